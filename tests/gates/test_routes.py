"""Per-route guards under the shadow gate's pooled checks (gates/routes.py)."""

import numpy as np
import pytest

from qgate.gates.positions import ANSWER, PROMPT
from qgate.gates.result import GUARD_ERROR, GateReport
from qgate.gates.routes import RouteCheck, route_guards, route_labels
from qgate.gates.shadow import ShadowConfig, shadow_gate

CHAT, CODE = "chat", "code-assist"


def _synthetic(routes: list[str], kl_of, agree_of, positions: int = 40, seed: int = 0):
    """One prompt per entry of `routes`: two traffic prompt tokens, then `positions - 1` answer tokens, all
    distinct; the candidate's KL per position from kl_of(route, rng, n) and its top-1 agreement with probability
    agree_of(route)."""
    rng = np.random.default_rng(seed)
    k, n = len(routes), positions + 1
    seqs = [[1, 100 + p] + [1000 + 50 * p + j for j in range(positions - 1)] for p in range(k)]
    ref = {
        "tokens": np.concatenate(seqs),
        "seq_lens": np.full(k, n),
        "prompt_lens": np.full(k, 2),
        "prompt_tokens": np.full(k, 2),
        "token_class": np.concatenate([[PROMPT, PROMPT] + [ANSWER] * (positions - 1)] * k).astype(np.int8),
        "prompt_of": np.repeat(np.arange(k), n - 1),
        "prompt_route": np.array(routes),
    }
    kl = np.concatenate([kl_of(r, rng, n - 1) * rng.lognormal(0, 0.5) for r in routes])
    agree = np.concatenate([rng.random(n - 1) < agree_of(r) for r in routes])
    m = {
        "kl": kl,
        "agree": agree,
        "tail": np.zeros_like(kl),
        "undefined": np.zeros(len(kl), bool),
        "first_div": np.full(k, 5),
        "gen_lens": np.full(k, positions - 1),
    }
    return m, ref


def _mild(route, rng, n):
    return rng.exponential(0.01, n)


CFG = ShadowConfig(kl_p99_max=0.5, top1_agreement_min=0.85)


def test_a_route_the_pooled_checks_pass_fails_its_guard_and_the_gate():
    # a fifth of the traffic (code) agrees on 0.65 of its tokens: pooled with chat's 0.99 that is 0.92, above 0.85
    m, ref = _synthetic([CHAT] * 48 + [CODE] * 12, _mild, lambda r: 0.99 if r == CHAT else 0.65)
    results, _, _ = shadow_gate(m, ref, CFG)
    by = {r.metric: r for r in results}
    assert by["top1_agreement"].verdict == "pass" and 0.88 < by["top1_agreement"].observed < 0.95
    bad, good = by[f"route.{CODE}.top1_agreement"], by[f"route.{CHAT}.top1_agreement"]
    assert bad.verdict == "fail" and bad.decided_on == "holm-guard" and bad.ci[1] < 0.85
    assert bad.n == 12 * 39 and bad.evidence["route"] == CODE and bad.evidence["share_of_gated"] == 0.2
    assert "wholly below 0.85" in bad.evidence["why"] and bad.evidence["holm_round"] == 1
    assert bad.evidence["adjusted_level"] == pytest.approx(1 - GUARD_ERROR)  # two routes: 0.025 / 2 each side
    lo95, hi95 = bad.evidence["ci_95_unadjusted"]
    assert bad.ci[0] < lo95 and hi95 < bad.ci[1]  # the adjusted interval is the wider
    assert good.verdict == "info" and good.passed and good.evidence["holm_round"] == 2  # tested alone after code
    assert good.evidence["adjusted_level"] == pytest.approx(1 - 2 * GUARD_ERROR)
    assert by[f"route.{CODE}.kl_p99"].verdict == "info"  # its KL is as mild as chat's
    assert f"route.{CHAT}.kl_mean" not in by  # kl_mean_max is null: reported pooled, not guarded
    decided = GateReport.decide(results, "block")
    assert decided.verdict == "fail" and f"route.{CODE}.top1_agreement" in decided.failed


def test_a_route_whose_kl_tail_the_pooled_p99_cannot_show_fails_its_kl_guard():
    # code (12% of the traffic) has KL 15x chat's: the pooled p99 sits under 0.5, its interval straddling it, while
    # code's own p99 is shown above 0.5; under on_inconclusive: warn only the guard keeps the candidate out
    def kl_of(route, rng, n):
        return rng.exponential(0.01 if route == CHAT else 0.15, n)

    m, ref = _synthetic([CHAT] * 150 + [CODE] * 20, kl_of, lambda r: 0.99, positions=80)
    results = shadow_gate(m, ref, CFG)[0]
    by = {r.metric: r for r in results}
    assert by["kl_p99"].verdict == "inconclusive" and by["kl_p99"].observed < 0.5
    guard = by[f"route.{CODE}.kl_p99"]
    assert guard.verdict == "fail" and guard.ci[0] > 0.5 and guard.observed > 0.5
    assert by[f"route.{CHAT}.kl_p99"].verdict == "info"
    assert GateReport.decide(results, "warn").verdict == "fail"
    off = shadow_gate(m, ref, ShadowConfig(kl_p99_max=0.5, top1_agreement_min=0.85, route_guards=False))[0]
    assert GateReport.decide(off, "warn").verdict != "fail"


