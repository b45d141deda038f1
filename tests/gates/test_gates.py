import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import tiny

from qgate.errors import BackendUnavailable, ConfigError, InputError
from qgate.gates import report
from qgate.gates.evalgate import EvalConfig, eval_gate, task_config
from qgate.gates.gating import GateConfig, run_gates
from qgate.gates.result import GateResult, overall
from qgate.gates.shadow import ShadowConfig, baseline_reference, candidate_metrics, unpassable_quantiles
from qgate.gates.stats import (
    cluster_bootstrap_t,
    holm,
    mcnemar_exact,
    paired_binary_ci,
    paired_ratio_ci,
    paired_ratio_score,
    quantile,
    quantile_ci,
    ratio_of_sums_ci,
)

FAST = GateConfig(
    shadow=ShadowConfig(max_new_tokens=20, max_prompt_tokens=64), eval=EvalConfig(limit=12)
)  # 24 x 20 answer tokens: they bound KL p99 while its tail's design effect stays under 1.17 (t on 23 df)


class CountingRunner:
    """Wraps a runner and counts forward passes, to prove cache hits."""

    def __init__(self, inner):
        self.inner, self.tokenizer, self.kind, self.calls = inner, inner.tokenizer, inner.kind, 0
        self.max_length, self.numerics, self.batch_tokens = inner.max_length, inner.numerics, inner.batch_tokens

    def logits(self, ids):
        self.calls += 1
        return self.inner.logits(ids)

    def logits_batch(self, seqs, keep_last=None):
        self.calls += 1
        return self.inner.logits_batch(seqs, keep_last)

    def greedy(self, ids, n):
        self.calls += 1
        return self.inner.greedy(ids, n)

    def greedy_batch(self, prompts, n):
        self.calls += 1
        return self.inner.greedy_batch(prompts, n)


def test_topk_kl_is_a_lower_bound_and_exact_with_full_vocab(base_art, w8_art, calib_arts, tmp_path):
    from qgate.engines.runners import load_runner

    base, cand = load_runner(base_art), load_runner(w8_art)
    vocab = base.logits([1, 2]).shape[-1]
    full_cfg = ShadowConfig(max_new_tokens=8, max_prompt_tokens=48, top_k=vocab, max_prompts=6)
    k_cfg = ShadowConfig(max_new_tokens=8, max_prompt_tokens=48, top_k=8, max_prompts=6)
    ref_full, _ = baseline_reference(lambda: base, base_art, calib_arts["shadow"], full_cfg, tmp_path)
    ref_k, _ = baseline_reference(lambda: base, base_art, calib_arts["shadow"], k_cfg, tmp_path)
    m_full, m_k = candidate_metrics(cand, ref_full), candidate_metrics(cand, ref_k)
    # direct full-vocabulary KL on the same sequences
    start, direct = 0, []
    for n in ref_full["seq_lens"]:
        seq = ref_full["tokens"][start : start + n].tolist()
        lp, lq = tiny.log_softmax64(base.logits(seq)[:-1]), tiny.log_softmax64(cand.logits(seq)[:-1])
        direct.append((np.exp(lp) * (lp - lq)).sum(-1))
        start += n
    direct = np.concatenate(direct)
    # float32 storage of the baseline's log-probs, and its reference from the prefill + KV-cached decode path
    np.testing.assert_allclose(m_full["kl"], direct, rtol=1e-3, atol=2e-6)
    assert np.all(m_k["kl"] <= direct + 1e-6)
    assert m_full["tail"].max() < 1e-5


def test_candidate_identical_to_baseline_passes_with_zero_disagreement(base_art, calib_arts, workdir):
    """With enough items. On 12 items a task, no flips cannot show that recovery is above 0.9 (an interval that
    stays open with zero flips), so each task is inconclusive, not a pass on a zero-width interval."""
    art = run_gates(base_art, base_art, calib_arts["shadow"], FAST, workdir / "gate-self", workdir / "cache-self")
    report = json.loads((art.path / "report.json").read_text())
    by = {r["metric"]: r for r in report["results"]}
    mc = [r for r in report["results"] if r["metric"].endswith(".recovery")]
    assert len(mc) == 6 and all(r["verdict"] == "inconclusive" and r["ci"][0] < 0.9 < 1.0 < r["ci"][1] for r in mc)
    assert {r["verdict"] for r in report["results"]} == {"pass", "info", "inconclusive"} and report[
        "verdict"
    ] == "inconclusive"
    # 240 items, one check. An identical candidate's ~1e-6 nats can cluster in a few prompts past FAST's bound on the
    # design effect (1.26 on one host), so the pass run scores 24 x 32 tokens, bounded up to 1.87.
    pooled = GateConfig(shadow=replace(FAST.shadow, max_new_tokens=32), eval=EvalConfig(limit=40, pool=True))
    art = run_gates(
        base_art, base_art, calib_arts["shadow"], pooled, workdir / "gate-self-pooled", workdir / "cache-self"
    )
    pooled_report = json.loads((art.path / "report.json").read_text())
    assert pooled_report["passed"] is True and art.meta["passed"] is True
    assert {r["metric"]: r for r in pooled_report["results"]}["mc_pooled.recovery"]["ci"][0] > 0.9
    # the reference comes from generation (prefill + KV-cached decode), the candidate from teacher forcing: ~1e-6 nats
    assert by["kl_p99"]["observed"] < 1e-5 and by["top1_agreement"]["observed"] == 1.0
    assert by["identical_generation"]["observed"] == 1.0
    assert by["bigbench_general_knowledge.recovery"]["evidence"]["flip_rate"] == 0.0
    assert abs(by["chatterbot_ppl.bpb_increase"]["observed"]) < 1e-6
    # the baseline cache keeps each item's chosen answer and gold index, and acc is exactly their agreement
    caches = [
        json.loads(p.read_text())["bigbench_general_knowledge"]
        for p in (workdir / "cache-self").glob("eval-baseline-*.json")
    ]
    assert sorted(len(c["per_item"]) for c in caches) == [12, 40]  # one per limit
    (gk,) = [c for c in caches if len(c["per_item"]) == 12]
    assert len(gk["chosen"]) == len(gk["gold"]) == len(gk["per_item"]) == 12
    assert [float(c == g) for c, g in zip(gk["chosen"], gk["gold"], strict=True)] == gk["per_item"]
    assert by["bigbench_general_knowledge.recovery"]["evidence"]["label_bias"]["share"] >= 1 / 12


def test_a_memory_budget_batches_every_row_together_with_the_same_scores(base_art, calib_arts, monkeypatch):
    """A GPU runner's memory budget (batch_tokens) replaces the CPU's row caps: the baseline's answers decode in one
    batch and the shadow sequences score in one forward, with the answers and log-probs the CPU's batches give."""
    from qgate.chat import encode_with_sources
    from qgate.engines.runners import load_runner
    from qgate.gates import passes
    from qgate.gates import shadow as sh

    runner = load_runner(base_art)
    cfg = sh.ShadowConfig(max_new_tokens=6, max_prompt_tokens=48)
    rows = sh.load_shadow(calib_arts["shadow"], cfg)
    prompts = [encode_with_sources(runner.tokenizer, r["messages"], 48)[0] for r in rows]
    monkeypatch.setattr(passes, "GREEDY_BATCH_ROWS", 5)
    monkeypatch.setattr(passes, "MAX_BATCH_ROWS", 5)
    assert len(passes.greedy_batches(runner, prompts, 6)) > 1
    capped = passes.greedy_scored(runner, prompts, 6, 4)
    seqs = [p + a for p, (a, _) in zip(prompts, capped, strict=True)]
    calls = []
    inner = runner.logits_batch
    runner.logits_batch = lambda batch, keep_last=None: calls.append(len(batch)) or inner(batch, keep_last)
    capped_scores = passes.score_sequences(runner, seqs, "t", lambda x: (x.max(-1),))
    assert max(calls) <= 5
    runner.batch_tokens = 10**6
    assert passes.greedy_batches(runner, prompts, 6) == [
        sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    ]
    budgeted = passes.greedy_scored(runner, prompts, 6, 4)
    calls.clear()
    scores = passes.score_sequences(runner, seqs, "t", lambda x: (x.max(-1),))
    assert calls == [len(seqs)]
    for (a, (ids, lp)), (b, (ids2, lp2)) in zip(capped, budgeted, strict=True):
        assert a == b and np.abs(lp - lp2).max() < 1e-4
    assert all(np.abs(x[0] - y[0]).max() < 1e-4 for x, y in zip(capped_scores, scores, strict=True))


def test_second_candidate_reuses_cached_baseline(base_art, w8_art, awq_art, calib_arts, workdir, monkeypatch):
    import qgate.engines.runners as runners

    made = []
    real = runners.load_runner

    def counting(art, *device):
        r = CountingRunner(real(art, *device))
        made.append((art.sha256, r))
        return r

    monkeypatch.setattr(runners, "load_runner", counting)
    cache = workdir / "cache-shared"
    first = run_gates(w8_art, base_art, calib_arts["shadow"], FAST, workdir / "g1", cache)
    base_calls_first = sum(r.calls for sha, r in made if sha == base_art.sha256)
    made.clear()
    second = run_gates(awq_art, base_art, calib_arts["shadow"], FAST, workdir / "g2", cache)
    base_calls_second = sum(r.calls for sha, r in made if sha == base_art.sha256)
    assert base_calls_first > 0 and base_calls_second == 0
    rep1, rep2 = (json.loads((a.path / "report.json").read_text()) for a in (first, second))
    assert rep1["cache"] == {"shadow_baseline": "miss", "noise_floor": "miss", "eval_baseline": "miss"}
    assert rep2["cache"] == {"shadow_baseline": "hit", "noise_floor": "hit", "eval_baseline": "hit"}


def test_baseline_caches_are_not_reused_across_a_library_upgrade(base_art, w8_art, calib_arts, workdir, monkeypatch):
    """A baseline's cached answers, log-probs, noise floor, long-context NLLs and eval scores were computed by one
    release of torch and transformers (and lm-eval): after an upgrade they are computed again, so a candidate is not
    compared with another library's numbers. A local build label (+cpu, +cu128) is not a release."""
    import qgate.execute

    cache = workdir / "cache-upgrade"
    first = run_gates(w8_art, base_art, calib_arts["shadow"], FAST, workdir / "g-up1", cache)
    real = qgate.execute.versions
    made = {p.name for p in cache.glob("*.sha256")}
    assert len(made) == 4, made  # shadow reference, noise floor, long context, eval

    def relabelled(names):  # the same releases built for another device
        return {n: v.split("+")[0] + "+cu128" for n, v in real(names).items()}

    monkeypatch.setattr(qgate.execute, "versions", relabelled)
    same = run_gates(w8_art, base_art, calib_arts["shadow"], FAST, workdir / "g-up2", cache)
    assert {p.name for p in cache.glob("*.sha256")} == made
    for name in ("transformers", "lm-eval"):
        monkeypatch.setattr(
            qgate.execute, "versions", lambda names, n=name: real(names) | {n: "99.0"} if n in names else real(names)
        )
        run_gates(w8_art, base_art, calib_arts["shadow"], FAST, workdir / f"g-up-{name}", cache)
        now = {p.name for p in cache.glob("*.sha256")}
        added = {n.split("-")[0] for n in now - made}
        assert added == ({"shadow", "noise", "long", "eval"} if name == "transformers" else {"eval"}), now - made
        made = now
    reports = [json.loads((a.path / "report.json").read_text()) for a in (first, same)]
    assert reports[0]["cache"] == {"shadow_baseline": "miss", "noise_floor": "miss", "eval_baseline": "miss"}
    assert reports[1]["cache"] == {"shadow_baseline": "hit", "noise_floor": "hit", "eval_baseline": "hit"}


def test_report_files_and_evidence(base_art, w8_art, calib_arts, workdir):
    art = run_gates(w8_art, base_art, calib_arts["shadow"], FAST, workdir / "g-w8", workdir / "cache-shared")
    html = (art.path / "report.html").read_text()
    assert "data:image/png;base64," in html and "kl_p99" in html
    assert (art.path / "shadow.png").stat().st_size > 5000 and (art.path / "eval.png").exists()
    assert (art.path / "routes.png").stat().st_size > 5000  # the split holds chat, code-assist and rewrite
    report = json.loads((art.path / "report.json").read_text())
    for r in report["results"]:
        assert {"metric", "observed", "threshold", "higher_is_better", "n", "ci", "p_value", "passed"} <= set(r)
    assert report["inputs"]["calibration_sha256"] == w8_art.meta["calibration_sha256"]
    assert art.parents == (w8_art.sha256, base_art.sha256, calib_arts["shadow"].sha256)
    # the shadow prompts FAST cuts to their last 64 tokens: counted, and every gated shadow check says what it covers
    from transformers import AutoTokenizer

    from qgate.chat import render

    tok = AutoTokenizer.from_pretrained(base_art.path)
    rows = [json.loads(x) for x in (calib_arts["shadow"].path / "data.jsonl").read_text().splitlines()]
    lens = [len(tok(render(tok, r["messages"]), add_special_tokens=False)["input_ids"]) for r in rows]
    cut = sum(n > 64 for n in lens)
    s = report["shadow_scoring"]
    assert 0 < cut < len(rows) and (s["prompts_cut"], s["longest_prompt_tokens"], s["max_prompt_tokens"]) == (
        cut,
        max(lens),
        64,
    )
    caveated = {r["metric"] for r in report["results"] if "caveat" in r["evidence"]}
    gated = {r["metric"] for r in report["results"] if r["gate"] == "shadow" and r["threshold"] is not None}
    assert caveated == gated - {"defined_logits"} and caveated >= {"kl_p99", "top1_agreement"}
    caveat = {r["evidence"]["caveat"] for r in report["results"] if "caveat" in r["evidence"]}
    assert caveat == {
        f"{cut} of {len(rows)} shadow prompts are longer than gates.shadow.max_prompt_tokens (64; the longest has "
        f"{max(lens)} tokens) and were scored on their last 64 tokens: this evidence covers contexts of up to "
        "84 tokens, not those prompts whole"
    }
    assert f"<b>Caveat</b>: {cut} of {len(rows)} shadow prompts are longer than" in html
    from qgate.gates.markdown import version_description

    md = version_description(report, {}, "runs:/x").split("**Caveats**\n\n")[1].split("\n\n")[0]
    decided = [r for r in report["results"] if r["metric"] in caveated and r["verdict"] != "info"]
    names = ", ".join(f"`shadow.{r['metric']}`" for r in decided)  # a route guard that did not fail decided nothing
    assert md == f"- {names}: {caveat.pop()}"  # one line naming every check the caveat weakens
    whole = run_gates(
        w8_art,
        base_art,
        calib_arts["shadow"],
        GateConfig(shadow=replace(FAST.shadow, max_prompt_tokens=max(lens)), eval=None),
        workdir / "g-w8-whole",
        workdir / "cache-shared",
    )
    whole_report = json.loads((whole.path / "report.json").read_text())
    assert whole_report["shadow_scoring"]["prompts_cut"] == 0 and not any(
        "caveat" in r["evidence"] for r in whole_report["results"]
    )
    assert "Every prompt was scored whole" in (whole.path / "report.html").read_text()


