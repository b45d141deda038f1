"""Eval gate: offline lm-evaluation-harness tasks, compared item by item.

    scores = run_tasks(runner, EvalConfig().tasks)       # {task: {"kind", "per_item", ...}}
    results = eval_gate(base_scores, cand_scores, EvalConfig())

Each check follows the one rule it states (`decided_on`):
- Multiple-choice tasks: recovery (candidate accuracy / baseline accuracy) with Tang's paired score interval for a
  ratio of accuracies (`stats.paired_ratio_ci`). PASS when the 95% CI lies above `min_recovery`, FAIL when it lies
  wholly below, INCONCLUSIVE otherwise ("ci").
- `pool: true`: the items of every multiple-choice task form one gated check (`mc_pooled.recovery`), so its power
  comes from all of them. Each task's row is then a guard against a loss that pooling hides ("holm-guard"): the
  same `min_recovery` margin, on intervals adjusted by Holm's step-down procedure over the pooled tasks (family-wise
  95%); a task fails when its adjusted interval lies wholly below the margin, and is otherwise reported.
- `significant_loss_alpha` (off by default): its own row per gated recovery check (`<task>.no_significant_loss`),
  the exact one-sided McNemar p-value of a loss among the flipped items; FAIL below alpha ("point"). Without it a
  loss smaller than the margin passes however significant, which is what a margin means.
- Perplexity tasks: relative increase in bits per byte, with a t interval over documents (`stats.ratio_of_sums_ci`:
  the bytes cancel, so it is the candidate's summed NLL over the baseline's) ("ci").
Label bias: a task whose baseline picks one answer position on LABEL_BIAS of its items or more is flagged
(`evidence.caveat`), and the pooled check also states its recovery and mde over the items of the other tasks: items
a model answers by position add n without adding power against a loss of knowledge.
Task YAMLs are lm-eval configs shipped under gates/tasks/; no `!function` code runs.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import yaml

from qgate.errors import ConfigError
from qgate.gates.result import GUARD_ERROR, POSITIVE, SHARE, GateResult, check_threshold_values
from qgate.gates.stats import (
    holm,
    mcnemar_exact,
    paired_binary_ci,
    paired_ratio_ci,
    paired_ratio_score,
    ratio_of_sums_ci,
)
from qgate.naming import Registry

TASK_DIR = Path(__file__).parent / "tasks"
LABEL_BIAS = 0.9  # a task whose baseline picks one answer position this often is answered by bias, not by item
TASKS: Registry[Path] = Registry("eval task")
for _f in sorted(TASK_DIR.glob("*.yaml")):
    TASKS.register(_f.stem, _f)
# 1,617 multiple-choice items whose answers are written per item, plus 300 perplexity documents. An item only adds
# power where the baseline's answer depends on it: the demo's 135M model answers "plausible" to every
# sports_understanding item and picks one answer position on 90-97% of the strategyqa, misconceptions and anachronisms
# items (fixed answer pairs, label bias), but on at most 52% of the items of these six tasks, at 0.35-0.98 accuracy
# against 0.14-0.33 by chance. The fixed-pair tasks, implicatures and metaphor_boolean ship for models that can do them.
DEFAULT_TASKS = (
    "bigbench_general_knowledge",
    "bigbench_social_iqa",
    "bigbench_ruin_names",
    "bigbench_movie_recommendation",
    "bigbench_unit_identification",
    "bigbench_goal_inference",
    "chatterbot_ppl",
)


@dataclass(frozen=True)
class EvalConfig:
    tasks: tuple[str, ...] = DEFAULT_TASKS  # gates/tasks/*.yaml by name
    limit: int | None = None  # items per task; None: all
    min_recovery: float | None = 0.9  # candidate acc / baseline acc: PASS needs the 95% CI above it
    max_bpb_increase: float | None = 0.05  # perplexity tasks: relative increase: PASS needs the 95% CI below it
    pool: bool = False  # one gated check over all multiple-choice items; per-task rows are guards
    significant_loss_alpha: float | None = None  # a number: also FAIL a recovery check's items on an exact McNemar
    # loss (one-sided p below it), as its own row; None: off
    VERSION = 5  # of the checks' rules; what changed in each is in git

    def __post_init__(self):
        check_threshold_values("gates.eval", self, {"min_recovery": SHARE, "max_bpb_increase": POSITIVE})
        if not self.tasks:
            raise ConfigError("gates.eval.tasks is empty", hint="name tasks, or run no eval gate: gates.eval: null")
        if self.limit is not None and self.limit < 1:  # lm-eval reads 0 as no items
            raise ConfigError(f"gates.eval.limit must be >= 1 or null (every item), got {self.limit}")
        for t in self.tasks:
            task_kind(t)
        a = self.significant_loss_alpha
        if a is not None and not 0 < a < 1:
            raise ConfigError(f"gates.eval.significant_loss_alpha must be in (0, 1) or null (off), got {a}")

    def idle(self) -> dict[str, str]:
        """The thresholds this config sets that decide no check, each with why: no task is of the kind it applies to
        (KINDS: min_recovery decides multiple-choice tasks, max_bpb_increase perplexity ones)."""
        kinds = {task_kind(t) for t in self.tasks}
        return {
            threshold: f"no task in gates.eval.tasks has output_type {kind}"
            for kind, threshold in KINDS.items()
            if getattr(self, threshold) is not None and kind not in kinds
        }


KINDS = {"multiple_choice": "min_recovery", "loglikelihood_rolling": "max_bpb_increase"}  # output_type: its threshold
METRICS = {"multiple_choice": "acc", "loglikelihood_rolling": "bits_per_byte"}  # output_type: what run_tasks reads


def task_kind(name: str, config: dict | None = None) -> str:
    """The output_type of task `name`: one of KINDS, the kinds eval_gate scores, with the metric run_tasks reads for
    it in its metric_list (or no metric_list: lm-eval's defaults for both kinds hold it). config: its task_config,
    where the caller has read it already."""
    cfg = task_config(name) if config is None else config
    kind = cfg.get("output_type")
    if kind not in KINDS:
        raise ConfigError(
            f"{TASKS.get(name)}: output_type {kind!r} is not one qgate scores", hint=f"one of {', '.join(KINDS)}"
        )
    listed = cfg.get("metric_list")  # none: lm-eval's defaults for the kind, which hold METRICS[kind]
    metrics = [m.get("metric") for m in listed or [] if isinstance(m, dict)]
    if listed is not None and METRICS[kind] not in metrics:
        raise ConfigError(
            f"{TASKS.get(name)}: a {kind} task's metric_list must name {METRICS[kind]!r}, got {metrics}",
            hint=f"add '- metric: {METRICS[kind]}' to metric_list: qgate gates its items on it",
        )
    return kind


def task_config(name: str) -> dict:
    path = TASKS.get(name)
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:  # includes unknown tags such as !function
        raise ConfigError(f"{path}: not plain YAML ({e})", hint="qgate task files may not execute code") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: not an lm-eval task (a YAML mapping), got {type(cfg).__name__}")
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") or {}
    if not isinstance(files, dict):
        raise ConfigError(
            f"{path}: dataset_kwargs.data_files must map each split to a file, got {files!r}",
            hint="write it as 'data_files: {test: data/<task>.jsonl}'",
        )
    resolved = {k: (path.parent / v).resolve() for k, v in files.items()}
    for k, f in resolved.items():
        if not f.is_relative_to(path.parent.resolve()):
            raise ConfigError(
                f"{path}: dataset_kwargs.data_files.{k} {files[k]!r} points outside the task directory",
                hint="keep a task's data beside its YAML",
            )
    if resolved:
        cfg["dataset_kwargs"]["data_files"] = {k: str(f) for k, f in resolved.items()}
    return cfg


def _compile_templates_once() -> None:
    """lm-eval compiles a task's Jinja template (doc_to_text, doc_to_target, doc_to_choice) again for every document
    (lm_eval.utils.apply_template): ~1 ms each, ~2.3 s of building the default tasks' requests. A template is the
    same string for every document, and a compiled one renders any of them, so each is compiled once."""
    import lm_eval.utils as lm_utils

    if getattr(lm_utils.apply_template, "compiles_once", False):
        return
    compiled = functools.lru_cache(maxsize=1024)(lm_utils.env.from_string)

    def apply_template(template: str, doc: dict) -> str:
        return compiled(template).render(**doc)

    apply_template.compiles_once = True
    lm_utils.apply_template = apply_template


SCORES_VERSION = 3  # of what run_tasks returns: part of the key of the baseline's cached scores
NO_ANSWER = -1  # the chosen answer of an item whose every choice has log-likelihood -inf


def _chosen(lls: list[float]) -> int:
    """The answer a model picks: lm-eval's argmax, but no answer when no choice has any probability (logits that
    define no distribution: gates/lm.py), where the argmax would be the first choice and score by answer position."""
    return int(np.argmax(lls)) if max(lls) > float("-inf") else NO_ANSWER


def run_tasks(runner, cfg: EvalConfig) -> dict:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager, get_task_dict

    from qgate.gates.lm import RunnerLM

    _compile_templates_once()
    configs = {t: task_config(t) for t in cfg.tasks}
    kinds = {t: task_kind(t, c) for t, c in configs.items()}
    task_dict = get_task_dict(list(configs.values()), TaskManager(include_defaults=False))
    res = evaluator.evaluate(
        lm=RunnerLM(runner), task_dict=task_dict, limit=cfg.limit, log_samples=True, verbosity="ERROR"
    )
    out = {}
    for name in cfg.tasks:
        samples = sorted(res["samples"][name], key=lambda s: s["doc_id"])
        if kinds[name] == "multiple_choice":  # filtered_resps: one (log-likelihood, is greedy) per choice
            chosen = [_chosen([float(r[0]) for r in s["filtered_resps"]]) for s in samples]
            out[name] = {
                "kind": "mc",
                "chosen": chosen,
                "gold": [int(s["target"]) for s in samples],
                "per_item": [float(s["acc"]) if c != NO_ANSWER else 0.0 for s, c in zip(samples, chosen, strict=True)],
            }
        else:  # loglikelihood_rolling: bits_per_byte samples are (loglikelihood, bytes)
            out[name] = {
                "kind": "ppl",
                "ll": [float(s["bits_per_byte"][0]) for s in samples],
                "bytes": [int(s["bits_per_byte"][1]) for s in samples],
            }
    return out


def _bpb(ll: np.ndarray, nbytes: np.ndarray) -> float:
    return float(-ll.sum() / nbytes.sum() / np.log(2))


def label_bias(scores: dict) -> dict | None:
    """How far the model answers a multiple-choice task by answer position rather than by item: the share of items on
    which it picks its most-chosen choice index, beside the share of items whose gold answer is that index. At
    LABEL_BIAS or more, the task's items barely depend on the model's knowledge, so losing it cannot show there.
    None for scores cached before the chosen index was kept."""
    if "chosen" not in scores or not scores["chosen"]:
        return None
    chosen, gold = np.asarray(scores["chosen"]), np.asarray(scores["gold"])
    if not (chosen >= 0).any():
        return None
    index = int(np.bincount(chosen[chosen >= 0]).argmax())
    share = float((chosen == index).mean())
    return {"index": index, "share": share, "gold_share": float((gold == index).mean()), "flagged": share >= LABEL_BIAS}


def _bias_caveat(b: dict) -> str:
    return (
        f"label bias: the baseline picks choice {b['index']} on {b['share']:.0%} of items (the gold answer is choice "
        f"{b['index']} on {b['gold_share']:.0%}), so these items carry little evidence of a loss"
    )


def _mc_check(
    name: str, bc: np.ndarray, cc: np.ndarray, min_recovery: float | None, evidence: dict | None = None
) -> GateResult:
    """Recovery with its 95% paired score interval, decided on that interval alone. The accuracy difference and its
    Agresti-Min interval (`delta`, `delta_ci`) are evidence beside it."""
    test = mcnemar_exact(bc, cc)
    delta, lo, hi = paired_binary_ci(bc, cc)
    base_acc, cand_acc = float(bc.mean()), float(cc.mean())
    rec, rec_lo, rec_hi = paired_ratio_ci(bc, cc)
    ci = (rec_lo, rec_hi) if base_acc > 0 else None
    ev = {"base_acc": base_acc, "cand_acc": cand_acc, "delta": delta, "delta_ci": [lo, hi], **test, **(evidence or {})}
    if base_acc == 0:
        ev["error"] = (
            f"the baseline answers none of the {len(bc)} items, so recovery (the candidate's accuracy over the "
            "baseline's) is undefined: gate on tasks the baseline scores on, or pool them (gates.eval.pool)"
        )
    return GateResult.check("eval", f"{name}.recovery", rec, min_recovery, True, len(bc), ci, test["p_value"], ev)


def _loss_check(name: str, r: GateResult, alpha: float) -> GateResult:
    """The named no-significant-loss check beside recovery check `r`: the exact one-sided McNemar p-value of a loss,
    which must be at least alpha."""
    ev = r.evidence
    return GateResult.check(
        "eval",
        f"{name}.no_significant_loss",
        ev["p_loss"],
        alpha,
        True,
        r.n,
        p_value=ev["p_loss"],
        evidence={
            "lost": ev["lost"],
            "gained": ev["gained"],
            "test": "exact McNemar, one-sided (loss)",
            "why": f"{ev['lost']} items lost and {ev['gained']} gained: a significant loss",
        },
    )


def eval_gate(base: dict, cand: dict, cfg: EvalConfig) -> list[GateResult]:
    results, pooled_b, pooled_c, pooled_tasks, biased, mc_rows = [], [], [], [], [], []
    for name in cfg.tasks:
        b, c = base[name], cand[name]
        if b["kind"] == "mc":
            bc, cc = np.array(b["per_item"]) > 0.5, np.array(c["per_item"]) > 0.5
            bias = label_bias(b)
            ev = (
                {}
                if bias is None
                else {"label_bias": bias} | ({"caveat": _bias_caveat(bias)} if bias["flagged"] else {})
            )
            mc_rows.append(len(results))
            results.append(_mc_check(name, bc, cc, None if cfg.pool else cfg.min_recovery, ev))
            if cfg.significant_loss_alpha is not None and not cfg.pool:
                results.append(_loss_check(name, results[-1], cfg.significant_loss_alpha))
            pooled_b.append(bc)
            pooled_c.append(cc)
            pooled_tasks.append(name)
            biased.append(bool(bias and bias["flagged"]))
        else:
            bll, cll, nb = np.array(b["ll"]), np.array(c["ll"]), np.array(b["bytes"])
            base_bpb, cand_bpb = _bpb(bll, nb), _bpb(cll, nb)
            _, lo, hi, interval = ratio_of_sums_ci(cll, bll, np.arange(len(nb)))  # one document a cluster
            ev = {"base_bpb": base_bpb, "cand_bpb": cand_bpb, "interval": interval}
            results.append(
                GateResult.check(
                    "eval",
                    f"{name}.bpb_increase",
                    cand_bpb / base_bpb - 1,
                    cfg.max_bpb_increase,
                    False,
                    len(nb),
                    (lo - 1, hi - 1),
                    None,
                    ev,
                )
            )
    if cfg.pool and pooled_b:
        if cfg.min_recovery is not None:
            _guard_tasks(results, mc_rows, pooled_b, pooled_c, cfg.min_recovery)
        ev: dict = {"tasks": pooled_tasks}
        if any(biased):
            keep = [i for i, f in enumerate(biased) if not f]
            n_biased = sum(len(pooled_b[i]) for i, f in enumerate(biased) if f)
            ev["label_biased_tasks"] = [t for t, f in zip(pooled_tasks, biased, strict=True) if f]
            if keep:
                rest = _mc_check(
                    "informative",
                    np.concatenate([pooled_b[i] for i in keep]),
                    np.concatenate([pooled_c[i] for i in keep]),
                    cfg.min_recovery,
                )
                ev["informative"] = {
                    "n": rest.n,
                    "observed": rest.observed,
                    "ci": list(rest.ci) if rest.ci else None,
                    "mde": rest.mde,
                }
                tail = f"over the other {rest.n} items the recovery is {rest.observed:.3f}, mde " + (
                    f"{rest.mde:.3f}" if rest.mde is not None else "unknown"
                )
            else:
                tail = "no pooled task is free of it, so this check's power against a real loss is unknown"
            ev["caveat"] = (
                f"{n_biased} items come from tasks the baseline answers by label bias "
                f"({', '.join(ev['label_biased_tasks'])}); {tail}"
            )
        pooled = _mc_check("mc_pooled", np.concatenate(pooled_b), np.concatenate(pooled_c), cfg.min_recovery, ev)
        head = [pooled] + (
            [_loss_check("mc_pooled", pooled, cfg.significant_loss_alpha)]
            if cfg.significant_loss_alpha is not None
            else []
        )
        results[:0] = head
    return results


def _guard_tasks(
    results: list[GateResult], rows: list[int], base: list[np.ndarray], cand: list[np.ndarray], margin: float
) -> None:
    """Pooled mode: each task's row (results[i] for i in rows, with items base[j], cand[j]) becomes a guard at the
    pooled check's margin, in place. Holm's step-down over the tasks, as intervals: in order of the one-sided p-value
    of "recovery >= margin" (the paired score statistic at the margin), the task at step s (of m) gets the paired
    score interval at z = z(1 - GUARD_ERROR/(m - s)); it fails when that interval lies wholly below the margin and
    every task before it failed. That is Holm's test of a loss beyond the margin at family-wise error GUARD_ERROR,
    the bad side of the gated check's 95% CI."""
    from scipy.stats import norm

    m = len(rows)
    p_one = [
        float(norm.cdf(paired_ratio_score(b, c, margin, skew=True))) if b.any() else 1.0
        for b, c in zip(base, cand, strict=True)
    ]
    adjusted = holm(p_one)
    failing = True
    for step, j in enumerate(sorted(range(m), key=lambda j: p_one[j])):
        r = results[rows[j]]
        level = 1 - 2 * GUARD_ERROR / (m - step)
        _, lo, hi = paired_ratio_ci(base[j], cand[j], z=float(norm.ppf(1 - GUARD_ERROR / (m - step))))
        ci = (lo, hi)
        ev = r.evidence | {
            "ci_95_unadjusted": list(r.ci) if r.ci else None,
            "holm_step": step + 1,
            "holm_tasks": m,
            "adjusted_level": level,
            "p_holm": adjusted[j],
            "rule": "holm-guard at the pooled margin",
        }
        g = GateResult.guard(
            "eval", r.metric, r.observed, margin, True, r.n, ci, may_fail=failing, p_value=adjusted[j], evidence=ev
        )
        if g.verdict == "fail":
            g = replace(
                g,
                evidence=g.evidence
                | {
                    "why": f"recovery {r.observed:.3f}: its Holm-adjusted {level:.2%} interval "
                    f"lies wholly below {margin:g}, a loss pooling would hide"
                },
            )
        failing = g.verdict == "fail"
        results[rows[j]] = g
