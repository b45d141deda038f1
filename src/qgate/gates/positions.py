"""Which shadow positions count as evidence: token classes, repeated prefixes, and how much of each prompt is seen.

    masks, scored = scoring_summary(ref, "answer")   # masks["gated"]: bool per scored position

A baseline reference (gates/shadow.py) records, per token of each scored sequence, its class: chat template, traffic
prompt text or baseline answer. Position t predicts token t+1, so it takes that token's class. A position whose whole
prefix (tokens 0..t+1) was already scored in an earlier prompt adds no evidence and is left out of every mask.
"""

from __future__ import annotations

import numpy as np

TEMPLATE, PROMPT, ANSWER = 0, 1, 2  # token classes: chat template, traffic prompt text, baseline answer
POSITION_SETS = {"answer": (ANSWER,), "answer+prompt": (ANSWER, PROMPT)}


def position_classes(ref: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per scored position (t predicts token t+1 of its sequence): the class of the predicted token, and whether
    the position's whole prefix (tokens 0..t+1) is new, i.e. not already scored in an earlier prompt."""
    cls, first = [], []
    seen: set[int] = set()
    start = 0
    for n in ref["seq_lens"]:
        seq, c = ref["tokens"][start : start + n].tolist(), ref["token_class"][start : start + n]
        cls.append(c[1:])
        h, new = hash((seq[0],)), np.zeros(n - 1, bool)
        for t in range(1, n):
            h = hash((h, seq[t]))
            new[t - 1] = h not in seen
            seen.add(h)
        first.append(new)
        start += n
    return np.concatenate(cls), np.concatenate(first)


def held_prompts(ref: dict) -> np.ndarray:
    """Per shadow prompt, whether the checks count it: ref["held_out"] (gates/held_out.py) where the gate set it,
    else every prompt."""
    return ref["held_out"] if "held_out" in ref else np.ones(len(ref["seq_lens"]), bool)


def scoring_summary(ref: dict, positions: str) -> tuple[dict[str, np.ndarray], dict]:
    """Masks of the gated, answer and traffic-prompt positions (repeated prefixes and the positions of prompts not
    held out dropped), and what was scored."""
    cls, new = position_classes(ref)
    held = held_prompts(ref)
    kept = held[ref["prompt_of"]]
    traffic = np.isin(cls, (ANSWER, PROMPT))
    new = new & kept
    masks = {
        "gated": np.isin(cls, POSITION_SETS[positions]) & new,
        "answer": (cls == ANSWER) & new,
        "prompt": (cls == PROMPT) & new,
    }
    info = {
        "positions": positions,
        "total_positions": int(len(cls)),
        "answer_positions": int(np.sum(cls == ANSWER)),
        "traffic_prompt_positions": int(np.sum(cls == PROMPT)),
        "template_positions_excluded": int(np.sum(cls == TEMPLATE)),
        "repeated_prefix_excluded": int(np.sum(traffic & ~new & kept)),
        "fitted_positions_excluded": int(np.sum(traffic & ~kept)),
        "gated_positions": int(masks["gated"].sum()),
        "unique_positions": int(new.sum()),
        "prompts": int(len(ref["seq_lens"])),
        "fitted_prompts_excluded": int((~held).sum()),
    }
    return masks, info


def coverage(ref: dict, max_prompt_tokens: int, max_new_tokens: int) -> dict:
    """How much of the shadow prompts the gate sees: a prompt longer than max_prompt_tokens is scored on its last
    max_prompt_tokens tokens (chat.encode_with_sources keeps the latest turn). `caveat`: what a gate on cut prompts
    cannot say, for the checks it weakens; None when every prompt was scored whole."""
    lens, m = ref["prompt_tokens"], max_prompt_tokens
    cut, longest = int(np.sum(lens > m)), int(lens.max(initial=0))
    caveat = (
        f"{cut} of {len(lens)} shadow prompts are longer than gates.shadow.max_prompt_tokens ({m}; the longest has "
        f"{longest} tokens) and were scored on their last {m} tokens: this evidence covers contexts of up to "
        f"{m + max_new_tokens} tokens, not those prompts whole"
        if cut
        else None
    )
    return {"max_prompt_tokens": m, "prompts_cut": cut, "longest_prompt_tokens": longest, "caveat": caveat}