def test_three_verdicts_decided_on_the_confidence_interval():
    ok = GateResult.check("shadow", "kl_p99", 0.09, 0.1, False, 100, ci=(0.08, 0.095))
    straddles = GateResult.check("shadow", "kl_p99", 0.09, 0.1, False, 400, ci=(0.05, 0.14))
    bad = GateResult.check("shadow", "kl_p99", 0.2, 0.1, False, 100, ci=(0.15, 0.25))
    assert (ok.verdict, ok.passed, ok.decided_on) == ("pass", True, "ci")
    assert (bad.verdict, bad.passed) == ("fail", False)
    assert (straddles.verdict, straddles.passed) == ("inconclusive", False)
    # the end facing the threshold is 0.05 from the point, which is 0.01 from it: about (0.05 / 0.01)^2 = 25x the items
    assert straddles.n_to_decide == 400 * 25
    # only the facing side counts, on either side of the threshold: a skewed interval's far side says nothing
    good = GateResult.check("shadow", "kl_p99", 0.25, 0.375, False, 48, ci=(0.125, 0.5))
    worse = GateResult.check("shadow", "kl_p99", 0.5, 0.375, False, 48, ci=(0.3125, 1.0))
    assert good.n_to_decide == 48 * (0.25 / 0.125) ** 2 == 192  # the half width would say 108
    assert worse.n_to_decide == 48 * (0.1875 / 0.125) ** 2 == 108  # the half width would say 363
    assert straddles.mde == pytest.approx(0.09 / (2 * 1.959964) * (1.959964 + 0.841621), rel=1e-6)
    hi = GateResult.check("eval", "recovery", 0.95, 0.9, True, 69, ci=(0.80, 1.10))
    assert hi.verdict == "inconclusive" and "~" in hi.line() and "INCONCLUSIVE" in hi.line()
    assert GateResult.check("eval", "recovery", 0.7, 0.9, True, 69, ci=(0.6, 0.8)).verdict == "fail"
    # an unbounded upper end can fail a lower-is-better check but never pass it
    assert (
        GateResult.check("shadow", "kl_p999", 0.01, 0.1, False, 50, ci=(0.005, float("inf"))).verdict == "inconclusive"
    )
    assert GateResult.check("shadow", "kl_p999", 0.5, 0.1, False, 50, ci=(0.3, float("inf"))).verdict == "fail"
    # an interval the sample cannot place (NaN ends: a ratio over one document) is unbounded: it decides nothing
    one_doc = GateResult.check("eval", "wikitext.bpb_increase", 0.0, 0.02, False, 1, ci=(float("nan"), float("nan")))
    assert (one_doc.verdict, one_doc.decided_on, one_doc.ci) == ("inconclusive", "ci", (-np.inf, np.inf))
    half = GateResult.check("eval", "wikitext.bpb_increase", 0.5, 0.02, False, 1, ci=(0.3, float("nan")))
    assert (half.verdict, half.ci) == ("fail", (0.3, np.inf))
    err = GateResult.check("eval", "acc", float("nan"), 0.1, False, 0, evidence={"error": "boom"})
    assert (err.verdict, err.passed, err.decided_on, err.evidence) == ("error", False, "not-run", {"error": "boom"})
    assert GateResult.check("x", "y", float("nan"), 0.1, False, 0).evidence == {"error": "no finite value"}
    assert GateResult.check("x", "y", 3.0, None, False, 10).verdict == "info"
    assert overall([ok, straddles]) == "inconclusive" and overall([ok, straddles, bad]) == "fail"
    assert overall([ok, err]) == "fail" and overall([ok]) == "pass"


def test_a_check_with_no_positions_is_an_error_only_where_it_has_a_threshold():
    """No position of the gated kind scored: every KL and top-1 check gets a NaN row, decided on not-run (ERROR)
    where the config sets its threshold and report-only (INFO) where it does not; none when nothing is gated. The
    evidence given for kl_mean (what was scored) stays on its row, as it does once positions are scored."""
    from qgate.gates.kl_checks import kl_top1_checks

    m = {"kl": np.full(6, 0.01), "agree": np.ones(6, bool)}
    none, clusters = np.zeros(6, bool), np.repeat(np.arange(3), 2)
    cfg, scored = ShadowConfig(kl_p99_max=0.5, kl_p999_max=1.0, top1_agreement_min=None), {"scored": {"answer": 0}}
    rows = kl_top1_checks(m, clusters, none, cfg, evidence=scored)
    got = {r.metric: (r.verdict, r.decided_on, r.threshold) for r in rows}
    assert got == {
        "kl_mean": ("info", "report-only", None),
        "kl_p99": ("error", "not-run", 0.5),
        "kl_p999": ("error", "not-run", 1.0),
        "top1_agreement": ("info", "report-only", None),
    }
    assert all(np.isnan(r.observed) and r.evidence["error"] == "no positions of this kind were scored" for r in rows)
    assert [r.evidence.get("scored") for r in rows] == [{"answer": 0}, None, None, None]
    assert overall(rows) == "fail"
    assert kl_top1_checks(m, clusters, none, None) == []
    scored = kl_top1_checks(m, clusters, ~none, ShadowConfig())  # the same four rows once positions are scored
    assert [r.verdict for r in scored] == ["info", "inconclusive", "info", "pass"]


def test_a_split_too_small_to_pass_a_tail_check_is_refused_before_scoring(
    base_art, w8_art, calib_arts, workdir, monkeypatch
):
    assert unpassable_quantiles(ShadowConfig(max_new_tokens=16), 23) == []  # 368 positions can bound p99
    assert unpassable_quantiles(ShadowConfig(max_new_tokens=16), 22) == [
        "gates.shadow.kl_p99_max: p99 needs at least 368 scored positions for its 95% interval to have an upper end, "
        "and 22 prompts give at most 352 (16 per prompt)"
    ]
    assert unpassable_quantiles(ShadowConfig(max_new_tokens=16, kl_p99_max=None), 22) == []  # reported, not gated
    assert unpassable_quantiles(ShadowConfig(max_new_tokens=16, positions="answer+prompt"), 22) == []  # 400 a prompt
    assert len(unpassable_quantiles(ShadowConfig(max_new_tokens=16, max_prompts=22), 100)) == 1  # the first 22 only
    # p99.9 needs ten times as many: the default split (64 prompts x 48 answer tokens) can never pass it
    assert [w.split(":")[0] for w in unpassable_quantiles(ShadowConfig(kl_p999_max=0.5), 64)] == [
        "gates.shadow.kl_p999_max"
    ]

    thin = GateConfig(shadow=ShadowConfig(max_new_tokens=8, max_prompt_tokens=64), eval=None, long_context=None)
    with pytest.raises(InputError) as e:  # 24 prompts x 8 tokens: 192 positions
        run_gates(w8_art, base_art, calib_arts["shadow"], thin, workdir / "g-thin", workdir / "cache-thin")
    assert "24 prompts give at most 192" in e.value.message and "no candidate could pass" in e.value.message
    assert "--shadow-size" in e.value.hint and "max_new_tokens" in e.value.hint
    assert not (workdir / "g-thin").exists() and not any((workdir / "cache-thin").iterdir())  # nothing scored

    class Scored(Exception):
        pass

    def scored(*a, **k):
        raise Scored

    import qgate.gates.gating as gating

    monkeypatch.setattr(gating, "_score", scored)  # under warn the gate scores: its p99 can still fail a candidate
    with pytest.raises(Scored):
        run_gates(
            w8_art,
            base_art,
            calib_arts["shadow"],
            replace(thin, on_inconclusive="warn"),
            workdir / "g-w",
            workdir / "c-w",
        )


