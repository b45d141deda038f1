"""The pipeline's stages, one function each: it takes artifacts and its config, computes its own key, and returns its
artifacts. The ledger (pipeline/ledger.py) skips a stage whose key built an artifact that is still intact.

    led = Ledger(spec.path(spec.workdir))
    base = model_stage(led, spec)
    cal = calibrate_stage(led, spec, spec.traffic_source())
    chain = variant_chain(led, spec, spec.variants[0], Chain(base, cal, cache_dir=led.workdir / "cache"))
    chain = register_stage(led, spec, chain)          # chain.version: the registered version

A variant's chain is the table VARIANT_STAGES, run in order: its checkpoint (quantized, or searched), its serving
engine, its gate report. `qgate run`, `qgate search` and the drift jobs all run these functions; none of them calls
another stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from qgate.artifact import Artifact, sha256_json, sha256_tree, typed_config
from qgate.pipeline.ledger import Ledger
from qgate.pipeline.spec import PipelineSpec, VariantSpec


class Calibration(NamedTuple):
    """What the calibrate stage returns: the calibration set, the shadow split the gates score on, the traffic profile
    drift is measured against, and the search split (None without `calibrate.search_size`)."""

    calib: Artifact
    shadow: Artifact
    profile: Artifact
    search: Artifact | None


@dataclass(frozen=True)
class Chain:
    """One variant's artifacts as its chain builds them: the inputs every variant shares, then what each stage adds."""

    base: Artifact
    cal: Calibration
    cache_dir: Path
    variant: VariantSpec | None = None
    checkpoint: Artifact | None = None
    candidate: Artifact | None = None  # what is gated: the engine, or the checkpoint when no engine is built
    notes: tuple[str, ...] = ()  # why the candidate is not the engine the spec asked for
    report: Artifact | None = None
    version: int | None = None  # set by register_stage


def model_stage(led: Ledger, spec: PipelineSpec) -> Artifact:
    """The spec's model imported as the baseline that every variant quantizes: refused here, before calibration, when
    it is quantized already."""
    from qgate.models import IMPORT_VERSION, ModelSource, import_model, source_fingerprint
    from qgate.quantize.compress import check_unquantized

    msrc = ModelSource(**spec.model.model_dump())
    if msrc.hf_dir:
        msrc = ModelSource(hf_dir=str(spec.path(msrc.hf_dir)))
    base = led.run(
        "model",
        {"src": source_fingerprint(msrc), "import": IMPORT_VERSION},
        led.workdir / "base",
        lambda out: import_model(msrc, out),
    )
    check_unquantized(base, "the spec's model")
    return base


def traffic_key(spec: PipelineSpec, parts: list, executor: str, scans: Path) -> str:
    """The calibrate stage's traffic key: the `traffic_sha256` of the partitions `list_partitions` gave. Partitions
    the scan cache `scans` holds unchanged give the sha256 their scans recorded, so only new or changed ones are read
    (a sliding window hashes one day)."""
    from qgate.calibrate.sample import SampleConfig
    from qgate.calibrate.scan_cache import ScanCache
    from qgate.calibrate.sources import traffic_sha256

    cache = ScanCache(scans, SampleConfig(**spec.calibrate.model_dump()), len(parts) > 1)
    return traffic_sha256(parts, executor, known=cache.sha256)


def calibrate_stage(
    led: Ledger,
    spec: PipelineSpec,
    traffic: str | Path,
    executor: str = "serial",
    traffic_sha: str | None = None,
    scan_cache: Path | None = None,
    parts: list | None = None,
    held_from: tuple[str, ...] = (),
) -> Calibration:
    """Sample `traffic` (a file, glob, directory or URI). The executor does not enter the key: serial and Ray scans
    give the same sets. traffic_sha and parts: the traffic's `traffic_key` and the partitions it was hashed from, when
    the caller has them already. The traffic is listed once, so the partitions sampled are the ones the key was
    hashed from even when files arrive in between. scan_cache: where scans of unchanged partitions are kept for the
    next run (default <workdir>/cache/scans; calibrate/scan_cache.py). held_from: calibration requests of a model to
    be gated on the shadow split (its `calibration_prompts`), which the shadow split passes over."""
    from qgate.calibrate.sample import SampleConfig, load_sampled, sample_traffic
    from qgate.calibrate.sources import list_partitions

    sample_cfg = SampleConfig(**spec.calibrate.model_dump())
    scans = scan_cache or led.workdir / "cache" / "scans"
    if parts is None:
        parts = list_partitions(traffic)
    key = {
        "traffic": traffic_sha or traffic_key(spec, parts, executor, scans),
        "cfg": sample_cfg.__dict__,
        "v": SampleConfig.VERSION,  # what the sampler reads of a record
    }
    if held_from:
        key["held_from"] = sha256_json(sorted(held_from))
    calib = led.run(
        "calibrate",
        key,
        led.workdir / "calib",
        lambda out: sample_traffic(
            traffic,
            out,
            sample_cfg,
            executor=executor,
            scan_cache=scans,
            parts=parts,
            picture=True,
            failed_rejects=led.workdir / "calib.rejects.jsonl",
            held_from=held_from,
        )["calib"],
    )
    arts = load_sampled(calib.path.parent)
    return Calibration(calib, arts["shadow"], arts["profile"], arts.get("search"))


