"""Run every configured gate for one candidate and write the gate-report artifact.

    art = run_gates(candidate, baseline, shadow, GateConfig(), out=Path("runs/gate-awq"), cache_dir=Path("runs/.cache"))
    art.meta["passed"]   # the verdict; the CLI maps False to exit code 2

Baseline work (shadow answers, eval scores) is cached by content hash in cache_dir,
so gating a second candidate against the same baseline does not recompute it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from qgate.artifact import Artifact, engine_checkpoint, sha256_json, sha256_tree, typed_config
from qgate.cache import read_cached, write_cached
from qgate.engines.protocol import ScoresServed
from qgate.errors import BackendUnavailable, ConfigError, InputError
from qgate.execute import releases
from qgate.gates.contract import ContractConfig, contract_gate
from qgate.gates.evalgate import SCORES_VERSION, TASK_DIR, EvalConfig, eval_gate, run_tasks
from qgate.gates.kl_checks import KL_THRESHOLDS, kl_top1_checks
from qgate.gates.longctx import LongContextConfig, baseline_long_reference, long_context_gate
from qgate.gates.noise import check_thresholds, noise_floor
from qgate.gates.passes import rescore_reference
from qgate.gates.report import write_report
from qgate.gates.result import ON_INCONCLUSIVE, POSITIVE, GateReport, GateResult, OnInconclusive, check_threshold_values
from qgate.gates.scoring import SCORING_LIBRARIES
from qgate.gates.shadow import (
    ShadowConfig,
    baseline_reference,
    candidate_metrics,
    load_shadow,
    more_positions_hint,
    run_shadow,
    unpassable_quantiles,
)
from qgate.gates.stats import time_ratio_ci


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


@dataclass(frozen=True)
class ParityConfig:
    """Engine candidates: the engine vs its own checkpoint on the reference path, on the gated shadow positions.
    Tells a kernel or runtime bug from quantization loss. Report-only unless a threshold is set."""

    enabled: bool = True  # score an engine against its own checkpoint
    kl_mean_max: float | None = None  # as gates.shadow's, engine vs checkpoint; None: reported only
    kl_p99_max: float | None = None  # as gates.shadow's, engine vs checkpoint
    kl_p999_max: float | None = None  # as gates.shadow's, engine vs checkpoint
    top1_agreement_min: float | None = None  # as gates.shadow's, engine vs checkpoint
    VERSION = 1

    def __post_init__(self):
        check_threshold_values("gates.parity", self, KL_THRESHOLDS)


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
    dtype: str = "auto"  # reference checkpoints' compute dtype: auto (float32 on CPU, served dtype on CUDA)
    VERSION = 19  # of the report's layout and the gates' rules; what changed in each is in git

    def __post_init__(self):
        from qgate.device import check_device, check_dtype

        if self.on_inconclusive not in ON_INCONCLUSIVE:
            raise ConfigError(f"gates.on_inconclusive: {self.on_inconclusive!r} is not 'block' or 'warn'")
        check_device(self.device)
        check_dtype(self.dtype)


def scoring_versions() -> dict[str, str]:
    """What the scores depend on beside the models and data, for the report: the versions of Python, qgate and the
    libraries a verdict depends on (execute.environment is the other question: whether two processes may share
    results)."""
    import sys

    import qgate
    from qgate.execute import LIBRARIES, versions

    return {"python": sys.version.split()[0], "qgate": qgate.__version__} | versions(LIBRARIES)


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


def _checkpoint_side(ckpt: Artifact | None, ref: dict, cfg: GateConfig) -> tuple[dict, dict] | None:
    """An engine's own checkpoint on the reference path, scored against the baseline's reference and rescored as a
    reference for the engine: (checkpoint metrics, checkpoint reference), or None when the checkpoint is gone. The
    checkpoint is freed before this returns, so the engine loads into a device holding no other model."""
    if ckpt is None:
        return None
    runner = _LazyRunner(ckpt, cfg.device, cfg.dtype)
    m_ckpt = candidate_metrics(runner(), ref, desc="parity: checkpoint vs baseline")
    ckpt_ref = rescore_reference(runner(), ref, cfg.shadow.top_k, desc="parity: checkpoint reference")
    runner.release()
    return m_ckpt, ckpt_ref


def _parity(
    cand_runner, ckpt: Artifact | None, side: tuple[dict, dict] | None, ref: dict, gated, cfg: GateConfig
) -> list[GateResult]:
    """Checkpoint vs baseline and engine vs checkpoint, on the baseline's shadow tokens and the gated positions."""
    if side is None:
        why = "the engine's checkpoint is not on disk or changed since the build"
        return [
            GateResult.check("parity", m, float("nan"), None, False, 0, evidence={"error": why})
            for m in ("engine_vs_checkpoint.kl_p99", "checkpoint_vs_baseline.kl_p99")
        ]
    m_ckpt, ckpt_ref = side
    m_eng = candidate_metrics(cand_runner, ckpt_ref, desc="parity: engine vs checkpoint")
    ev = {"checkpoint": ckpt.sha256, "checkpoint_path": str(ckpt.path)}
    results = kl_top1_checks(
        m_eng, ref["prompt_of"], gated, cfg.parity, prefix="engine_vs_checkpoint.", evidence=ev, gate="parity"
    )
    return results + kl_top1_checks(
        m_ckpt, ref["prompt_of"], gated, None, prefix="checkpoint_vs_baseline.", gate="parity"
    )