def test_a_tail_too_thin_to_bound_says_how_many_more_values_would_bound_it():
    rng = np.random.default_rng(1)
    x = rng.exponential(0.01, 200)  # p99 ~0.046, far below a threshold of 0.5; 200 values cannot bound p99 above
    lo, hi, ev = quantile_ci(x, np.arange(x.size), 0.99, cluster_name="prompts")
    row = GateResult.check("shadow", "kl_p99", float(np.quantile(x, 0.99)), 0.5, False, x.size, (lo, hi), evidence=ev)
    assert row.verdict == "inconclusive" and hi == float("inf")
    # independent values: n_eff is n over (t_199 / z)^2 = 1.012, and about 368 of them bound p99 at 95%
    assert ev["min_n_effective"] == 368 and ev["n_effective"] in (196, 197) and ev["design_df"] == 199
    assert row.n_to_decide == ev["n_to_bound"] == ev["clusters_to_bound"] == -(-200 * 368 // ev["n_effective"])
    said = f"about {row.n_to_decide} prompts ({row.n_to_decide} values) would bound it"
    assert said in row.line() and "may not decide" not in row.line() and said in report._row(row.to_dict())
    from qgate.gates.markdown import version_description

    doc = {"candidate": {"name": "c"}, "verdict": "inconclusive", "inputs": {}, "results": [row.to_dict()]}
    md = version_description(doc, {}, "runs:/x").split("**Undecided**\n\n")[1].split("\n\n")[0]
    assert md == f"- `shadow.kl_p99`: ~{row.n_to_decide} items would decide it; {ev['unbounded_because']}"
    more = rng.exponential(0.01, row.n_to_decide)  # that many values of the same traffic decide it
    lo, hi, ev = quantile_ci(more, np.arange(more.size), 0.99)
    assert (
        GateResult.check("shadow", "kl_p99", float(np.quantile(more, 0.99)), 0.5, False, more.size, (lo, hi)).verdict
        == "pass"
    )
    # clustered: the count scales with the design effect; a bad point is not bounded, its lower end counts instead
    cl = np.repeat(np.arange(48), 48)
    y = rng.exponential(0.01, cl.size)
    y[cl == 0] *= 50  # the tail in one prompt
    lo, hi, ev = quantile_ci(y, cl, 0.99)
    assert hi == float("inf") and ev["n_to_bound"] == -(-y.size * 368 // ev["n_effective"]) > y.size
    assert ev["clusters_to_bound"] == -(-48 * 368 // ev["n_effective"])
    bad = GateResult.check("shadow", "kl_p99", 0.6, 0.5, False, y.size, (0.4, float("inf")), evidence=ev)
    assert bad.verdict == "inconclusive" and bad.n_to_decide == 4 * y.size  # its lower end's count, not n_to_bound


def test_quantile_interval_respects_clustering_and_refuses_to_bound_thin_tails():
    rng = np.random.default_rng(0)
    clusters = np.repeat(np.arange(48), 48)
    truth = np.log(100)  # p99 of Exp(1)
    hits = 0
    for _ in range(200):
        lo, hi, ev = quantile_ci(rng.exponential(1.0, clusters.size), clusters, 0.99)
        hits += lo <= truth <= hi
    assert hits / 200 >= 0.93  # nominal 95%
    x = rng.exponential(1.0, clusters.size)
    lo, hi, ev = quantile_ci(x, clusters, 0.999)  # 2,304 tokens < 3,688 needed: p99.9 cannot be bounded above
    assert hi == float("inf") and ev["min_n_effective"] == 3688 and "cannot bound" in ev["unbounded_because"]
    # the whole tail inside 3 prompts: a large design effect, fewer effective tokens, a wider interval
    y = x.copy()
    y[clusters < 3] *= 20
    _, hi_c, ev_c = quantile_ci(y, clusters, 0.99)
    _, hi_i, ev_i = quantile_ci(y, np.arange(y.size), 0.99)
    assert ev_c["design_effect"] > 3 and ev_c["n_effective"] < ev_i["n_effective"] and hi_c >= hi_i
    lo, hi, _ = quantile_ci(np.repeat([3.84], 2304) + rng.normal(0, 1e-3, 2304), clusters, 0.99)
    assert hi > lo  # no zero-width intervals


def test_an_infinite_quantile_is_not_called_too_few_values_to_bound():
    """A p99 whose values are +inf (a candidate whose logits define no distribution there) is infinite on its values:
    its upper end is +inf with enough values to bound it, and the evidence does not ask for more of them."""
    clusters = np.repeat(np.arange(24), 20)
    x = np.random.default_rng(4).exponential(0.01, clusters.size)
    x[clusters < 2] = np.inf  # 40 of 480 values, 8%: past p99
    lo, hi, ev = quantile_ci(x, clusters, 0.99)
    assert lo == hi == float("inf") and ev["n_effective"] >= ev["min_n_effective"] == 368
    assert "unbounded_because" not in ev and "n_to_bound" not in ev
    row = GateResult.check("shadow", "kl_p99", float(quantile(x, 0.99)), 0.5, False, x.size, (lo, hi), evidence=ev)
    assert row.verdict == "fail" and "would bound" not in row.line()
    _, hi, ev = quantile_ci(x[:200], clusters[:200], 0.99)  # 10 prompts, 200 values: too few, whatever they hold
    assert hi == float("inf") and "cannot bound" in ev["unbounded_because"]


def test_quantile_interval_takes_its_effective_n_on_the_clusters_degrees_of_freedom():
    from scipy.stats import norm
    from scipy.stats import t as student_t

    rng = np.random.default_rng(3)
    clusters = np.repeat(np.arange(12), 200)  # 2,400 tokens in 12 prompts
    x = rng.exponential(1.0, clusters.size) * np.exp(rng.normal(0, 0.3, 12))[clusters]
    lo, hi, ev = quantile_ci(x, clusters, 0.99)
    _, hi_plain, ev_plain = quantile_ci(x, clusters, 0.99, design_df=np.inf)  # Kish's n / deff, no adjustment
    deff = ev_plain["design_effect"]
    assert ev["design_df"] == 11 and ev["design_effect"] == deff > 1
    assert abs(ev_plain["n_effective"] - x.size / deff) <= 2
    adjust = (student_t.ppf(0.975, 11) / norm.ppf(0.975)) ** 2  # 1.261: the variance rests on 12 prompts
    assert abs(ev["n_effective"] - x.size / (deff * adjust)) <= 2
    assert hi >= hi_plain and lo <= quantile(x, 0.99) <= hi
    # one prompt has no degrees of freedom: however many tokens, it bounds nothing
    lo, hi, ev = quantile_ci(x[:200], np.zeros(200), 0.99)
    assert (
        (lo, hi) == (float("-inf"), float("inf"))
        and ev["n_effective"] == 1
        and "cannot bound" in ev["unbounded_because"]
    )


def test_quantile_interval_lower_end_stays_below_the_estimate_at_small_effective_n():
    # two or three prompts, or p99.9 on a few hundred tokens: an effective n of a few, where the lower rank is the
    # last one; the lower end must not be the sample maximum (a guard on a small route would fail on one token)
    rng = np.random.default_rng(3)
    for k, q, per in ((2, 0.99, 60), (2, 0.999, 200), (3, 0.999, 40)):
        clusters = np.repeat(np.arange(k), per)
        x = rng.exponential(1.0, clusters.size) * np.exp(rng.normal(0, 0.5, k))[clusters]
        lo, hi, ev = quantile_ci(x, clusters, q)
        assert ev["n_effective"] < 25 and hi == float("inf")  # below 25 the lower rank of p99.9 is the last
        assert lo <= quantile(x, q) < x.max(), (k, q, lo, ev["n_effective"])


def test_mcnemar_and_paired_ci_known_values():
    base = np.array([1] * 10 + [0] * 10, bool)
    cand = np.array([0] * 8 + [1] * 2 + [0] * 10, bool)  # 8 lost, 0 gained
    t = mcnemar_exact(base, cand)
    assert (t["lost"], t["gained"], t["flip_rate"]) == (8, 0, 0.4)
    assert abs(t["p_value"] - 2 * 0.5**8) < 1e-12
    m, lo, hi = paired_binary_ci(base, cand)
    assert m == -0.4 and hi < 0 < 1 + lo


def test_paired_accuracy_interval_never_has_zero_width_and_covers():
    same = np.array([1] * 31 + [0] * 38, bool)  # 69 items, no discordant pair
    m, lo, hi = paired_binary_ci(same, same)
    assert m == 0 and -0.04 < lo < -0.02 and 0.02 < hi < 0.04  # about +-2/(n+2), not [0, 0]
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(2000):  # true loss 2 points: 3% lost, 1% gained
        u = rng.random(300)
        base = u < 0.5
        cand = base.copy()
        cand[u < 0.03], cand[(u >= 0.5) & (u < 0.51)] = False, True
        _, lo, hi = paired_binary_ci(base, cand)
        hits += lo <= -0.02 <= hi
    assert 0.93 <= hits / 2000 <= 0.975  # nominal 95%


def _items(both: int, gained: int, lost: int, neither: int) -> tuple[np.ndarray, np.ndarray]:
    """Paired right/wrong items (baseline, candidate) with these counts."""
    counts = [both, gained, lost, neither]
    return np.repeat([True, False, True, False], counts), np.repeat([True, True, False, False], counts)


@pytest.mark.parametrize(
    "table, level, published, digits",
    [  # Tang's asymptotic score interval, as published (ratesci's and contingencytables' tests, Fagerland et al.)
        ((59, 6, 16, 80), 0.95, (0.7476, 0.9876), 4),  # Cavo et al. 2012
        ((1, 1, 7, 12), 0.95, (0.065, 0.907), 3),  # Bentur et al. 2009
        ((446, 5, 16, 690), 0.90, (0.958, 0.992), 3),
        ((43, 0, 1, 0), 0.90, (0.904, 1.039), 3),
    ],
)
def test_paired_ratio_score_and_interval_known_values(table, level, published, digits):
    """The score statistic crosses -+z at Tang's published ends; the gate's interval takes Tang's lower end and the
    skewness-corrected upper end, each where its own statistic equals -+z."""
    from scipy.stats import norm

    z = float(norm.ppf(1 - (1 - level) / 2))
    base, cand = _items(*table)
    step = 0.5 * 10**-digits  # the published figures' rounding
    lo_pub, hi_pub = published
    assert paired_ratio_score(base, cand, lo_pub - step) > z > paired_ratio_score(base, cand, lo_pub + step)
    assert paired_ratio_score(base, cand, hi_pub - step) > -z > paired_ratio_score(base, cand, hi_pub + step)
    est, lo, hi = paired_ratio_ci(base, cand, z)
    assert est == pytest.approx((table[0] + table[1]) / (table[0] + table[2]))
    assert round(lo, digits) == lo_pub and lo < est < hi
    assert paired_ratio_score(base, cand, hi, skew=True) == pytest.approx(-z, abs=1e-9)


def test_paired_ratio_interval_edges():
    """No discordant item among n, k right on both: the lower end is k / (k + z^2), not k/k; at a ratio of 1 the
    skewness correction vanishes; a baseline with nothing right has no ratio."""
    z = 1.959964
    for k, n in ((8, 16), (50, 100), (800, 1617)):
        base, cand = _items(k, 0, 0, n - k)
        est, lo, hi = paired_ratio_ci(base, cand)
        assert est == 1.0 and lo == pytest.approx(k / (k + z * z), rel=1e-9) and hi > 1.0
    base, cand = _items(40, 3, 9, 48)
    assert paired_ratio_score(base, cand, 1.0) == pytest.approx(paired_ratio_score(base, cand, 1.0, skew=True))
    assert paired_ratio_score(base, cand, 0.9) > paired_ratio_score(base, cand, 0.95)  # decreasing in the ratio
    assert all(np.isnan(paired_ratio_ci(*_items(0, 5, 0, 5))))
    est, lo, hi = paired_ratio_ci(*_items(0, 0, 10, 0))  # the candidate got nothing right
    assert (est, lo) == (0.0, 0.0) and 0 < hi < 0.5
    (r,) = eval_gate(
        {"t": {"kind": "mc", "per_item": [0.0] * 10}},
        {"t": {"kind": "mc", "per_item": [1.0] * 10}},
        _eval_cfg(("t",), min_recovery=0.9),
    )
    assert r.verdict == "error" and r.ci is None


@pytest.mark.parametrize(
    "n, base_acc, margin, gained",
    [
        (50, 0.9, 0.95, 0.0),  # few items, every flip a loss: the rule before passed 9.8% of these
        (200, 0.5, 0.98, 0.0),  # a near-lossless variant: 7.9% before
        (200, 0.9, 0.9, 0.01),
        (50, 0.9, 0.9, 0.01),  # Tang's upper end alone fails 3.8% of these
    ],
)
def test_a_candidate_exactly_at_the_margin_passes_and_fails_at_most_nominally(n, base_acc, margin, gained):
    """The eval gate's promise: PASS only when the 95% interval lies wholly above min_recovery, FAIL only when wholly
    below. So a candidate whose true recovery equals the margin should pass at most 2.5% of the time and fail at
    most 2.5%. 20,000 draws of paired items from the true table, each distinct table gated once and weighted by how
    often it was drawn: both rates stay below 3% (Monte Carlo error about 0.11%)."""
    lost = base_acc * (1 - margin) + gained
    p = np.array([base_acc - lost, gained, lost, 1 - base_acc - gained])
    tables, weight = np.unique(np.random.default_rng(0).multinomial(n, p, 20000), axis=0, return_counts=True)
    passes = fails = 0
    cfg = _eval_cfg(("t",), min_recovery=margin)
    for t, w in zip(tables, weight, strict=True):
        base, cand = _items(*map(int, t))
        (r,) = eval_gate(
            {"t": {"kind": "mc", "per_item": base.astype(float).tolist()}},
            {"t": {"kind": "mc", "per_item": cand.astype(float).tolist()}},
            cfg,
        )
        passes += w * (r.verdict == "pass")
        fails += w * (r.verdict == "fail")
    assert passes / 20000 < 0.03 and fails / 20000 < 0.03


def test_time_ratio_interval_covers_at_three_passes_a_side():
    """The perf check's interval: a ratio of geometric-mean times with a t interval on log times. Run-to-run jitter
    of 5% and 3% (log-normal) on three passes a side, a true speed-up of 1.3: nominal 95% coverage, read apart
    (Welch) and, with a host speed that drifts 20% between rounds, in turn (paired), where the drift cancels; two
    equal sets of times give an interval centred on 1."""
    from qgate.gates.stats import time_ratio_ci

    rng = np.random.default_rng(3)
    hits, widths = {"apart": 0, "in turn": 0}, []
    for _ in range(2000):
        base, cand = 13.0 * np.exp(rng.normal(0, 0.05, 3)), 10.0 * np.exp(rng.normal(0, 0.03, 3))
        ratio, lo, hi = time_ratio_ci(base, cand)
        hits["apart"] += lo <= 1.3 <= hi
        assert lo < ratio < hi
        drift = np.exp(rng.normal(0, 0.2, 3))  # the host's speed over the rounds, shared by a round's two passes
        _, lo, hi = time_ratio_ci(base * drift, cand * drift, paired=True)
        hits["in turn"] += lo <= 1.3 <= hi
        _, lo_w, hi_w = time_ratio_ci(base * drift, cand * drift)  # the same passes read apart: drift widens it
        widths.append(np.log(hi / lo) / np.log(hi_w / lo_w))
    assert all(0.93 <= h / 2000 <= 0.975 for h in hits.values()), hits
    assert np.median(widths) < 0.5, np.median(widths)
    ratio, lo, hi = time_ratio_ci([1.0, 1.1, 0.9], [1.0, 1.1, 0.9])
    assert abs(ratio - 1) < 1e-12 and abs(lo * hi - 1) < 1e-9 and 0.7 < lo < 0.85, (lo, hi)
    assert np.isnan(time_ratio_ci([1.0], [1.0, 1.1])[1])  # one pass: no spread to read an interval from


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("threshold", [2.05, 2.1, 1.9])
def test_passes_to_decide_names_the_fewest_passes_of_the_same_spread_that_decide(paired, threshold):
    """An INCONCLUSIVE speed-up names how many timed passes of each model would decide it: with passes of the same
    log mean and spread, the interval at that many clears the threshold and at one fewer it does not. The t
    quantile's fall with the passes counts: the standard error alone would name about twice as many at 3 passes."""
    from qgate.gates.stats import passes_to_decide, time_ratio_ci

    base, cand = [2.0, 2.1, 1.9], [1.0, 1.02, 0.98]
    _, lo, hi = time_ratio_ci(base, cand, paired)
    assert lo < threshold < hi  # undecided at 3 passes
    m = passes_to_decide(base, cand, threshold, paired)

    def like(times, k):  # k passes with the log mean and sample spread of `times`
        x = np.log(times)
        z = np.linspace(-1, 1, k)
        return np.exp(x.mean() + x.std(ddof=1) * (z - z.mean()) / z.std(ddof=1))

    def decided(k):  # paired: the log ratios keep the three pairs' mean and spread
        b = like(base, k)
        c = b / like(np.divide(base, cand), k) if paired else like(cand, k)
        _, lo, hi = time_ratio_ci(b, c, paired)
        return not lo < threshold < hi

    assert m > 3 and decided(m) and not decided(m - 1), m
    se_alone = 3 * (np.log(hi / lo) / 2 / abs(np.log(hi * lo) / 2 - np.log(threshold))) ** 2  # 1/sqrt(n) only
    assert m < se_alone, (m, se_alone)


def _skewed_prompts(rng, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 agreement of k prompts of 16-48 answer tokens whose disagreement rates are Beta(0.2, 1.8): most prompts
    near none, a few with many, mean 0.1. (agreement per position, prompt of each)."""
    n = rng.integers(16, 49, k)
    prompt = np.repeat(np.arange(k), n)
    return (rng.random(prompt.size) >= rng.beta(0.2, 1.8, k)[prompt]).astype(float), prompt


def test_a_mean_over_skewed_prompts_passes_at_its_threshold_about_as_often_as_nominal():
    """The shadow gate's top-1 agreement (and mean KL): positions clustered in prompts, a few prompts holding most of
    the disagreement. For a true agreement on the threshold (0.9), the bootstrap-t interval's lower end lies above it
    about 2.5% of the time with 48 prompts (3,000 draws: under 3.6% allowed for Monte Carlo error); the percentile
    bootstrap of the same resamples, the rule before, about 7%."""
    rng = np.random.default_rng(0)
    passes = percentile_passes = fails = 0
    for _ in range(3000):
        agree, prompt = _skewed_prompts(rng, 48)
        mean, lo, hi, ev = cluster_bootstrap_t(agree, prompt, seed=int(rng.integers(2**31)))
        assert lo <= mean <= hi and ev["clusters"] == 48
        passes += lo > 0.9
        fails += hi < 0.9
        percentile_passes += ev["percentile"][0] > 0.9
    assert passes / 3000 < 0.036 and fails / 3000 < 0.036 and percentile_passes / 3000 > 0.05
    same = np.ones(100)
    assert cluster_bootstrap_t(same, np.repeat(np.arange(10), 10))[1:3] == (1.0, 1.0)  # nothing varies
    assert cluster_bootstrap_t(same, np.zeros(100))[1:3] == (float("-inf"), float("inf"))  # one prompt decides nothing


def test_disagreement_held_by_a_few_prompts_does_not_narrow_the_passing_end():
    """Top-1 agreement where one prompt in 12 is broken (agreement 0.2) and the rest agree everywhere: the true
    agreement is 0.933. A resample of the 24 prompts that draws none of the broken ones has no spread, and the
    bootstrap left those out, the very resamples above the mean, so its lower end sat above the truth in 40% of
    samples (400 draws), where only a sample with no broken prompt at all (11.5%: (11/12)^24) must miss it. That
    end now comes from the cluster-robust t interval, and misses about that often. One flip in 1,152 positions still
    bounds the agreement far above any threshold, below its estimate."""
    rng = np.random.default_rng(0)
    true, above, unavoidable = 1 - (1 / 12) * 0.8, 0, 0
    for _ in range(400):
        broken = rng.random(24) < 1 / 12
        agree = (rng.random((24, 48)) < np.where(broken, 0.2, 1.0)[:, None]).astype(float).ravel()
        mean, lo, hi, ev = cluster_bootstrap_t(agree, np.repeat(np.arange(24), 48), seed=int(rng.integers(2**31)))
        above += lo > true
        unavoidable += not broken.any()
        if broken.sum() == 1:
            assert ev["no_spread_share"] > 0.025 and "the lower end" in ev["ends_from"] and np.isfinite(lo)
    assert unavoidable / 400 > 0.08 and above / 400 < unavoidable / 400 + 0.03
    one = np.ones(24 * 48)
    one[5] = 0.0
    mean, lo, hi, ev = cluster_bootstrap_t(one, np.repeat(np.arange(24), 48))
    assert 0.99 < lo < mean < hi and "the lower end" in ev["ends_from"]


def _documents(rng, k: int, increase: float = 0.05) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token NLLs of k documents of 20-400 tokens, the candidate's each raised by its document's own increase
    (mean `increase`, sd 0.02 between documents) plus token noise: (candidate, baseline, document of each token)."""
    m = rng.integers(20, 400, k)
    doc = np.repeat(np.arange(k), m)
    base = rng.gamma(4.0, 0.5, doc.size)
    cand = base * (1 + rng.normal(increase, 0.02, k)[doc]) + rng.normal(0, 0.3, doc.size)
    return cand, base, doc


def test_bootstrap_t_with_few_clusters_is_a_t_interval_and_never_a_point_by_chance():
    from qgate.gates.stats import BOOT_MIN_CLUSTERS, cluster_bootstrap_t

    rng = np.random.default_rng(0)
    x = (rng.random(5 * 40) < 0.8).astype(float)
    cl = np.repeat(np.arange(5), 40)
    mean, lo, hi, ev = cluster_bootstrap_t(x, cl)
    assert 5 < BOOT_MIN_CLUSTERS and ev["method"].startswith("cluster-robust t") and lo < mean < hi and ev["df"] < 5
    same = np.tile([1.0, 0.0, 1.0, 1.0], 20)  # two prompts with the same share, 0.75, by chance
    assert cluster_bootstrap_t(same, np.repeat([0, 1], 40))[1:3] == (float("-inf"), float("inf"))
    big = np.tile(same, 5)  # ten such prompts: bootstrapped, and still no interval from identical cluster means
    assert cluster_bootstrap_t(big, np.repeat(np.arange(10), 40))[1:3] == (float("-inf"), float("inf"))
    assert cluster_bootstrap_t(np.ones(400), np.repeat(np.arange(10), 40))[:3] == (1.0, 1.0, 1.0)  # nothing varies


def test_a_ratio_over_few_documents_holds_its_level_where_a_bootstrap_cannot():
    """The long-context check's statistic: the candidate's NLL summed over a window's tokens over the baseline's, the
    tokens grouped in documents of unequal length, each with its own increase. At a true increase on the threshold
    each end of the 95% interval crosses it by mistake at most about 2.5% of the time, with 2, 4 or 8 documents
    (3,000 draws each; under 4% allowed for Monte Carlo error), where a percentile bootstrap over documents crosses
    it about 25% of the time with 2 (benchmarks/bench_long_context_ci.py)."""
    rng = np.random.default_rng(0)
    for k in (2, 4, 8):
        low = high = 0
        for _ in range(3000):
            cand, base, doc = _documents(rng, k)
            ratio, lo, hi, ev = ratio_of_sums_ci(cand, base, doc)
            low += lo > 1.05
            high += hi < 1.05
        assert low / 3000 < 0.04 and high / 3000 < 0.04 and ev["clusters"] == k
        if k == 8:
            assert (low + high) / 3000 > 0.01  # not an interval too wide to decide anything
    # equal documents: exactly the one-sample t interval on their own ratios
    from scipy.stats import t

    doc = np.repeat(np.arange(5), 10)
    per_doc = np.array([1.02, 1.07, 1.05, 1.01, 1.09])
    ratio, lo, hi, ev = ratio_of_sums_ci(per_doc[doc], np.ones(50), doc)
    half = t.ppf(0.975, 4) * per_doc.std(ddof=1) / np.sqrt(5)
    assert ev["df"] == pytest.approx(4) and (lo, hi) == pytest.approx((per_doc.mean() - half, per_doc.mean() + half))
    assert np.isnan(ratio_of_sums_ci(per_doc[doc], np.ones(50), np.zeros(50))[1])  # one document: no interval
    many = np.arange(100_000)  # a perplexity task of many documents: its degrees of freedom take O(k), not k x k
    assert ratio_of_sums_ci(1 + rng.normal(0, 0.01, many.size), np.ones(many.size), many)[3]["df"] == pytest.approx(
        99_999
    )


def _eval_cfg(tasks, **kw) -> EvalConfig:
    """An EvalConfig over synthetic task names (the real constructor checks names against shipped tasks)."""
    cfg = EvalConfig.__new__(EvalConfig)
    for k, v in (
        {
            "tasks": tasks,
            "limit": None,
            "min_recovery": 0.9,
            "max_bpb_increase": 0.05,
            "pool": False,
            "significant_loss_alpha": None,
        }
        | kw
    ).items():
        object.__setattr__(cfg, k, v)
    return cfg


def test_pooled_tasks_decide_what_each_small_task_cannot():
    """Three 70-item tasks, each losing 5 items (recovery ~0.87 against a limit of 0.95): alone each interval
    straddles the limit; pooled, the 210 items' interval lies below it."""
    rng = np.random.default_rng(0)
    base, cand = {}, {}
    for t in ("a", "b", "c"):
        b = rng.random(70) < 0.6
        c = b.copy()
        c[np.nonzero(b)[0][:5]] = False  # 5 losses
        base[t], cand[t] = (
            {"kind": "mc", "per_item": b.astype(float).tolist()},
            {"kind": "mc", "per_item": c.astype(float).tolist()},
        )
    alone = eval_gate(base, cand, _eval_cfg(("a", "b", "c"), min_recovery=0.95))
    assert [r.verdict for r in alone] == ["inconclusive"] * 3
    pooled = eval_gate(base, cand, _eval_cfg(("a", "b", "c"), min_recovery=0.95, pool=True))
    assert pooled[0].metric == "mc_pooled.recovery" and pooled[0].n == 210 and pooled[0].verdict == "fail"
    assert pooled[0].ci[1] < 0.95 and pooled[0].decided_on == "ci"
    assert pooled[0].evidence["lost"] == 15 and pooled[0].evidence["tasks"] == ["a", "b", "c"]
    assert [(r.verdict, r.decided_on) for r in pooled[1:]] == [("info", "holm-guard")] * 3  # none alone below 0.95
    assert pooled[0].mde < min(r.mde for r in alone)


def _six_tasks(losses: dict[str, tuple[int, int]], seed: int = 0) -> tuple[dict, dict]:
    """Six 300-item tasks (a, b, ..., f), the baseline right on about half; losses: task -> (items lost, gained)."""
    rng = np.random.default_rng(seed)
    base, cand = {}, {}
    for t in "abcdef":
        lost, gained = losses.get(t, (0, 0))
        b = rng.random(300) < 0.5
        c = b.copy()
        c[np.nonzero(b)[0][:lost]], c[np.nonzero(~b)[0][:gained]] = False, True
        base[t], cand[t] = (
            {"kind": "mc", "per_item": b.astype(float).tolist()},
            {"kind": "mc", "per_item": c.astype(float).tolist()},
        )
    return base, cand


def test_pooling_does_not_hide_a_loss_beyond_the_margin_in_one_task():
    """Task a loses 60 items and gains none (recovery ~0.6); each other task gains 12: pooled, 60 lost and 60 gained
    pass. The guard holds task a to the pooled margin (0.85) on Holm-adjusted intervals and fails it."""
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    base, cand = _six_tasks({"a": (60, 0)} | {t: (0, 12) for t in "bcdef"})
    res = {r.metric: r for r in eval_gate(base, cand, _eval_cfg(tuple("abcdef"), min_recovery=0.85, pool=True))}
    pooled, a = res["mc_pooled.recovery"], res["a.recovery"]
    assert (pooled.verdict, pooled.decided_on, pooled.evidence["lost"]) == ("pass", "ci", 60)
    assert (a.verdict, a.decided_on, a.threshold) == ("fail", "holm-guard", 0.85) and a.ci[1] < 0.85
    assert a.evidence["holm_step"] == 1 and a.evidence["adjusted_level"] == pytest.approx(1 - 0.05 / 6)
    assert a.ci[0] < a.evidence["ci_95_unadjusted"][0] and a.evidence["p_holm"] < 0.025  # wider than the 95% CI
    assert "lies wholly below 0.85" in a.line()
    assert [res[f"{t}.recovery"].verdict for t in "bcdef"] == ["info"] * 5


def test_the_task_guard_follows_the_margin_not_a_test_against_zero_loss():
    """Task a loses 20 items and gains none (recovery ~0.87): McNemar finds that loss (p ~ 2e-6) but it is within the
    0.85 margin, so the guard reports it. A loss whose plain 95% interval lies below the margin but whose
    Holm-adjusted one does not is reported too: six tasks tested at once need more evidence than one."""
    base, cand = _six_tasks({"a": (20, 0)})
    res = {r.metric: r for r in eval_gate(base, cand, _eval_cfg(tuple("abcdef"), min_recovery=0.85, pool=True))}
    a = res["a.recovery"]
    assert a.evidence["p_loss"] < 1e-5 and a.observed > 0.85 and a.verdict == "info" and a.passed
    for lost in range(30, 60):
        base, cand = _six_tasks({"a": (lost, 0)})
        a = {r.metric: r for r in eval_gate(base, cand, _eval_cfg(tuple("abcdef"), min_recovery=0.85, pool=True))}[
            "a.recovery"
        ]
        if a.evidence["ci_95_unadjusted"][1] < 0.85 <= a.ci[1]:
            break
    else:
        pytest.fail("no loss count falls between the plain and the adjusted interval")
    assert a.verdict == "info" and a.evidence["p_holm"] > 0.025
    # Holm steps down: once a task is not failed, no task after it is, whatever its own interval
    base, cand = _six_tasks({"a": (60, 0), "b": (lost, 0)})
    res = {r.metric: r for r in eval_gate(base, cand, _eval_cfg(tuple("abcdef"), min_recovery=0.85, pool=True))}
    assert res["a.recovery"].verdict == "fail" and res["b.recovery"].evidence["holm_step"] == 2


@pytest.mark.parametrize(
    "kind,metric,match",
    [
        ("generate_until", "exact_match", "output_type 'generate_until' is not one qgate scores"),
        ("multiple_choice", "acc_norm", r"multiple_choice task's metric_list must name 'acc', got \['acc_norm'\]"),
        ("loglikelihood_rolling", "word_perplexity", "must name 'bits_per_byte'"),
    ],
)
def test_a_task_qgate_cannot_score_is_refused_when_the_config_is_built(tmp_path, kind, metric, match):
    """run_tasks reads each item's score by the task's output_type: acc for multiple-choice, bits_per_byte for
    perplexity. A task of another kind, or one whose metric_list lacks that metric, is refused by EvalConfig; one
    with no metric_list gets lm-eval's defaults for its kind, which hold the metric, and loads."""
    from qgate.gates.evalgate import TASKS

    body = f"task: zz_kind\noutput_type: {kind}\n"
    (tmp_path / "zz_kind.yaml").write_text(body + f"metric_list:\n  - metric: {metric}\n")
    (tmp_path / "zz_default.yaml").write_text(body)
    TASKS.register("zz_kind_test_task", tmp_path / "zz_kind.yaml")
    TASKS.register("zz_default_test_task", tmp_path / "zz_default.yaml")
    try:
        with pytest.raises(ConfigError, match=match):
            EvalConfig(tasks=("zz_kind_test_task",))
        if kind in ("multiple_choice", "loglikelihood_rolling"):
            assert EvalConfig(tasks=("zz_default_test_task",), min_recovery=None, max_bpb_increase=None)
    finally:
        TASKS._items.pop("zz_kind_test_task")
        TASKS._items.pop("zz_default_test_task")


def test_eval_recovery_on_a_task_the_baseline_never_answers_is_an_error_that_says_why():
    """Recovery divides by the baseline's accuracy: with none of a task's items right it is undefined, an ERROR that
    names the cause and the way out; pooled, that task is one guard row among others and decides nothing."""
    base = {"z": {"kind": "mc", "per_item": [0.0] * 40}, "t": {"kind": "mc", "per_item": [1.0] * 60 + [0.0] * 40}}
    cand = {"z": {"kind": "mc", "per_item": [0.0] * 38 + [1.0] * 2}, "t": base["t"]}
    (r,) = eval_gate(base, cand, _eval_cfg(("z",), min_recovery=0.9))
    assert r.verdict == "error" and np.isnan(r.observed)
    assert r.evidence["error"].startswith("the baseline answers none of the 40 items, so recovery")
    res = {x.metric: x for x in eval_gate(base, cand, _eval_cfg(("z", "t"), min_recovery=0.9, pool=True))}
    assert res["mc_pooled.recovery"].verdict == "pass" and res["z.recovery"].verdict == "info"


def test_eval_recovery_is_decided_on_its_interval_alone():
    """15 items lost, none gained, recovery 0.75 against a limit of 0.5: the CI lies above the limit, so the check
    passes. "No significant loss" is its own row when asked for, and fails on its own."""
    base = {"t": {"kind": "mc", "per_item": [1.0] * 60 + [0.0] * 40}}
    cand = {"t": {"kind": "mc", "per_item": [0.0] * 15 + [1.0] * 45 + [0.0] * 40}}
    (r,) = eval_gate(base, cand, _eval_cfg(("t",), min_recovery=0.5))
    assert r.observed == pytest.approx(0.75) and r.evidence["lost"] == 15 and r.ci[0] > 0.5
    assert (r.verdict, r.decided_on) == ("pass", "ci")
    r, loss = eval_gate(base, cand, _eval_cfg(("t",), min_recovery=0.5, significant_loss_alpha=0.05))
    assert r.verdict == "pass" and loss.metric == "t.no_significant_loss"
    assert loss.observed == pytest.approx(0.5**15) and (loss.verdict, loss.decided_on, loss.threshold) == (
        "fail",
        "point",
        0.05,
    )
    pooled = eval_gate(base, cand, _eval_cfg(("t",), min_recovery=0.5, pool=True, significant_loss_alpha=0.05))
    assert [x.metric for x in pooled] == ["mc_pooled.recovery", "mc_pooled.no_significant_loss", "t.recovery"]
    gain = {"t": {"kind": "mc", "per_item": [1.0] * 60 + [1.0] * 15 + [0.0] * 25}}  # 15 gained: no loss to find
    assert eval_gate(base, gain, _eval_cfg(("t",), min_recovery=0.5, significant_loss_alpha=0.05))[1].verdict == "pass"
    with pytest.raises(ConfigError, match="significant_loss_alpha"):
        EvalConfig(significant_loss_alpha=1.5)


def test_label_biased_tasks_are_flagged_and_the_pooled_check_states_its_power_without_them():
    """Task "bias": the baseline picks choice 0 on 95% of 400 items, so it is right exactly where gold is 0. Task
    "know": 200 items with varied answers. The pooled check names "bias" and gives recovery and mde over "know"
    alone."""
    rng = np.random.default_rng(1)
    gold_b = (rng.random(400) < 0.5).astype(int)
    chosen_b = np.where(rng.random(400) < 0.95, 0, 1)
    gold_k = rng.integers(0, 4, 200)
    chosen_k = np.where(rng.random(200) < 0.7, gold_k, (gold_k + 1) % 4)
    base = {
        "bias": {
            "kind": "mc",
            "per_item": (chosen_b == gold_b).astype(float).tolist(),
            "chosen": chosen_b.tolist(),
            "gold": gold_b.tolist(),
        },
        "know": {
            "kind": "mc",
            "per_item": (chosen_k == gold_k).astype(float).tolist(),
            "chosen": chosen_k.tolist(),
            "gold": gold_k.tolist(),
        },
    }
    c_know = (chosen_k == gold_k).copy()
    c_know[np.nonzero(c_know)[0][:10]] = False  # the candidate loses 10 of the items it knew
    cand = {
        "bias": {"kind": "mc", "per_item": base["bias"]["per_item"]},
        "know": {"kind": "mc", "per_item": c_know.astype(float).tolist()},
    }
    pooled, bias, know = eval_gate(base, cand, _eval_cfg(("bias", "know"), min_recovery=0.9, pool=True))
    lb = bias.evidence["label_bias"]
    assert lb["flagged"] and lb["index"] == 0 and 0.93 < lb["share"] < 0.97 and 0.45 < lb["gold_share"] < 0.55
    assert "choice 0 on 9" in bias.evidence["caveat"]
    assert not know.evidence["label_bias"]["flagged"] and "caveat" not in know.evidence
    inf = pooled.evidence["informative"]
    assert pooled.n == 600 and inf["n"] == 200 and pooled.evidence["label_biased_tasks"] == ["bias"]
    assert inf["observed"] == pytest.approx(c_know.mean() / (chosen_k == gold_k).mean())
    assert inf["mde"] > pooled.mde  # fewer items that can show a loss: less power than the pooled n suggests
    assert "400 items come from tasks the baseline answers by label bias (bias)" in pooled.evidence["caveat"]
    # a task with no chosen answers recorded (an older cache) is neither flagged nor counted against the pool
    old = {t: {"kind": "mc", "per_item": base[t]["per_item"]} for t in base}
    assert "caveat" not in eval_gate(old, cand, _eval_cfg(("bias", "know"), pool=True))[0].evidence
    # every reader gets the caveat: the registry description / CI job summary, and the --json check
    from qgate.cli.output import checks
    from qgate.gates.markdown import version_description

    report = {
        "candidate": {"name": "c"},
        "verdict": pooled.verdict,
        "inputs": {},
        "results": [r.to_dict() for r in (pooled, bias, know)],
    }
    md = version_description(report, {}, "runs:/x")
    assert "**Caveats**" in md and "`eval.mc_pooled.recovery`: 400 items come from" in md
    assert (
        "bias.recovery" not in md.split("**Caveats**")[1].split("**Lineage**")[0]
    )  # report-only rows: in the full report
    assert (
        checks(report["results"])[0].caveat == pooled.evidence["caveat"] and checks(report["results"])[2].caveat is None
    )


def test_task_files_are_plain_yaml_with_shipped_data():
    for name in EvalConfig().tasks:
        cfg = task_config(name)
        for f in cfg["dataset_kwargs"]["data_files"].values():
            with open(f) as fh:
                assert sum(1 for _ in fh) >= 60


def test_runner_lm_batched_and_shared_context_scores_match_single_sequences(base_art):
    from qgate.engines.runners import load_runner

    runner = load_runner(base_art)
    shared, prefix = tiny.check_lm_scores(runner)
    assert shared == 9  # the choices of all four multiple-choice contexts went through the shared-context path
    assert prefix >= 8  # and the instructions two of them share were computed once


def test_runner_lm_finishes_batches_on_the_device_as_request_by_request():
    """Device logits are reduced a whole batch at once and left there until every batch of the call is queued (one
    host copy at the end); the sums and greedy flags equal the per-request reduction, in request order across
    batches, and a request whose logits define no distribution still scores -inf."""
    import torch

    from qgate.gates.lm import Scores, finish

    g = torch.Generator().manual_seed(0)
    items = [
        (i, torch.randn(n, 50, generator=g) * 3, [int(t) for t in torch.randint(0, 50, (n,), generator=g)])
        for i, n in enumerate([1, 4, 2, 7])
    ]
    items[1][1][2, 5] = float("nan")
    top = items[2][1].argmax(-1).tolist()
    items[2] = (2, items[2][1], top)  # the greedy path
    scores = Scores(4)
    scores.defer(items[2:])  # two batches, queued out of request order
    scores.defer(items[:2])
    assert scores.out == [None] * 4 and len(scores.pending) == 2
    got = scores.resolved()
    assert scores.pending == []
    want = [None] * 4
    for i, logits, target in items:
        want[i] = finish(logits, target)
    assert got[1] == (float("-inf"), False) and got[2][1] is True
    for (a, ga), (b, gb) in zip(got, want, strict=True):
        assert ga == gb and a == pytest.approx(b, rel=1e-6, abs=1e-5)


def test_requests_summed_in_one_pass_are_summed_one_by_one():
    """The device path's per-request sums in one pass give each request what summing its own positions gives: in
    order, a request of no positions 0 and greedy, one with an undefined position -inf and not greedy."""
    from qgate.gates.lm import _summed, _summed_requests

    rng = np.random.default_rng(4)
    n = np.array([2, 0, 3, 1, 4])
    lp = -rng.random(n.sum()).astype(np.float32) * 5
    hit = rng.random(n.sum()) < 0.7
    hit[:2] = True
    lp[4] = np.nan  # the third request's second position
    got = _summed_requests(lp, hit, n)
    at = np.concatenate([[0], np.cumsum(n)])
    want = [_summed(lp[a:b], hit[a:b]) for a, b in zip(at[:-1], at[1:], strict=True)]
    assert got[1] == (0.0, True) and got[2] == (float("-inf"), False) and got[0][1] is True
    for (a, ga), (b, gb) in zip(got, want, strict=True):
        assert ga == gb and a == pytest.approx(b, rel=1e-6)


@pytest.mark.parametrize("forward_cost", [0, 10**6])
def test_runner_lm_scores_match_with_every_continuation_length_alone_or_all_padded_together(base_art, forward_cost):
    from qgate.engines.runners import load_runner

    runner = load_runner(base_art)
    runner.forward_cost = forward_cost  # 0: one forward per continuation length; huge: one padded forward per batch
    assert tiny.check_lm_scores(runner)[0] == 9


def test_packed_questions_and_sequences_score_what_padded_ones_do(base_art, monkeypatch):
    """Where the reference packs contexts and their continuations several to a row (CUDA; switched on here for the
    CPU), every continuation's logits equal those of the padded path within float32 rounding, with a shared prefix and
    without, in one forward over fewer positions, and so do whole sequences' (logits_batch); RunnerLM's scores equal
    one-at-a-time scoring. A model with a
    sliding window is not packed: the packed rows' mask would not carry it."""
    import qgate.engines.runners as runners

    runner = runners.load_runner(base_art)
    groups = [([5, 6, 7, 8, 9, 10, 11], [[12], [13, 14, 15]]), ([20, 21, 22], [[23, 24]]), ([30], [[31, 32, 33, 34]])]
    groups += [([40, 41, 42], [[43], [44, 45]])]
    positions: list[int] = []
    forward = runner.model.forward
    runner.model.forward = lambda ids, **k: positions.append(ids.numel()) or forward(ids, **k)
    padded = [runner.continuation_logits(groups, prefix) for prefix in ((), [1, 2, 3])]
    assert not runner.packs_contexts and positions[0] == 4 * 7  # the contexts' forward: 4 rows of the longest
    assert len(positions) >= 4 and sum(positions) > 28 + 6  # and then the continuations' forwards
    monkeypatch.setitem(runners.PACKED_CONTEXTS, "cpu", True)
    assert runner.packs_contexts
    positions.clear()
    for prefix, want in zip(((), [1, 2, 3]), padded, strict=True):
        got = runner.continuation_logits(groups, prefix)
        for g0, g1 in zip(want, got, strict=True):
            assert [x.shape for x in g0] == [y.shape for y in g1]
            assert all(np.abs(x - y).max() < 1e-5 for x, y in zip(g0, g1, strict=True))
    # trees of 9, 4, 4 and 4 positions in rows of 12: [9] and [4, 4, 4]; then the prefix and the same rows
    assert positions == [2 * 12, 3, 2 * 12]
    # whole sequences too, all their positions or their last k
    seqs = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30], [40, 41, 42, 43]]
    for keep in (None, 2):
        positions.clear()
        got = runner.logits_batch(seqs, keep)
        assert positions == [2 * 7]  # [7] and [4, 2, 1]
        monkeypatch.setitem(runners.PACKED_CONTEXTS, "cpu", False)
        want = runner.logits_batch(seqs, keep)
        monkeypatch.setitem(runners.PACKED_CONTEXTS, "cpu", True)
        assert (
            [x.shape for x in got]
            == [x.shape for x in want]
            == [(min(keep or len(q), len(q)), want[0].shape[1]) for q in seqs]
        )
        assert all(np.abs(x - y).max() < 1e-5 for x, y in zip(got, want, strict=True))
    assert tiny.check_lm_scores(runner)[0] == 9
    runner.model.config.sliding_window = 4
    try:
        assert not runner.packs_contexts
    finally:
        runner.model.config.sliding_window = None
    del runner.model.forward


def test_a_packed_question_is_never_wider_than_the_longest_sequence(base_art, monkeypatch):
    """RunnerLM splits a question whose choices would pack into a row wider than max_length (the longest sequence it
    scores whole) into several calls, each within it, and scores every choice as one call would; and it gives a
    packing runner's call no more contexts and choices together than its token budget."""
    import qgate.engines.runners as runners
    from qgate.gates.lm import RunnerLM

    monkeypatch.setitem(runners.PACKED_CONTEXTS, "cpu", True)
    runner = runners.load_runner(base_art)
    pairs = [([1, 5, 6, 7, 8, 9], [10 + j, 20 + j, 30 + j, 40 + j]) for j in range(5)]  # 6 + 5 x 4 tokens
    calls: list[list] = []
    inner = runner.continuation_logits
    runner.continuation_logits = lambda groups, prefix=(): calls.append(groups) or inner(groups, prefix)
    lm = RunnerLM(runner)
    want = lm._score_many(pairs)
    assert len(calls) == 1 and len(calls[0][0][1]) == 5  # one row of 6 + 5 x 3 = 21 positions
    calls.clear()
    lm.max_length = 16
    got = lm._score_many(pairs)
    assert [len(ks) for g in calls for _, ks in g] == [2, 2, 1]  # groups: 6 + 2 x 4 <= 16 < 6 + 3 x 4
    assert all(len(c) + sum(len(k) - 1 for k in ks) <= 16 for g in calls for c, ks in g)
    for (a, ga), (b, gb) in zip(got, want, strict=True):
        assert ga == gb and a == pytest.approx(b, abs=1e-4)
    # the questions of one call fit the token budget together: one forward holds their contexts and choices
    calls.clear()
    lm.max_length, lm.batch_tokens = 1024, 30
    questions = [([1, 50 + q, 6, 7, 8, 9], [k, k + 1, k + 2]) for q in range(4) for k in (10, 20)]  # 6 + 2 x 3 each
    lm._score_many(questions)
    assert [len(g) for g in calls] == [2, 2]  # 24 <= 30 < 36 tokens


def test_pack_trees_lays_out_each_context_with_its_continuations():
    """pack_trees: each continuation is scored at its context's last position and its own fed tokens, at the
    positions it would hold alone after the prefix; a token sees the prefix, its context and its own branch only."""
    import torch

    from qgate.engines.padding import pack_trees

    groups = [([5, 6, 7], [[8, 9], [10], [11, 12, 13]]), ([20], [[21, 22]]), ([30, 31, 32, 33, 34, 35], [[36]])]
    t = pack_trees(groups, prefix=2, pad=0)
    assert t.tokens.shape == (2, 8)  # trees of 6, 2 and 6 positions: [6, 2] and [6] in rows of 8 (16, not 18)
    assert t.tokens.tolist() == [[5, 6, 7, 8, 11, 12, 20, 21], [30, 31, 32, 33, 34, 35, 0, 0]]
    assert t.positions[0].tolist() == [2, 3, 4, 5, 5, 6, 2, 3]
    assert t.tree.tolist() == [[0] * 6 + [1, 1], [2] * 6 + [-1, -1]]
    assert t.branch[0].tolist() == [-1, -1, -1, 0, 2, 2, -1, 0]
    assert t.spans == [[(0, 2), (2, 3), (3, 6)], [(6, 8)], [(8, 9)]]
    assert t.at.tolist() == [[0, 2], [0, 3], [0, 2], [0, 2], [0, 4], [0, 5], [0, 6], [0, 7], [1, 5]]
    mask = t.mask(2, torch.device("cpu")).numpy()  # [n, W, 2 + W]
    assert mask.shape == (2, 8, 10) and mask[0, :, :2].all() and not mask[1, 6:, :2].any()
    sees = [[np.nonzero(row)[0].tolist() for row in m[:, 2:]] for m in mask]
    assert sees[0][4] == [0, 1, 2, 4] and sees[0][5] == [0, 1, 2, 4, 5]  # continuation 2 skips continuation 0
    assert sees[0][3] == [0, 1, 2, 3] and sees[0][7] == [6, 7] and sees[1][5] == list(range(6))
    assert sees[1][6] == [6] and sees[1][7] == [7]  # padding sees itself only
    with pytest.raises(ValueError, match="group 1: an empty context"):
        pack_trees([([1], [[2]]), ([], [[3]])], 0, 0)


def test_segments_are_whole_sequences_seeing_what_the_mask_lets_them_see():
    """Trees.segments: where each group is one sequence, its columns as (row, first, end), inside which the mask is
    plain causal and outside which it sees nothing; several continuations to a group give None. segments_pay takes
    the segments where they compute less than the mask's full squares."""
    import torch

    from qgate.engines.padding import pack_trees, sequences_as_trees
    from qgate.engines.static_llama import segments_pay

    seqs = [[1] * 9, [2] * 3, [3] * 5, [4] * 2]
    t = pack_trees(sequences_as_trees(seqs, keep_last=2), 0, 0)
    segs = t.segments()
    assert sorted(b - a for _, a, b in segs) == [2, 3, 5, 9] and len(segs) == len(seqs)
    mask = t.mask(0, torch.device("cpu")).numpy()
    real = np.zeros(t.tokens.shape, dtype=bool)
    for r, a, b in segs:
        assert (mask[r, a:b, a:b] == np.tril(np.ones((b - a, b - a), dtype=bool))).all()
        assert not mask[r, a:b, :a].any() and not mask[r, a:b, b:].any()
        assert (t.tokens[r, a:b] == t.tokens[r, a]).all() and not real[r, a:b].any()
        real[r, a:b] = True
    assert real.sum() == (t.tree >= 0).sum()  # every real column is in one segment
    assert pack_trees([([1, 2], [[3], [4]])], 0, 0).segments() is None
    assert segments_pay([(0, 0, 4000)], 1, 4096)  # a long document: half its square
    assert segments_pay([(r, 0, 100) for r in range(16)] + [(r, 100, 250) for r in range(16)], 16, 256)
    assert not segments_pay([(r, 10 * i, 10 * i + 10) for r in range(16) for i in range(25)], 16, 256)  # 400 calls
    assert not segments_pay([(r, 0, 50) for r in range(64)], 64, 64)  # short rows: the calls cost more


def test_pack_sequences_fills_rows_first_fit_by_decreasing_length():
    import random

    from qgate.engines.padding import pack_sequences, packed_width

    assert pack_sequences([5, 3, 2, 4], width=5) == [[0], [3], [1, 2]]
    assert packed_width([5, 3, 2, 4]) == 7 and pack_sequences([5, 3, 2, 4], 7) == [[0, 2], [3, 1]]
    assert packed_width([10, 6, 6, 6]) == 16  # [10, 6], [6, 6]: 32 positions; at 10, one a row: 40
    rng = random.Random(0)
    for _ in range(100):
        lengths = [rng.randint(1, 20) for _ in range(rng.randint(1, 40))]
        width = max(lengths) + rng.randint(0, 10)
        rows = pack_sequences(lengths, width)
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in r) <= width for r in rows)
        fill = [sum(lengths[i] for i in r) for r in rows]
        assert all(a + b > width for a, b in zip(fill, fill[1:]))  # first fit: no two rows would fit in one
        w = packed_width(lengths)
        assert max(lengths) <= w <= 2 * max(lengths)
        assert len(pack_sequences(lengths, w)) * w <= len(pack_sequences(lengths, max(lengths))) * max(lengths)
    with pytest.raises(ValueError, match="does not fit"):
        pack_sequences([3, 9], width=8)


