"""Run a pipeline spec end to end, skipping stages whose inputs did not change.

    summary = run_pipeline(load_spec(Path("pipelines/promote.yaml")))

Each stage's key is the hash of its config and its input artifacts' sha256. A stage
whose key matches the last run's and whose artifact is still on disk is skipped.
Stage functions never call each other: this module is the only place they meet.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from qgate.artifact import MANIFEST, Artifact, build_atomically, sha256_json, sha256_tree, typed_config
from qgate.errors import PromotionRefused, QgateError
from qgate.pipeline.spec import PipelineSpec, VariantSpec

WORKER_LOG = "ray-workers.log"


class StageLedger:
    """stages.json in the workdir: stage name -> the key it ran with, what it produced, and how long it took.

    Nothing in it is trusted on its word: an entry is used only if its paths stay inside the workdir and the
    artifact there still hashes to the recorded sha256. Anything else is reported and the stage runs again."""

    def __init__(self, workdir: Path, echo: Callable[[str], None] = print, persist: bool = True):
        self.workdir = Path(workdir)
        self.path = self.workdir / "stages.json"
        self.echo = echo
        self.persist = persist  # False in a Ray task: the driver records what it returns, one writer per ledger
        self.recorded: list[tuple[str, str, dict]] = []
        self.data = {}
        if self.path.exists():
            try:
                self.data = json.loads(self.path.read_text())
                if not isinstance(self.data, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                echo(f"  ! {self.path} is unreadable ({e}): every stage runs again")
                self.data = {}

    def lookup(self, name: str, key: str) -> dict | None:
        rec = self.data.get(name)
        if not isinstance(rec, dict) or rec.get("key") != key or not rec.get("paths"):
            return None
        root = self.workdir.resolve()
        paths = [(self.workdir / p).resolve() for p in rec["paths"]]  # relative: the workdir can move
        if any(not p.is_relative_to(root) for p in paths):
            self.echo(f"  ! {name}: ledger entry points outside the workdir ({rec['paths']}); running the stage again")
            return None
        if not all(Path(p, MANIFEST).exists() for p in paths) or "sha256" not in rec:  # gone, or an older ledger
            return None
        actual = sha256_tree(paths[0])
        if actual != rec.get("sha256"):
            self.echo(
                f"  ! {name}: {paths[0]} changed since it was built (sha256 {actual[:12]} != recorded "
                f"{str(rec.get('sha256'))[:12]}); running the stage again"
            )
            return None
        return rec | {"paths": [str(p) for p in paths]}

    def record(self, name: str, key: str, **values) -> None:
        if "paths" in values:
            values["paths"] = [
                os.path.relpath(p, self.workdir) if Path(p).is_relative_to(self.workdir) else str(p)
                for p in values["paths"]
            ]
        self.data[name] = {"key": key, **values}
        self.recorded.append((name, key, values))
        if not self.persist:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)


class Runner:
    def __init__(
        self,
        spec: PipelineSpec,
        echo: Callable[[str], None] = print,
        workdir: Path | None = None,
        persist_ledger: bool = True,
    ):
        self.spec = spec
        self.workdir = Path(workdir) if workdir is not None else spec.path(spec.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ledger = StageLedger(self.workdir, echo, persist=persist_ledger)
        self.echo = echo
        self.ran: list[str] = []
        self.skipped: list[str] = []

    def seconds(self) -> dict[str, float]:
        """Per stage, the wall time of the run that did the work (kept in the ledger, so a skipping re-run keeps it)."""
        data = self.ledger.data
        return {k: data[k]["seconds"] for k in self.ran + self.skipped if "seconds" in data.get(k, {})}

    def stage(self, name: str, key_data: dict, out: Path, fn: Callable[[Path], Artifact]) -> Artifact:
        """Skip if the ledger holds this key and its artifact is intact; else `fn(tmp)` builds the stage's whole output
        in a temporary directory that is renamed to `out` when complete (artifact.build_atomically)."""
        key = sha256_json(key_data)
        rec = self.ledger.lookup(name, key)
        if rec:
            art = Artifact.load(Path(rec["paths"][0]))
            if art.sha256 == rec["sha256"]:
                self.skipped.append(name)
                self.echo(f"  = {name}: unchanged, skipped ({art.path})")
                return art
        t = time.perf_counter()
        self.echo(f"  > {name} ...")
        art = build_atomically(out, fn)
        secs = round(time.perf_counter() - t, 1)
        self.ledger.record(name, key, paths=[str(art.path)], sha256=art.sha256, seconds=secs)
        self.ran.append(name)
        self.echo(f"  + {name}: done in {secs}s ({art.path})")
        return art


class _StageBar:
    """A stage-count bar on a terminal; nothing without one (each stage already logs its start and end line)."""

    def __init__(self, total: int, desc: str):
        from qgate.progress import interactive

        self.bar = None
        if interactive():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=" stage", position=0, leave=True)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def recipe(v: VariantSpec) -> dict:
    """How to rebuild a variant: kept with its registered version, so a drift job can re-run it."""
    return {
        "scheme": v.scheme,
        "options": dict(v.options),
        "kv_cache": v.kv_cache,
        "engine": v.engine.model_dump() if v.engine is not None else None,
    } | ({"search": dict(v.search)} if v.search is not None else {})


def model_stage(r: Runner, spec: PipelineSpec) -> Artifact:
    from qgate.models import IMPORT_VERSION, ModelSource, import_model, source_fingerprint

    msrc = ModelSource(**spec.model.model_dump())
    if msrc.hf_dir:
        msrc = ModelSource(hf_dir=str(spec.path(msrc.hf_dir)))
    return r.stage(
        "model",
        {"src": source_fingerprint(msrc), "import": IMPORT_VERSION},
        r.workdir / "base",
        lambda out: import_model(msrc, out),
    )


def cached_traffic_sha(spec: PipelineSpec, parts: list, engine: str, scans: Path) -> str:
    """The `traffic_sha256` of a traffic's partitions (as `list_partitions` gave them), the calibrate stage's key:
    partitions the scan cache `scans` holds unchanged give the sha256 their scans recorded, so only new or changed
    ones are read (a sliding window hashes one day)."""
    from qgate.calibrate.sample import SampleConfig
    from qgate.calibrate.scan_cache import ScanCache
    from qgate.calibrate.sources import traffic_sha256

    cache = ScanCache(scans, SampleConfig(**spec.calibrate.model_dump()), len(parts) > 1)
    return traffic_sha256(parts, engine, known=cache.sha256)


def calibrate_stage(
    r: Runner,
    spec: PipelineSpec,
    traffic: str | Path,
    engine: str = "serial",
    traffic_sha: str | None = None,
    scan_cache: Path | None = None,
    parts: list | None = None,
) -> tuple[Artifact, Artifact, Artifact]:
    """(calibration set, shadow set, traffic profile) sampled from `traffic` (a file, glob, directory or URI); the
    engine does not enter the key: serial and Ray scans give the same sets. traffic_sha and parts: the traffic's
    `traffic_sha256` (`cached_traffic_sha`) and the partitions it was hashed from, when the caller has them already.
    The traffic is listed once: the partitions sampled are the ones the key was hashed from, even when files arrive
    in between (a second listing would key one set and sample another). scan_cache: where scans of unchanged
    partitions are kept for the next run (default <workdir>/cache/scans; calibrate/scan_cache.py)."""
    from qgate.calibrate.sample import SampleConfig, sample_traffic
    from qgate.calibrate.sources import list_partitions

    scfg = SampleConfig(**spec.calibrate.model_dump())
    scans = scan_cache or r.workdir / "cache" / "scans"
    if parts is None:
        parts = list_partitions(traffic)
    key = {"traffic": traffic_sha or cached_traffic_sha(spec, parts, engine, scans), "cfg": scfg.__dict__}
    calib = r.stage(
        "calibrate",
        key,
        r.workdir / "calib",
        lambda out: sample_traffic(
            traffic,
            out,
            scfg,
            engine=engine,
            scan_cache=scans,
            parts=parts,
            picture=True,
            failed_rejects=r.workdir / "calib.rejects.jsonl",
        )["calib"],
    )
    return calib, Artifact.load(r.workdir / "calib" / "shadow"), Artifact.load(r.workdir / "calib" / "profile")


def search_stage(
    r: Runner, spec: PipelineSpec, v: VariantSpec, base: Artifact, calib: Artifact, shadow: Artifact, cache_dir: Path
) -> Artifact:
    """The variant's searched checkpoint (its `search:` settings, defaults when it has none); `qgate search` and
    `qgate run` share the stage, so one reuses what the other found. Points are gated on the calibration stage's
    search split, so the shadow split that gates the chosen point afterwards is data the search never saw."""
    from qgate.gates.run import numerics_key
    from qgate.pipeline.search import search_checkpoint
    from qgate.pipeline.spec import search_config
    from qgate.quantize.run import CalibOptions
    from qgate.quantize.schemes import KVCacheConfig, scheme_config

    scheme, gate_cfg = scheme_config(v.scheme, **v.options), spec.gate_config()
    kv = KVCacheConfig(v.kv_cache) if v.kv_cache else None
    opts, scfg = CalibOptions(**spec.quantize.model_dump()), search_config(v)
    held = Artifact.load(
        calib.path.parent / "search", "calibration-set"
    )  # sample_traffic's sibling of calib/ and shadow/
    key = {
        "base": base.sha256,
        "calib": calib.sha256,
        "scheme": typed_config(scheme),
        "kv": v.kv_cache,
        "opts": opts.__dict__,
        "search": typed_config(scfg),
        "points_on": held.sha256,
        "shadow_cfg": typed_config(gate_cfg.shadow),
    }
    key |= numerics_key(base, gate_cfg.device, gate_cfg.dtype)  # the points are gated in these numerics
    return r.stage(
        f"search:{v.name}",
        key,
        r.workdir / "variants" / v.name / "checkpoint",
        lambda out: search_checkpoint(
            base, calib, held, scheme, scfg, gate_cfg, out, cache_dir, kv=kv, opts=opts, echo=r.echo, confirm=shadow
        ),
    )


def gate_variants(
    r: Runner,
    spec: PipelineSpec,
    base: Artifact,
    calib: Artifact,
    shadow: Artifact,
    profile: Artifact,
    variants: list[VariantSpec],
    cache_dir: Path,
    step: Callable[[Artifact], Artifact] = lambda a: a,
    parallel: str = "serial",
) -> list[dict]:
    """Per variant: quantize, build its engine, gate it. Returns one outcome per variant, in spec order.
    parallel="ray": each variant's chain is a Ray task with the variant's `resources` (execute.py); the tasks skip
    what the ledger already holds and return what they built, which this process records. A chain that fails
    returns the stages it finished with its error: nothing more is submitted, the chains already running finish and
    their stages are recorded too (hours of GPU work a re-run skips), then the first failure is raised."""
    if parallel == "serial":
        return [variant_chain(r, spec, v, base, calib, shadow, profile, cache_dir, step) for v in variants]
    from qgate.execute import map_ordered

    calls = [(spec, v.name, base, calib, shadow, profile, cache_dir, r.workdir) for v in variants]
    r.echo(f"  > {len(calls)} variant(s) as Ray tasks; their library logs: {r.workdir / 'logs' / WORKER_LOG}")
    outcomes, failed = [], None
    for v, (outcome, records, ran, skipped, error) in zip(
        variants,
        map_ordered(
            _variant_task,
            calls,
            parallel,
            [dict(v.resources) for v in variants],
            stop_after=lambda res: res[4] is not None,
        ),
    ):
        for name, key, values in records:
            r.ledger.record(name, key, **values)
        r.ran += ran
        r.skipped += skipped
        if error is not None:
            r.echo(f"  ! {v.name} failed: {error}; variants already running finish, and every finished stage is kept")
            failed = failed or error
            continue
        for _ in range(3):  # quantize (or search), engine, gate
            step(None)
        outcomes.append(outcome)
    if failed is not None:
        raise failed
    return outcomes


def _variant_task(
    spec: PipelineSpec,
    name: str,
    base: Artifact,
    calib: Artifact,
    shadow: Artifact,
    profile: Artifact,
    cache_dir: Path,
    workdir: Path,
) -> tuple[dict | None, list, list, list, Exception | None]:
    """One variant's chain in a Ray worker: (outcome, ledger records, stages run, stages skipped, None), or, when it
    fails, (None, the stages it finished, ..., its error): the driver records them before raising the error."""
    from qgate.progress import console_err, quiet_console

    v = next(x for x in spec.variants if x.name == name)
    quiet_console(Path(workdir) / "logs" / WORKER_LOG)  # libraries' output to the log; Ray forwards only qgate's lines
    err = console_err()
    r = Runner(spec, lambda m: print(f"[{name}] {m}", file=err, flush=True), workdir=workdir, persist_ledger=False)
    try:
        outcome = variant_chain(r, spec, v, base, calib, shadow, profile, cache_dir)
    except Exception as e:  # noqa: BLE001  returned, not raised: the stages before it are recorded by the driver
        import traceback

        traceback.print_exc()  # into the worker log, where the libraries' output is
        return None, r.ledger.recorded, r.ran, r.skipped, _portable(e)
    return outcome, r.ledger.recorded, r.ran, r.skipped, None


def _portable(e: Exception) -> Exception:
    """The error itself when it survives the trip to the driver (a pickle round trip), else a QgateError with its
    type and message: an exception whose class takes other arguments must not lose the stages returned beside it."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001  any pickling failure: the message still reaches the driver
        return QgateError(f"{type(e).__name__}: {e}")


