"""The scheduled drift job: is production still fit for today's traffic? If not, recalibrate, gate, register, promote.

    report = drift_check(spec, "logs/2026-11-21/")  # report["verdict"]: "drift" | "no-drift"; files in <workdir>/drift/
    report["inconclusive"]                           # the traffic facets that could not tell: not drift, not shown ok
    result = drift_run(spec, "logs/2026-11-21/")    # the check, then on drift: every variant recalibrated on it

Two kinds of drift, reported side by side:
- traffic drift: the recent traffic's profile against the profile production was calibrated on (stored with its
  version);
- quality drift: production re-gated against the baseline, with the same shadow gate, on a fresh shadow sample of the
  recent traffic that passes over the requests production was calibrated on (recent logs repeat older ones). An
  inconclusive quality check counts as drift under `gates.on_inconclusive: block`.
Every step is a ledger stage or an idempotent registry call, so a killed job re-run finishes without duplicate versions.
One job per registered model at a time (locks.job_lock).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from qgate.errors import PromotionRefused
from qgate.gates.result import GateReport
from qgate.pipeline.jobs import check_gate_device, gate_variants
from qgate.pipeline.ledger import Ledger
from qgate.pipeline.spec import PipelineSpec, VariantSpec
from qgate.pipeline.stages import Chain, calibrate_stage, model_stage, register_stage, traffic_key
from qgate.pipeline.summary import best_passing


def _traffic(spec: PipelineSpec, recent: str | Path, executor: str) -> tuple[str, list]:
    """(the recent traffic's content hash, its partitions), once per job: listed once, so every stage of the job
    samples the partitions it was keyed by, and hashed on the executor, reading only the partitions the drift
    scan cache has not seen unchanged (stages.traffic_key)."""
    from qgate.calibrate.sources import list_partitions

    parts = list_partitions(recent)
    return traffic_key(spec, parts, executor, _scans(spec)), parts


def _dirs(spec: PipelineSpec, sha: str, echo) -> tuple[Ledger, Ledger]:
    """(main ledger: model import and caches shared with `qgate run`; drift ledger: one workdir per recent traffic)."""
    main = Ledger(spec.path(spec.workdir), echo)
    return main, Ledger(main.workdir / "drift" / sha[:16], echo)


def _scans(spec: PipelineSpec) -> Path:
    """Scans of recent-traffic partitions, shared by every window the drift job checks: a sliding window of
    partitions rescans (and re-hashes) only the new ones (calibrate/scan_cache.py)."""
    return spec.path(spec.workdir) / "drift" / "scans"


def drift_check(
    spec: PipelineSpec,
    recent: str | Path,
    echo: Callable[[str], None] = print,
    record: bool = True,
    wait: float = 0.0,
    executor: str = "serial",
) -> dict:
    """Traffic and quality drift of production on `recent`; under the model's drift lock (a running drift job refuses
    it). executor: how the recent traffic's partitions are hashed and scanned (execute.py)."""
    from qgate.locks import job_lock, workdir_lock

    drift_preflight(spec, recent, executor)
    sha, parts = _traffic(spec, recent, executor)
    main, _ = _dirs(spec, sha, echo)
    what = f"qgate drift check for {spec.registry.model_name}"
    with (
        job_lock(_lock_path(spec, main), what, wait=wait, echo=echo),
        workdir_lock(main.workdir, what, wait=wait, echo=echo),
    ):
        return _check(spec, recent, sha, parts, executor, echo, record)


def drift_preflight(spec: PipelineSpec, recent: str | Path, executor: str = "serial") -> None:
    """What a drift job refuses before it writes anything, its log included. A drift job watches a registered
    production version: MLflow missing, or a missing store, fails before the traffic is read; so do an unknown
    executor, a gate device this host lacks, and local recent traffic with no traffic file. Cheap: the CLI calls it
    before it opens its log, and each job again. A URI is listed by the job itself, where its log records retries."""
    from qgate.calibrate.sources import is_uri, list_partitions
    from qgate.execute import check_executor
    from qgate.registry.client import tracking_uri
    from qgate.registry.names import require_mlflow

    require_mlflow("a drift job (its production version is read from the model registry)")
    tracking_uri(spec.path(spec.registry.store), create=False, spec_key="registry.store in the spec")
    check_executor(executor)
    check_gate_device(spec)
    if not is_uri(recent):
        list_partitions(recent)


