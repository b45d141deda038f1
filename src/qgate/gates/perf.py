"""The perf check: the candidate's teacher-forced scoring throughput on the shadow sequences against the baseline's.

    times = perf_times(cand_runner, baseline, ref, floor, PerfConfig(min_prefill_speedup=1.5), "auto", "auto")
    result = perf_check(floor, times, "teacher-forced", cand_runner.kind, "cpu", PerfConfig(min_prefill_speedup=1.5))

Report-only unless `min_prefill_speedup` is set; then both times must be taken warm, on the same card or CPU, each
`repeats` times, and the check is decided on the 95% interval of their ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from qgate.artifact import Artifact
from qgate.errors import BackendUnavailable, ConfigError
from qgate.gates.numerics import LazyRunner
from qgate.gates.result import POSITIVE, GateResult, check_threshold_values
from qgate.gates.shadow import candidate_metrics
from qgate.gates.stats import passes_to_decide, time_ratio_ci


@dataclass(frozen=True)
class PerfConfig:
    min_prefill_speedup: float | None = None  # candidate vs baseline teacher-forced scoring throughput, 95% CI
    repeats: int = 3  # timed scoring passes of each model when the check gates: its interval comes from their spread
    VERSION = 2

    def __post_init__(self):
        check_threshold_values("gates.perf", self, {"min_prefill_speedup": POSITIVE})
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 2:
            raise ConfigError(
                f"gates.perf.repeats must be a whole number >= 2, got {self.repeats!r}",
                hint="the speed-up's interval is read from the spread of each model's timed passes: one pass has none",
            )

    @property
    def gates(self) -> bool:
        """Whether the check decides (a threshold is set): then both its times must be comparable, taken on this card
        or CPU, warm (after one untimed batch), and `repeats` times each; report-only, the times the shadow gate took
        anyway are reported."""
        return self.min_prefill_speedup is not None

    @property
    def passes(self) -> int:
        """Timed scoring passes of each model: `repeats` when the check gates, else the one the shadow gate makes."""
        return self.repeats if self.gates else 1


def floor_passes(floor: dict, ref: dict) -> list[float]:
    """The baseline's timed teacher-forced passes recorded with its noise floor (one, in a floor cached before it
    recorded passes; the reference's own time where a floor recorded none)."""
    passes = floor.get("baseline_score_passes") or [floor.get("baseline_score_seconds", ref["score_seconds"])]
    return [float(x) for x in passes]


def perf_times(cand, baseline: Artifact, ref: dict, floor: dict, cfg: PerfConfig, device: str, dtype: str) -> dict:
    """The times the perf check divides when it gates: each model's teacher-forced scoring of the shadow sequences,
    `cfg.repeats` timed passes each, each side warm (one untimed batch before its first).

    In turn (`paired`): the baseline is loaded again beside the candidate, and the two are timed pass by pass,
    alternating which goes first, so a host that runs faster or slower as the gate goes on moves both alike. Apart:
    when the baseline does not fit beside the candidate (BackendUnavailable before it loads, or CUDA running out of
    memory as it scores), the candidate's passes against the baseline's recorded with its noise floor, timed before
    the candidate loaded or in an earlier run (`apart_because` says why)."""
    base = LazyRunner(baseline, device, dtype)
    b_s: list[float] = []
    c_s: list[float] = []
    try:
        for k in range(cfg.repeats):
            turn = ((base, b_s, "baseline"), (lambda: cand, c_s, "candidate"))
            for runner, into, who in turn if k % 2 == 0 else turn[::-1]:
                desc = f"perf: {who}, pass {k + 1}/{cfg.repeats} in turn"
                into.append(candidate_metrics(runner(), ref, desc, served=False, warm_up=k == 0)["score_seconds"])
        return {"baseline": b_s, "candidate": c_s, "paired": True}
    except BackendUnavailable as e:  # raised before the baseline loads
        why = f"the baseline does not fit beside the candidate: {e.message}"
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
        if "out of memory" not in str(e):
            raise
        why = f"the baseline ran out of memory beside the candidate: {str(e).splitlines()[0]}"
    finally:
        base.release()
    c_s = candidate_metrics(cand, ref, "perf: candidate apart", served=False, warm_up=True, passes=cfg.repeats)[
        "score_passes"
    ]
    return {"baseline": floor_passes(floor, ref), "candidate": c_s, "paired": False, "apart_because": why}


