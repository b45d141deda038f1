"""Where answers end, and whether they call a tool: guards under the shadow gate's top-1 check for a candidate that
decides otherwise than the baseline at the one position of an answer that decides it.

    rows = decision_guards(ref, m, threshold, ("stop", "tool"))   # ref["stop_ids"], ref["call_ids"]; m per prompt

A model decides to end an answer at one position of it, and the gated checks pool every position. A candidate that
never emits its stop token disagrees with the baseline once per answer that ended, a fraction of a percent of the
answer positions, and its KL elsewhere barely moves: the pooled top-1 agreement and KL p99 can pass it, and served,
each of its answers runs to the request's token limit. One that cuts answers short is as hidden. A tool call is the
same kind of decision: the token that begins it (`<tool_call>`, `[TOOL_CALLS]`, or for a JSON call such as Llama
3.1's the answer's first token when it opens with `{`: gates/tool_calls.py reads which from the chat template) is one
position of an answer, and a candidate that answers in prose where the baseline calls a tool breaks the agent that
sent the request. So the top-1 threshold is also held on these decisions, counted per answer,
as guards (GateResult.guard):
  stop.ends       of the answers the baseline ended within max_new_tokens (on a stop token of its generation
                  config), the share the candidate ends at the same position: its top-1 there is a stop token
  stop.continues  of all answers, the share the candidate would not cut short: its top-1 is a stop token at none of
                  the positions where the baseline's answer goes on
  tool.calls      of the answers in which the baseline begins a tool call, the share the candidate begins it at the
                  same position: its top-1 at the baseline's first call token is a call token
  tool.refrains   of all answers, the share in which the candidate would begin a call at none of the positions where
                  the baseline's answer does not
A JSON call is begun only at an answer's first token, so for it both tool guards read that position alone.
Teacher-forced, as every shadow figure: each position is judged on the baseline's tokens before it. Answers are
independent, so each share gets an exact (Clopper-Pearson) interval, adjusted by Holm's step-down over the guards
present at GUARD_ERROR (routes.holm_rounds). A guard FAILs when its interval lies wholly below the threshold and never
passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qgate.gates.positions import ANSWER, held_prompts
from qgate.gates.result import GateResult
from qgate.gates.routes import holm_rounds

SHOWN = 10  # shadow prompt indices and decision ids listed per guard, at most


@dataclass(frozen=True)
class Decision:
    ids: str  # ref key: the token ids that make the decision
    spurious: str  # m key, per prompt: the candidate's top-1 is one of them where the baseline's token is not
    at_first: str  # m key, per prompt: it is one of them at the baseline's first such position
    agrees: str  # guard over the answers where the baseline made the decision
    refrains: str  # guard over every answer
    decided: str  # evidence key: how many answers the baseline made it in
    first_only: str | None  # ref key, where present: True when the decision is made at an answer's first token only
    miss_agrees: str  # what a FAIL of `agrees` says of the answers that disagree
    miss_refrains: str


DECISIONS = {
    "stop": Decision(
        "stop_ids",
        "stops_early",
        "stops_at_end",
        "stop.ends",
        "stop.continues",
        "baseline_ended",
        None,
        "answers the baseline ended the candidate does not end there (it would run on)",
        "answers the candidate would end where the baseline's goes on (it would cut them short)",
    ),
    "tool": Decision(
        "call_ids",
        "calls_spurious",
        "calls_at_first",
        "tool.calls",
        "tool.refrains",
        "baseline_called",
        "call_first_only",
        "answers in which the baseline calls a tool but the candidate would not (it would answer without the call)",
        "answers in which the candidate would begin a tool call where the baseline's answer does not",
    ),
}


def decided(ref: dict, ids: np.ndarray, first_only: bool = False) -> np.ndarray:
    """Per shadow prompt: whether the baseline's answer holds one of `ids` (for stop ids: it stopped within
    max_new_tokens rather than being cut there, since an answer ends at its first stop token); first_only: whether
    its first token is one."""
    starts = np.cumsum(ref["seq_lens"]) - ref["seq_lens"]
    if first_only:
        has = ref["seq_lens"] > ref["prompt_lens"]
        first = np.minimum(starts + ref["prompt_lens"], max(len(ref["tokens"]) - 1, 0))
        return has & np.isin(ref["tokens"][first], ids) if len(first) else np.zeros(0, bool)
    hit = np.isin(ref["tokens"], ids) & (ref["token_class"] == ANSWER)
    return np.add.reduceat(hit, starts) > 0 if len(hit) else np.zeros(0, bool)


def first_only(ref: dict, d: Decision) -> bool:
    """Whether `ref` says decision `d` is made at an answer's first token only (a JSON tool call)."""
    return bool(d.first_only and ref.get(d.first_only, False))