def _check(
    spec: PipelineSpec,
    recent: str | Path,
    sha: str,
    parts: list,
    executor: str,
    echo: Callable[[str], None],
    record: bool,
) -> dict:
    from qgate.calibrate.traffic_drift import traffic_drift
    from qgate.gates.gating import shadow_check
    from qgate.gates.result import caveats
    from qgate.pipeline.drift_report import write_drift_report
    from qgate.registry.evidence import production_evidence, record_drift

    cfg = spec.drift_config()
    store = spec.path(spec.registry.store)
    main, r = _dirs(spec, sha, echo)
    model = spec.registry.model_name
    prod = production_evidence(model, cfg.alias, store, main.workdir / "drift" / "production")
    echo(
        f"  production: {model} v{prod['version']} ({prod['variant']}) @{cfg.alias}, calibrated on "
        f"{prod['profile']['requests']} requests"
    )
    cal = calibrate_stage(
        r, spec, recent, executor, traffic_sha=sha, scan_cache=_scans(spec), parts=parts, held_from=_held_from(prod)
    )
    shadow, profile = cal.shadow, cal.profile
    if held := shadow.meta.get("held_from"):
        echo(
            f"  recent sample: its shadow split passes over the {held['requests']} requests production was made with "
            f"({held['in_other_splits']} of them are in its other splits)"
        )
    new = json.loads((profile.path / "profile.json").read_text())
    rows = traffic_drift(prod["profile"], new, cfg)
    for row in rows:
        echo(
            f"  traffic {row['facet']:10s} JS {row['js']:.4f}  limit {row['threshold']:g}  noise p99 "
            f"{row['noise_p99']:.4f}  {row['verdict'].upper()}" + (f" ({row['note']})" if row.get("note") else "")
        )
    reasons = [f"{x['facet']} moved (JS {x['js']:.3f} > {x['threshold']:g})" for x in rows if x["verdict"] == "drift"]
    quality = None
    if cfg.quality:
        gate_cfg = spec.gate_config()
        echo("  > quality: production vs baseline on a fresh shadow sample of the recent traffic ...")
        quality = shadow_check(prod["artifact"], model_stage(main, spec), shadow, gate_cfg, main.workdir / "cache")
        quality["gated"] = prod["gated"]
        for x in quality["results"]:
            if x["threshold"] is not None:
                then = prod["gated"].get(x["metric"])
                ci = f" [{x['ci'][0]:.4g}, {x['ci'][1]:.4g}]" if x["ci"] else ""  # defined_logits has none
                echo(
                    f"  quality {x['metric']:16s} when gated {then if then is None else f'{then:.4g}'}  recent "
                    f"{x['observed']:.4g}{ci}  threshold {x['threshold']:g}  {x['verdict'].upper()}"
                )
        for c in caveats(quality["results"]):
            echo(f"  quality caveat: {c}")
        for n in quality["notes"]:
            echo(f"  quality note: {n}")
        if not quality["passed"]:
            reasons.append(f"production's shadow gate is {quality['verdict'].upper()} on the recent traffic")
    verdict = "drift" if reasons else "no-drift"
    unsure = [x for x in rows if x["verdict"] == "inconclusive"]
    report = {
        "version": 1,
        "verdict": verdict,
        "drift": bool(reasons),
        "reasons": reasons,
        "inconclusive": [x["facet"] for x in unsure],  # not drift, and not shown ok
        "model": model,
        "alias": cfg.alias,
        "checked_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "production": {
            "version": prod["version"],
            "variant": prod["variant"],
            "recipe": prod["recipe"],
            "calibrated_requests": prod["profile"]["requests"],
            "profile_sha256": prod["profile_sha256"],
        },
        "recent": {
            "source": str(recent),
            "requests": new["requests"],
            "profile_sha256": profile.sha256,
            "shadow_sha256": shadow.sha256,
            "shadow_held_from": shadow.meta.get("held_from"),  # the requests production was made with, passed over
            "workdir": str(r.workdir),
        },
        "traffic": rows,
        "quality": quality,
        "config": spec.drift,
    }

    out = r.workdir / "report"
    write_drift_report(out, report, prod["profile"], new)
    report["report"] = str(out / "drift.html")
    if record:
        report["report_artifact"] = record_drift(model, prod["version"], out, verdict, store)
    notes = [f"{x['facet']} ({x['note']})" for x in unsure]
    echo(
        f"  = drift check: {verdict.upper()}"
        + (f" ({'; '.join(reasons)})" if reasons else "")
        + (f"; inconclusive, so not shown ok: {'; '.join(notes)}" if notes else "")
        + f"; report {out / 'drift.html'}"
    )
    return report


def _held_from(prod: dict) -> tuple[str, ...]:
    """The requests production was made with (gates/held_out.made_with: its calibration set's, and its search's):
    the recent sample's shadow split passes over them, so production is re-gated on traffic it was not fitted to, at
    the split's full size."""
    from qgate.gates.held_out import made_with

    return tuple(sorted(made_with(prod["artifact"])))