def variant_chain(
    r: Runner,
    spec: PipelineSpec,
    v: VariantSpec,
    base: Artifact,
    calib: Artifact,
    shadow: Artifact,
    profile: Artifact,
    cache_dir: Path,
    step: Callable[[Artifact], Artifact] = lambda a: a,
) -> dict:
    """Quantize (or search), build the engine, gate: one variant's outcome."""
    from qgate.engines.build import build_engine, engine_config, unsupported
    from qgate.gates.run import run_gates
    from qgate.quantize.run import CalibOptions, quantize
    from qgate.quantize.schemes import KVCacheConfig, scheme_config, smooths
    from qgate.quantize.smoothing import cached_smoothing

    w = r.workdir
    gate_cfg = spec.gate_config()
    gate_key = typed_config(gate_cfg)  # every gate setting, defaults included
    if gate_cfg.eval is not None:  # and the shipped eval data: a larger task set re-gates
        from qgate.gates.evalgate import TASK_DIR

        gate_key = {"cfg": gate_key, "tasks": sha256_tree(TASK_DIR)}
    opts = CalibOptions(**spec.quantize.model_dump())
    scheme = scheme_config(v.scheme, **v.options)
    kv = KVCacheConfig(v.kv_cache) if v.kv_cache else None
    key = {
        "base": base.sha256,
        "calib": calib.sha256,
        "scheme": typed_config(scheme),
        "kv": v.kv_cache,
        "opts": opts.__dict__,
    }
    if v.search is not None:  # the checkpoint is the smallest point that passed the shadow gate
        ckpt = step(search_stage(r, spec, v, base, calib, shadow, cache_dir))
    else:
        ckpt = step(
            r.stage(
                f"quantize:{v.name}",
                key,
                w / "variants" / v.name / "checkpoint",
                lambda out: quantize(
                    base,
                    calib,
                    scheme,
                    out,
                    kv=kv,
                    opts=opts,
                    smoothed=cached_smoothing(base, calib, scheme, opts, cache_dir, r.echo)
                    if smooths(scheme, kv)
                    else None,
                ),
            )
        )
    cand, notes = ckpt, ()
    why = unsupported(ckpt, v.engine.backend) if v.engine is not None else None
    if why:
        notes = (f"engine {v.engine.backend} not built: {why}; gated on the PyTorch reference path",)
        r.echo(f"  ! {v.name}: {notes[0]}")
    elif v.engine is not None:
        ecfg = typed_config(engine_config(v.engine.backend, **v.engine.options))
        key = {"ckpt": ckpt.sha256, "engine": [v.engine.backend, ecfg], "profile": profile.sha256}
        cand = r.stage(
            f"engine:{v.name}",
            key,
            w / "variants" / v.name / "engine",
            lambda out: build_engine(ckpt, v.engine.backend, out, profile, **v.engine.options),
        )
    step(cand)
    key = {"cand": cand.sha256, "base": base.sha256, "shadow": shadow.sha256, "gates": gate_key} | (
        {"notes": notes} if notes else {}
    )
    report = step(
        r.stage(
            f"gate:{v.name}",
            key,
            w / "variants" / v.name / "gate",
            lambda out: run_gates(
                cand, base, shadow, gate_cfg, out, cache_dir, name=v.name, checkpoint=ckpt, notes=notes
            ),
        )
    )
    return {"variant": v.name, "candidate": cand, "report": report, "recipe": recipe(v)}