REFERENCE_OF_RECORD = "cpu-float32"  # the numerics whose cached work keeps the keys and paths it had before devices


def scoring_numerics(art: Artifact, device: str = "auto", dtype: str = "auto") -> str:
    """The numerics a checkpoint is scored in on the reference path ('cpu-float32', 'cpu-bfloat16', 'cuda-bfloat16'):
    part of the key of anything computed from its scores."""
    from qgate.device import compute_dtype, numerics, resolve_device

    dev = resolve_device(device)
    return numerics(dev, compute_dtype(json.loads((art.path / "config.json").read_text()), dev, dtype))


def numerics_key(art: Artifact, device: str = "auto", dtype: str = "auto") -> dict:
    """The part of a cache key that names the numerics scores were computed in: nothing for the reference of record,
    so keys made before other numerics existed stay valid."""
    tag = scoring_numerics(art, device, dtype)
    return {} if tag == REFERENCE_OF_RECORD else {"numerics": tag}


class _LazyRunner:
    """Loads a model the first time it is needed, once, on a device; `release` frees it."""

    def __init__(self, art: Artifact, device: str = "auto", dtype: str = "auto"):
        self.art, self.device, self.dtype, self.runner, self._tag = art, device, dtype, None, None

    def __call__(self):
        from qgate.engines.runners import load_runner

        if self.runner is None:
            self.runner = load_runner(self.art, self.device, self.dtype)
        return self.runner

    def tag(self) -> str:
        if self._tag is None:
            self._tag = scoring_numerics(self.art, self.device, self.dtype)
        return self._tag

    def cache(self, cache_dir: Path) -> Path:
        """Where this model's cached reference work lives: `cache_dir` for float32 on the CPU (the reference of
        record), a subdirectory per device and dtype otherwise, so CPU and GPU references never mix."""
        return Path(cache_dir) if self.tag() == REFERENCE_OF_RECORD else Path(cache_dir) / self.tag()

    def release(self) -> None:
        from qgate.device import release

        if self.runner is not None:
            device = getattr(self.runner, "device", None)
            self.runner = None
            release(device)


def baseline_floor(
    baseline: Artifact, shadow: Artifact, cfg: GateConfig, cache_dir: Path, runner=None
) -> tuple[dict, dict, bool]:
    """The baseline's shadow reference and noise floor (both cached), after checking the thresholds against the floor:
    ConfigError if a threshold is tighter than the baseline itself can meet. Returns (reference, floor, reference
    cached). With a perf threshold, a floor whose time was measured on another card or CPU, or cold, is measured again
    here: the perf check divides it by the candidate's time."""
    from qgate.device import resolve_device, timing_host

    runner = runner or _LazyRunner(baseline, cfg.device, cfg.dtype)
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
    runner = _LazyRunner(baseline, cfg.device, cfg.dtype)
    _, floor, _ = baseline_floor(baseline, shadow, cfg, Path(cache_dir), runner)
    if cfg.long_context is not None:
        baseline_long_reference(runner, baseline, cfg.long_context, runner.cache(cache_dir))
    if cfg.eval is not None:
        _cached_eval(runner, baseline, cfg.eval, runner.cache(cache_dir))
    runner.release()
    return floor


