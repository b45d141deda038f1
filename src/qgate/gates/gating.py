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

import numpy as np

from qgate.artifact import Artifact, engine_checkpoint, sha256_json, sha256_tree, typed_config
from qgate.cache import read_cached, write_cached
from qgate.engines.protocol import ScoresServed
from qgate.errors import ConfigError, InputError
from qgate.execute import releases
from qgate.gates.contract import ContractConfig, contract_gate
from qgate.gates.evalgate import SCORES_VERSION, TASK_DIR, EvalConfig, eval_gate, run_tasks
from qgate.gates.held_out import held_out
from qgate.gates.longctx import LongContextConfig, baseline_long_reference, long_context_gate
from qgate.gates.noise import check_thresholds, noise_floor
from qgate.gates.numerics import LazyRunner
from qgate.gates.parity import ParityConfig, checkpoint_side, parity_checks
from qgate.gates.perf import PerfConfig, floor_passes, perf_check, perf_times
from qgate.gates.report import write_report
from qgate.gates.result import ON_INCONCLUSIVE, GateReport, GateResult, OnInconclusive
from qgate.gates.scoring import SCORING_LIBRARIES
from qgate.gates.shadow import (
    ShadowConfig,
    baseline_reference,
    load_shadow,
    more_positions_hint,
    run_shadow,
    unpassable_quantiles,
)


