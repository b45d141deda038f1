"""`qgate run` and `qgate search`: the stage table (pipeline/stages.py) run over one spec, serially or on Ray.

    summary = run_pipeline(load_spec(Path("pipelines/promote.yaml")))
    ckpt = run_search(spec, "awq-w4a16-searched")

A run imports the model, samples the traffic, warms the baseline's references, runs every variant's chain
(VARIANT_STAGES), registers each gated variant, and promotes the one `promote.choose` picks. Stages whose key and
artifact the ledger holds are skipped, so a re-run after a kill or a spec edit does only what changed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from qgate.artifact import Artifact
from qgate.errors import PromotionRefused, QgateError
from qgate.pipeline.ledger import Ledger
from qgate.pipeline.spec import PipelineSpec, VariantSpec
from qgate.pipeline.stages import (
    VARIANT_STAGES,
    Chain,
    calibrate_stage,
    model_stage,
    register_stage,
    search_stage,
    variant_chain,
)
from qgate.pipeline.summary import best_passing, frontier, variant_summary

WORKER_LOG = "ray-workers.log"
EXECUTORS = ("serial", "ray")  # variants need the resources they declare: Ray places them, local processes cannot


def run_pipeline(
    spec: PipelineSpec, echo: Callable[[str], None] = print, wait: float = 0.0, executor: str = "serial"
) -> dict:
    """Under the workdir lock: a second job on the same workdir waits `wait` seconds, then raises LockHeld (exit 1).
    executor: "serial" (default) or "ray": traffic partitions are scanned and variants run as Ray tasks."""
    from qgate.locks import workdir_lock

    run_preflight(spec, executor)
    if executor == "ray":
        placeable(spec.variants, echo)
    with workdir_lock(spec.path(spec.workdir), f"qgate run {spec.name}", wait=wait, echo=echo):
        return _run(spec, echo, executor)


def run_preflight(spec: PipelineSpec, executor: str = "serial") -> None:
    """What `qgate run` refuses before it writes anything, its log and the workdir included: an unknown executor, a
    gate device this host lacks, MLflow missing, a tracking URI MLflow refuses (else the register stage fails after
    the gates), a local traffic source with no traffic file. Cheap: `qgate run` calls it before it opens its log, and
    run_pipeline again. A traffic URI is listed by the run itself, where its log records the object store's retries."""
    from qgate.calibrate.sources import is_uri, list_partitions
    from qgate.execute import check_executor
    from qgate.registry.client import env_tracking_uri
    from qgate.registry.names import require_mlflow

    check_executor(executor, EXECUTORS)
    check_gate_device(spec)
    if executor == "serial":  # on Ray a variant is searched on the worker that quantizes it, whose check that is
        check_search_budgets(spec, [v.name for v in spec.variants if v.search is not None])
    require_mlflow("qgate run (its register and promote stages)")
    env_tracking_uri()
    traffic = spec.traffic_source()
    if not is_uri(traffic):
        list_partitions(traffic)


def search_preflight(spec: PipelineSpec, variant: str) -> None:
    """What `qgate search` refuses before it writes anything: a misspelt variant, a search that cannot run (its size
    budget on this host included), a gate device this host lacks. The model and the baseline's references after it
    take minutes."""
    check_search_budgets(spec, [variant])  # check_search, then the budget on this host
    check_gate_device(spec)


def check_search_budgets(spec: PipelineSpec, variants: list[str]) -> None:
    """Each variant's search as `qgate search` checks it (spec.check_search), and then a ConfigError, before any
    stage, when its size budget is below its scheme's own bits per weight in the float format quantize stores the
    spec's model in on this host (stored_float_bits: 16-bit scales for a model that declares a 16-bit format or on
    CUDA, 32-bit for a float32 or GGUF model on a CPU); loading the spec refused only the budgets no host could meet."""
    from qgate.errors import ConfigError
    from qgate.naming import key_path
    from qgate.pipeline.spec import check_search
    from qgate.quantize.compress import stored_float_bits
    from qgate.quantize.schemes import scheme_config
    from qgate.search.plan import ladder_problem

    model = _declaring_model(spec)
    for name in variants:
        cfg, v = check_search(spec, name), spec.variant(name)
        if cfg.max_bits_per_weight is not None and (
            problem := ladder_problem(scheme_config(v.scheme, **v.options), cfg, stored_float_bits(model))
        ):
            where = key_path("variants", spec.variants.index(v), "search")
            raise ConfigError(f"{where}.{problem[0]} on this host (variant {name})", hint=problem[1])