def perf_check(floor: dict, times: dict, how: str, runtime: str, cand_on: str, cfg: PerfConfig) -> GateResult:
    """The candidate's teacher-forced scoring throughput on the shadow sequences against the baseline's: the ratio of
    their geometric-mean times (`times`: perf_times' passes when the check gates; report-only, the noise floor's
    first pass and the candidate's shadow scoring, `how` it scored). Gating, it is decided on its 95% interval
    (stats.time_ratio_ci: paired when the two were timed in turn); two passes timed apart carry a caveat, since
    their interval does not hold a host that ran faster or slower between them. Two times are evidence only when they
    time the same work on the same card or CPU (`cand_on` and the floor's `timed_on`, device.timing_host): otherwise,
    as for an engine on the CPU against a baseline on a GPU, the check is INCONCLUSIVE and says why; report-only, an
    engine's served scoring is reported as such."""
    base_s, cand_s, paired = times["baseline"], times["candidate"], times["paired"]
    speedup, lo, hi = time_ratio_ci(base_s, cand_s, paired=paired)
    base_on = cand_on if paired else floor.get("timed_on")
    evidence = {
        "baseline_score_seconds": base_s[0],
        "candidate_score_seconds": cand_s[0],
        "baseline_score_passes": base_s,
        "candidate_score_passes": cand_s,
        "timed": "in turn, in this process" if paired else "apart: the baseline with its noise floor",
        "candidate_scoring": how,
        "candidate_runtime": runtime,
        "baseline_timing_from_cache": not paired and bool(floor.get("cached")),
        "baseline_timed_on": base_on,
        "candidate_timed_on": cand_on,
        "timed_after_warm_up": cfg.gates,
        "n_counts": "timed passes of each model",
    }
    if cfg.gates and not paired:
        when = "in an earlier run" if floor.get("cached") else "before the candidate loaded"
        evidence["caveat"] = (
            f"the baseline was timed {when}, apart from the candidate ({times.get('apart_because', 'not in turn')}): "
            "the interval does not hold a host that ran faster or slower between the two"
        )
    n = min(len(base_s), len(cand_s))
    ci = (lo, hi) if n >= 2 else None
    result = GateResult.check(
        "perf", "prefill_speedup", speedup, cfg.min_prefill_speedup, True, n, ci, evidence=evidence
    )
    if result.verdict == "inconclusive" and ci is not None:  # the t quantile falls too as passes are added
        result = replace(result, n_to_decide=passes_to_decide(base_s, cand_s, cfg.min_prefill_speedup, paired=paired))
    comparable = base_on == cand_on and how == "teacher-forced"
    if result.verdict == "info":
        why = {} if comparable else {"why": _not_comparable(base_on, cand_on, how)}
        return replace(result, evidence=evidence | why)
    if result.verdict == "error":
        return result
    if not comparable:
        why = _not_comparable(base_on, cand_on, how)
    elif ci is None:
        why = "one timed pass of a model has no spread to read an interval from: time each gates.perf.repeats times"
    else:
        return result
    return replace(result, verdict="inconclusive", passed=False, n_to_decide=None, evidence=evidence | {"why": why})


def _not_comparable(base_on: str | None, cand_on: str, how: str) -> str:
    """Why two perf times do not time the same work on the same card or CPU."""
    if base_on != cand_on:
        where = base_on or "a host the cache does not record"
        return f"not comparable: the baseline's time was measured on {where}, the candidate's on {cand_on}"
    return f"not comparable: the candidate's time is its {how} scoring, the baseline's teacher-forced"
