"""What every gate returns: which way is better, what it measured, the threshold, and the evidence.

    GateResult.check("shadow", "kl_p99", observed=0.08, threshold=0.1, higher_is_better=False, n=4800, ci=(0.07, 0.09))

A check passes on its confidence bound, not on its point estimate: the upper bound
for lower-is-better metrics, the lower bound for higher-is-better ones. A check
that could not run is recorded as failed with the reason, never as passed.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class GateResult:
    gate: str
    metric: str
    observed: float
    threshold: float | None
    higher_is_better: bool
    n: int
    ci: tuple[float, float] | None = None
    p_value: float | None = None
    passed: bool = False
    decided_on: str = "point"       # "ci-upper" / "ci-lower" / "point" / "p-value" / "report-only"
    evidence: dict = field(default_factory=dict)

    @classmethod
    def check(cls, gate: str, metric: str, observed: float, threshold: float | None, higher_is_better: bool, n: int,
              ci: tuple[float, float] | None = None, p_value: float | None = None, evidence: dict | None = None) -> "GateResult":
        if threshold is None:
            return cls(gate, metric, observed, None, higher_is_better, n, ci, p_value, True, "report-only", evidence or {})
        if ci is not None and all(math.isfinite(x) for x in ci):
            bound, how = (ci[0], "ci-lower") if higher_is_better else (ci[1], "ci-upper")
        else:
            bound, how = observed, "point"
        ok = math.isfinite(bound) and (bound >= threshold if higher_is_better else bound <= threshold)
        return cls(gate, metric, observed, threshold, higher_is_better, n, ci, p_value, bool(ok), how, evidence or {})

    @classmethod
    def could_not_run(cls, gate: str, metric: str, reason: str) -> "GateResult":
        return cls(gate, metric, float("nan"), None, True, 0, None, None, False, "not-run", {"error": reason})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ci"] = list(self.ci) if self.ci else None
        return d

    def line(self) -> str:
        cmp = ">=" if self.higher_is_better else "<="
        ci = f" CI[{self.ci[0]:.4g}, {self.ci[1]:.4g}]" if self.ci else ""
        thr = f" (need {cmp} {self.threshold:.4g} on {self.decided_on})" if self.threshold is not None else " (report only)"
        verdict = "INFO" if self.decided_on == "report-only" else ("PASS" if self.passed else "FAIL")
        return f"{verdict}  {self.gate}.{self.metric} = {self.observed:.4g}{ci}{thr}  n={self.n}"
