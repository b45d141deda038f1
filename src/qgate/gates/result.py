"""What every gate returns: which way is better, what it measured, the threshold, and the evidence.

    GateResult.check("shadow", "kl_p99", observed=0.08, threshold=0.1, higher_is_better=False, n=4800, ci=(0.07, 0.09))

One verdict vocabulary, decided here and nowhere else. A check follows one rule, named in `decided_on`:
  "ci"          pass when the 95% CI lies wholly on the good side of the threshold, fail when it lies wholly on
                the bad side, inconclusive when it straddles it (saying roughly how many more items would decide,
                `n_to_decide`);
  "point"       no CI (a significance test's p-value, an infinite observation, a count): the observed value
                against the threshold;
  "holm-guard"  a guard (`GateResult.guard`): fail when its multiplicity-adjusted CI lies wholly on the bad side,
                otherwise reported (info): it can stop a candidate, never pass one;
  "report-only" no threshold (info);
  "not-run"     a threshold but no finite value to hold against it: the check could not run (error, never a pass).
An unbounded CI end (a quantile the sample cannot pin down, or an end given as NaN: an interval over one document)
can never decide in its favour.
Every thresholded check with a CI also states its minimum detectable effect at its n (`mde`):
the true distance from the observed value that an 80%-power test at this CI's width would detect.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

VERDICTS = ("pass", "fail", "inconclusive", "error", "info")
OnInconclusive = Literal["block", "warn"]  # gates.on_inconclusive: does an undecided check block promotion?
ON_INCONCLUSIVE: tuple[str, ...] = get_args(OnInconclusive)
Z95, Z80 = 1.959964, 0.841621
GUARD_ERROR = 0.025  # a family of guards' one-sided, family-wise error: the bad side of a two-sided 95% interval
SHARE = (0.0, 1.0)  # a threshold on a share (agreement, recovery) lies in (0, 1]
POSITIVE = (0.0, math.inf)  # one on a divergence, an increase or a speed-up is finite and > 0


def check_threshold_values(section: str, cfg, ranges: dict[str, tuple[float, float]]) -> None:
    """Each threshold of `cfg` named in `ranges` is null (reported, not gated) or a finite number in (low, high]:
    outside that range a check could never fail, or never pass, whatever it measured. ConfigError naming each one."""
    from qgate.errors import ConfigError, config_problems

    problems = []
    for name, (low, high) in ranges.items():
        value = getattr(cfg, name)
        if value is not None and not (low < value <= high and math.isfinite(value)):
            span = f"in ({low:g}, {high:g}]" if math.isfinite(high) else f"a finite number > {low:g}"
            problems.append(
                ConfigError(
                    f"{section}.{name} must be {span}, got {value}",
                    hint="outside that range the check could never fail, or never pass; null reports the value "
                    "without gating on it",
                )
            )
    if problems:
        raise config_problems(problems)


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
    decided_on: str = (
        "point"  # the rule that decided the verdict: "ci" / "point" / "holm-guard" / "report-only" / "not-run"
    )
    evidence: dict = field(default_factory=dict)
    verdict: str = "fail"
    mde: float | None = None  # minimum detectable effect at this n (metric units)
    n_to_decide: int | None = None  # inconclusive only: roughly how many items would decide it

    @classmethod
    def check(
        cls,
        gate: str,
        metric: str,
        observed: float,
        threshold: float | None,
        higher_is_better: bool,
        n: int,
        ci: tuple[float, float] | None = None,
        p_value: float | None = None,
        evidence: dict | None = None,
    ) -> GateResult:
        ev = evidence or {}
        mde = _mde(ci)
        if threshold is None:
            return cls(
                gate, metric, observed, None, higher_is_better, n, ci, p_value, True, "report-only", ev, "info", mde
            )
        if math.isnan(observed):
            return cls(
                gate,
                metric,
                observed,
                threshold,
                higher_is_better,
                n,
                ci,
                p_value,
                False,
                "not-run",
                {"error": "no finite value"} | ev,  # a caller's own reason for the missing value wins
                "error",
                mde,
            )
        sign = 1.0 if higher_is_better else -1.0  # work in "higher is better" units
        if ci is not None and math.isfinite(observed) and any(math.isnan(x) for x in ci):
            # an end the sample cannot place (NaN) is unbounded that way
            ci = (-math.inf if math.isnan(ci[0]) else ci[0], math.inf if math.isnan(ci[1]) else ci[1])
        if ci is None or math.isinf(observed):  # an infinite KL: on the point
            verdict, how = ("pass" if sign * (observed - threshold) >= 0 else "fail"), "point"
        else:
            good, bad = (ci[0], ci[1]) if higher_is_better else (ci[1], ci[0])  # the CI end nearer failing, the other
            how = "ci"
            if sign * (good - threshold) >= 0 and math.isfinite(good):
                verdict = "pass"
            elif sign * (bad - threshold) < 0:
                verdict = "fail"
            else:
                verdict = "inconclusive"
        more = None
        if verdict == "inconclusive":
            more = _n_to_decide(observed, threshold, ci, n)
            if more is None and sign * (observed - threshold) > 0:  # a good point, its interval unbounded on that side
                more = ev.get("n_to_bound")  # stats.quantile_ci: the sample size that bounds it
        return cls(
            gate,
            metric,
            observed,
            threshold,
            higher_is_better,
            n,
            ci,
            p_value,
            verdict == "pass",
            how,
            ev,
            verdict,
            mde,
            more,
        )

    @classmethod
    def guard(
        cls,
        gate: str,
        metric: str,
        observed: float,
        threshold: float,
        higher_is_better: bool,
        n: int,
        ci: tuple[float, float],
        may_fail: bool = True,
        p_value: float | None = None,
        evidence: dict | None = None,
    ) -> GateResult:
        """A check that can stop a candidate but never pass one: fail when `ci` (already adjusted for the other
        guards it is tested beside) lies wholly on the bad side of `threshold` and `may_fail` (a step-down procedure
        such as Holm's has not stopped before it); otherwise info, reported with its threshold."""
        sign = 1.0 if higher_is_better else -1.0
        best = ci[1] if higher_is_better else ci[0]  # the CI end nearest passing: wholly bad when even it is bad
        failed = may_fail and math.isfinite(best) and sign * (best - threshold) < 0
        return cls(
            gate,
            metric,
            observed,
            threshold,
            higher_is_better,
            n,
            ci,
            p_value,
            not failed,
            "holm-guard",
            evidence or {},
            "fail" if failed else "info",
            _mde(ci),
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ci"] = list(self.ci) if self.ci else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> GateResult:
        known = {f for f in cls.__dataclass_fields__}
        d = {k: v for k, v in d.items() if k in known}
        return cls(**{**d, "ci": tuple(d["ci"]) if d.get("ci") else None})

    def line(self) -> str:
        cmp = ">=" if self.higher_is_better else "<="
        ci = f" CI[{self.ci[0]:.4g}, {self.ci[1]:.4g}]" if self.ci else ""
        thr = f" (need {cmp} {self.threshold:.4g})" if self.threshold is not None else ""
        extra = f"  n={self.n}"
        if self.mde is not None and self.threshold is not None:
            extra += f"  mde={self.mde:.3g}"
        if self.decided_on == "holm-guard":
            extra += "  [guard: Holm-adjusted CI]"
        if self.verdict == "inconclusive" and (notes := decide_notes(self.to_dict())):
            extra += "  " + "; ".join(notes)
        elif self.verdict == "inconclusive" and not self.evidence.get("why"):
            extra += "  (unbounded CI or observed on the threshold: more items may not decide it)"
        if self.verdict == "error":
            extra += f"  ({self.evidence.get('error', 'could not run')})"
        elif self.verdict != "pass" and self.evidence.get("why"):
            extra += f"  ({self.evidence['why']})"
        return f"{self.verdict.upper():12s} {self.gate}.{self.metric} = {self.observed:.4g}{ci}{thr}{extra}"


def _mde(ci: tuple[float, float] | None) -> float | None:
    """(z_.975 + z_.80) standard errors, the standard error read off the 95% CI's width."""
    if ci is None or not all(math.isfinite(x) for x in ci):
        return None
    return (ci[1] - ci[0]) / (2 * Z95) * (Z95 + Z80)


def decide_notes(r: dict) -> list[str]:
    """What a check's row says would decide it (report.json's form of a GateResult): roughly how many of what its n
    counts (`n_to_decide`; `evidence.n_counts`, items unless it says otherwise), and why its interval is unbounded
    (stats.quantile_ci)."""
    ev = r.get("evidence") or {}
    n, unbounded = r.get("n_to_decide"), ev.get("unbounded_because")
    return ([f"~{n} {ev.get('n_counts', 'items')} would decide it"] if n else []) + ([unbounded] if unbounded else [])


def what_would_decide(results: list[dict]) -> dict[str, str]:
    """ "gate.metric" -> one line for each INCONCLUSIVE row, in report order: its decide_notes and the reason it
    gives (`evidence.why`), or, when its evidence says neither, that its interval straddles the threshold."""
    out = {}
    for r in results:
        if r["verdict"] == "inconclusive":
            why = (r.get("evidence") or {}).get("why")
            said = "; ".join(decide_notes(r) + ([why] if why else []))
            out[f"{r['gate']}.{r['metric']}"] = said or "its 95% interval straddles the threshold"
    return out


def _n_to_decide(observed: float, threshold: float, ci: tuple[float, float] | None, n: int) -> int | None:
    """Roughly how many items would decide an interval that straddles the threshold: the n at which the interval's
    side that faces the threshold (the observed value's distance to that end), shrinking as 1/sqrt(n), would reach
    it. Only that end crosses, and the intervals of skewed statistics (bootstrap-t, quantiles, ratios) are not
    symmetric (benchmarks/bench_n_to_decide.py). None where that side is unbounded, or the observed value is the
    threshold."""
    if ci is None or n <= 0:
        return None
    toward = threshold - observed
    side = ci[1] - observed if toward > 0 else observed - ci[0]
    if not (math.isfinite(side) and side > 0 and toward != 0):
        return None
    return int(math.ceil(n * (side / abs(toward)) ** 2))


def caveats(results: list[dict]) -> dict[str, list[str]]:
    """Each caveat on a check that reached a verdict (evidence.caveat), in the order first met, with the checks
    ("gate.metric") it weakens: one caveat, such as cut shadow prompts, can weaken several. Report-only rows, a guard
    that did not fail among them, decided nothing for a caveat to weaken."""
    out: dict[str, list[str]] = {}
    for r in results:
        if r["threshold"] is not None and r["verdict"] != "info" and r["evidence"].get("caveat"):
            out.setdefault(r["evidence"]["caveat"], []).append(f"{r['gate']}.{r['metric']}")
    return out


def overall(results: list[GateResult]) -> str:
    """The report's verdict: any fail or error fails it; else any inconclusive makes it inconclusive."""
    vs = {r.verdict for r in results}
    if vs & {"fail", "error"}:
        return "fail"
    return "inconclusive" if "inconclusive" in vs else "pass"


def passes(verdict: str, on_inconclusive: OnInconclusive = "block") -> bool:
    """Whether a verdict (a report's, or one check's) lets the candidate through under the inconclusive policy: pass
    does; fail and error never do; inconclusive does only under "warn". Every caller decides it here."""
    if on_inconclusive not in ON_INCONCLUSIVE:
        raise ValueError(f"on_inconclusive must be one of {ON_INCONCLUSIVE}, got {on_inconclusive!r}")
    return verdict in ("pass", "info") or (verdict == "inconclusive" and on_inconclusive == "warn")


@dataclass(frozen=True)
class GateReport:
    """A gate report's verdict under its inconclusive policy. Whether a candidate passes is asked of this type and
    decided nowhere else.

        report = GateReport.decide(results, "block")    # as run_gates writes it
        GateReport.of(gate_artifact).passed             # as every reader asks it
    """

    verdict: str  # overall(results): pass, fail or inconclusive
    on_inconclusive: OnInconclusive
    results: tuple[dict, ...]  # GateResult.to_dict() of every check, in report order
    stopped: dict | None = None  # gates.stop_on_fail: {"after": [failed checks], "skipped": [gates]}
    scored: bool = True  # False: the serving contract failed and nothing was scored

    @classmethod
    def decide(
        cls,
        results: list[GateResult],
        on_inconclusive: OnInconclusive,
        stopped: dict | None = None,
        scored: bool = True,
    ) -> GateReport:
        """The policy is checked where it is applied, in `passes`."""
        return cls(overall(results), on_inconclusive, tuple(r.to_dict() for r in results), stopped, scored)

    @classmethod
    def from_json(cls, report: dict) -> GateReport:
        """From a report.json's content; the verdict is the one recorded there."""
        return cls(
            report["verdict"],
            report.get("on_inconclusive", "block"),
            tuple(report["results"]),
            report.get("stopped"),
            report.get("scored", True),
        )

    @classmethod
    def of(cls, art) -> GateReport:
        """The report of a gate-report artifact (its report.json)."""
        import json

        return cls.from_json(json.loads((art.path / "report.json").read_text()))

    @property
    def passed(self) -> bool:
        return passes(self.verdict, self.on_inconclusive)

    def lets_through(self, check: dict) -> bool:
        """Whether one of this report's checks (a `results` row) lets the candidate through under its policy."""
        return passes(check["verdict"], self.on_inconclusive)

    @property
    def warned(self) -> bool:
        """Inconclusive, and let through only because the policy is "warn"."""
        return self.verdict == "inconclusive" and self.passed

    @property
    def failed(self) -> list[str]:
        return [r["metric"] for r in self.results if r["verdict"] in ("fail", "error")]

    @property
    def inconclusive(self) -> list[str]:
        return [r["metric"] for r in self.results if r["verdict"] == "inconclusive"]

    @property
    def summary(self) -> dict[str, float]:
        """ "gate.metric" -> observed value, for every check."""
        return {r["gate"] + "." + r["metric"]: r["observed"] for r in self.results}

    def checks(self) -> list[dict]:
        """The thresholded checks, each with its caveat: what a summary table shows."""
        keys = ("gate", "metric", "verdict", "observed", "ci", "n", "mde", "n_to_decide")
        return [
            {k: r[k] for k in keys} | {"caveat": r["evidence"].get("caveat")}
            for r in self.results
            if r["threshold"] is not None
        ]

    def caveats(self) -> dict[str, list[str]]:
        return caveats(list(self.results))
