"""The pipeline spec: strict YAML, validated into typed configs. Unknown keys are errors with their path.

    spec = load_spec(Path("pipelines/promote.yaml"))
    spec.gate_config()   # GateConfig built from the `gates:` section

Relative paths in a spec are relative to the spec file's directory.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from qgate.errors import ConfigError, InputError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    hf_dir: str | None = None
    gguf_package: str | None = None
    gguf_file: str | None = None


class CalibrateSpec(_Strict):
    calib_size: int = 256
    shadow_size: int = 64
    seed: int = 0


class QuantizeSpec(_Strict):
    max_seq_length: int = 512
    max_samples: int | None = None


class EngineSpec(_Strict):
    backend: Literal["cpu", "trtllm"]
    options: dict[str, Any] = Field(default_factory=dict)


class VariantSpec(_Strict):
    name: str
    scheme: str
    options: dict[str, Any] = Field(default_factory=dict)
    kv_cache: Literal["fp8", "int8"] | None = None
    engine: EngineSpec | None = None   # None: gate the checkpoint on the PyTorch reference path

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not v or not all(c.isalnum() or c in "-_." for c in v):
            raise ValueError("variant names may use letters, digits, '-', '_' and '.' only")
        return v


class GatesSpec(_Strict):
    shadow: dict[str, Any] = Field(default_factory=dict)
    eval: dict[str, Any] | None = Field(default_factory=dict)   # null: no eval gate
    perf: dict[str, Any] = Field(default_factory=dict)


class RegistrySpec(_Strict):
    model_name: str
    store: str = ".qgate/mlflow"   # embedded SQLite store; MLFLOW_TRACKING_URI overrides


class PromoteSpec(_Strict):
    alias: str = "production"
    choose: Literal["best", "first"] = "best"   # best: passing variant with the lowest shadow kl_p99


class PipelineSpec(_Strict):
    version: Literal[1]
    name: str
    workdir: str
    model: ModelSpec
    traffic: str
    calibrate: CalibrateSpec = Field(default_factory=CalibrateSpec)
    quantize: QuantizeSpec = Field(default_factory=QuantizeSpec)
    variants: list[VariantSpec] = Field(min_length=1)
    gates: GatesSpec = Field(default_factory=GatesSpec)
    registry: RegistrySpec
    promote: PromoteSpec = Field(default_factory=PromoteSpec)
    root: Path = Path(".")   # the spec file's directory; set by load_spec

    def path(self, p: str) -> Path:
        return (self.root / p).resolve()

    def gate_config(self):
        from qgate.gates.evalgate import EvalConfig
        from qgate.gates.run import GateConfig, PerfConfig
        from qgate.gates.shadow import ShadowConfig

        ev = None if self.gates.eval is None else _build(EvalConfig, self.gates.eval, "gates.eval")
        return GateConfig(shadow=_build(ShadowConfig, self.gates.shadow, "gates.shadow"), eval=ev,
                          perf=_build(PerfConfig, self.gates.perf, "gates.perf"))


def _build(cls, data: dict, where: str):
    """A frozen dataclass config from a mapping, with the spec path in every error."""
    known = {f.name for f in fields(cls)}
    for k in data:
        if k not in known:
            import difflib

            close = difflib.get_close_matches(k, known, n=1)
            raise ConfigError(f"{where}.{k}: unknown key" + (f"; did you mean {close[0]!r}?" if close else ""),
                              hint=f"allowed: {sorted(known)}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e.message}", hint=e.hint) from e
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from e


def load_spec(path: Path) -> PipelineSpec:
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: pipeline spec not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})", hint="tags such as !function are not allowed") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a pipeline spec is a mapping at the top level")
    if "root" in data:
        raise ConfigError(f"{path}: root: unknown key")
    try:
        spec = PipelineSpec(**data, root=path.parent.resolve())
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
        raise ConfigError(f"{path}: {loc}: {msg}" + (f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else "")) from e
    _check_semantics(spec, path)
    return spec


def _check_semantics(spec: PipelineSpec, path: Path) -> None:
    """Fail at load time, not an hour in: scheme names, option names, thresholds, unique variant names."""
    from qgate.engines.build import engine_config
    from qgate.quantize.schemes import KVCacheConfig, scheme_config

    names = [v.name for v in spec.variants]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"{path}: variants: duplicate name {sorted(dup)[0]!r}")
    for i, v in enumerate(spec.variants):
        try:
            scheme_config(v.scheme, **v.options)
            if v.kv_cache:
                KVCacheConfig(v.kv_cache)
            if v.engine:
                engine_config(v.engine.backend, **v.engine.options)
        except ConfigError as e:
            raise ConfigError(f"{path}: variants[{i}] ({v.name}): {e.message}", hint=e.hint) from e
    spec.gate_config()