@dataclass(frozen=True)
class GateConfig:
    contract: ContractConfig = field(default_factory=ContractConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    eval: EvalConfig | None = field(default_factory=EvalConfig)
    long_context: LongContextConfig | None = field(default_factory=LongContextConfig)  # None: not probed
    perf: PerfConfig = field(default_factory=PerfConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    on_inconclusive: OnInconclusive = "block"  # block: an inconclusive check blocks promotion; warn: it passes
    score_anyway: bool = False  # score a candidate whose serving contract failed (its verdict is FAIL regardless)
    stop_on_fail: bool = False  # after a decided FAIL on shadow, parity or perf, skip long context and eval
    device: str = "auto"  # where models are scored: auto (CUDA when present), cpu, cuda, cuda:N
    dtype: str = "auto"  # reference checkpoints' compute dtype: auto (float32 on CPU, served dtype on CUDA); a model
    # whose config says float16 computes in float16 whatever this says (device.compute_dtype)
    VERSION = 31  # of the report's layout and the gates' rules; what changed in each is in git

    # the thresholds of the checks that hold the candidate's behaviour against the baseline's and can pass it
    BEHAVIOUR = {
        "shadow": ("kl_mean_max", "kl_p99_max", "kl_p999_max", "top1_agreement_min", "identical_generation_min"),
        "eval": ("min_recovery", "max_bpb_increase"),
        "long_context": ("max_nll_increase",),
    }

    def behaviour_thresholds(self) -> dict[str, str | None]:
        """Each of BEHAVIOUR's thresholds ("gates.shadow.kl_p99_max", ...): None where it decides a check, else why it
        decides none (null, its section off, or no eval task of the kind it applies to). With none deciding, every
        check on behaviour is report-only, and a PASS would say only that the serving contract holds and the logits
        are defined: the contract, the guards, perf and parity can stop a candidate but not show that it behaves
        alike."""
        out = {}
        for section, names in self.BEHAVIOUR.items():
            sub = getattr(self, section)
            idle = sub.idle() if section == "eval" and sub is not None else {}
            for name in names:
                why = "section off" if sub is None else "null" if getattr(sub, name) is None else idle.get(name)
                out[f"gates.{section}.{name}"] = why
        return out

    def __post_init__(self):
        from qgate.device import check_device, check_dtype

        if self.on_inconclusive not in ON_INCONCLUSIVE:
            raise ConfigError(f"gates.on_inconclusive: {self.on_inconclusive!r} is not 'block' or 'warn'")
        check_device(self.device)
        check_dtype(self.dtype)


def scoring_versions() -> dict[str, str]:
    """What the scores depend on beside the models and data, for the report: the versions of Python, qgate and the
    libraries a verdict depends on (execute.environment is the other question: whether two processes may share
    results). torch as it names itself: PyPI's CUDA wheels leave their build (+cu130) out of the package metadata."""
    import sys

    import torch

    import qgate
    from qgate.execute import LIBRARIES, versions

    return (
        {"python": sys.version.split()[0], "qgate": qgate.__version__}
        | versions(LIBRARIES)
        | {"torch": torch.__version__}
    )


def _describe(art: Artifact, name: str | None = None) -> dict:
    return {
        "name": name or art.path.name,
        "path": str(art.path),
        "kind": art.kind,
        "sha256": art.sha256,
        "scheme": art.meta.get("scheme"),
        "backend": art.meta.get("backend", "torch-reference"),
        "kv_cache_dtype": art.meta.get("kv_cache_dtype"),
    }


def _cached_eval(runner_factory, baseline: Artifact, cfg: EvalConfig, cache_dir: Path) -> tuple[dict, bool]:
    key = sha256_json(
        {
            "baseline": baseline.sha256,
            "tasks": cfg.tasks,
            "limit": cfg.limit,
            "data": sha256_tree(TASK_DIR),
            "v": SCORES_VERSION,
            "libs": releases((*SCORING_LIBRARIES, "lm-eval")),
        }
    )
    path = cache_dir / f"eval-baseline-{key[:24]}.json"
    if (data := read_cached(path)) is not None:
        return json.loads(data), True
    scores = run_tasks(runner_factory(), cfg)
    write_cached(path, json.dumps(scores).encode())
    return scores, False


def baseline_floor(
    baseline: Artifact, shadow: Artifact, cfg: GateConfig, cache_dir: Path, runner=None
) -> tuple[dict, dict, bool]:
    """The baseline's shadow reference and noise floor (both cached), after checking the thresholds against the floor:
    ConfigError if a threshold is tighter than the baseline itself can meet. Returns (reference, floor, reference
    cached). With a perf threshold, a floor whose time was measured on another card or CPU, or cold, is measured again
    here: the perf check divides it by the candidate's time."""
    from qgate.device import resolve_device, timing_host

    runner = runner or LazyRunner(baseline, cfg.device, cfg.dtype)
    cache_dir = runner.cache(cache_dir)
    ref, hit = baseline_reference(runner, baseline, shadow, cfg.shadow, cache_dir)
    here = timing_host(resolve_device(cfg.device)) if cfg.perf.gates else None
    floor = noise_floor(runner, baseline, shadow, ref, cfg.shadow, cache_dir, timed_on=here, passes=cfg.perf.passes)
    check_thresholds(cfg.shadow, floor)
    return ref, floor, hit


def warm_baseline(baseline: Artifact, shadow: Artifact, cfg: GateConfig, cache_dir: Path) -> dict:
    """Every baseline cache the gates read (shadow reference, noise floor, long-context reference, eval scores),
    computed once before variants fan out, so parallel gates share them instead of each computing its own. Returns the
    noise floor."""
    runner = LazyRunner(baseline, cfg.device, cfg.dtype)
    _, floor, _ = baseline_floor(baseline, shadow, cfg, Path(cache_dir), runner)
    if cfg.long_context is not None:
        baseline_long_reference(runner, baseline, cfg.long_context, runner.cache(cache_dir))
    if cfg.eval is not None:
        _cached_eval(runner, baseline, cfg.eval, runner.cache(cache_dir))
    runner.release()
    return floor


def shadow_check(candidate: Artifact, baseline: Artifact, shadow: Artifact, cfg: GateConfig, cache_dir: Path) -> dict:
    """The shadow gate alone, on a given shadow set: what a drift job re-runs for production on today's traffic. The
    held-out rules hold as in run_gates (gates/held_out.py): a split production was made with is refused, and
    requests it was made with are left out, `notes` saying how many."""
    from qgate.engines.runners import load_runner

    held = held_out(candidate, shadow, load_shadow(shadow, cfg.shadow))
    base = LazyRunner(baseline, cfg.device, cfg.dtype)
    ref, hit = baseline_reference(base, baseline, shadow, cfg.shadow, base.cache(cache_dir))
    base.release()
    check = run_shadow(load_runner(candidate, cfg.device, cfg.dtype), ref | {"held_out": held.mask}, cfg.shadow)
    decided = GateReport.decide(check.results, cfg.on_inconclusive)
    return {
        "verdict": decided.verdict,
        "passed": decided.passed,
        "on_inconclusive": cfg.on_inconclusive,
        "results": list(decided.results),
        "scoring": check.scored,
        "notes": list(held.notes),
        "baseline_cached": hit,
        "seconds": {"baseline": 0.0 if hit else float(ref["seconds"]), "candidate": check.metrics["score_seconds"]},
    }


def _idle_note(cfg: GateConfig) -> tuple[str, ...]:
    """The eval thresholds the config sets that decide no check, since no task is of the kind they apply to
    (EvalConfig.idle): a reader of the config would take them for checks that ran. A spec where no behaviour
    threshold decides anything is refused at load; this is the case beside others that do."""
    idle = [f"gates.eval.{name} ({why})" for name, why in (cfg.eval.idle() if cfg.eval else {}).items()]
    return (f"Set, but deciding no check: {'; '.join(idle)}.",) if idle else ()


def _tools_note(results: list, tool_guards: bool) -> tuple[str, ...]:
    """What the reader must know when the shadow split's tool use is not tested as configured: the baseline's chat
    template writes no tools for requests that offer them, or (with the tool-call guards on) it begins a tool call in
    no way gates/tool_calls.py reads, so the guards have nothing to read."""
    rendering = (r for r in results if (r.gate, r.metric) == ("contract", "prompt_rendering"))
    tools = next((r.evidence.get("tools") for r in rendering), None)
    if not tools:
        return ()
    if tools["not_written"]:
        return (
            f"{tools['not_written']} of the {tools['requests']} shadow requests that offer tools render without "
            "them: the baseline's chat template writes no tools, so they are scored as that model is served, and "
            "tool use itself is not tested.",
        )
    if tool_guards and tools.get("call_start") is None:
        return (
            f"The tool-call guards (tool.calls, tool.refrains) did not run on the {tools['requests']} shadow requests "
            "that offer tools: the baseline's chat template begins a tool call neither with a token of its own (an "
            "added token such as <tool_call>) nor as JSON that opens the answer (it writes calls as ordinary words, "
            "or none), so where an answer begins a call cannot be told from one token. Tool use there is judged only "
            "by the pooled KL and top-1 checks.",
        )
    return ()


def _provenance_notes(candidate: Artifact, baseline: Artifact) -> tuple[str, ...]:
    """What a reader of the verdict must know about where the two models came from, when qgate did not make them."""
    from qgate.models import IMPORTED
    from qgate.quantize.schemes import stored_description

    notes = ()
    if candidate.meta.get("scheme") == IMPORTED:
        notes += (
            "The candidate was quantized outside qgate (`qgate model import`): the data it was calibrated on is not "
            "recorded, so that the shadow split was held out from it is not checked.",
        )
    if stored := stored_description(baseline.path):
        notes += (f"The baseline is itself quantized ({stored}): a PASS says the candidate behaves like that model.",)
    return notes


def run_gates(
    candidate: Artifact,
    baseline: Artifact,
    shadow: Artifact,
    cfg: GateConfig,
    out: Path,
    cache_dir: Path,
    name: str | None = None,
    checkpoint: Artifact | None = None,
    notes: tuple[str, ...] = (),
) -> Artifact:
    """checkpoint: for an engine candidate, the checkpoint it was built from (default: its manifest's record).
    notes: what the caller wants every reader to know (for example an engine that could not be built).
    A candidate whose serving contract fails is not scored unless cfg.score_anyway: its verdict is FAIL whatever
    the scores, and scoring a large model costs hours; the report holds the contract's evidence and says so."""
    out, cache_dir = Path(out), Path(cache_dir)
    try:  # before any scoring: the baseline's answers are written here
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "it is a file" if cache_dir.is_file() else e.strerror
        raise InputError(
            f"{cache_dir}: cannot hold the baseline cache: {why}", hint="pass --cache a directory (made if missing)"
        ) from None
    timings: dict[str, float] = {}
    t = time.perf_counter()
    rows = load_shadow(shadow, cfg.shadow)
    held = held_out(candidate, shadow, rows, checkpoint)
    if cfg.on_inconclusive == "block" and (why := unpassable_quantiles(cfg.shadow, int(held.mask.sum()))):
        if held.left_out:
            why.append(f"{held.left_out} of its {len(rows)} prompts are ones the candidate was made with")
        raise InputError(
            f"{shadow.path}: {'; '.join(why)}: such a check can fail but never pass, so under gates.on_inconclusive: "
            "block no candidate could pass this gate",
            hint=more_positions_hint("qgate calibrate sample --shadow-size"),
        )
    notes = notes + held.notes
    results = contract_gate(candidate, baseline, rows, cfg.contract)
    timings["contract"] = time.perf_counter() - t
    refused = [r.metric for r in results if r.verdict in ("fail", "error")]
    if refused and not cfg.score_anyway:
        notes = notes + (
            f"Not scored: the serving contract failed ({', '.join(refused)}), so the verdict is FAIL "
            "whatever the scores. `qgate gate --score-anyway` (gates.score_anyway: true) scores it anyway.",
        )
        scored, m = (
            {
                "inputs": {"candidate_runtime": None},
                "noise_floor": None,
                "shadow_scoring": None,
                "long_context": None,
                "stopped": None,
                "cache": {"shadow_baseline": "skipped", "noise_floor": "skipped", "eval_baseline": "skipped"},
            },
            None,
        )
    else:
        more, scored, m = _score(candidate, baseline, shadow, cfg, cache_dir, checkpoint, timings, held.mask)
        results += more
        if stop := scored["stopped"]:
            notes = notes + (
                f"Not run: {' and '.join(stop['skipped'])}. The gate had already failed on {', '.join(stop['after'])}, "
                "so the verdict is FAIL whatever they show (gates.stop_on_fail: true; set it false to score them).",
            )
    notes = notes + _tools_note(results, cfg.shadow.tool_guards and m is not None) + _idle_note(cfg)
    if (made_from := candidate.meta.get("base_model")) and made_from != baseline.sha256:
        notes = notes + (
            f"The candidate was made from base model {made_from[:16]}, not from the baseline it is gated against "
            f"({baseline.sha256[:16]}): the verdict compares it with that baseline.",
        )
    notes = notes + _provenance_notes(candidate, baseline)
    decided = GateReport.decide(results, cfg.on_inconclusive, scored["stopped"], m is not None)
    verdict, passed = decided.verdict, decided.passed
    report = {
        "version": 2,
        "verdict": verdict,
        "passed": passed,
        "on_inconclusive": cfg.on_inconclusive,
        "candidate": _describe(candidate, name),
        "baseline": _describe(baseline, "baseline"),
        "inputs": {
            "candidate_sha256": candidate.sha256,
            "baseline_sha256": baseline.sha256,
            "shadow_sha256": shadow.sha256,
            "calibration_sha256": candidate.meta.get("calibration_sha256"),
        }
        | scored["inputs"],
        "noise_floor": scored["noise_floor"],
        "cache": scored["cache"],
        "shadow_scoring": scored["shadow_scoring"],
        "long_context": scored["long_context"],
        "stopped": scored["stopped"],
        "scored": m is not None,
        "config": {
            "contract": typed_config(cfg.contract),
            "shadow": typed_config(cfg.shadow),
            "parity": typed_config(cfg.parity),
            "eval": typed_config(cfg.eval) if cfg.eval else None,
            "perf": typed_config(cfg.perf),
            "long_context": typed_config(cfg.long_context) if cfg.long_context else None,
            "on_inconclusive": cfg.on_inconclusive,
            "score_anyway": cfg.score_anyway,
            "stop_on_fail": cfg.stop_on_fail,
        },
        "results": list(decided.results),
        "timings": {k: round(v, 2) for k, v in timings.items()},
        "environment": scoring_versions(),
        "notes": list(notes),
    }
    source = checkpoint or (engine_checkpoint(candidate) if candidate.kind == "engine" else candidate)
    if source is not None and source.meta.get("search"):  # a searched checkpoint carries its search's evidence
        report["search"] = source.meta["search"] | {"plot": str(source.path / "qgate-search.png")}
    write_report(out, report, m)
    return Artifact.create(
        "gate-report",
        out,
        report["config"],
        (candidate.sha256, baseline.sha256, shadow.sha256),
        {
            "passed": passed,
            "verdict": verdict,
            "summary": decided.summary,
            "candidate": candidate.sha256,
            "failed": decided.failed,
            "inconclusive": decided.inconclusive,
            "scored": m is not None,
        },
    )


def _score(
    candidate: Artifact,
    baseline: Artifact,
    shadow: Artifact,
    cfg: GateConfig,
    cache_dir: Path,
    checkpoint: Artifact | None,
    timings: dict[str, float],
    held: np.ndarray,
) -> tuple[list[GateResult], dict, dict]:
    """Every gate after the contract: (results, what the report records of the scoring, the shadow metrics with the
    masks of gated positions and held-out prompts). Adds its timings to `timings`. held: bool per shadow prompt, the
    ones the shadow checks count (gates/held_out.py)."""
    from qgate.device import timing_host
    from qgate.engines.runners import load_runner

    # One model in memory at a time: the baseline's work (cached by content) comes first and the baseline is freed,
    # then an engine's checkpoint for parity, then the candidate; an 8B pair never has to fit on one GPU twice.
    base = LazyRunner(baseline, cfg.device, cfg.dtype)
    bcache = base.cache(cache_dir)
    ref, floor, shadow_hit = baseline_floor(baseline, shadow, cfg, cache_dir, base)
    timings["baseline_shadow"] = 0.0 if shadow_hit else float(ref["seconds"])
    lref = None
    if cfg.long_context is not None:
        lref, long_hit = baseline_long_reference(base, baseline, cfg.long_context, bcache)
        timings["baseline_long_context"] = 0.0 if long_hit else float(lref["seconds"])
    eval_hit = base_scores = None
    if cfg.eval is not None:
        t = time.perf_counter()
        base_scores, eval_hit = _cached_eval(base, baseline, cfg.eval, bcache)
        timings["baseline_eval"] = 0.0 if eval_hit else time.perf_counter() - t
    base.release()
    parity = candidate.kind == "engine" and cfg.parity.enabled
    if parity:
        t = time.perf_counter()
        ckpt = checkpoint or engine_checkpoint(candidate)
        side = checkpoint_side(ckpt, ref, cfg.shadow.top_k, cfg.device, cfg.dtype)
        parity_s = time.perf_counter() - t
    t = time.perf_counter()
    cand = load_runner(candidate, cfg.device, cfg.dtype)
    timings["candidate_load"] = time.perf_counter() - t
    ref = ref | {"held_out": held}
    check = run_shadow(cand, ref, cfg.shadow)
    m, results, scored, gated = check.metrics, list(check.results), check.scored, check.gated
    timings["candidate_shadow"] = m["score_seconds"]
    if parity:
        t = time.perf_counter()
        results += parity_checks(cand, ckpt, side, ref, gated, cfg.parity)
        timings["parity"] = parity_s + time.perf_counter() - t
    scored_on = timing_host(getattr(cand, "device", None))  # an onnxruntime engine has none: the CPU
    how = "served (answers as decode steps)" if isinstance(cand, ScoresServed) else "teacher-forced"
    if cfg.perf.gates:  # timed again teacher-forced, as the baseline is
        t = time.perf_counter()
        times, how = perf_times(cand, baseline, ref, floor, cfg.perf, cfg.device, cfg.dtype), "teacher-forced"
        timings["perf"] = time.perf_counter() - t
    else:
        times = {"baseline": floor_passes(floor, ref)[:1], "candidate": [m["score_seconds"]], "paired": False}
    results.append(perf_check(floor, times, how, cand.kind, scored_on, cfg.perf))
    stopped = _stopped(results, cfg)
    long_cov = None
    if lref is not None and stopped is None:
        long_results, long_cov = long_context_gate(
            cand, lref, cfg.long_context, cfg.shadow.max_prompt_tokens + cfg.shadow.max_new_tokens
        )
        timings["candidate_long_context"] = long_cov["seconds"]
        results += long_results
    if cfg.eval is not None and stopped is None:
        t = time.perf_counter()
        cand_scores = run_tasks(cand, cfg.eval)
        timings["candidate_eval"] = time.perf_counter() - t
        results += eval_gate(base_scores, cand_scores, cfg.eval)
    record = {
        "inputs": {"candidate_runtime": cand.kind, "numerics": cand.numerics, "scored_on": scored_on},
        "noise_floor": floor,
        "shadow_scoring": scored,
        "long_context": long_cov,
        "stopped": stopped,
        "cache": {
            "shadow_baseline": "hit" if shadow_hit else "miss",
            "noise_floor": "hit" if floor["cached"] else "miss",
            "eval_baseline": {None: "off", True: "hit", False: "miss"}[eval_hit],
        },
    }
    return results, record, m | {"gated": gated, "held_out": held}


def _stopped(results: list[GateResult], cfg: GateConfig) -> dict | None:
    """Under `stop_on_fail`, the checks left unscored because a decided FAIL already fixes the verdict: {"after":
    the failed checks, "skipped": the gates not run}; None when every configured check runs."""
    failed = [f"{r.gate}.{r.metric}" for r in results if r.verdict == "fail"]
    skipped = [g for g, on in (("long_context", cfg.long_context), ("eval", cfg.eval)) if on is not None]
    if not (cfg.stop_on_fail and failed and skipped):
        return None
    return {"after": failed, "skipped": skipped}