def candidate_decision(cand_top1: np.ndarray, answer: np.ndarray, ids: np.ndarray) -> tuple[bool, bool]:
    """For one answer and one decision: (whether the candidate's top-1 is one of `ids` at a position where the
    baseline's answer token is not, whether it is one at the first position where the baseline's is). cand_top1: the
    candidate's top-1 at the positions that predict the answer's tokens, in order."""
    hit, base = np.isin(cand_top1, ids), np.isin(answer, ids)
    first = np.flatnonzero(base)
    return bool((hit & ~base).any()), bool(len(first) and hit[first[0]])


def decision_guards(
    ref: dict, m: dict, threshold: float | None, kinds: tuple[str, ...] = ("stop",), gate: str = "shadow"
) -> list[GateResult]:
    """The guards of each decision in `kinds` (DECISIONS) whose ids `ref` holds, held to `threshold` (the gated top-1
    agreement); `agrees` only where the baseline made the decision in some answer. [] when threshold is None."""
    if threshold is None or not (counts := _counts(ref, m, kinds)):
        return []
    intervals = {
        name: (lambda level, k=k, n=n: (k / n, *_exact(k, n, level), {"answers": n, "agree": k}))
        for name, (k, n, _) in counts.items()
    }
    rows = holm_rounds(intervals, True, threshold)
    out = []
    for kind in kinds:
        d = DECISIONS[kind]
        for name, what in ((d.agrees, d.miss_agrees), (d.refrains, d.miss_refrains)):
            if name not in rows:
                continue
            obs, lo, hi, ev, level, step, m_left = rows[name]
            k, n, misses = counts[name]
            ids = [int(t) for t in ref[d.ids]]  # a JSON call's: every token whose text opens with "{"
            ev = ev | {
                "ci_95_unadjusted": [lo, hi] if m_left == 1 else list(_exact(k, n, 0.95)),
                "holm_round": step,
                "holm_guards": m_left,
                "adjusted_level": level,
                "rule": f"holm-guard over the {len(counts)} decision guards, at the top-1 agreement threshold",
                d.ids: ids[:SHOWN],
                "ids_total": len(ids),
                d.decided: counts[d.agrees][1] if d.agrees in counts else 0,
                "answers_total": counts[d.refrains][1],
                "prompts_disagreeing": [int(i) for i in misses[:SHOWN]],
            }
            if first_only(ref, d):
                ev["first_token_only"] = True
            if hi < threshold:
                ev["why"] = (
                    f"{len(misses)} of {n} {what}: {name} {obs:.4g}, its Holm-adjusted {level:.2%} interval lies "
                    f"wholly below {threshold:g}"
                )
            out.append(GateResult.guard(gate, name, obs, threshold, True, n, (lo, hi), evidence=ev))
    return out


def floor(ref: dict, m: dict) -> dict:
    """Every decision's shares of the baseline scored against its own answers (the noise floor, gates/noise.py): per
    guard, {"observed", "ci" (exact, 95%), "agree", "answers"}; none for a decision whose ids `ref` lacks."""
    return {
        name: {"observed": k / n, "ci": list(_exact(k, n, 0.95)), "agree": k, "answers": n}
        for name, (k, n, _) in _counts(ref, m, tuple(DECISIONS)).items()
    }


def _counts(ref: dict, m: dict, kinds: tuple[str, ...]) -> dict[str, tuple[int, int, np.ndarray]]:
    """Per guard: (answers that agree, answers counted, the shadow prompts of those that do not), over the held-out
    prompts (positions.held_prompts); a decision's `agrees` only where the baseline made it, and nothing for a
    decision whose ids `ref` lacks or leaves empty."""
    held, out = held_prompts(ref), {}
    for kind in kinds:
        d = DECISIONS[kind]
        if not len(ids := ref.get(d.ids, ())):
            continue
        made = decided(ref, ids, first_only(ref, d)) & held
        shares = {d.refrains: (~m[d.spurious], held)}
        if made.any():
            shares[d.agrees] = (m[d.at_first], made)
        out |= {
            name: (int(agrees[among].sum()), int(among.sum()), np.flatnonzero(among & ~agrees))
            for name, (agrees, among) in shares.items()
        }
    return out


def _exact(k: int, n: int, level: float) -> tuple[float, float]:
    """The Clopper-Pearson interval of k successes in n at two-sided `level`."""
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)