def register_outcomes(r: Runner, spec: PipelineSpec, outcomes: list[dict], profile: Artifact) -> str:
    """Register every gated variant (idempotent: the registry finds a version registered before a kill). Returns the URI."""
    from qgate.registry.mlflow_store import register, tracking_uri

    store = spec.path(spec.registry.store)
    uri = tracking_uri(store)
    for o in outcomes:
        key = sha256_json(
            {"report": o["report"].sha256, "uri": uri, "name": spec.registry.model_name, "profile": profile.sha256}
        )
        rec = r.ledger.lookup(f"register:{o['variant']}", key)
        if rec:
            o["version"] = rec["version"]
            r.echo(f"  = register:{o['variant']}: already v{o['version']}")
        else:
            o["version"] = register(
                o["report"], o["candidate"], spec.registry.model_name, store, profile=profile, recipe=o["recipe"]
            )
            r.ledger.record(
                f"register:{o['variant']}",
                key,
                version=o["version"],
                paths=[str(o["report"].path)],
                sha256=o["report"].sha256,
            )
            r.echo(f"  + register:{o['variant']}: {spec.registry.model_name} v{o['version']}")
    return uri


def best_passing(spec: PipelineSpec, outcomes: list[dict]) -> dict | None:
    passing = [o for o in outcomes if o["report"].meta["passed"]]
    kl = lambda o: o["report"].meta["summary"].get("shadow.kl_p99", float("inf"))  # noqa: E731
    if spec.promote.choose == "best":
        passing.sort(key=kl)
    elif spec.promote.choose == "smallest":
        passing.sort(key=lambda o: (o["candidate"].meta.get("weights_bytes") or float("inf"), kl(o)))
    return passing[0] if passing else None


