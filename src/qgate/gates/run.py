"""Run every configured gate for one candidate and write the gate-report artifact.

    art = run_gates(candidate, baseline, shadow, GateConfig(), out=Path("runs/gate-awq"), cache_dir=Path("runs/.cache"))
    art.meta["passed"]   # the verdict; the CLI maps False to exit code 2

Baseline work (shadow answers, eval scores) is cached by content hash in cache_dir,
so gating a second candidate against the same baseline does not recompute it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from qgate.artifact import Artifact, sha256_json, sha256_tree, typed_config
from qgate.gates.evalgate import TASK_DIR, EvalConfig, eval_gate, run_tasks
from qgate.gates.report import write_report
from qgate.errors import ConfigError
from qgate.gates.result import GateResult, overall
from qgate.gates.shadow import ShadowConfig, baseline_reference, candidate_metrics, shadow_gate


@dataclass(frozen=True)
class PerfConfig:
    min_prefill_speedup: float | None = None   # candidate vs baseline teacher-forced scoring throughput
    VERSION = 1


@dataclass(frozen=True)
class GateConfig:
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    eval: EvalConfig | None = field(default_factory=EvalConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    on_inconclusive: str = "block"     # "block": an inconclusive check blocks promotion; "warn": it passes with a warning
    VERSION = 2

    def __post_init__(self):
        if self.on_inconclusive not in ("block", "warn"):
            raise ConfigError(f"gates.on_inconclusive: {self.on_inconclusive!r} is not 'block' or 'warn'")


def _describe(art: Artifact, name: str | None = None) -> dict:
    return {"name": name or art.path.name, "path": str(art.path), "kind": art.kind, "sha256": art.sha256,
            "scheme": art.meta.get("scheme"), "backend": art.meta.get("backend", "torch-reference"),
            "kv_cache_dtype": art.meta.get("kv_cache_dtype")}


def _cached_eval(runner_factory, baseline: Artifact, cfg: EvalConfig, cache_dir: Path) -> tuple[dict, bool]:
    key = sha256_json({"baseline": baseline.sha256, "tasks": cfg.tasks, "limit": cfg.limit, "data": sha256_tree(TASK_DIR), "v": 1})
    path = cache_dir / f"eval-baseline-{key[:24]}.json"
    if path.exists():
        return json.loads(path.read_text()), True
    scores = run_tasks(runner_factory(), cfg)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(scores))
    return scores, False


def run_gates(candidate: Artifact, baseline: Artifact, shadow: Artifact, cfg: GateConfig, out: Path, cache_dir: Path,
              name: str | None = None) -> Artifact:
    from qgate.engines.runners import load_runner

    out, cache_dir = Path(out), Path(cache_dir)
    timings: dict[str, float] = {}
    base_runner = None

    def baseline_runner():
        nonlocal base_runner
        if base_runner is None:
            base_runner = load_runner(baseline)
        return base_runner

    t = time.perf_counter()
    cand = load_runner(candidate)
    timings["candidate_load"] = time.perf_counter() - t
    ref, shadow_hit = baseline_reference(baseline_runner, baseline, shadow, cfg.shadow, cache_dir)
    timings["baseline_shadow"] = 0.0 if shadow_hit else float(ref["seconds"])
    m = candidate_metrics(cand, ref)
    timings["candidate_shadow"] = m["score_seconds"]
    results, scored, gated = shadow_gate(m, ref, cfg.shadow)
    speedup = float(ref["score_seconds"]) / m["score_seconds"] if m["score_seconds"] > 0 else float("nan")
    results.append(GateResult.check("perf", "prefill_speedup", speedup, cfg.perf.min_prefill_speedup, True, int(len(ref["seq_lens"])),
                                    evidence={"baseline_score_seconds": float(ref["score_seconds"]),
                                              "candidate_score_seconds": m["score_seconds"], "candidate_runtime": cand.kind,
                                              "baseline_timing_from_cache": shadow_hit}))  # cached: measured in an earlier run
    eval_hit = None
    if cfg.eval is not None:
        t = time.perf_counter()
        base_scores, eval_hit = _cached_eval(baseline_runner, baseline, cfg.eval, cache_dir)
        timings["baseline_eval"] = 0.0 if eval_hit else time.perf_counter() - t
        t = time.perf_counter()
        cand_scores = run_tasks(cand, cfg.eval)
        timings["candidate_eval"] = time.perf_counter() - t
        results += eval_gate(base_scores, cand_scores, cfg.eval)
    verdict = overall(results)
    passed = verdict == "pass" or (verdict == "inconclusive" and cfg.on_inconclusive == "warn")
    report = {
        "version": 2, "verdict": verdict, "passed": passed, "on_inconclusive": cfg.on_inconclusive, "candidate": _describe(candidate, name), "baseline": _describe(baseline, "baseline"),
        "inputs": {"candidate_sha256": candidate.sha256, "baseline_sha256": baseline.sha256, "shadow_sha256": shadow.sha256,
                   "calibration_sha256": candidate.meta.get("calibration_sha256"), "candidate_runtime": cand.kind},
        "cache": {"shadow_baseline": "hit" if shadow_hit else "miss", "eval_baseline": {None: "off", True: "hit", False: "miss"}[eval_hit]},
        "shadow_scoring": scored,
        "config": {"shadow": typed_config(cfg.shadow), "eval": typed_config(cfg.eval) if cfg.eval else None, "perf": typed_config(cfg.perf),
                   "on_inconclusive": cfg.on_inconclusive},
        "results": [r.to_dict() for r in results],
        "timings": {k: round(v, 2) for k, v in timings.items()},
    }
    write_report(out, report, m | {"gated": gated})
    summary = {r.gate + "." + r.metric: r.observed for r in results}
    return Artifact.create("gate-report", out, report["config"], (candidate.sha256, baseline.sha256, shadow.sha256),
                           {"passed": passed, "verdict": verdict, "summary": summary, "candidate": candidate.sha256,
                            "failed": [r.metric for r in results if r.verdict in ("fail", "error")],
                            "inconclusive": [r.metric for r in results if r.verdict == "inconclusive"]})