def test_left_and_right_pad_put_every_sequence_at_one_edge():
    from qgate.engines.padding import left_pad, right_pad

    tok, real = left_pad([[5, 6, 7], [8], []], pad=0, rows=4)
    assert tok.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0], [0, 0, 0]] and tok.dtype == np.int64
    assert real.tolist() == [[True] * 3, [False, False, True], [False] * 3, [False] * 3]
    assert left_pad([[1, 2]], pad=9)[0].tolist() == [[1, 2]]
    tok, real = right_pad([[5, 6, 7], [8], []], pad=0, rows=4)
    assert tok.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0], [0, 0, 0]] and tok.dtype == np.int64
    assert real.tolist() == [[True] * 3, [True, False, False], [False] * 3, [False] * 3]


def test_length_groups_is_the_cheapest_grouping():
    import itertools
    import random

    from qgate.engines.padding import length_groups

    def cost(groups, lengths, fc):
        return sum(fc + sum(1 for x in lengths if lo <= x <= hi) * hi for lo, hi in groups)

    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([1, 2, 3, 5, 8, 13, 20]) for _ in range(rng.randint(1, 30))]
        fc = rng.choice([0, 3, 24, 500])
        got = length_groups(lengths, fc)
        ls = sorted(set(lengths))
        assert [x for lo, hi in got for x in ls if lo <= x <= hi] == ls  # every length in exactly one group
        best = min(
            cost([(ls[a], ls[b - 1]) for a, b in zip((0, *cuts), (*cuts, len(ls)))], lengths, fc)
            for k in range(len(ls))
            for cuts in itertools.combinations(range(1, len(ls)), k)
        )
        assert cost(got, lengths, fc) == best
    assert length_groups([], 24) == []
    assert length_groups([1, 1, 9], 0) == [(1, 1), (9, 9)] and length_groups([1, 1, 9], 10**6) == [(1, 9)]