def run_pipeline(
    spec: PipelineSpec, echo: Callable[[str], None] = print, wait: float = 0.0, parallel: str = "serial"
) -> dict:
    """Under the workdir lock: a second job on the same workdir waits `wait` seconds, then raises LockHeld (exit 1).
    parallel: "serial" (default) or "ray": traffic partitions are scanned and variants run as Ray tasks."""
    from qgate.execute import check_engine
    from qgate.locks import workdir_lock

    check_engine(parallel, ("serial", "ray"))  # variants need the resources they declare: Ray places them
    if parallel == "ray":
        placeable(spec.variants, echo)
    with workdir_lock(spec.path(spec.workdir), f"qgate run {spec.name}", wait=wait, echo=echo):
        return _run(spec, echo, parallel)


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


def _run(spec: PipelineSpec, echo: Callable[[str], None], parallel: str = "serial") -> dict:
    from qgate.gates.run import warm_baseline
    from qgate.registry.mlflow_store import promote

    r = Runner(spec, echo)
    w = r.workdir
    total = 2 + 3 * len(spec.variants) + 1  # model, calibrate; per variant quantize, engine, gate; register
    bar = _StageBar(total, f"pipeline {spec.name}")

    def step(art):
        bar.update(1)
        return art

    from qgate.calibrate.sources import list_partitions

    traffic = spec.traffic_source()
    parts = list_partitions(traffic)  # a missing traffic log fails here, not after the model's import
    base = step(model_stage(r, spec))
    calib, shadow, profile = calibrate_stage(r, spec, traffic, engine=parallel, parts=parts)
    step(calib)
    gate_cfg = spec.gate_config()
    echo("  > baseline references and noise floor (cached per baseline) ...")
    t = time.perf_counter()
    floor = warm_baseline(
        base, shadow, gate_cfg, w / "cache"
    )  # once, before any fan-out; an impossible threshold fails here
    steps = {"baseline": round(time.perf_counter() - t, 1)}
    echo(
        f"  + noise floor: KL p99 {floor['kl_p99']['observed']:.3g}, top-1 {floor['top1_agreement']['observed']:.4f} "
        f"({floor['path']}); baseline references {steps['baseline']}s"
    )
    outcomes = gate_variants(r, spec, base, calib, shadow, profile, list(spec.variants), w / "cache", step, parallel)
    t = time.perf_counter()
    uri = register_outcomes(r, spec, outcomes, profile)
    steps["register"] = round(time.perf_counter() - t, 1)
    bar.update(1)
    bar.close()
    summary = {
        "tracking_uri": uri,
        "model_name": spec.registry.model_name,
        "workdir": str(w),
        "stage_seconds": r.seconds(),
        "step_seconds": steps,
        "stages_run": r.ran,
        "stages_skipped": r.skipped,
        "variants": [_variant_summary(o) for o in outcomes],
        "promoted": None,
    }
    chosen = best_passing(spec, outcomes)
    if chosen is None:
        (w / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        raise PromotionRefused(
            f"no variant passed its gates: {', '.join(o['variant'] for o in outcomes)}",
            hint=f"see the reports under {w / 'variants'}",
        )
    store = spec.path(spec.registry.store)
    summary["promoted"] = promote(spec.registry.model_name, chosen["version"], spec.promote.alias, store) | {
        "variant": chosen["variant"]
    }
    (w / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _variant_summary(o: dict) -> dict:
    s = o["report"].meta["summary"]
    meta = o["report"].meta
    report = json.loads((o["report"].path / "report.json").read_text())
    checks = [
        {k: r[k] for k in ("gate", "metric", "verdict", "observed", "ci", "n", "mde", "n_to_decide")}
        | {"caveat": r["evidence"].get("caveat")}
        for r in report["results"]
        if r["threshold"] is not None
    ]
    return {
        "variant": o["variant"],
        "version": o.get("version"),
        "passed": meta["passed"],
        "verdict": meta["verdict"],
        "failed_checks": meta.get("failed", []),
        "inconclusive_checks": meta.get("inconclusive", []),
        "stopped": report.get("stopped"),  # gates.stop_on_fail: what was not run, after which failures
        "checks": checks,
        "report": str(o["report"].path / "report.html"),
        "kl_p99": s.get("shadow.kl_p99"),
        "top1_agreement": s.get("shadow.top1_agreement"),
        "metrics": s,
        "weights_bytes": o["candidate"].meta.get("weights_bytes"),
        "bits_per_weight": _bits_per_weight(o["candidate"]),
        "search": _search_summary(o["candidate"].meta.get("search")),
        "backend": o["candidate"].meta.get("backend", "torch-reference"),
    }


def _bits_per_weight(candidate: Artifact) -> float | None:
    """From the manifest; for checkpoints made before it recorded the figure, measured from the checkpoint's files."""
    from qgate.quantize.run import linear_size

    if candidate.meta.get("bits_per_weight") is not None:
        return candidate.meta["bits_per_weight"]
    ckpt = Path(candidate.meta.get("checkpoint_path") or candidate.path)
    return linear_size(ckpt)["bits_per_weight"] if ckpt.is_dir() and candidate.meta.get("scheme") else None


def _search_summary(search: dict | None) -> dict | None:
    if not search:
        return None
    out = {
        k: search[k]
        for k in (
            "found",
            "chosen_k",
            "layers_total",
            "points_tried",
            "gate_runs",
            "seconds",
            "bits_per_weight",
            "fallback_bits",
        )
    }
    return out | {
        "smoothing_seconds": search.get("smoothing_seconds"),
        "sensitivity_seconds": (search.get("sensitivity") or {}).get("seconds"),
        "point_seconds": [p.get("seconds") for p in search.get("points", [])],
    }
