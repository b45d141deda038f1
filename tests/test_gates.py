import json

import numpy as np
import pytest

from qgate.gates.evalgate import EvalConfig, eval_gate, task_config
from qgate.gates.result import GateResult
from qgate.gates.run import GateConfig, run_gates
from qgate.gates.shadow import ShadowConfig, _log_softmax, baseline_reference, candidate_metrics
from qgate.gates.stats import cluster_bootstrap, mcnemar_exact, paired_mean_ci

FAST = GateConfig(shadow=ShadowConfig(max_new_tokens=12, max_prompt_tokens=64), eval=EvalConfig(limit=12))


class CountingRunner:
    """Wraps a runner and counts forward passes, to prove cache hits."""

    def __init__(self, inner):
        self.inner, self.tokenizer, self.kind, self.calls = inner, inner.tokenizer, inner.kind, 0
        self.max_length = inner.max_length

    def logits(self, ids):
        self.calls += 1
        return self.inner.logits(ids)

    def logits_batch(self, seqs):
        self.calls += 1
        return self.inner.logits_batch(seqs)

    def greedy(self, ids, n):
        self.calls += 1
        return self.inner.greedy(ids, n)


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
        seq = ref_full["tokens"][start:start + n].tolist()
        lp, lq = _log_softmax(base.logits(seq)[:-1]), _log_softmax(cand.logits(seq)[:-1])
        direct.append((np.exp(lp) * (lp - lq)).sum(-1))
        start += n
    direct = np.concatenate(direct)
    np.testing.assert_allclose(m_full["kl"], direct, rtol=1e-3, atol=2e-6)  # float32 storage of baseline log-probs
    assert np.all(m_k["kl"] <= direct + 1e-6)
    assert m_full["tail"].max() < 1e-5


def test_candidate_identical_to_baseline_passes_with_zero_disagreement(base_art, calib_arts, workdir):
    art = run_gates(base_art, base_art, calib_arts["shadow"], FAST, workdir / "gate-self", workdir / "cache-self")
    report = json.loads((art.path / "report.json").read_text())
    by = {r["metric"]: r for r in report["results"]}
    assert report["passed"] is True and art.meta["passed"] is True
    assert by["kl_p99"]["observed"] < 1e-6 and by["top1_agreement"]["observed"] == 1.0
    assert by["identical_generation"]["observed"] == 1.0
    assert by["bigbench_general_knowledge.recovery"]["evidence"]["flip_rate"] == 0.0
    assert abs(by["chatterbot_ppl.bpb_increase"]["observed"]) < 1e-6


def test_second_candidate_reuses_cached_baseline(base_art, w8_art, awq_art, calib_arts, workdir, monkeypatch):
    import qgate.engines.runners as runners

    made = []
    real = runners.load_runner

    def counting(art):
        r = CountingRunner(real(art))
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
    assert rep1["cache"] == {"shadow_baseline": "miss", "eval_baseline": "miss"}
    assert rep2["cache"] == {"shadow_baseline": "hit", "eval_baseline": "hit"}


def test_report_files_and_evidence(base_art, w8_art, calib_arts, workdir):
    art = run_gates(w8_art, base_art, calib_arts["shadow"], FAST, workdir / "g-w8", workdir / "cache-shared")
    html = (art.path / "report.html").read_text()
    assert "data:image/png;base64," in html and "kl_p99" in html
    assert (art.path / "shadow.png").stat().st_size > 5000 and (art.path / "eval.png").exists()
    report = json.loads((art.path / "report.json").read_text())
    for r in report["results"]:
        assert {"metric", "observed", "threshold", "higher_is_better", "n", "ci", "p_value", "passed"} <= set(r)
    assert report["inputs"]["calibration_sha256"] == w8_art.meta["calibration_sha256"]
    assert art.parents == (w8_art.sha256, base_art.sha256, calib_arts["shadow"].sha256)


def test_gate_decides_on_confidence_bound_not_point():
    ok = GateResult.check("shadow", "kl_p99", 0.09, 0.1, False, 100, ci=(0.08, 0.095))
    noisy = GateResult.check("shadow", "kl_p99", 0.09, 0.1, False, 100, ci=(0.05, 0.14))
    assert ok.passed and ok.decided_on == "ci-upper"
    assert not noisy.passed
    assert not GateResult.check("x", "y", float("nan"), 0.1, False, 0).passed
    assert not GateResult.could_not_run("eval", "acc", "boom").passed


def test_mcnemar_and_paired_ci_known_values():
    base = np.array([1] * 10 + [0] * 10, bool)
    cand = np.array([0] * 8 + [1] * 2 + [0] * 10, bool)  # 8 lost, 0 gained
    t = mcnemar_exact(base, cand)
    assert (t["lost"], t["gained"], t["flip_rate"]) == (8, 0, 0.4)
    assert abs(t["p_value"] - 2 * 0.5 ** 8) < 1e-12
    m, lo, hi = paired_mean_ci(cand.astype(float) - base.astype(float))
    assert m == -0.4 and hi < 0 < 1 + lo


def test_cluster_bootstrap_covers_truth():
    rng = np.random.default_rng(0)
    values = rng.normal(1.0, 1.0, 2000)
    clusters = np.repeat(np.arange(200), 10)
    lo, hi = cluster_bootstrap(values, clusters, np.mean)
    assert lo < 1.0 < hi and hi - lo < 0.3


def test_eval_gate_fails_significant_regression_even_with_lenient_recovery():
    base = {"t": {"kind": "mc", "per_item": [1.0] * 60 + [0.0] * 40}}
    cand = {"t": {"kind": "mc", "per_item": [0.0] * 15 + [1.0] * 45 + [0.0] * 40}}
    cfg = EvalConfig.__new__(EvalConfig)
    object.__setattr__(cfg, "tasks", ("t",))
    for k, v in {"limit": None, "min_recovery": 0.5, "alpha": 0.05, "max_bpb_increase": 0.05}.items():
        object.__setattr__(cfg, k, v)
    (r,) = eval_gate(base, cand, cfg)
    assert r.observed == pytest.approx(0.75) and r.evidence["lost"] == 15
    assert not r.passed and r.decided_on == "mcnemar"


def test_task_files_are_plain_yaml_with_shipped_data():
    for name in EvalConfig().tasks:
        cfg = task_config(name)
        for f in cfg["dataset_kwargs"]["data_files"].values():
            with open(f) as fh:
                assert sum(1 for _ in fh) >= 60


def test_runner_lm_batched_scores_match_single_sequences(base_art):
    from types import SimpleNamespace

    from qgate.engines.runners import load_runner
    from qgate.gates.lm import RunnerLM

    runner = load_runner(base_art)
    lm = RunnerLM(runner)
    reqs = [SimpleNamespace(args=(c, k)) for c, k in [("Question: why the cat\nAnswer:", " traffic"),
                                                     ("the", " model weights quantize serve latency token"),
                                                     ("please help", " a")]]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    for req, (ll, _) in zip(reqs, got):
        ctx, cont = req.args
        ids = [lm.prefix] + lm._encode(ctx + cont)
        n = len(lm._encode(ctx + cont)) - len(lm._encode(ctx))
        logp = _log_softmax(runner.logits(ids[:-1]))
        expect = sum(logp[len(ids) - 1 - n + j, ids[len(ids) - n + j]] for j in range(n))
        assert ll == pytest.approx(expect, abs=1e-4)