def test_homogeneous_candidate_passes_with_every_guard_info():
    m, ref = _synthetic([CHAT] * 30 + [CODE] * 15 + ["rewrite"] * 3, _mild, lambda r: 0.97)
    results, _, _ = shadow_gate(m, ref, CFG)
    guards = [r for r in results if r.metric.startswith("route.")]
    assert len(guards) == 2 * 3 and all(g.verdict == "info" and g.passed for g in guards)
    assert GateReport.decide(results, "block").verdict == "pass"
    # three prompts of rewrite: its adjusted interval is wide, but it is still a guard that could fail
    few = next(g for g in guards if g.metric == "route.rewrite.top1_agreement")
    assert few.evidence["holm_routes"] == 3 and few.ci[1] - few.ci[0] > 0.02


def test_no_guards_for_one_route_or_when_turned_off():
    m, ref = _synthetic([CHAT] * 20, _mild, lambda r: 0.97)
    assert not [r for r in shadow_gate(m, ref, CFG)[0] if r.metric.startswith("route.")]
    m, ref = _synthetic([CHAT] * 20 + [CODE] * 20, _mild, lambda r: 0.5 if r == CODE else 0.99)
    off = ShadowConfig(kl_p99_max=0.5, top1_agreement_min=0.85, route_guards=False)
    assert not [r for r in shadow_gate(m, ref, off)[0] if r.metric.startswith("route.")]
    assert [r for r in shadow_gate(m, ref, CFG)[0] if r.verdict == "fail"]  # on, code's 0.5 fails


def test_holm_steps_down_one_round_per_route_that_fails():
    """b is shown bad at the two-route level but not at three; it fails only once a has failed first."""
    from scipy.stats import norm

    def interval(lo_at):
        def f(mask, level):
            z = float(norm.ppf(1 - (1 - level) / 2))
            return 1.0, lo_at(z), float("inf"), {}

        return f

    z3, z2 = (float(norm.ppf(1 - GUARD_ERROR / m)) for m in (3, 2))
    lows = {"a": lambda z: 5.0, "b": lambda z: 0.5 + (z3 + z2) / 2 - z, "c": lambda z: 0.0}
    routes = np.repeat(np.array(list(lows)), 10)
    gated = np.ones(len(routes), bool)

    def check_of(route_lows):
        # each route's interval: the function of its own mask's route
        def f(mask, level):
            return interval(route_lows[str(routes[mask][0])])(mask, level)

        return RouteCheck("kl_p99", 0.5, False, f)

    by = {g.evidence["route"]: g for g in route_guards(routes, gated, [check_of(lows)])}
    assert [by[r].verdict for r in "abc"] == ["fail", "fail", "info"]
    assert [by[r].evidence["holm_round"] for r in "abc"] == [1, 2, 3]
    # without a's failure b never reaches the two-route level: Bonferroni's one round would stop there too
    lows["a"] = lambda z: 0.0
    by = {g.evidence["route"]: g for g in route_guards(routes, gated, [check_of(lows)])}
    assert [by[r].verdict for r in "abc"] == ["info"] * 3 and by["b"].evidence["holm_round"] == 1


def test_route_labels_are_metric_safe_and_distinct():
    labels = route_labels(["a b", "a_b", "chat/v2", "x" * 300, ""])
    assert (labels["a b"], labels["a_b"]) == ("a_b", "a_b_2")  # in sorted order, the second gets a suffix
    assert len(set(labels.values())) == 5 and all(len(v) <= 50 for v in labels.values())
    assert all(
        set(v) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") for v in labels.values()
    )
    assert labels["chat/v2"] == "chat_v2" and labels[""] == "_"


def test_a_route_of_two_prompts_gets_a_few_cluster_interval_not_a_point():
    # a bootstrap over two prompts has t = 0 in every resample: its interval would be the point, and a guard would
    # fail the route on two prompts
    m, ref = _synthetic([CHAT] * 40 + ["rewrite"] * 2, _mild, lambda r: 0.5 if r == "rewrite" else 0.99)
    by = {r.metric: r for r in shadow_gate(m, ref, CFG)[0]}
    few = by["route.rewrite.top1_agreement"]
    assert few.observed < 0.7 and few.verdict == "info" and few.ci[1] - few.ci[0] > 0.2
    assert few.evidence["method"].startswith("cluster-robust t (CR2)") and few.evidence["clusters"] == 2
