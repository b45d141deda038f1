"""One variant of a pipeline spec, and its search and engine checked against its scheme before any stage runs.

    v = VariantSpec(name="awq", scheme="awq-w4a16", engine=EngineSpec(backend="torch-int4"))
    cfg = search_config(v)      # its SearchConfig, or a ConfigError with the key path

pipeline/spec.py runs these checks at load for every variant and collects each problem; `qgate search` and the
search stage run them for the one variant they search, whose `search:` key may be absent and so unchecked at load.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from qgate.errors import ConfigError
from qgate.naming import build_config


class Strict(BaseModel):
    """A spec section: unknown keys are errors, and a loaded spec does not change."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSpec(Strict):
    backend: str  # a row of engines/build.py BACKENDS (checked at load, with a suggestion)
    options: dict[str, Any] = Field(default_factory=dict)


class VariantSpec(Strict):
    name: str
    scheme: str
    options: dict[str, Any] = Field(default_factory=dict)
    kv_cache: Literal["fp8", "int8"] | None = None
    engine: EngineSpec | None = None  # None: gate the checkpoint on the PyTorch reference path
    search: dict[str, Any] | None = None  # per-layer fallback search (search/plan.py SearchConfig); `qgate search`
    resources: dict[str, float] = Field(default_factory=dict)  # Ray task resources under `qgate run --executor ray`:
    # num_cpus, num_gpus, memory (bytes) or custom ones

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, x in v.items() if x < 0]
        if bad:
            raise ValueError(f"resources must be >= 0 ({', '.join(bad)})")
        return v

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not v or not all(c.isalnum() or c in "-_." for c in v):
            raise ValueError("variant names may use letters, digits, '-', '_' and '.' only")
        return v

    def recipe(self) -> dict:
        """How to rebuild this variant: kept with its registered version, so a drift job can re-run it."""
        return {
            "scheme": self.scheme,
            "options": dict(self.options),
            "kv_cache": self.kv_cache,
            "engine": self.engine.model_dump() if self.engine is not None else None,
        } | ({"search": dict(self.search)} if self.search is not None else {})


def search_config(v: VariantSpec, where: str = "search"):
    """The variant's SearchConfig, checked on its own and against the variant (search_fits)."""
    from qgate.search.plan import SearchConfig

    return search_fits(v, build_config(SearchConfig, v.search or {}, where), where)


def no_search_split(where: str) -> ConfigError:
    return ConfigError(
        f"{where}: its points would be chosen on the shadow split that then gates the chosen one, which flatters it",
        hint="set calibrate.search_size (e.g. 48): a held-out split of its own for the search",
    )


def search_fits(v: VariantSpec, cfg, where: str = "search"):
    """cfg, a valid SearchConfig, when the variant can be searched with it; ConfigError when its scheme has no
    per-layer fallback, or cfg's ladder does not climb from it (search/plan.py ladder_problem), or its KV cache or
    engine rule out cfg's options."""
    from qgate.pipeline.search import fine_groups_refusal
    from qgate.quantize.schemes import KVCacheConfig, scheme_config
    from qgate.search.plan import FLOAT_BITS, ladder_problem

    scheme = scheme_config(v.scheme, **v.options)
    if not hasattr(scheme, "group_size"):
        raise ConfigError(
            f"{where}: scheme {v.scheme} has no per-layer fallback", hint="search awq-w4a16 or gptq-w4a16"
        )
    if problem := ladder_problem(scheme, cfg, min(FLOAT_BITS)):  # what no host could search; the search checks its own
        why, fix = problem
        raise ConfigError(f"{where}.{why}", hint=fix)
    if reason := fine_groups_refusal(scheme, KVCacheConfig(v.kv_cache) if v.kv_cache else None, cfg):
        raise ConfigError(f"{where}: {reason}", hint="drop search.fine_group_size or the variant's kv_cache")
    from qgate.engines.build import BACKENDS, DENSE_W8

    name = v.engine.backend if v.engine else None
    int8 = [b for b in BACKENDS.names() if BACKENDS.get(b).int8_layers]
    if cfg.lm_head and (name is None or not BACKENDS.get(name).int8_layers):
        raise ConfigError(
            f"{where}.lm_head: variant {v.name} is served by {f'the {name} engine' if name else 'the reference path'}"
            ", which computes a W8A16 head in full precision: quantizing it would cost accuracy and save nothing",
            hint=f"drop search.lm_head, or serve the variant with engine backend {' or '.join(int8)}",
        )
    if cfg.fallback_bits == 8 and name is not None and not BACKENDS.get(name).int8_layers:
        raise ConfigError(
            f"{where}.fallback_bits: 8 (the default) moves layers to W8A16, and the variant's {name} engine has no "
            f"int8 kernel: it would serve them as dense weights, {DENSE_W8}",
            hint=f"set search.fallback_bits: 16, or serve the variant with engine backend {' or '.join(int8)}",
        )
    return cfg


def check_engine(v: VariantSpec, where: str, fine_group_size: int | None = None) -> None:
    """An engine the pipeline could build and gate for this variant, or a ConfigError now (engines/build.py's table
    says which backends the gates can run and which variants each refuses). A searched variant's W8 or unquantized
    layers are handled at build time: it is gated on the reference path and its report says so."""
    from qgate.engines.build import backend, refusal
    from qgate.quantize.schemes import scheme_config

    keep = "drop `engine:` to gate the checkpoint on the PyTorch reference path"
    row = backend(v.engine.backend)
    if row.runner is None:
        raise ConfigError(
            f"{where}: the gates cannot run {row.name} engines ({row.description}), so this variant could never "
            "be gated",
            hint=f"{keep}, then bundle the promoted checkpoint with `qgate engine build --backend {row.name}`",
        )
    why = refusal(row.name, v.scheme, scheme_config(v.scheme, **v.options), v.kv_cache, fine_group_size)
    if why:
        raise ConfigError(f"{where}: {why}", hint=f"{keep}, or choose {row.serves}")