def test_padded_batches_cover_every_row_once_within_the_budget_and_the_cheapest_groups():
    import random

    from qgate.engines.padding import length_groups, padded_batches

    rng = random.Random(1)
    for _ in range(100):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 200))]
        fc, budget = rng.choice([0, 24, 256]), rng.choice([64, 2048, 65536])
        batches = padded_batches(lengths, fc, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        groups = length_groups(lengths, fc)
        for b in batches:
            top = max(lengths[i] for i in b)
            assert len(b) == 1 or len(b) * top <= budget  # a row longer than the budget runs alone
            lo, hi = next(g for g in groups if g[0] <= top <= g[1])
            assert all(lo <= lengths[i] <= hi for i in b)  # one group's rows only
    assert padded_batches([5, 1, 5, 1], 10**6, 100) == [[1, 3, 0, 2]]  # one forward, shortest first
    assert padded_batches([5, 1, 5, 1], 0, 100) == [[1, 3], [0, 2]]  # one per length
    assert padded_batches([5, 5, 5], 10**6, 10) == [[0, 1], [2]]


def test_token_batches_fill_the_budget_with_real_tokens_shortest_first():
    """A packing runner's batches: every row once, shortest first, each batch within the budget of real tokens (a row
    over it alone), and a batch cut only where the next row would not fit: fewer forwards than padded groups."""
    import random

    from qgate.engines.padding import padded_batches, token_batches

    rng = random.Random(2)
    for _ in range(100):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 200))]
        budget = rng.choice([64, 2048, 65536])
        batches = token_batches(lengths, budget)
        order = [i for b in batches for i in b]
        assert order == sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        held = [sum(lengths[i] for i in b) for b in batches]
        assert all(len(b) == 1 or h <= budget for b, h in zip(batches, held, strict=True))
        assert all(h + lengths[b[0]] > budget for h, b in zip(held, batches[1:], strict=False))
        assert len(batches) <= len(padded_batches(lengths, 256, budget))
    assert token_batches([5, 3, 2, 4], 8) == [[2, 1], [3], [0]]
    assert token_batches([9, 1], 4) == [[1], [0]] and token_batches([], 8) == []