def _declaring_model(spec: PipelineSpec) -> Path | None:
    """The spec's model directory, whose config.json says which float format the model declares; None for a GGUF
    (imported in float32), or where config.json is missing or does not parse: the model stage reports that."""
    if not spec.model.hf_dir:
        return None
    hf_dir = spec.path(spec.model.hf_dir)
    try:
        return hf_dir if isinstance(json.loads((hf_dir / "config.json").read_text()), dict) else None
    except (OSError, ValueError):
        return None


def check_gate_device(spec: PipelineSpec) -> None:
    """BackendUnavailable, before any stage, when the gates' device is not on this host (`gates.device: cuda` on a
    host without CUDA). The gates score here, on the driver (the baseline's references first), even when variants
    run as Ray tasks, and the model and calibrate stages before them can take minutes."""
    from qgate.device import resolve_device

    resolve_device(spec.gates.device or "auto")


def _run(spec: PipelineSpec, echo: Callable[[str], None], executor: str = "serial") -> dict:
    from qgate.calibrate.sources import list_partitions
    from qgate.progress import StageBar
    from qgate.registry.mlflow_store import promote

    led = Ledger(spec.path(spec.workdir), echo)
    w = led.workdir
    bar = StageBar(2 + len(VARIANT_STAGES) * len(spec.variants) + 1, f"pipeline {spec.name}")  # model, calibrate,
    # each variant's chain, register
    traffic = spec.traffic_source()
    parts = list_partitions(traffic)  # a missing traffic log fails here, not after the model's import
    base = model_stage(led, spec)
    bar.update()
    cal = calibrate_stage(led, spec, traffic, executor=executor, parts=parts)
    bar.update()
    steps = {"baseline": _warm_baseline(spec, base, cal.shadow, w / "cache", echo)}
    shared = Chain(base, cal, w / "cache")
    chains = gate_variants(led, spec, shared, list(spec.variants), bar.update, executor)
    t = time.perf_counter()
    chains = [register_stage(led, spec, c) for c in chains]
    steps["register"] = round(time.perf_counter() - t, 1)
    bar.update()
    bar.close()
    summary = {
        "tracking_uri": _tracking_uri(spec),
        "model_name": spec.registry.model_name,
        "workdir": str(w),
        "stage_seconds": led.seconds(),
        "step_seconds": steps,
        "stages_run": led.ran,
        "stages_skipped": led.skipped,
        "variants": [variant_summary(c) for c in chains],
        "promoted": None,
    }
    chosen = best_passing(spec, chains)
    summary["frontier"] = frontier(spec, summary["variants"], chains, w, chosen)
    if chosen is None:
        (w / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        raise PromotionRefused(
            f"no variant passed its gates: {', '.join(c.variant.name for c in chains)}",
            hint=f"see the reports under {w / 'variants'}",
        )
    store = spec.path(spec.registry.store)
    summary["promoted"] = promote(spec.registry.model_name, chosen.version, spec.promote.alias, store) | {
        "variant": chosen.variant.name
    }
    (w / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _tracking_uri(spec: PipelineSpec) -> str:
    from qgate.registry.client import tracking_uri

    return tracking_uri(spec.path(spec.registry.store))


def _warm_baseline(spec: PipelineSpec, base: Artifact, shadow: Artifact, cache: Path, echo) -> float:
    """The baseline's references and noise floor, once before any fan-out (an impossible threshold fails here).
    Returns the seconds it took."""
    from qgate.gates.gating import warm_baseline

    echo("  > baseline references and noise floor (cached per baseline) ...")
    t = time.perf_counter()
    floor = warm_baseline(base, shadow, spec.gate_config(), cache)
    secs = round(time.perf_counter() - t, 1)
    echo(
        f"  + noise floor: KL p99 {floor['kl_p99']['observed']:.3g}, top-1 {floor['top1_agreement']['observed']:.4f} "
        f"({floor['path']}); baseline references {secs}s"
    )
    return secs


def gate_variants(
    led: Ledger,
    spec: PipelineSpec,
    shared: Chain,
    variants: list[VariantSpec],
    step: Callable[[], None] = lambda: None,
    executor: str = "serial",
) -> list[Chain]:
    """Each variant's chain, in spec order. executor="ray": each chain is a Ray task with the variant's `resources`
    (execute.py); the tasks skip what the ledger already holds and return what they built, which this process
    records. A chain that fails returns the stages it finished with its error: nothing more is submitted, the chains
    already running finish and their stages are recorded too (hours of GPU work a re-run skips), then the first
    failure is raised."""
    if executor == "serial":
        return [variant_chain(led, spec, v, shared, step) for v in variants]
    from qgate.execute import map_ordered

    calls = [(spec, v.name, shared, led.workdir) for v in variants]
    led.echo(f"  > {len(calls)} variant(s) as Ray tasks; their library logs: {led.workdir / 'logs' / WORKER_LOG}")
    chains, failed = [], None
    for v, (chain, recorded, ran, skipped, error) in zip(
        variants,
        map_ordered(
            _variant_task,
            calls,
            executor,
            [dict(v.resources) for v in variants],
            stop_after=lambda res: res[4] is not None,
        ),
    ):
        led.merge(recorded, ran, skipped)
        if error is not None:
            led.echo(f"  ! {v.name} failed: {error}; variants already running finish, and every finished stage is kept")
            failed = failed or error
            continue
        for _ in VARIANT_STAGES:
            step()
        chains.append(chain)
    if failed is not None:
        raise failed
    return chains


def _variant_task(
    spec: PipelineSpec, name: str, shared: Chain, workdir: Path
) -> tuple[Chain | None, list, list, list, Exception | None]:
    """One variant's chain in a Ray worker: (chain, ledger records, stages run, stages skipped, None), or, when it
    fails, (None, the stages it finished, ..., its error): the driver records them before raising the error."""
    from qgate.progress import console_err, quiet_console

    v = next(x for x in spec.variants if x.name == name)
    quiet_console(Path(workdir) / "logs" / WORKER_LOG)  # libraries' output to the log; Ray forwards only qgate's lines
    err = console_err()
    led = Ledger(workdir, lambda m: print(f"[{name}] {m}", file=err, flush=True), persist=False)
    try:
        chain = variant_chain(led, spec, v, shared)
    except Exception as e:  # noqa: BLE001  returned, not raised: the stages before it are recorded by the driver
        import traceback

        traceback.print_exc()  # into the worker log, where the libraries' output is
        return None, led.recorded, led.ran, led.skipped, _portable(e)
    return chain, led.recorded, led.ran, led.skipped, None


def _portable(e: Exception) -> Exception:
    """The error itself when it survives the trip to the driver (a pickle round trip), else a QgateError with its
    type and message: an exception whose class takes other arguments must not lose the stages returned beside it."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001  any pickling failure: the message still reaches the driver
        return QgateError(f"{type(e).__name__}: {e}")


def placeable(variants: list[VariantSpec], echo: Callable[[str], None]) -> None:
    """Before any work: a variant whose `resources` no node of the Ray cluster has now. On a local Ray instance
    nothing will add one, so its task would wait forever: a ConfigError. On a cluster an autoscaler may add one:
    a warning that says what the task waits for."""
    from qgate.errors import ConfigError
    from qgate.execute import unplaceable
    from qgate.naming import key_path

    short, largest, local = unplaceable([dict(v.resources) for v in variants])
    for i, need in short:
        v = variants[i]
        what = (
            f"{key_path('variants', i, 'resources')}: variant {v.name} asks one node for {_amounts(need)}; the largest "
            f"node of this Ray {'instance' if local else 'cluster'} has {_amounts(largest) or 'nothing'}"
        )
        if local:
            raise ConfigError(
                f"{what}, so its task would wait forever",
                hint="lower the variant's resources, or set RAY_ADDRESS to a cluster whose nodes have them",
            )
        echo(f"  ! {what}: its task waits until such a node joins (an autoscaler adds one); Ctrl-C stops the run")


def _amounts(res: dict) -> str:
    return ", ".join(
        f"{k} {v / 2**30:.1f} GiB" if k.endswith("memory") else f"{k} {v:g}" for k, v in sorted(res.items())
    )


def run_search(spec: PipelineSpec, variant: str, echo: Callable[[str], None] = print, wait: float = 0.0) -> Artifact:
    """`qgate search`: the model, calibrate and baseline stages of `spec`, then the search for `variant`, under the
    workdir lock. `qgate run` on the same spec reuses the result."""
    from qgate.gates.gating import baseline_floor
    from qgate.locks import workdir_lock

    v = spec.variant(variant)
    search_preflight(spec, variant)
    with workdir_lock(spec.path(spec.workdir), f"qgate search {spec.name} {variant}", wait=wait, echo=echo):
        led = Ledger(spec.path(spec.workdir), echo)
        base = model_stage(led, spec)
        cal = calibrate_stage(led, spec, spec.traffic_source())
        baseline_floor(base, cal.shadow, spec.gate_config(), led.workdir / "cache")
        return search_stage(led, spec, v, base, cal, led.workdir / "cache")
