"""`qgate calibrate`: sample calibration and shadow sets from traffic; measure drift between profiles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qgate.calibrate.sample import SampleConfig
from qgate.cli.options import Executor, OutDir, flag

app = typer.Typer(no_args_is_help=True, help="Calibration sets from production traffic logs.")
_D = SampleConfig()


@app.command("sample")
def sample_cmd(
    traffic: Annotated[
        str,
        typer.Option(
            "--traffic",
            help="Traffic: a JSONL/Parquet file, a quoted glob, a directory of "
            "partitions, or a URI such as s3://bucket/logs/.",
        ),
    ],
    out: OutDir,
    calib_size: Annotated[int, typer.Option(help="Calibration prompts.")] = _D.calib_size,
    shadow_size: Annotated[int, typer.Option(help="Held-out shadow prompts (disjoint).")] = _D.shadow_size,
    search_size: Annotated[
        int,
        typer.Option(help="Held-out prompts a search chooses its point on (disjoint from both; 0: no search split)."),
    ] = _D.search_size,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = _D.seed,
    max_reject_fraction: Annotated[
        float, typer.Option(help="Fail when more of the records than this are rejected (see rejects.jsonl).")
    ] = _D.max_reject_fraction,
    min_words: Annotated[
        int, typer.Option(help="Drop prompts with fewer words (counted as too short).")
    ] = _D.min_words,
    max_line_bytes: Annotated[
        int, typer.Option(help="Reject longer JSONL lines without reading them.")
    ] = _D.max_line_bytes,
    executor: Executor = "serial",
    scan_cache: Annotated[
        Path | None,
        typer.Option(
            help="Keep each partition's scan here; a later run reuses the scans of "
            "partitions unchanged since (same size and modification time) and removes the ones it did not use."
        ),
    ] = None,
    held_from: Annotated[
        Path | None,
        typer.Option(
            help="A checkpoint or engine to be gated on this sample: the shadow split passes over the requests it "
            "was made with, its calibration set's and its search's (as a drift job does for production)."
        ),
    ] = None,
) -> None:
    """Stratified, deduplicated, PII-scrubbed calibration + shadow split with a traffic profile."""
    from qgate.artifact import Artifact, build_atomically
    from qgate.calibrate.sample import sample_traffic
    from qgate.naming import build_config

    held = _calibration_requests(held_from) if held_from else ()

    values = dict(calib_size=calib_size, shadow_size=shadow_size, search_size=search_size, seed=seed)
    values |= dict(max_reject_fraction=max_reject_fraction, min_words=min_words, max_line_bytes=max_line_bytes)
    cfg = build_config(SampleConfig, values, "calibrate", field_name=flag)
    kept = Path(out).with_name(f"{Path(out).name}.rejects.jsonl")  # the evidence of a failed run: `out` is not made
    build_atomically(
        out,
        lambda tmp: sample_traffic(
            traffic,
            tmp,
            cfg,
            executor=executor,
            scan_cache=scan_cache,
            picture=True,
            failed_rejects=kept,
            field_name=flag,
            held_from=held,
        )["calib"],
    )
    arts = {
        name: Artifact.load(Path(out) / name)
        for name in ("calib", "shadow", "profile") + (("search",) if search_size else ())
    }
    for line in _summary(arts, Path(out) / "rejects.jsonl"):
        typer.echo(line)
    typer.echo(f"picture of the traffic: {Path(out) / 'profile.png'}")


_TABLE_ROWS = 20
_REASONS = 3


def _calibration_requests(path: Path) -> tuple[str, ...]:
    """The requests a checkpoint or engine records it was made with (gates/held_out.made_with: its calibration set's
    and its search's; none for one made without data)."""
    from qgate.artifact import Artifact
    from qgate.errors import InputError
    from qgate.gates.held_out import made_with, unrecorded

    art = Artifact.load(path, ("checkpoint", "engine"))
    if unrecorded(art):
        raise InputError(
            f"{path}: --held-from: this {art.kind} records no calibration requests (it was quantized before qgate "
            "recorded them), so the shadow split cannot pass over them",
            hint="quantize it again with this qgate, or drop --held-from: the gate then scores every shadow request "
            "and its report says the overlap was not checked",
        )
    return tuple(sorted(made_with(art)))


def _reasons(rejects: Path, rejected: int) -> list[str]:
    """The commonest reasons in rejects.jsonl, one line each with its count: what a reader of the summary needs first
    (a whole kind of request left out, say), without opening the file. Turn and call numbers are folded into `[i]`."""
    import re
    from collections import Counter

    if not rejected or not rejects.is_file():
        return []
    with rejects.open() as f:
        counts = Counter(re.sub(r"\[\d+\]", "[i]", json.loads(line)["reason"]) for line in f)
    more = len(counts) - _REASONS
    return [f"  {n:,} rejected: {why}" for why, n in counts.most_common(_REASONS)] + (
        [f"  ... and {more} more reasons" if more > 1 else "  ... and 1 more reason"] if more > 0 else []
    )


def _summary(arts: dict, rejects: Path) -> list[str]:
    """What a sampling run read and kept: counts (saying which are estimates), each artifact, and the strata."""
    calib, shadow = arts["calib"].meta, arts["shadow"].meta
    stats, est = calib["stats"], calib["estimates"]
    unique = est["unique_prompts"]
    lines = [
        f"read {stats.get('records', 0):,} records: {stats.get('rejected', 0):,} rejected (see {rejects}), "
        f"{stats.get('too_short', 0):,} too short, {stats.get('duplicates', 0):,} duplicates"
        + ("" if unique["exact"] else " (estimated)")
        + (f"; {tools:,} read use tools" if (tools := stats.get("tool_use")) else ""),
        *_reasons(rejects, stats.get("rejected", 0)),
        f"unique prompts: {unique['value']:,}"
        + (
            ""
            if unique["exact"]
            else f", an HLL estimate ({unique['lower']:,.0f}-{unique['upper']:,.0f} at 2 "
            f"standard deviations); {len(est['strata_estimated'])} strata counted by their sketches"
        ),
    ]
    width = max(len(str(a.path)) for a in arts.values())
    for name, art in arts.items():
        what = (
            f"{art.meta['requests']:,} requests profiled"
            if name == "profile"
            else f"{art.meta['n']:,} prompts in {len(art.meta['strata'])} strata"
        )
        lines.append(f"{name:8s} {str(art.path):{width}s}  {what:28s} sha256 {art.sha256[:16]}")
    if held := shadow.get("held_from"):
        lines.append(
            f"shadow   passes over the {held['requests']:,} requests --held-from was made with "
            f"({held['in_other_splits']:,} of them are in the other splits)"
        )
    strata = sorted(set(calib["strata"]) | set(shadow["strata"]), key=lambda s: (-calib["strata"].get(s, 0), s))
    lines.append(f"  {'stratum (route|words)':32s} {'calib':>6s} {'shadow':>6s}")
    for s in strata[:_TABLE_ROWS]:
        lines.append(f"  {s:32s} {calib['strata'].get(s, 0):6d} {shadow['strata'].get(s, 0):6d}")
    if len(strata) > _TABLE_ROWS:
        lines.append(f"  ... {len(strata) - _TABLE_ROWS} more strata in {arts['calib'].path / 'qgate-artifact.json'}")
    return lines


@app.command("drift")
def drift_cmd(
    reference: Annotated[
        Path, typer.Option("--reference", help="Traffic-profile artifact the model was calibrated on.")
    ],
    current: Annotated[Path, typer.Option("--current", help="Traffic-profile artifact of recent traffic.")],
) -> None:
    """Compare two traffic profiles facet by facet; exit 3 when traffic moved (default limits; `qgate drift check` reads
    them from a spec and finds production's profile in the registry)."""
    from qgate.artifact import Artifact
    from qgate.calibrate.traffic_drift import DriftConfig, traffic_drift
    from qgate.errors import EXIT_DRIFT

    a, b = (
        json.loads((Artifact.load(p, "traffic-profile").path / "profile.json").read_text())
        for p in (reference, current)
    )
    rows = traffic_drift(a, b, DriftConfig())
    for r in rows:
        typer.echo(
            f"{r['facet']:10s} JS {r['js']:.4f}  limit {r['threshold']:g}  noise p99 {r['noise_p99']:.4f}  "
            f"{r['verdict'].upper()}"
        )
    if any(r["verdict"] == "drift" for r in rows):
        raise typer.Exit(EXIT_DRIFT)