class _TableRunner:
    """A runner whose logits [len, V] come from the ids alone (each position's row is its token's), with the rows of
    each logits_batch call in `calls`; batch_tokens: its token budget (None: the CPU's)."""

    tokenizer = SimpleNamespace(bos_token_id=1, eos_token_id=2)
    forward_cost = 0

    def __init__(self, seed: int, batch_tokens: int | None = None):
        import torch

        self.table = torch.randn(40, 40, generator=torch.Generator().manual_seed(seed))
        self.batch_tokens = batch_tokens
        self.calls: list[int] = []

    def logits_batch(self, seqs, keep_last=None):
        import torch

        self.calls.append(len(seqs))
        return [self.table[torch.tensor(s)][-(keep_last or len(s)) :] for s in seqs]


def test_runner_lm_queues_every_step_into_one_resolve_in_request_order(monkeypatch):
    """_score_many scores its pairs `step` at a time into one Scores and resolves once at the end, where a device's
    log-probs are copied back (deferred here on the CPU as they are on a GPU); every request keeps its own score
    across steps, as one-at-a-time reduction gives it."""
    import torch

    from qgate.gates import lm as lm_module

    resolves = []
    monkeypatch.setattr(lm_module.Scores, "add", lm_module.Scores.defer)
    resolved = lm_module.Scores.resolved
    monkeypatch.setattr(lm_module.Scores, "resolved", lambda self: resolves.append(len(self.pending)) or resolved(self))
    runner = _TableRunner(3)
    calls = runner.calls
    lm = lm_module.RunnerLM(runner)
    pairs = [([1, 3 + i], [5 + i, 7 + 2 * i][: 1 + i % 2]) for i in range(7)]
    got = lm._score_many(pairs, 2)
    assert sum(calls) == 7 and len(calls) >= 4  # steps of 2, 2, 2 and 1 requests
    assert resolves == [len(calls)]  # every step's batches copied back at once, at the end
    for (c, k), (ll, greedy) in zip(pairs, got, strict=True):
        want = lm_module.finish(runner.table[torch.tensor(c + k)][len(c) - 1 : -1], k)
        assert greedy == want[1] and ll == pytest.approx(want[0], rel=1e-6)


def test_runner_lm_steps_scale_with_the_runners_token_budget(monkeypatch):
    """A step holds `step` requests on the CPU's token budget, and k times as many on a runner whose budget (a GPU's,
    from its free memory) is k times the CPU's; every request's score is the same either way."""

    from qgate.gates import lm as lm_module

    steps: list[int] = []
    queue = lm_module.RunnerLM._queue
    monkeypatch.setattr(lm_module.RunnerLM, "_queue", lambda self, p, *a: steps.append(len(p)) or queue(self, p, *a))
    pairs = [([1, 3 + i], [5 + i, 7 + 2 * i][: 1 + i % 2]) for i in range(7)]
    scores = {}
    for budget, want in (
        (None, [2, 2, 2, 1]),
        (lm_module.RunnerLM.BATCH_TOKENS - 1, [2, 2, 2, 1]),  # a budget under the CPU's: the CPU's
        (3 * lm_module.RunnerLM.BATCH_TOKENS + 5, [6, 1]),
        (4 * lm_module.RunnerLM.BATCH_TOKENS, [7]),
    ):
        steps.clear()
        scores[budget] = lm_module.RunnerLM(_TableRunner(5, budget))._score_many(pairs, 2)
        assert steps == want, budget
    assert all(s == scores[None] for s in scores.values())


def test_a_packing_runner_scores_whole_sequences_in_one_forward_per_token_budget(base_art, monkeypatch):
    """Perplexity windows and unshared requests on a runner that packs its rows run as few forwards as the token
    budget allows (not one per padded length group), with the scores of the padded path."""
    import qgate.engines.runners as runners
    from qgate.gates.lm import RunnerLM

    runner = runners.load_runner(base_art)
    lm = RunnerLM(runner)
    docs = [SimpleNamespace(args=(t,)) for t in ("a b c", "one two three four five six seven eight", "x", "hello " * 9)]
    forwards = []
    forward = runner.model.forward
    runner.model.forward = lambda ids, **k: forwards.append(ids.shape) or forward(ids, **k)
    try:
        runner.forward_cost = 0  # padded: one forward per length
        want = lm.loglikelihood_rolling(docs, disable_tqdm=True)
        assert len(forwards) == 4
        monkeypatch.setitem(runners.PACKED_CONTEXTS, "cpu", True)
        forwards.clear()
        got = lm.loglikelihood_rolling(docs, disable_tqdm=True)
        assert len(forwards) == 1  # every window within the budget: one packed forward
        n = sorted(len(lm._encode(d.args[0])) for d in docs)  # each document is one window
        lm.batch_tokens = n[0] + n[1]
        forwards.clear()
        assert lm.loglikelihood_rolling(docs, disable_tqdm=True) == pytest.approx(got, abs=1e-4)
        assert len(forwards) == 3  # the two shortest together, the others alone
    finally:
        del runner.model.forward
    assert got == pytest.approx(want, abs=1e-4) and all(x < 0 for x in got)


def test_prefix_runs_group_contexts_by_what_they_share():
    from qgate.gates.lm import prefix_runs

    a, b, c = (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 9), (1, 2, 3, 4)
    runs = prefix_runs([a, (7, 8), b, c, (7, 9, 9)], 3)
    assert sorted(runs) == [(0, [(7, 8), (7, 9, 9)]), (3, sorted([a, b, c]))]
    assert prefix_runs([a, b], 5) == [(0, [a, b])]  # sharing 4 tokens is below the minimum
    assert prefix_runs([a, a[:5]], 2) == [(4, [a[:5], a])]  # each member keeps a token after the prefix
    assert prefix_runs([], 2) == []
    assert prefix_runs([a, b, c, (7, 8)], 3, min_saved=7) == [(0, sorted([a, b, c, (7, 8)]))]  # saves 2 x 3 < 7 tokens
    assert prefix_runs([a, b, c], 3, min_saved=6)[0] == (3, sorted([a, b, c]))


def test_encode_with_sources_marks_traffic_tokens_not_template(base_art):
    from transformers import AutoTokenizer

    from qgate.chat import encode_messages, encode_with_sources

    tok = AutoTokenizer.from_pretrained(base_art.path)
    msgs = [{"role": "user", "content": "why the cat dog"}]
    ids, flags, tokens = encode_with_sources(tok, msgs, 64)
    assert ids == encode_messages(tok, msgs, 64) and tokens == len(ids)
    cut = encode_with_sources(tok, msgs, 4)
    assert cut.ids == ids[-4:] and cut.from_traffic == flags[-4:] and cut.tokens == len(ids)
    text = "".join(tok.decode([i]) for i, f in zip(ids, flags) if f)
    assert text.strip() == "why the cat dog"  # every traffic token, and only those
    assert not flags[0] and not flags[-1]  # <|im_start|> ... assistant\n are the template's


def _synthetic(template_kl: float):
    """Two prompts sharing a 4-token template (system prompt) then 3 traffic tokens, then 5 answer tokens."""
    from qgate.gates.positions import ANSWER, PROMPT, TEMPLATE

    seqs, cls = [], []
    for p in range(40):
        seqs.append([1, 2, 3, 4] + [10 + p, 11 + p, 12 + p] + [50 + p + j for j in range(5)])
        cls.append([TEMPLATE] * 4 + [PROMPT] * 3 + [ANSWER] * 5)
    ref = {
        "tokens": np.concatenate(seqs),
        "seq_lens": np.array([12] * 40),
        "prompt_lens": np.array([7] * 40),
        "prompt_tokens": np.array([7] * 40),  # none cut
        "token_class": np.concatenate(cls).astype(np.int8),
        "prompt_of": np.repeat(np.arange(40), 11),
    }
    rng = np.random.default_rng(0)
    kl = rng.exponential(0.001, 40 * 11)
    pos_cls = np.concatenate([c[1:] for c in cls])
    kl[pos_cls == TEMPLATE] = template_kl  # a default system prompt the candidate reads badly
    m = {
        "kl": kl,
        "agree": pos_cls != TEMPLATE,
        "tail": np.zeros_like(kl),
        "undefined": np.zeros(len(kl), bool),
        "first_div": np.full(40, 5),
        "gen_lens": np.full(40, 5),
    }
    return m, ref


def test_shadow_gate_scores_traffic_not_template_boilerplate():
    from qgate.gates.shadow import shadow_gate

    m, ref = _synthetic(template_kl=3.84)
    cfg = ShadowConfig(kl_p99_max=0.5, top1_agreement_min=0.9)
    results, scored, gated = shadow_gate(m, ref, cfg)
    by = {r.metric: r for r in results}
    assert scored["template_positions_excluded"] == 40 * 3  # positions predicting template tokens 2..4
    assert scored["answer_positions"] == 200 and scored["traffic_prompt_positions"] == 120
    assert scored["gated_positions"] == 200 == gated.sum() and scored["positions"] == "answer"
    assert by["kl_p99"].observed < 0.01 and by["top1_agreement"].observed == 1.0 and by["kl_p99"].n == 200
    assert by["prompt.kl_p99"].verdict == "info" and by["prompt.kl_p99"].n == 120
    assert by["kl_p999"].ci[1] == float("inf")  # 200 tokens cannot bound p99.9
    both, scored2, _ = shadow_gate(m, ref, ShadowConfig(positions="answer+prompt"))
    assert scored2["gated_positions"] == 320 and {"answer.kl_p99", "prompt.kl_p99"} <= {r.metric for r in both}


