"""Where answers end: guards under the shadow gate's top-1 check for a candidate that stops where the baseline goes on,
or goes on where it stops.

    rows = end_guards(ref, m, threshold)   # ref["stop_ids"]; m["stops_early"], m["stops_at_end"] per prompt

A model decides to end an answer at one position of it, and the gated checks pool every position. A candidate that
never emits its stop token disagrees with the baseline once per answer that ended, a fraction of a percent of the
answer positions, and its KL elsewhere barely moves: the pooled top-1 agreement and KL p99 can pass it, and served,
each of its answers runs to the request's token limit. One that cuts answers short is as hidden. So the top-1
threshold is also held on these decisions, counted per answer, as two guards (GateResult.guard):
  stop.ends       of the answers the baseline ended within max_new_tokens (on a stop token of its generation
                  config), the share the candidate ends at the same position: its top-1 there is a stop token
  stop.continues  of all answers, the share the candidate would not cut short: its top-1 is a stop token at none of
                  the positions where the baseline's answer goes on
Teacher-forced, as every shadow figure: each position is judged on the baseline's tokens before it. Answers are
independent, so each share gets an exact (Clopper-Pearson) interval, adjusted by Holm's step-down over the two at
GUARD_ERROR (routes.holm_rounds). A guard FAILs when its interval lies wholly below the threshold and never passes.
"""

from __future__ import annotations

import numpy as np

from qgate.gates.positions import held_prompts
from qgate.gates.result import GateResult
from qgate.gates.routes import holm_rounds

SHOWN = 10  # shadow prompt indices listed per guard, at most


def ended(ref: dict) -> np.ndarray:
    """Per shadow prompt: whether the baseline's answer ends on one of ref["stop_ids"] (it stopped within
    max_new_tokens rather than being cut there)."""
    last = ref["tokens"][np.cumsum(ref["seq_lens"]) - 1]
    has_answer = ref["seq_lens"] > ref["prompt_lens"]
    return has_answer & np.isin(last, ref["stop_ids"])


def candidate_stops(cand_top1: np.ndarray, answer: np.ndarray, stop_ids: np.ndarray) -> tuple[bool, bool]:
    """For one answer: (whether the candidate's top-1 is a stop token at a position where the baseline's answer goes
    on, whether it is one at the position where that answer ends on a stop token). cand_top1: the candidate's top-1
    at the positions that predict the answer's tokens, in order."""
    stop_at = np.isin(cand_top1, stop_ids)
    if len(answer) and np.isin(answer[-1], stop_ids):
        return bool(stop_at[:-1].any()), bool(stop_at[-1])
    return bool(stop_at.any()), False


def end_guards(ref: dict, m: dict, threshold: float | None, gate: str = "shadow") -> list[GateResult]:
    """stop.ends (where the baseline ended any answer) and stop.continues, held to `threshold` (the gated top-1
    agreement); [] when it is None or the baseline's generation config names no stop token."""
    if threshold is None or not (counts := _counts(ref, m)):
        return []
    intervals = {
        name: (lambda level, k=k, n=n: (k / n, *_exact(k, n, level), {"answers": n, "agree": k}))
        for name, (k, n, _) in counts.items()
    }
    rows = holm_rounds(intervals, True, threshold)
    out = []
    for name in ("stop.ends", "stop.continues"):
        if name not in rows:
            continue
        obs, lo, hi, ev, level, step, m_left = rows[name]
        k, n, misses = counts[name]
        ev = ev | {
            "ci_95_unadjusted": [lo, hi] if m_left == 1 else list(_exact(k, n, 0.95)),
            "holm_round": step,
            "holm_guards": m_left,
            "adjusted_level": level,
            "rule": "holm-guard over the two answer-end guards, at the top-1 agreement threshold",
            "stop_ids": [int(t) for t in ref["stop_ids"]],
            "baseline_ended": counts["stop.ends"][1] if "stop.ends" in counts else 0,
            "answers_total": counts["stop.continues"][1],
            "prompts_disagreeing": [int(i) for i in misses[:SHOWN]],
        }
        if hi < threshold:
            what = (
                "answers the baseline ended the candidate does not end there (it would run on)"
                if name == "stop.ends"
                else "answers the candidate would end where the baseline's goes on (it would cut them short)"
            )
            ev["why"] = (
                f"{len(misses)} of {n} {what}: {name} {obs:.4g}, its Holm-adjusted {level:.2%} interval lies wholly "
                f"below {threshold:g}"
            )
        out.append(GateResult.guard(gate, name, obs, threshold, True, n, (lo, hi), evidence=ev))
    return out


def floor(ref: dict, m: dict) -> dict:
    """The two shares of the baseline scored against its own answers (the noise floor, gates/noise.py): per guard,
    {"observed", "ci" (exact, 95%), "agree", "answers"}; {} where the baseline names no stop token."""
    return {
        name: {"observed": k / n, "ci": list(_exact(k, n, 0.95)), "agree": k, "answers": n}
        for name, (k, n, _) in _counts(ref, m).items()
    }


def _counts(ref: dict, m: dict) -> dict[str, tuple[int, int, np.ndarray]]:
    """Per guard: (answers that agree, answers counted, the shadow prompts of those that do not), over the held-out
    prompts (positions.held_prompts); stop.ends only where the baseline ended an answer, and {} where its generation
    config names no stop token."""
    if not len(ref.get("stop_ids", ())):
        return {}
    held = held_prompts(ref)
    done = ended(ref) & held
    shares = {"stop.continues": (~m["stops_early"], held)}
    if done.any():
        shares["stop.ends"] = (m["stops_at_end"], done)
    return {
        name: (int(agrees[among].sum()), int(among.sum()), np.flatnonzero(among & ~agrees))
        for name, (agrees, among) in shares.items()
    }


def _exact(k: int, n: int, level: float) -> tuple[float, float]:
    """The Clopper-Pearson interval of k successes in n at two-sided `level`."""
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)