def shadow_check(candidate: Artifact, baseline: Artifact, shadow: Artifact, cfg: GateConfig, cache_dir: Path) -> dict:
    """The shadow gate alone, on a given shadow set: what a drift job re-runs for production on today's traffic."""
    from qgate.engines.runners import load_runner

    base = _LazyRunner(baseline, cfg.device, cfg.dtype)
    ref, hit = baseline_reference(base, baseline, shadow, cfg.shadow, base.cache(cache_dir))
    base.release()
    check = run_shadow(load_runner(candidate, cfg.device, cfg.dtype), ref, cfg.shadow)
    decided = GateReport.decide(check.results, cfg.on_inconclusive)
    return {
        "verdict": decided.verdict,
        "passed": decided.passed,
        "on_inconclusive": cfg.on_inconclusive,
        "results": list(decided.results),
        "scoring": check.scored,
        "baseline_cached": hit,
        "seconds": {"baseline": 0.0 if hit else float(ref["seconds"]), "candidate": check.metrics["score_seconds"]},
    }


def check_held_out(candidate: Artifact, shadow: Artifact, checkpoint: Artifact | None = None) -> None:
    """The split a gate scores on must be one the candidate was not made with: InputError (no verdict) when the
    candidate's manifest, or its checkpoint's for an engine, names `shadow` as its calibration set or as a parent
    (a search records the split it chose its point on)."""
    source = checkpoint or (engine_checkpoint(candidate) if candidate.kind == "engine" else None)
    for art in (candidate, source):
        if art is None:
            continue
        if shadow.sha256 == art.meta.get("calibration_sha256"):
            how = "was calibrated on this split"
        elif shadow.sha256 in art.parents:
            how = "was made with this split (a search chose its layout on it)"
        else:
            continue
        raise InputError(
            f"{shadow.path}: {candidate.path} {how}, so a gate on it would score the prompts the candidate was fitted "
            "to, not held-out traffic",
            hint="gate on a split of the same `qgate calibrate sample` that the candidate was not made with: the "
            "shadow split, with calibration on the calib split and a search on the search split",
        )


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
    if cfg.on_inconclusive == "block" and (why := unpassable_quantiles(cfg.shadow, len(rows))):
        raise InputError(
            f"{shadow.path}: {'; '.join(why)}: such a check can fail but never pass, so under gates.on_inconclusive: "
            "block no candidate could pass this gate",
            hint=more_positions_hint("qgate calibrate sample --shadow-size"),
        )
    check_held_out(candidate, shadow, checkpoint)
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
        more, scored, m = _score(candidate, baseline, shadow, cfg, cache_dir, checkpoint, timings)
        results += more
        if stop := scored["stopped"]:
            notes = notes + (
                f"Not run: {' and '.join(stop['skipped'])}. The gate had already failed on {', '.join(stop['after'])}, "
                "so the verdict is FAIL whatever they show (gates.stop_on_fail: true; set it false to score them).",
            )
    if (made_from := candidate.meta.get("base_model")) and made_from != baseline.sha256:
        notes = notes + (
            f"The candidate was made from base model {made_from[:16]}, not from the baseline it is gated against "
            f"({baseline.sha256[:16]}): the verdict compares it with that baseline.",
        )
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
) -> tuple[list[GateResult], dict, dict]:
    """Every gate after the contract: (results, what the report records of the scoring, the shadow metrics with the
    mask of gated positions). Adds its timings to `timings`."""
    from qgate.device import timing_host
    from qgate.engines.runners import load_runner

    # One model in memory at a time: the baseline's work (cached by content) comes first and the baseline is freed,
    # then an engine's checkpoint for parity, then the candidate; an 8B pair never has to fit on one GPU twice.
    base = _LazyRunner(baseline, cfg.device, cfg.dtype)
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
        side = _checkpoint_side(ckpt, ref, cfg)
        parity_s = time.perf_counter() - t
    t = time.perf_counter()
    cand = load_runner(candidate, cfg.device, cfg.dtype)
    timings["candidate_load"] = time.perf_counter() - t
    check = run_shadow(cand, ref, cfg.shadow)
    m, results, scored, gated = check.metrics, list(check.results), check.scored, check.gated
    timings["candidate_shadow"] = m["score_seconds"]
    if parity:
        t = time.perf_counter()
        results += _parity(cand, ckpt, side, ref, gated, cfg)
        timings["parity"] = parity_s + time.perf_counter() - t
    scored_on = timing_host(getattr(cand, "device", None))  # an onnxruntime engine has none: the CPU
    how = "served (answers as decode steps)" if isinstance(cand, ScoresServed) else "teacher-forced"
    if cfg.perf.gates:  # timed again teacher-forced, as the baseline is
        t = time.perf_counter()
        times, how = _perf_times(cand, baseline, ref, floor, cfg), "teacher-forced"
        timings["perf"] = time.perf_counter() - t
    else:
        times = {"baseline": _floor_passes(floor, ref)[:1], "candidate": [m["score_seconds"]], "paired": False}
    results.append(_perf_check(floor, times, how, cand.kind, scored_on, cfg.perf))
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
    return results, record, m | {"gated": gated}