def test_repeated_prefixes_are_scored_once():
    from qgate.gates.positions import ANSWER, PROMPT, TEMPLATE, position_classes

    m, ref = _synthetic(0.0)
    ref = dict(ref, tokens=ref["tokens"].copy())
    ref["tokens"][12:24] = ref["tokens"][0:12]  # prompt 1 repeats prompt 0 token for token
    cls, new = position_classes(ref)
    assert not new[11:22].any() and new[:11].all()
    assert set(cls[:11].tolist()) == {TEMPLATE, PROMPT, ANSWER}


def test_noise_floor_is_measured_cached_reported_and_guards_thresholds(base_art, calib_arts, workdir):
    from qgate.errors import ConfigError
    from qgate.gates.noise import check_thresholds

    cfg = GateConfig(shadow=ShadowConfig(max_new_tokens=20, max_prompt_tokens=64), eval=None)
    art = run_gates(base_art, base_art, calib_arts["shadow"], cfg, workdir / "g-floor", workdir / "cache-floor")
    report = json.loads((art.path / "report.json").read_text())
    floor = report["noise_floor"]
    assert floor["cached"] is False and "KV-cached decode" in floor["path"] and floor["baseline_score_seconds"] > 0
    assert (
        0 < floor["kl_p99"]["observed"] < 1e-5 and floor["top1_agreement"]["observed"] > 0.99
    )  # a second path, not a copy
    assert floor["stop.continues"]["answers"] == 24 and floor["stop.continues"]["observed"] > 0.9  # every answer
    html = (art.path / "report.html").read_text()
    assert "Noise floor" in html and "<b>stop.continues</b>" in html
    again = run_gates(base_art, base_art, calib_arts["shadow"], cfg, workdir / "g-floor2", workdir / "cache-floor")
    assert json.loads((again.path / "report.json").read_text())["noise_floor"]["cached"] is True
    # a floor cached before a guard existed lacks its shares: measured again, so its thresholds are checked
    from qgate.cache import write_cached

    (path,) = (workdir / "cache-floor").glob("noise-floor-*.json")
    old = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("stop.")}
    write_cached(path, json.dumps(old).encode())
    third = run_gates(base_art, base_art, calib_arts["shadow"], cfg, workdir / "g-floor3", workdir / "cache-floor")
    floor = json.loads((third.path / "report.json").read_text())["noise_floor"]
    assert floor["cached"] is False and floor["stop.continues"]["answers"] == 24
    synthetic = {
        "path": "test",
        "kl_p99": {"observed": 0.02, "ci": [0.01, 0.03]},
        "top1_agreement": {"observed": 0.97, "ci": [0.95, 0.98]},
    }
    with pytest.raises(ConfigError, match=r"kl_p99_max: 0.01 is tighter than the measured noise floor.*kl_p99 0.02"):
        check_thresholds(ShadowConfig(kl_p99_max=0.01, top1_agreement_min=None), synthetic)
    with pytest.raises(ConfigError, match=r"top1_agreement_min: 0.96 is tighter"):
        check_thresholds(ShadowConfig(kl_p99_max=0.5, top1_agreement_min=0.96), synthetic)
    check_thresholds(ShadowConfig(kl_p99_max=0.05, top1_agreement_min=0.9), synthetic)


def test_perf_divides_times_from_one_card_or_cpu_and_measures_a_foreign_one_again(base_art, calib_arts, workdir):
    """The prefill speed-up divides two times. With a perf threshold, a cached baseline time measured on another card
    or CPU is measured again here; report-only, it is reused and the row says it is not comparable; a candidate timed
    elsewhere than its baseline is INCONCLUSIVE, naming both."""
    import torch

    from qgate.cache import write_cached
    from qgate.device import timing_host
    from qgate.gates.perf import PerfConfig, perf_check

    here, h100 = timing_host(torch.device("cpu")), "NVIDIA H100 80GB HBM3; torch 2.11.0+cu130"
    shadow = ShadowConfig(max_new_tokens=8, max_prompt_tokens=32, kl_p99_max=None)  # 192 positions: reported
    gated = GateConfig(shadow=shadow, eval=None, long_context=None, perf=PerfConfig(min_prefill_speedup=0.01))
    cache = workdir / "cache-perf"

    def gate(cfg, name):
        art = run_gates(base_art, base_art, calib_arts["shadow"], cfg, workdir / name, cache)
        report = json.loads((art.path / "report.json").read_text())
        return report, next(r for r in report["results"] if r["gate"] == "perf")

    def measured_on_an_h100():
        (path,) = cache.glob("noise-floor-*.json")
        write_cached(path, json.dumps(json.loads(path.read_text()) | {"timed_on": h100}).encode())

    report, perf = gate(gated, "g-perf1")
    assert report["noise_floor"]["timed_on"] == here == report["inputs"]["scored_on"], report["noise_floor"]
    assert perf["verdict"] == "pass" and perf["evidence"]["baseline_timed_on"] == here
    assert report["environment"]["torch"] == torch.__version__ and report["environment"]["qgate"]
    from qgate.gates.markdown import version_description

    assert f"| scored on | `{here}` |" in version_description(report, {}, "runs:/x")  # the registry page says where
    measured_on_an_h100()
    report, perf = gate(gated, "g-perf2")
    assert report["noise_floor"]["cached"] is False and report["noise_floor"]["timed_on"] == here
    assert perf["verdict"] == "pass" and perf["evidence"]["baseline_timed_on"] == here
    measured_on_an_h100()
    report, perf = gate(replace(gated, perf=PerfConfig()), "g-perf3")
    assert report["noise_floor"]["cached"] is True and perf["verdict"] == "info"
    assert (
        perf["evidence"]["why"]
        == f"not comparable: the baseline's time was measured on {h100}, the candidate's on {here}"
    )

    floor = {"baseline_score_seconds": 2.0, "baseline_score_passes": [2.0, 2.1, 1.9], "timed_on": h100}
    cand = [1.0, 1.02, 0.98]
    apart = {"baseline": floor["baseline_score_passes"], "candidate": cand, "paired": False}
    tf, served = "teacher-forced", "served (answers as decode steps)"
    r = perf_check(floor, apart, tf, "cpu-onnxruntime", here, PerfConfig(min_prefill_speedup=1.5))
    assert r.verdict == "inconclusive" and not r.passed and h100 in r.line() and here in r.line(), r.line()
    alone = {"baseline": [2.0], "candidate": [1.0], "paired": False}
    r = perf_check(floor | {"timed_on": here}, alone, served, "torch-int4", here, PerfConfig())
    assert r.verdict == "info" and "time is its served (answers as decode steps) scoring" in r.line(), r.line()
    floor |= {"timed_on": here}
    for limit, verdict in ((1.5, "pass"), (2.5, "fail"), (2.1, "inconclusive")):  # Welch: CI [1.79, 2.23]
        r = perf_check(floor, apart, tf, "cpu-onnxruntime", here, PerfConfig(limit))
        assert (r.verdict, r.decided_on, r.n) == (verdict, "ci", 3) and 1.78 < r.ci[0] < 1.8 < 2.22 < r.ci[1] < 2.24
        assert abs(r.observed - 2.0) < 0.01 and r.evidence["candidate_score_passes"] == cand, r
        assert "apart from the candidate" in r.evidence["caveat"], r.evidence  # drift between them is not in it
    assert "~7 timed passes of each model would decide it" in r.line(), r.line()  # stats.passes_to_decide
    in_turn = apart | {"paired": True}  # the same passes timed in turn: their ratios 2.0, 2.06, 1.94
    r = perf_check(floor, in_turn, tf, "cpu-onnxruntime", here, PerfConfig(2.2))
    assert r.verdict == "fail" and 1.85 < r.ci[0] < r.ci[1] < 2.16 and "caveat" not in r.evidence, r
    assert perf_check(floor, apart, tf, "cpu-onnxruntime", here, PerfConfig(2.2)).verdict == "inconclusive"
    for bad in (1, 2.5, True):  # one pass has no spread; a count is a whole number
        with pytest.raises(ConfigError, match="gates.perf.repeats"):
            PerfConfig(min_prefill_speedup=1.5, repeats=bad)
    r = perf_check(floor, apart | {"candidate": cand[:1]}, tf, "cpu-onnxruntime", here, PerfConfig(1.5))
    assert r.verdict == "inconclusive" and "one timed pass" in r.line(), r.line()  # no spread on one side


def test_a_time_on_a_slice_of_a_card_is_not_one_on_the_whole_card(monkeypatch):
    """A MIG slice runs a fraction of its card's SMs under the card's name: timing_host tells them apart, so the
    perf check does not divide a time on one by a time on the other."""
    import torch

    from qgate.device import timing_host

    card = {"name": "NVIDIA H100 80GB HBM3", "multi_processor_count": 132, "total_memory": 85 * 10**9}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(**card))
    whole = timing_host(torch.device("cuda"))
    assert whole.startswith("NVIDIA H100 80GB HBM3, 132 SMs, 79 GiB; torch "), whole
    card |= {"multi_processor_count": 16, "total_memory": 10 * 10**9}  # a 1g.10gb slice
    assert timing_host(torch.device("cuda")) != whole


def test_perf_times_both_models_in_turn_warm_or_says_they_were_timed_apart(base_art, calib_arts, workdir, monkeypatch):
    """A runner's first forward pays for what later ones reuse (on a GPU: CUDA's lazy module loading, cuBLAS handles,
    the allocator's growth), and a host's speed drifts between processes. When the perf check gates, the baseline is
    loaded again beside the candidate and the two are timed in turn, each after one untimed batch, so neither a first
    forward that costs seconds nor a drift between the baseline's process and the candidate's is in the speed-up. A
    baseline that does not fit beside the candidate is timed apart, with its noise floor (a floor cached report-only,
    timed cold, or in fewer passes, is measured again), and the row carries a caveat saying so."""
    import time

    from qgate.engines.runners import TorchRunner
    from qgate.gates.perf import PerfConfig

    cold_s, forward = 4.0, TorchRunner.logits_batch
    first_calls: list[int] = []

    def cold_first_forward(self, seqs, *args, **kwargs):
        if not getattr(self, "warmed", False):
            self.warmed = True
            first_calls.append(len(seqs))
            time.sleep(cold_s)
        return forward(self, seqs, *args, **kwargs)

    monkeypatch.setattr(TorchRunner, "logits_batch", cold_first_forward)
    shadow = ShadowConfig(max_new_tokens=8, max_prompt_tokens=32, kl_p99_max=None)  # 192 positions: reported

    def gate(perf, name):
        cfg = GateConfig(shadow=shadow, eval=None, long_context=None, perf=perf)
        art = run_gates(base_art, base_art, calib_arts["shadow"], cfg, workdir / name, workdir / "cache-warm")
        report = json.loads((art.path / "report.json").read_text())
        return report, next(r for r in report["results"] if r["gate"] == "perf")

    report, perf = gate(PerfConfig(), "g-cold")  # report-only: no extra batch, both times cold here
    assert perf["verdict"] == "info" and perf["evidence"]["timed_after_warm_up"] is False
    assert report["noise_floor"]["warm_up"] is False and "perf" not in report["timings"]
    assert len(first_calls) == 2 and perf["evidence"]["candidate_score_seconds"] > cold_s, first_calls

    report, perf = gate(PerfConfig(min_prefill_speedup=0.01), "g-warm")  # times of ~30 ms: a loose threshold
    ev = perf["evidence"]
    assert report["noise_floor"]["cached"] is False and report["noise_floor"]["warm_up"] is True, report["noise_floor"]
    assert len(report["noise_floor"]["baseline_score_passes"]) == 3, report["noise_floor"]
    assert len(first_calls) == 5, first_calls  # the noise floor's baseline, the candidate, the baseline in turn
    assert ev["timed"] == "in turn, in this process" and ev["timed_after_warm_up"] is True and "caveat" not in ev
    assert len(ev["baseline_score_passes"]) == len(ev["candidate_score_passes"]) == 3, ev  # gates.perf.repeats
    assert max(ev["baseline_score_passes"] + ev["candidate_score_passes"]) < cold_s, ev  # each pass timed warm
    assert ev["baseline_score_passes"] != report["noise_floor"]["baseline_score_passes"], ev
    assert perf["verdict"] == "pass" and perf["decided_on"] == "ci" and perf["n"] == 3, perf
    assert report["timings"]["perf"] > cold_s  # the baseline's load and first forward are the gate's time

    import qgate.device
    import qgate.gates.gating as gating

    shadow_gate, fits, loaded = gating.run_shadow, qgate.device.check_model_fits, []

    def candidate_loaded(runner, *args, **kwargs):
        loaded.append(runner)
        return shadow_gate(runner, *args, **kwargs)

    def only_one_fits(device, path, *args, **kwargs):
        if loaded:  # a model is loaded already: the baseline does not fit beside it
            raise BackendUnavailable(f"{path}: its weights take 1 GiB on cpu, which has 0 B available", hint="gate")
        return fits(device, path, *args, **kwargs)

    monkeypatch.setattr(gating, "run_shadow", candidate_loaded)
    monkeypatch.setattr(qgate.device, "check_model_fits", only_one_fits)
    report, perf = gate(PerfConfig(min_prefill_speedup=0.01, repeats=4), "g-apart")  # a floor with too few passes
    ev, floor = perf["evidence"], report["noise_floor"]
    assert floor["cached"] is False and ev["baseline_score_passes"] == floor["baseline_score_passes"], (ev, floor)
    assert len(ev["baseline_score_passes"]) == len(ev["candidate_score_passes"]) == 4, ev
    assert ev["timed"].startswith("apart") and max(ev["candidate_score_passes"]) < cold_s, ev
    assert "before the candidate loaded, apart from the candidate (the baseline does not fit beside" in ev["caveat"]
    assert "0 B available)" in ev["caveat"] and "\n" not in ev["caveat"], ev["caveat"]  # one line, no hint
    assert perf["verdict"] == "pass" and perf["decided_on"] == "ci", perf


def test_lm_eval_templates_compile_once_and_render_as_before():
    """run_tasks makes lm-eval compile each Jinja template once instead of once per document: same text out."""
    import lm_eval.utils as lm_utils

    from qgate.gates.evalgate import _compile_templates_once

    template, docs = (
        "Q: {{question}}\nA: {{choices[label]}}",
        [{"question": f"q{i}", "choices": ["x", "y"], "label": i % 2} for i in range(50)],
    )
    want = [lm_utils.env.from_string(template).render(**d) for d in docs]
    _compile_templates_once()
    _compile_templates_once()  # idempotent: one wrapper, not a wrapper of a wrapper
    assert getattr(lm_utils.apply_template, "compiles_once", False)
    assert [lm_utils.apply_template(template, d) for d in docs] == want
    assert want[1] == "Q: q1\nA: y"


