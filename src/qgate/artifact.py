"""The one manifest type that flows through every stage.

    art = Artifact.load(Path("out/calib"))     # reads out/calib/qgate-artifact.json
    art.verify()                               # recomputes the content sha256

A stage takes artifacts and returns one. Downstream code reads `kind` and `config`
from the manifest; it never re-parses a file name or guesses what a directory holds.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from qgate.errors import DiskFull, InputError, free_bytes, human_bytes

MANIFEST = "qgate-artifact.json"
UNHASHED = (MANIFEST, "build.log")  # what qgate writes about an artifact, not its content: a build log has timestamps
KINDS = ("checkpoint", "calibration-set", "traffic-profile", "engine", "gate-report")
WRITTEN_BY = {
    "checkpoint": "`qgate model import` (a baseline) or `qgate quantize` writes one",
    "calibration-set": "`qgate calibrate sample` writes its calib, shadow and search splits",
    "traffic-profile": "`qgate calibrate sample` writes it as profile/",
    "engine": "`qgate engine build` writes one",
    "gate-report": "`qgate gate` writes one",
}
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def sha256_tree(path: Path, exclude: tuple[str, ...] = UNHASHED, suffix: str = "") -> str:
    """Content hash of a file or a directory: relative paths and file bytes, in sorted order. suffix: only the files
    whose names end with it (".py": a package's source, without the bytecode its imports leave beside it)."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(suffix)):
        rel = f.relative_to(path).as_posix()
        if rel in exclude or "/.cache/" in f"/{rel}":
            continue
        h.update(rel.encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def typed_config(cfg: Any) -> dict:
    """{"type": "AWQConfig", "version": 1, "data": {...}} for a frozen dataclass config."""
    if not is_dataclass(cfg):
        raise TypeError(f"config must be a dataclass, got {type(cfg).__name__}")
    return {"type": type(cfg).__name__, "version": getattr(cfg, "VERSION", 1), "data": _jsonable(asdict(cfg))}


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


@dataclass(frozen=True)
class Artifact:
    kind: str
    path: Path
    sha256: str
    config: dict
    parents: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)  # facts measured by the stage (sizes, counts, timings)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"artifact kind {self.kind!r} is not one of {KINDS}")

    @classmethod
    def create(
        cls, kind: str, path: Path, config: dict, parents: tuple[str, ...] = (), meta: dict | None = None
    ) -> Artifact:
        """Hash `path`'s content and write its manifest beside it."""
        path = Path(path).resolve()
        art = cls(kind, path, sha256_tree(path), config, tuple(parents), dict(meta or {}))
        art.save()
        return art

    def save(self) -> None:
        target = self.path / MANIFEST if self.path.is_dir() else self.path.with_name(self.path.name + ".qgate.json")
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["path"] = str(self.path)
        data["parents"] = list(self.parents)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
        os.replace(tmp, target)

    @classmethod
    def load(cls, path: Path, kind: str | tuple[str, ...] | None = None) -> Artifact:
        """The artifact whose manifest is in (or, for a file, beside) `path`; InputError unless it is one of `kind`."""
        path = Path(path)
        if not path.exists():
            raise InputError(
                f"{path}: no such file or directory",
                hint="check the path: pass a directory written by a qgate stage, or import a model with "
                "`qgate model import`",
            )
        manifest = path / MANIFEST if path.is_dir() else path.with_name(path.name + ".qgate.json")
        if not manifest.exists():
            raise InputError(
                f"{path}: no qgate manifest ({manifest.name}) found",
                hint="pass a directory written by a qgate stage, or import a model with `qgate model import`",
            )
        try:
            data = json.loads(manifest.read_text())
            art = cls(
                kind=data["kind"],
                path=path.resolve(),
                sha256=data["sha256"],
                config=data["config"],
                parents=tuple(data.get("parents", ())),
                meta=data.get("meta", {}),
            )
        except (json.JSONDecodeError, KeyError, ValueError) as e:
            raise InputError(f"{manifest}: unreadable manifest ({e})", hint="re-run the stage that wrote it") from e
        kinds = (kind,) if isinstance(kind, str) else kind
        if kinds is not None and art.kind not in kinds:
            raise InputError(
                f"{path}: expected {' or '.join(map(_a, kinds))} artifact, found {_a(art.kind)}",
                hint="; ".join(f"{k}: {WRITTEN_BY[k]}" for k in kinds),
            )
        return art

    def verify(self) -> None:
        actual = sha256_tree(self.path)
        if actual != self.sha256:
            raise InputError(
                f"{self.path}: content changed since qgate wrote it (sha256 {actual[:12]} != manifest "
                f"{self.sha256[:12]})",
                hint="re-run the stage that produced it; do not edit artifacts in place",
            )


def served_bytes(meta: dict) -> int | None:
    """The bytes of the weights an artifact serves, from its manifest's meta: an engine that stores its own (the cpu
    engine's ONNX files, the torch-int4 engine's packed file) records them as `engine_bytes`; a checkpoint, and a
    TensorRT-LLM bundle, which serves the checkpoint it holds, as the checkpoint's safetensors (`weights_bytes`).
    None when neither is known."""
    return meta.get("engine_bytes") or meta.get("weights_bytes")


def engine_checkpoint(engine: Artifact) -> Artifact | None:
    """The checkpoint an engine was built from, as its manifest records it; None if gone or changed."""
    path = engine.meta.get("checkpoint_path")
    if not path or not Path(path).exists():
        return None
    ckpt = Artifact.load(Path(path), "checkpoint")
    return ckpt if ckpt.sha256 == engine.meta.get("checkpoint") else None


def _disk_full(out: Path, tmp: Path) -> DiskFull:
    """The one-line error of a stage whose output filled the disk; `tmp`, its partial output, is removed first."""
    import shutil

    written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) if tmp.exists() else 0
    shutil.rmtree(tmp, ignore_errors=True)
    free = free_bytes(out.parent)
    return DiskFull(
        f"{out}: the disk filled after {human_bytes(written)} of this output were written (removed, nothing kept); "
        f"{'an unknown amount' if free is None else human_bytes(free)} free there now, and the output needs more "
        f"than {human_bytes(written)}: free space or point the workdir at a larger disk, then run again"
    )