def _floor_passes(floor: dict, ref: dict) -> list[float]:
    """The baseline's timed teacher-forced passes recorded with its noise floor (one, in a floor cached before it
    recorded passes; the reference's own time where a floor recorded none)."""
    passes = floor.get("baseline_score_passes") or [floor.get("baseline_score_seconds", ref["score_seconds"])]
    return [float(x) for x in passes]


def _perf_times(cand, baseline: Artifact, ref: dict, floor: dict, cfg: GateConfig) -> dict:
    """The times the perf check divides when it gates: each model's teacher-forced scoring of the shadow sequences,
    `cfg.perf.repeats` timed passes each, each side warm (one untimed batch before its first).

    In turn (`paired`): the baseline is loaded again beside the candidate, and the two are timed pass by pass,
    alternating which goes first, so a host that runs faster or slower as the gate goes on moves both alike. Apart:
    when the baseline does not fit beside the candidate (BackendUnavailable before it loads, or CUDA running out of
    memory as it scores), the candidate's passes against the baseline's recorded with its noise floor, timed before
    the candidate loaded or in an earlier run (`apart_because` says why)."""
    base = _LazyRunner(baseline, cfg.device, cfg.dtype)
    b_s: list[float] = []
    c_s: list[float] = []
    try:
        for k in range(cfg.perf.repeats):
            turn = ((base, b_s, "baseline"), (lambda: cand, c_s, "candidate"))
            for runner, into, who in turn if k % 2 == 0 else turn[::-1]:
                desc = f"perf: {who}, pass {k + 1}/{cfg.perf.repeats} in turn"
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
    c_s = candidate_metrics(cand, ref, "perf: candidate apart", served=False, warm_up=True, passes=cfg.perf.repeats)[
        "score_passes"
    ]
    return {"baseline": _floor_passes(floor, ref), "candidate": c_s, "paired": False, "apart_because": why}


def _perf_check(floor: dict, times: dict, how: str, runtime: str, cand_on: str, cfg: PerfConfig) -> GateResult:
    """The candidate's teacher-forced scoring throughput on the shadow sequences against the baseline's: the ratio of
    their geometric-mean times (`times`: _perf_times' passes when the check gates; report-only, the noise floor's
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


def _stopped(results: list[GateResult], cfg: GateConfig) -> dict | None:
    """Under `stop_on_fail`, the checks left unscored because a decided FAIL already fixes the verdict: {"after":
    the failed checks, "skipped": the gates not run}; None when every configured check runs."""
    failed = [f"{r.gate}.{r.metric}" for r in results if r.verdict == "fail"]
    skipped = [g for g, on in (("long_context", cfg.long_context), ("eval", cfg.eval)) if on is not None]
    if not (cfg.stop_on_fail and failed and skipped):
        return None
    return {"after": failed, "skipped": skipped}