def checkpoint_stage(led: Ledger, spec: PipelineSpec, v: VariantSpec, chain: Chain) -> Chain:
    """The variant's checkpoint: quantized by its scheme, or, with `search:`, the smallest searched point that
    passed."""
    if v.search is not None:
        return replace(chain, checkpoint=search_stage(led, spec, v, chain.base, chain.cal, chain.cache_dir))
    from qgate.quantize.compress import CalibOptions, quantize, storage_key
    from qgate.quantize.schemes import KVCacheConfig, scheme_config, smooths
    from qgate.quantize.smoothing import cached_smoothing

    base, calib = chain.base, chain.cal.calib
    opts = CalibOptions(**spec.quantize.model_dump())
    scheme = scheme_config(v.scheme, **v.options)
    kv = KVCacheConfig(v.kv_cache) if v.kv_cache else None
    key = {
        "base": base.sha256,
        "calib": calib.sha256,
        "scheme": typed_config(scheme),
        "kv": v.kv_cache,
        "opts": opts.__dict__,
    } | storage_key(base.path)
    ckpt = led.run(
        f"quantize:{v.name}",
        key,
        led.workdir / "variants" / v.name / "checkpoint",
        lambda out: quantize(
            base,
            calib,
            scheme,
            out,
            kv=kv,
            opts=opts,
            smoothed=cached_smoothing(base, calib, scheme, opts, chain.cache_dir, led.echo)
            if smooths(scheme, kv)
            else None,
        ),
    )
    return replace(chain, checkpoint=ckpt)


def search_stage(
    led: Ledger, spec: PipelineSpec, v: VariantSpec, base: Artifact, cal: Calibration, cache_dir: Path
) -> Artifact:
    """The variant's searched checkpoint (its `search:` settings). `qgate search` and `qgate run` share the stage, so
    one reuses what the other found. Points are gated on the search split, so the shadow split that gates the chosen
    point afterwards is data the search never saw."""
    from qgate.gates.numerics import numerics_key
    from qgate.pipeline.search import search_checkpoint
    from qgate.pipeline.variant import search_config
    from qgate.quantize.compress import CalibOptions, storage_key
    from qgate.quantize.schemes import KVCacheConfig, scheme_config

    scheme, gate_cfg = scheme_config(v.scheme, **v.options), spec.gate_config()
    kv = KVCacheConfig(v.kv_cache) if v.kv_cache else None
    opts, search_cfg = CalibOptions(**spec.quantize.model_dump()), search_config(v)
    key = {
        "base": base.sha256,
        "calib": cal.calib.sha256,
        "scheme": typed_config(scheme),
        "kv": v.kv_cache,
        "opts": opts.__dict__,
        "search": typed_config(search_cfg),
        "points_on": cal.search.sha256,  # spec validation requires calibrate.search_size with a search
        "shadow_cfg": typed_config(gate_cfg.shadow),
    }
    key |= numerics_key(base, gate_cfg.device, gate_cfg.dtype)  # the points are gated in these numerics
    key |= storage_key(base.path)
    return led.run(
        f"search:{v.name}",
        key,
        led.workdir / "variants" / v.name / "checkpoint",
        lambda out: search_checkpoint(
            base,
            cal.calib,
            cal.search,
            scheme,
            search_cfg,
            gate_cfg,
            out,
            cache_dir,
            kv=kv,
            opts=opts,
            echo=led.echo,
            confirm=cal.shadow,
        ),
    )