def _check_replaceable(out: Path) -> None:
    """`out` may be replaced only when it is absent, an empty directory, or an output qgate wrote (a manifest in it or
    in a directory up to two levels below): a mistyped output path must never remove a user's files."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink():
        marks = (MANIFEST, f"*/{MANIFEST}", f"*/*/{MANIFEST}", "*.qgate.json", "*/*.qgate.json")
        if next(out.iterdir(), None) is None or any(next(out.glob(m), None) for m in marks):
            return
    what = "a file" if out.is_file() else "a link" if out.is_symlink() else "a directory that no qgate stage wrote"
    raise InputError(
        f"{out}: the output path is {what}; it is left as it is, and nothing was built",
        hint="choose a new output path, or one a qgate stage wrote before (it is replaced as a whole)",
    )


def build_atomically(out: Path, fn) -> Artifact:
    """Run `fn(tmp)`, which writes a stage's whole output under `tmp` and returns its artifact (at `tmp` or below),
    then rename `tmp` to `out`. A stage killed at any moment leaves either the previous complete `out` or none,
    never a half-written one; the leftover temporary directory is removed by the next build into `out`. An `out` that
    holds anything but a qgate output is refused before `fn` runs (InputError), as is one that cannot be written.
    Returns the artifact reloaded from its place under `out`."""
    import shutil

    out = Path(out).absolute()
    _check_replaceable(out)
    for stale in [*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")]:  # a killed build's
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:  # the parent can hold this build's temporary directory: made and removed here, before `fn` runs
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        tmp.rmdir()
    except OSError as e:
        above = next((p for p in out.parents if p.exists()), None)  # a file where a directory must be, or a refusal
        why = f"{above} is not a directory" if above is not None and not above.is_dir() else e.strerror
        raise InputError(
            f"{out}: cannot write an output there: {why}",
            hint="choose an output path on a disk this user can write",
        ) from None
    try:
        try:
            art = fn(tmp)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise _disk_full(out, tmp) from e
        rel = Path(art.path).resolve().relative_to(tmp.resolve())
        for m in list(tmp.rglob(MANIFEST)) + list(tmp.rglob("*.qgate.json")):  # manifests name their final place
            data = json.loads(m.read_text())
            final = (
                out / m.parent.relative_to(tmp)
                if m.name == MANIFEST
                else out / m.relative_to(tmp).with_name(m.name[: -len(".qgate.json")])
            )
            data["path"] = str(final)
            m.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            out.rename(old)  # killed here: `out` is missing, and the next run rebuilds it
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Artifact.load(out / rel)


def _a(noun: str) -> str:
    """'a checkpoint', 'an engine'."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"
