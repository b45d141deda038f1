"""Eval gate: offline lm-evaluation-harness tasks, compared item by item.

    scores = run_tasks(runner, EvalConfig().tasks)       # {task: {"kind", "per_item", ...}}
    results = eval_gate(base_scores, cand_scores, EvalConfig())

Multiple-choice tasks: recovery ratio (candidate accuracy / baseline accuracy) with a
paired confidence interval, and an exact McNemar test on the items that flipped; a
significant loss fails the task whatever the recovery. With `pool: true` the items of
every multiple-choice task are pooled into one gated check (`mc_pooled.recovery`), so
its power comes from all of them; the per-task rows are then reported, not gated. Perplexity tasks: relative
increase in bits per byte, with a paired bootstrap interval over documents.
Task YAMLs are lm-eval configs shipped under gates/tasks/; no `!function` code runs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from qgate.errors import ConfigError
from qgate.gates.result import GateResult
from qgate.gates.stats import mcnemar_exact, paired_bootstrap, paired_mean_ci
from qgate.naming import Registry

TASK_DIR = Path(__file__).parent / "tasks"
TASKS: Registry[Path] = Registry("eval task")
for _f in sorted(TASK_DIR.glob("*.yaml")):
    TASKS.register(_f.stem, _f)
# 2,218 multiple-choice items with short prompts (chosen by tokens per item: benchmarks/bench_eval.py), plus 300
# perplexity documents. An item only adds power where the baseline's answer depends on it: the demo's 135M model
# answers "plausible" to every sports_understanding item. social_iqa, implicatures and metaphor_boolean ship too.
DEFAULT_TASKS = ("bigbench_general_knowledge", "bigbench_misconceptions", "bigbench_sports_understanding", "bigbench_strategyqa",
                 "bigbench_anachronisms", "chatterbot_ppl")


@dataclass(frozen=True)
class EvalConfig:
    tasks: tuple[str, ...] = DEFAULT_TASKS
    limit: int | None = None             # items per task; None: all
    min_recovery: float | None = 0.9     # candidate acc / baseline acc, on the CI lower bound
    alpha: float = 0.05                  # McNemar: a significant loss fails the task
    max_bpb_increase: float | None = 0.05   # perplexity tasks: relative increase, on the CI upper bound
    pool: bool = False                   # one gated check over all multiple-choice items; per-task rows report-only
    VERSION = 2

    def __post_init__(self):
        for t in self.tasks:
            TASKS.get(t)
        if not 0 < self.alpha < 1:
            raise ConfigError(f"gates.eval.alpha must be in (0, 1), got {self.alpha}")


def task_config(name: str) -> dict:
    path = TASKS.get(name)
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:  # includes unknown tags such as !function
        raise ConfigError(f"{path}: not plain YAML ({e})", hint="qgate task files may not execute code") from e
    files = cfg.get("dataset_kwargs", {}).get("data_files", {})
    resolved = {k: (path.parent / v).resolve() for k, v in files.items()}
    for k, f in resolved.items():
        if not f.is_relative_to(path.parent.resolve()):
            raise ConfigError(f"{path}: dataset_kwargs.data_files.{k} {files[k]!r} points outside the task directory",
                              hint="keep a task's data beside its YAML")
    cfg["dataset_kwargs"]["data_files"] = {k: str(f) for k, f in resolved.items()}
    return cfg


def run_tasks(runner, cfg: EvalConfig) -> dict:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager, get_task_dict

    from qgate.gates.lm import RunnerLM

    task_dict = get_task_dict([task_config(t) for t in cfg.tasks], TaskManager())
    res = evaluator.evaluate(lm=RunnerLM(runner), task_dict=task_dict, limit=cfg.limit, log_samples=True, verbosity="ERROR")
    out = {}
    for name in cfg.tasks:
        samples = sorted(res["samples"][name], key=lambda s: s["doc_id"])
        if "acc" in samples[0]:
            out[name] = {"kind": "mc", "per_item": [float(s["acc"]) for s in samples]}
        else:  # bits_per_byte samples are (loglikelihood, bytes)
            out[name] = {"kind": "ppl", "ll": [float(s["bits_per_byte"][0]) for s in samples],
                         "bytes": [int(s["bits_per_byte"][1]) for s in samples]}
    return out


def _bpb(ll: np.ndarray, nbytes: np.ndarray) -> float:
    return float(-ll.sum() / nbytes.sum() / np.log(2))


def _mc_check(name: str, bc: np.ndarray, cc: np.ndarray, min_recovery: float | None, alpha: float,
              evidence: dict | None = None) -> GateResult:
    test = mcnemar_exact(bc, cc)
    delta, lo, hi = paired_mean_ci(cc.astype(float) - bc.astype(float))
    base_acc, cand_acc = float(bc.mean()), float(cc.mean())
    rec = cand_acc / base_acc if base_acc > 0 else float("nan")
    ci = ((base_acc + lo) / base_acc, (base_acc + hi) / base_acc) if base_acc > 0 else None
    ev = {"base_acc": base_acc, "cand_acc": cand_acc, "delta": delta, "delta_ci": [lo, hi], **test, **(evidence or {})}
    r = GateResult.check("eval", f"{name}.recovery", rec, min_recovery, True, len(bc), ci, test["p_value"], ev)
    if min_recovery is not None and test["p_value"] < alpha and test["lost"] > test["gained"]:
        r = r.failed("mcnemar")   # a significant regression overrides recovery
    return r


def eval_gate(base: dict, cand: dict, cfg: EvalConfig) -> list[GateResult]:
    results, pooled_b, pooled_c, pooled_tasks = [], [], [], []
    for name in cfg.tasks:
        b, c = base[name], cand[name]
        if b["kind"] == "mc":
            bc, cc = np.array(b["per_item"]) > 0.5, np.array(c["per_item"]) > 0.5
            results.append(_mc_check(name, bc, cc, None if cfg.pool else cfg.min_recovery, cfg.alpha))
            pooled_b.append(bc)
            pooled_c.append(cc)
            pooled_tasks.append(name)
        else:
            bll, cll, nb = np.array(b["ll"]), np.array(c["ll"]), np.array(b["bytes"])
            base_bpb, cand_bpb = _bpb(bll, nb), _bpb(cll, nb)
            ci = paired_bootstrap(np.stack([cll, bll], 1), nb, lambda ll, b: _bpb(ll[:, 0], b) / _bpb(ll[:, 1], b) - 1)
            ev = {"base_bpb": base_bpb, "cand_bpb": cand_bpb}
            results.append(GateResult.check("eval", f"{name}.bpb_increase", cand_bpb / base_bpb - 1, cfg.max_bpb_increase,
                                            False, len(nb), ci, None, ev))
    if cfg.pool and pooled_b:
        results.insert(0, _mc_check("mc_pooled", np.concatenate(pooled_b), np.concatenate(pooled_c), cfg.min_recovery,
                                    cfg.alpha, {"tasks": pooled_tasks}))
    return results