def engine_stage(led: Ledger, spec: PipelineSpec, v: VariantSpec, chain: Chain) -> Chain:
    """The serving engine the variant asks for, as the candidate to gate. Without `engine:`, or when the backend
    cannot hold the checkpoint's layout (a searched mix of W4 and W8 layers), the checkpoint itself is the candidate,
    gated on the PyTorch reference path, and a note says why."""
    from qgate.engines.build import build_engine, engine_config, unsupported

    ckpt = chain.checkpoint
    if v.engine is None:
        return replace(chain, candidate=ckpt)
    why = unsupported(ckpt, v.engine.backend)
    if why:
        note = f"engine {v.engine.backend} not built: {why}; gated on the PyTorch reference path"
        led.echo(f"  ! {v.name}: {note}")
        return replace(chain, candidate=ckpt, notes=(note,))
    ecfg = typed_config(engine_config(v.engine.backend, **v.engine.options))
    key = {"ckpt": ckpt.sha256, "engine": [v.engine.backend, ecfg], "profile": chain.cal.profile.sha256}
    cand = led.run(
        f"engine:{v.name}",
        key,
        led.workdir / "variants" / v.name / "engine",
        lambda out: build_engine(ckpt, v.engine.backend, out, chain.cal.profile, **v.engine.options),
    )
    return replace(chain, candidate=cand)


def gate_stage(led: Ledger, spec: PipelineSpec, v: VariantSpec, chain: Chain) -> Chain:
    """The candidate's gate report against the baseline on the shadow split, under every gate the spec configures."""
    from qgate.gates.gating import run_gates

    gate_cfg = spec.gate_config()
    gate_key = typed_config(gate_cfg)  # every gate setting, defaults included
    if gate_cfg.eval is not None:  # and the shipped eval data: a larger task set re-gates
        from qgate.gates.evalgate import TASK_DIR

        gate_key = {"cfg": gate_key, "tasks": sha256_tree(TASK_DIR)}
    cand, base, shadow = chain.candidate, chain.base, chain.cal.shadow
    key = {"cand": cand.sha256, "base": base.sha256, "shadow": shadow.sha256, "gates": gate_key} | (
        {"notes": chain.notes} if chain.notes else {}
    )
    report = led.run(
        f"gate:{v.name}",
        key,
        led.workdir / "variants" / v.name / "gate",
        lambda out: run_gates(
            cand,
            base,
            shadow,
            gate_cfg,
            out,
            chain.cache_dir,
            name=v.name,
            checkpoint=chain.checkpoint,
            notes=chain.notes,
        ),
    )
    return replace(chain, report=report)


VariantStage = Callable[[Ledger, PipelineSpec, VariantSpec, Chain], Chain]

VARIANT_STAGES: tuple[VariantStage, ...] = (checkpoint_stage, engine_stage, gate_stage)


def variant_chain(
    led: Ledger,
    spec: PipelineSpec,
    v: VariantSpec,
    chain: Chain,
    step: Callable[[], None] = lambda: None,
) -> Chain:
    """Every stage of VARIANT_STAGES in order for one variant; `step` after each (a progress bar)."""
    chain = replace(chain, variant=v)
    for stage in VARIANT_STAGES:
        chain = stage(led, spec, v, chain)
        step()
    return chain


def register_stage(led: Ledger, spec: PipelineSpec, chain: Chain) -> Chain:
    """Register the gated variant with its evidence (idempotent: the registry finds a version registered before a
    kill, and the ledger one recorded after it). Returns the chain with its version."""
    from qgate.registry.client import tracking_uri
    from qgate.registry.mlflow_store import register

    store = spec.path(spec.registry.store)
    profile = chain.cal.profile
    key = sha256_json(
        {
            "report": chain.report.sha256,
            "uri": tracking_uri(store),
            "name": spec.registry.model_name,
            "profile": profile.sha256,
        }
    )
    v = chain.variant
    name = f"register:{v.name}"
    rec = led.lookup(name, key)
    if rec:
        led.echo(f"  = {name}: already v{rec['version']}")
        return replace(chain, version=rec["version"])
    version = register(
        chain.report, chain.candidate, spec.registry.model_name, store, profile=profile, recipe=v.recipe()
    )
    led.record(name, key, version=version, paths=[str(chain.report.path)], sha256=chain.report.sha256)
    led.echo(f"  + {name}: {spec.registry.model_name} v{version}")
    return replace(chain, version=version)