def test_logits_that_define_no_distribution_score_as_infinitely_far_not_as_nan(recwarn):
    """A row with a NaN or +inf logit, or none above -inf, has argmax UNDEFINED (matching no token) and log-probs -inf,
    so its KL is +inf; a defined row beside them is unchanged, and nothing warns. As the reference, such a row gives
    a NaN KL: nothing to compare with, never agreement."""
    from qgate.gates.scoring import UNDEFINED, kl_with_tail, reduce_logits, top_k_logprobs
    from qgate.gates.stats import quantile

    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 40)).astype(np.float32)
    clean = x.copy()
    x[1, 3], x[2, 5], x[3, :], x[4, 7] = np.nan, np.inf, -np.inf, -np.inf  # row 4: one -inf logit, still defined
    ids, lp = top_k_logprobs(clean, 6)
    top1, picked = reduce_logits(x, ids)
    assert top1[1:4].tolist() == [UNDEFINED] * 3 and np.isneginf(picked[1:4]).all()
    same = [0] + list(range(5, 12))
    ref_top1, ref_picked = reduce_logits(clean, ids)
    assert (top1[same] == ref_top1[same]).all() and (picked[same] == ref_picked[same]).all()
    kl, _ = kl_with_tail(lp, picked)
    assert np.isposinf(kl[1:4]).all() and np.isfinite(kl[[0, 4] + same[1:]]).all() and 0 < kl[4] < np.inf
    assert np.isnan(top_k_logprobs(x, 6)[1][1:4]).all()  # a baseline's undefined rows: NaN, refused by the gate
    undefined_ref, _ = kl_with_tail(top_k_logprobs(x, 6)[1], ref_picked)  # no reference there: NaN, not KL 0
    assert np.isnan(undefined_ref[1:4]).all() and np.isfinite(undefined_ref[[0, 4] + same[1:]]).all()
    assert quantile(kl, 0.5) == float(np.quantile(kl[np.isfinite(kl)].tolist() + [1e300] * 3, 0.5))
    assert quantile(kl, 0.99) == float("inf") and quantile([1.0, 2.0, np.inf], 0.5) == 2.0
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]


def test_an_infinite_observation_is_decided_a_nan_one_is_an_error():
    assert GateResult.check("shadow", "kl_p99", float("inf"), 0.5, False, 10, (1.0, float("inf"))).verdict == "fail"
    assert GateResult.check("shadow", "x", float("inf"), 0.5, True, 10).verdict == "pass"
    r = GateResult.check("shadow", "kl_p99", float("nan"), 0.5, False, 10)
    assert r.verdict == "error" and r.evidence["error"] == "no finite value"


def test_a_candidate_with_a_nan_weight_fails_with_evidence_and_a_nan_baseline_is_refused(base_art, calib_arts, workdir):
    """One NaN weight makes every logit after it NaN. The gate fails the candidate (it crashed drawing the report):
    defined_logits names how many positions and the first; the KL checks are +inf, not NaN; the report and its
    pictures are written; an eval item with no defined answer counts as wrong instead of as choice 0. The same model
    as the baseline is refused, naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from qgate.errors import InputError
    from qgate.gates.evalgate import NO_ANSWER, label_bias
    from qgate.models import ModelSource, import_model

    src = workdir / "tiny-nan-src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(workdir / "tiny-src", src)
    (st,) = src.glob("*.safetensors")
    t = load_file(st)
    (k,) = [n for n in t if "layers.0.mlp.down_proj" in n]
    t[k][0, 0] = float("nan")
    save_file(t, st, metadata={"format": "pt"})
    cand = import_model(ModelSource(hf_dir=str(src)), workdir / "tiny-nan")
    cfg = GateConfig(shadow=FAST.shadow, eval=EvalConfig(tasks=("bigbench_general_knowledge",), limit=12))
    art = run_gates(cand, base_art, calib_arts["shadow"], cfg, workdir / "gate-nan", workdir / "cache-nan")
    report = json.loads((art.path / "report.json").read_text())
    by = {r["metric"]: r for r in report["results"]}
    assert report["verdict"] == "fail" and art.meta["passed"] is False
    idle = "gates.eval.max_bpb_increase (no task in gates.eval.tasks has output_type loglikelihood_rolling)"
    assert f"Set, but deciding no check: {idle}." in report["notes"]  # its one task is multiple-choice
    d = by["defined_logits"]
    total = report["shadow_scoring"]["total_positions"]
    assert (d["verdict"], d["observed"], d["n"]) == ("fail", 0.0, total) and d["evidence"] == {
        "undefined_positions": total,
        "first": {"prompt": 0, "position": 0},
        "why": f"{total} of {total} positions have NaN or +inf logits; the first: shadow prompt 0, position 0",
    }
    assert GateResult.from_dict(d).line().endswith(f"n={total}  ({d['evidence']['why']})")
    assert by["kl_p99"]["verdict"] == "fail" and by["kl_p99"]["observed"] == float("inf")
    assert by["kl_mean"]["observed"] == float("inf") and by["top1_agreement"]["observed"] == 0.0
    assert "defined_logits" in art.meta["failed"] and (art.path / "shadow.png").stat().st_size > 10_000
    assert "defined_logits" in (art.path / "report.html").read_text()
    rec = by["bigbench_general_knowledge.recovery"]
    assert rec["observed"] == 0.0 and rec["evidence"]["flip_rate"] > 0
    assert label_bias({"chosen": [NO_ANSWER] * 3, "gold": [0, 1, 2]}) is None
    assert label_bias({"chosen": [NO_ANSWER, 1, 1], "gold": [0, 1, 2]})["index"] == 1
    with pytest.raises(
        InputError,
        match=r"tiny-nan: the baseline's logits define no distribution at (\d+) of \1 shadow "
        r"positions \(NaN or \+inf logits\), the first at shadow prompt 0, position 0",
    ):
        run_gates(base_art, cand, calib_arts["shadow"], cfg, workdir / "gate-nan-base", workdir / "cache-nan")


def _float16_scaled(workdir, name: str, largest: float):
    """The tiny baseline stored in float16 with its residual stream scaled up: the embedding (the head, tied to it)
    and every block's o_proj and down_proj times c, the final norm's weight over c. RMSNorm takes the scale out
    before every block and before the head, so computed wider than float16 it is the baseline's function; the
    embedding's largest entry becomes `largest`."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from qgate.models import ModelSource, import_model

    src = workdir / f"{name}-src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(workdir / "tiny-src", src)
    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        c = largest / float(m.model.embed_tokens.weight.abs().max())
        m.model.embed_tokens.weight.mul_(c)
        m.model.norm.weight.div_(c)
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.mul_(c)
            layer.mlp.down_proj.weight.mul_(c)
    for f in src.glob("*.safetensors"):
        f.unlink()
    m.to(torch.float16).save_pretrained(src)
    return import_model(ModelSource(hf_dir=str(src)), workdir / name)


@pytest.mark.parametrize("native", [True, False])
def test_a_float16_candidate_is_scored_in_float16_whatever_gates_dtype_says(
    base_art, calib_arts, workdir, monkeypatch, native
):
    """A model whose config says float16 is served in float16, where an activation past 65,504 is inf. The baseline
    with its residual stream scaled 92,000x (the same function in float32 and bfloat16: every logit finite, every
    argmax the baseline's) reaches 118,000 there: scored in bfloat16, as gates.dtype says, or in float32, it passed.
    Now it is scored in float16, with torch's float16 matmuls or, on a CPU without them, float32 products rounded
    to float16: its logits are undefined and it fails. Scaled 25,000x (31,600 at most) it stays in range: every
    logit defined, and the baseline's answers within float16's rounding."""
    import torch
    from transformers import AutoModelForCausalLM

    import qgate.device
    from qgate.gates.numerics import scoring_numerics

    monkeypatch.setattr(qgate.device, "native_fp16", lambda dev: native)
    over = _float16_scaled(workdir, "tiny-f16-over", 30_000.0)
    ids = torch.tensor([list(range(5, 60))])
    with torch.no_grad():
        wide = AutoModelForCausalLM.from_pretrained(over.path, dtype=torch.float32)(ids).logits
        base = AutoModelForCausalLM.from_pretrained(base_art.path, dtype=torch.float32)(ids).logits
    assert torch.isfinite(wide).all() and torch.equal(wide.argmax(-1), base.argmax(-1))  # float32 hides it
    for name in ("auto", "float32", "bfloat16"):
        assert scoring_numerics(over, "cpu", name) == "cpu-float16"
    assert scoring_numerics(base_art, "cpu", "bfloat16") == "cpu-bfloat16"  # a float32 config: as before
    cfg = GateConfig(shadow=FAST.shadow, eval=None, long_context=None, dtype="bfloat16")
    art = run_gates(over, base_art, calib_arts["shadow"], cfg, workdir / f"gate-f16-{native}", workdir / "cache-f16")
    report = json.loads((art.path / "report.json").read_text())
    by = {r["metric"]: r for r in report["results"]}
    assert report["verdict"] == "fail" and by["defined_logits"]["verdict"] == "fail"
    assert by["defined_logits"]["observed"] < 0.5, by["defined_logits"]
    within = _float16_scaled(workdir, "tiny-f16-within", 8_000.0)
    art = run_gates(within, base_art, calib_arts["shadow"], cfg, workdir / f"gate-f16w-{native}", workdir / "cache-f16")
    by = {r["metric"]: r for r in json.loads((art.path / "report.json").read_text())["results"]}
    assert by["defined_logits"]["verdict"] == by["top1_agreement"]["verdict"] == "pass"
    assert by["kl_p99"]["observed"] < 1e-3 and by["kl_p99"]["verdict"] != "fail"


@pytest.mark.parametrize(
    ("verdict", "block", "warn"),
    [("pass", True, True), ("inconclusive", False, True), ("fail", False, False), ("error", False, False)],
)
def test_the_inconclusive_policy_is_decided_in_one_place(verdict, block, warn):
    from qgate.gates.result import passes

    assert passes(verdict, "block") is block and passes(verdict, "warn") is warn
    with pytest.raises(ValueError, match="on_inconclusive"):
        passes(verdict, "ignore")


def test_stop_on_fail_skips_long_context_and_eval_after_a_decided_fail_and_says_so(
    base_art, awq_art, calib_arts, workdir
):
    """A decided FAIL on the shadow check fixes the verdict; under stop_on_fail the costly long-context and eval gates
    are not run, the report names what was skipped and after which failure. Without it the same gate runs them."""
    from qgate.gates.longctx import LongContextConfig

    cfg = GateConfig(
        shadow=ShadowConfig(max_new_tokens=16, max_prompt_tokens=48, kl_p99_max=1e-4),  # 384 positions bound p99
        eval=EvalConfig(tasks=("bigbench_general_knowledge",), limit=8),
        long_context=LongContextConfig(max_documents=2, context_tokens=256, windows=2),
    )
    full = run_gates(awq_art, base_art, calib_arts["shadow"], cfg, workdir / "stop-off", workdir / "cache-stop")
    stopped = run_gates(
        awq_art,
        base_art,
        calib_arts["shadow"],
        replace(cfg, stop_on_fail=True),
        workdir / "stop-on",
        workdir / "cache-stop",
    )
    rf, rs = (json.loads((a.path / "report.json").read_text()) for a in (full, stopped))
    assert rf["verdict"] == rs["verdict"] == "fail" and not stopped.meta["passed"]
    gates_full, gates_stopped = ({r["gate"] for r in r_["results"]} for r_ in (rf, rs))
    assert {"long_context", "eval"} <= gates_full and rf["stopped"] is None
    assert gates_stopped.isdisjoint({"long_context", "eval"}) and {"shadow", "perf"} <= gates_stopped
    after = rs["stopped"]["after"]  # the pooled p99, then its guard on each route (every one fails at 1e-4)
    assert rs["stopped"]["skipped"] == ["long_context", "eval"] and after[0] == "shadow.kl_p99"
    assert all(a.startswith("shadow.route.") and a.endswith(".kl_p99") for a in after[1:])
    assert rs["long_context"] is None and rs["config"]["stop_on_fail"] is True
    note = "Not run: long_context and eval. The gate had already failed on shadow.kl_p99"
    assert any(n.startswith(note) for n in rs["notes"]) and note in (stopped.path / "report.html").read_text()
    # a passing candidate under stop_on_fail runs everything
    ok = run_gates(
        base_art,
        base_art,
        calib_arts["shadow"],
        replace(cfg, stop_on_fail=True, shadow=replace(cfg.shadow, kl_p99_max=0.5)),
        workdir / "stop-pass",
        workdir / "cache-stop",
    )
    ro = json.loads((ok.path / "report.json").read_text())
    assert ro["stopped"] is None and {"long_context", "eval"} <= {r["gate"] for r in ro["results"]}


@pytest.mark.parametrize(
    "section, key, value, span",
    [
        ("shadow", "kl_p99_max", float("nan"), "a finite number > 0"),  # NaN compares false: never decides
        ("shadow", "kl_mean_max", float("inf"), "a finite number > 0"),  # can never fail
        ("shadow", "kl_p999_max", -0.1, "a finite number > 0"),  # can never pass
        ("shadow", "top1_agreement_min", 0.0, "in (0, 1]"),  # agreement >= 0 always: can never fail
        ("shadow", "identical_generation_min", 1.5, "in (0, 1]"),
        ("parity", "top1_agreement_min", -1.0, "in (0, 1]"),
        ("eval", "min_recovery", 0.0, "in (0, 1]"),
        ("eval", "max_bpb_increase", float("inf"), "a finite number > 0"),
        ("long_context", "max_nll_increase", 0.0, "a finite number > 0"),
        ("perf", "min_prefill_speedup", float("nan"), "a finite number > 0"),
    ],
)
def test_a_threshold_that_could_never_fail_or_never_pass_is_refused_at_load(tmp_path, section, key, value, span):
    from specs import gates_spec

    from qgate.pipeline.spec import load_spec

    gates = {section: {key: value, **({"tasks": ["bigbench_general_knowledge"]} if section == "eval" else {})}}
    spec = gates_spec(tmp_path / "spec.yaml", gates)
    with pytest.raises(ConfigError) as e:
        load_spec(spec)
    assert str(e.value).splitlines()[0] == f"{spec}: gates.{section}.{key} must be {span}, got {value}"
    assert "null reports the value without gating on it" in e.value.hint
    gates[section][key] = None  # report-only is the way to say "do not gate on it"
    gates_spec(spec, gates)
    assert getattr(getattr(load_spec(spec).gate_config(), section), key) is None


def test_a_report_names_torchs_build_where_its_package_metadata_leaves_it_out(monkeypatch):
    """PyPI's CUDA wheels record torch 2.11.0 as their version and call themselves 2.11.0+cu130: the report says
    which build scored, as the card's timing host does."""
    import torch

    import qgate.execute
    from qgate.gates.gating import scoring_versions

    monkeypatch.setattr(qgate.execute, "versions", lambda names: dict.fromkeys(names, "1.0"))
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    got = scoring_versions()
    assert got["torch"] == "2.11.0+cu130" and got["transformers"] == "1.0"
    assert list(got)[:3] == ["python", "qgate", "torch"]