def _variants(prod: dict, spec: PipelineSpec, echo) -> list[VariantSpec]:
    """Production's own recipe first (renamed if a spec variant takes its name with another recipe), then the spec's."""
    out = list(spec.variants)
    if prod["recipe"] is None:
        echo(f"  ! production v{prod['version']} carries no recipe: recalibrating the spec's variants only")
        return out
    if any(v.recipe() == prod["recipe"] for v in out):
        return out
    name = prod["variant"] or f"production-v{prod['version']}"
    if any(v.name == name for v in out):
        name = f"production-{name}"
    return [VariantSpec(name=name, **prod["recipe"])] + out


def _lock_path(spec: PipelineSpec, main: Ledger) -> Path:
    """One lock per registered model: beside the embedded store, else (a remote server) under the workdir."""
    where = (
        main.workdir / "locks" if os.environ.get("MLFLOW_TRACKING_URI") else spec.path(spec.registry.store) / "locks"
    )
    return where / f"drift-{spec.registry.model_name}.lock"


def drift_run(
    spec: PipelineSpec,
    recent: str | Path,
    echo: Callable[[str], None] = print,
    wait: float = 0.0,
    executor: str = "serial",
) -> dict:
    """Check; on drift, recalibrate production's recipe and every spec variant on the recent traffic, gate and register
    them, then promote the best passing one (drift.auto_promote) or leave that to a person. Raises PromotionRefused when
    none passes. executor: how the recent traffic's partitions are hashed and scanned (execute.py)."""
    from qgate.locks import job_lock, workdir_lock
    from qgate.registry.mlflow_store import promote

    cfg = spec.drift_config()
    drift_preflight(spec, recent, executor)
    sha, parts = _traffic(spec, recent, executor)
    main, r = _dirs(spec, sha, echo)
    model = spec.registry.model_name
    what = f"qgate drift run for {model}"
    with (
        job_lock(_lock_path(spec, main), what, wait=wait, echo=echo),
        workdir_lock(main.workdir, what, wait=wait, echo=echo),
    ):
        report = _check(spec, recent, sha, parts, executor, echo, record=True)
        result = {"check": report, "action": "none", "promoted": None, "variants": []}
        if not report["drift"]:
            return result
        from qgate.registry.evidence import production_evidence

        prod = production_evidence(
            model, cfg.alias, spec.path(spec.registry.store), main.workdir / "drift" / "production"
        )
        variants = _variants(prod, spec, echo)
        main, r = _dirs(spec, sha, echo)  # fresh ledgers: the check has recorded its calibrate stage since
        echo(
            f"  > recalibrating {len(variants)} variant(s) on the recent traffic: {', '.join(v.name for v in variants)}"
        )
        base = model_stage(main, spec)
        cal = calibrate_stage(
            r, spec, recent, executor, traffic_sha=sha, scan_cache=_scans(spec), parts=parts, held_from=_held_from(prod)
        )
        chains = gate_variants(r, spec, Chain(base, cal, main.workdir / "cache"), variants)
        chains = [register_stage(r, spec, c) for c in chains]
        reports = [GateReport.of(c.report) for c in chains]
        result["variants"] = [
            {
                "variant": c.variant.name,
                "version": c.version,
                "verdict": g.verdict,
                "kl_p99": g.summary.get("shadow.kl_p99"),
                "report": str(c.report.path / "report.html"),
            }
            for c, g in zip(chains, reports, strict=True)
        ]
        chosen = best_passing(spec, chains)
        if chosen is None:
            (r.workdir / "result.json").write_text(json.dumps(result, indent=2, default=str))
            verdicts = ", ".join(f"{c.variant.name} {g.verdict.upper()}" for c, g in zip(chains, reports, strict=True))
            raise PromotionRefused(
                f"drift found ({'; '.join(report['reasons'])}) and no recalibrated variant passed its gates "
                f"({verdicts}); "
                f"production stays at v{prod['version']}",
                hint=f"see the reports under {r.workdir / 'variants'}",
            )
        if not cfg.auto_promote:
            result["action"] = "registered"
            result["candidate"] = {"variant": chosen.variant.name, "version": chosen.version}
            echo(
                f"  = {chosen.variant.name} v{chosen.version} passed; not promoted (drift.auto_promote: false): "
                f"qgate promote --model {model} --version {chosen.version}"
            )
        else:
            result["action"] = "promoted"
            result["promoted"] = promote(model, chosen.version, cfg.alias, spec.path(spec.registry.store)) | {
                "variant": chosen.variant.name
            }
            echo(
                f"  + promoted {chosen.variant.name} as {model} v{chosen.version} @{cfg.alias} "
                f"(previous: v{result['promoted']['previous']})"
            )
        (r.workdir / "result.json").write_text(json.dumps(result, indent=2, default=str))
        return result
