"""The pipeline spec: strict YAML, validated into typed configs. Unknown keys are errors with their path.

    spec = load_spec(Path("pipelines/promote.yaml"))
    spec.gate_config()    # GateConfig built from the `gates:` section
    spec.drift_config()   # DriftConfig built from the `drift:` section

Relative paths in a spec are relative to the spec file's directory.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, create_model

from qgate.calibrate.sample import SampleConfig
from qgate.errors import ConfigError, InputError, config_problems
from qgate.gates.result import OnInconclusive
from qgate.naming import build_config, key_path, suggest
from qgate.pipeline.strict_yaml import load_yaml
from qgate.pipeline.variant import (
    Strict,
    VariantSpec,
    check_engine,
    no_search_split,
    search_config,
    search_fits,
)
from qgate.quantize.compress import CalibOptions


class ModelSpec(Strict):
    hf_dir: str | None = None
    gguf_package: str | None = None
    gguf_file: str | None = None


def _section(config: type, name: str) -> type[Strict]:
    """A strict spec section with exactly the fields, types and defaults of the frozen dataclass `config`: the
    stage's own config is where a setting is defined and documented; its range checks run when the spec loads."""
    import dataclasses

    hints = typing.get_type_hints(config)
    fields = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(config)}
    return create_model(
        name, __base__=Strict, __doc__=f"`{name}` fields: {config.__module__}.{config.__name__}", **fields
    )


CalibrateSpec = _section(SampleConfig, "CalibrateSpec")
QuantizeSpec = _section(CalibOptions, "QuantizeSpec")


class GatesSpec(Strict):
    """Each section is its gate's config (gates/*.py), built by gate_config(); an unset scalar takes GateConfig's
    default (gates/gating.py), which is where each one is defined and documented."""

    contract: dict[str, Any] = Field(default_factory=dict)
    shadow: dict[str, Any] = Field(default_factory=dict)
    eval: dict[str, Any] | None = Field(default_factory=dict)  # null: no eval gate
    long_context: dict[str, Any] | None = Field(default_factory=dict)  # null: the served context is not probed
    perf: dict[str, Any] = Field(default_factory=dict)
    parity: dict[str, Any] = Field(default_factory=dict)
    on_inconclusive: OnInconclusive | None = None
    score_anyway: bool | None = None
    stop_on_fail: bool | None = None
    device: str | None = None
    dtype: str | None = None


_GATE_SCALARS = ("on_inconclusive", "score_anyway", "stop_on_fail", "device", "dtype")


class RegistrySpec(Strict):
    model_name: str
    store: str = ".qgate/mlflow"  # embedded SQLite store; MLFLOW_TRACKING_URI overrides


class PromoteSpec(Strict):
    alias: str = "production"
    choose: Literal["best", "smallest", "first"] = "best"  # best: passing variant with the lowest shadow kl_p99;
    # smallest: the fewest bytes of served weights, an engine's own files (ties: lower kl_p99)


class PipelineSpec(Strict):
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
    drift: dict[str, Any] = Field(default_factory=dict)  # `qgate drift`: see calibrate/traffic_drift.py DriftConfig
    root: Path = Path(".")  # the spec file's directory; set by load_spec

    def path(self, p: str) -> Path:
        return (self.root / p).resolve()

    def variant(self, name: str) -> VariantSpec:
        """The variant called `name`; ConfigError naming the spec's variants, with the closest, otherwise."""
        names = [v.name for v in self.variants]
        if name not in names:
            raise ConfigError(
                f"variant {name!r} is not in the spec{suggest(name, names)}", hint=f"variants: {', '.join(names)}"
            )
        return self.variants[names.index(name)]

    def traffic_source(self, traffic: str | None = None) -> str:
        """The traffic to sample: an object-store URI as written, a local path relative to the spec file."""
        from qgate.calibrate.sources import is_uri

        t = traffic if traffic is not None else self.traffic
        return t if is_uri(t) else str(self.path(t))

    def gate_config(self):
        from qgate.gates.contract import ContractConfig
        from qgate.gates.evalgate import EvalConfig
        from qgate.gates.gating import GateConfig
        from qgate.gates.longctx import LongContextConfig
        from qgate.gates.parity import ParityConfig
        from qgate.gates.perf import PerfConfig
        from qgate.gates.shadow import ShadowConfig

        lc = self.gates.long_context
        if lc is not None and lc.get("documents"):  # relative to the spec file, like every path in it
            lc = lc | {"documents": str(self.path(lc["documents"]))}
        sections = {
            "contract": (ContractConfig, self.gates.contract),
            "shadow": (ShadowConfig, self.gates.shadow),
            "eval": (EvalConfig, self.gates.eval),  # None: no eval gate
            "long_context": (LongContextConfig, lc),  # None: the served context is not probed
            "perf": (PerfConfig, self.gates.perf),
            "parity": (ParityConfig, self.gates.parity),
        }
        built, problems = {}, []
        for name, (cls, data) in sections.items():
            try:
                built[name] = None if data is None else build_config(cls, data, f"gates.{name}")
            except ConfigError as e:
                problems.append(e)
        if problems:
            raise config_problems(problems)
        cfg = GateConfig(**built, **{k: v for k in _GATE_SCALARS if (v := getattr(self.gates, k)) is not None})
        idle = cfg.behaviour_thresholds()
        if all(idle.values()):
            reasons: dict[str, list[str]] = {}
            for name, why in idle.items():
                reasons.setdefault(why, []).append(name)
            raise ConfigError(
                "gates: no check of the candidate's behaviour against the baseline's has a threshold that decides it ("
                + "; ".join(f"{', '.join(names)}: {why}" for why, names in reasons.items())
                + "), so a PASS would say only that the serving contract holds",
                hint="set at least one, such as gates.shadow.kl_p99_max: 0.5; to measure before choosing thresholds, "
                "set a loose one (gates.shadow.kl_mean_max: 10) and read the report's observed values and intervals",
            )
        return cfg

    def on_device(self, device: str | None) -> PipelineSpec:
        """This spec with gates.device set (the CLI's --device); unchanged for None."""
        if device is None:
            return self
        from qgate.device import check_device

        check_device(device, "--device")
        return self.model_copy(update={"gates": self.gates.model_copy(update={"device": device})})

    def drift_config(self):
        from qgate.calibrate.traffic_drift import DriftConfig

        return build_config(DriftConfig, self.drift, "drift")


def check_search(spec: PipelineSpec, name: str):
    """The SearchConfig `qgate search` runs variant `name` with, before any stage: a variant without a `search:` key
    is searched with the defaults, which loading the spec does not check. ConfigError as load_spec would give it."""
    v = spec.variant(name)  # an unknown name fails here, with the names there are
    where = key_path("variants", spec.variants.index(v), "search")
    try:
        if not spec.calibrate.search_size:
            raise no_search_split(where)
        return search_config(v, where)
    except ConfigError as e:
        raise ConfigError(f"{e.message} (variant {name})", hint=e.hint) from None


def _fields_at(loc: tuple) -> list[str]:
    """The keys the spec allows at `loc` (a pydantic error location), for did-you-mean suggestions."""
    model: Any = PipelineSpec
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        todo, model = [field.annotation], None
        while todo:  # unwrap Optional[...] and list[...] down to a model class
            t = todo.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                model = t
                break
            todo += list(typing.get_args(t))
    return sorted(n for n in model.model_fields if n != "root") if model else []


def _pydantic_error(path: Path, e: ValidationError) -> ConfigError:
    """Every problem pydantic found, each with its key path; an unknown key first, since it often explains a missing
    one (a misspelt key is both)."""
    problems = []
    for err in sorted(e.errors(), key=lambda x: x["type"] != "extra_forbidden"):
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            allowed = _fields_at(loc[:-1])
            msg, hint = f"unknown key{suggest(str(loc[-1]), allowed)}", f"allowed: {', '.join(allowed)}"
        else:
            got = err.get("input")
            shown = err["type"] != "missing" and isinstance(got, str | int | float | bool)
            msg, hint = err["msg"] + (f" (got {got!r})" if shown else ""), None
        problems.append(ConfigError(f"{key_path(*loc)}: {msg}", hint=hint))
    return config_problems(problems, f"{path}: ")


def load_spec(path: Path) -> PipelineSpec:
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: pipeline spec not found")
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a pipeline spec is a mapping at the top level")
    if "root" in data:
        raise ConfigError(f"{path}: root: unknown key")
    try:
        spec = PipelineSpec(**data, root=path.parent.resolve())
    except ValidationError as e:
        raise _pydantic_error(path, e) from e
    problems = _check_semantics(spec)
    if problems:
        raise config_problems(problems, f"{path}: ")
    return spec


def _unpassable_splits(spec: PipelineSpec, gates) -> list[ConfigError]:
    """A gated KL quantile that the split it is scored on is too small to pass (gates/shadow.unpassable_quantiles):
    the shadow split's gates under on_inconclusive: block, and a searched variant's points, which count only if
    they pass."""
    from qgate.gates.shadow import more_positions_hint, unpassable_quantiles

    splits = {"shadow_size": spec.calibrate.shadow_size} if gates.on_inconclusive == "block" else {}
    if spec.calibrate.search_size and any(v.search is not None for v in spec.variants):
        splits["search_size"] = spec.calibrate.search_size
    return [
        ConfigError(
            f"{why} (calibrate.{key}: {n}): such a check can fail but never pass",
            hint=more_positions_hint(f"calibrate.{key}"),
        )
        for key, n in splits.items()
        for why in unpassable_quantiles(gates.shadow, n)
    ]


def _check_semantics(spec: PipelineSpec) -> list[ConfigError]:
    """Fail at load time, not an hour in: scheme names, option names, thresholds, unique variant names. Every section
    and every variant is checked, so one load reports each problem, not only the first."""
    from qgate.engines.build import engine_config
    from qgate.quantize.schemes import KVCacheConfig, scheme_config
    from qgate.registry.names import name_problems
    from qgate.search.plan import SearchConfig

    problems: list[ConfigError] = []

    def check(fn: Callable[[], object], into: list[ConfigError] = problems) -> object:
        """fn's value, or None with its ConfigError kept `into`."""
        try:
            return fn()
        except ConfigError as e:
            into.append(e)
            return None

    check(lambda: build_config(SampleConfig, spec.calibrate.model_dump(), "calibrate"))  # sizes, reject limit
    check(lambda: CalibOptions(**spec.quantize.model_dump()))
    names = [v.name for v in spec.variants]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        problems.append(ConfigError(f"variants: duplicate name {sorted(dup)[0]!r}"))
    for i, v in enumerate(spec.variants):
        found: list[ConfigError] = []
        at = functools.partial(key_path, "variants", i)
        parts = [  # independent of each other: each one's problems are reported
            check(lambda v=v: scheme_config(v.scheme, where=at("options"), **v.options), found),
            check(lambda v=v: KVCacheConfig(v.kv_cache), found) if v.kv_cache else True,
            check(lambda v=v: engine_config(v.engine.backend, where=at("engine", "options"), **v.engine.options), found)
            if v.engine
            else True,
        ]
        searched = v.search is not None
        own = check(lambda v=v: build_config(SearchConfig, v.search, at("search")), found) if searched else True
        if searched and not spec.calibrate.search_size:
            found.append(no_search_split(at("search")))
        if all(p is not None for p in (*parts, own)):  # what needs the parts above to be valid
            search = check(lambda v=v, own=own: search_fits(v, own, at("search")), found) if searched else True
            if v.engine and search is not None:
                fine = search.fine_group_size if searched else None
                check(lambda v=v, fine=fine: check_engine(v, at("engine"), fine), found)
        for e in found:
            for p in e.problems:
                msg = p.message if p.message.startswith("variants[") else f"{key_path('variants', i)}: {p.message}"
                problems.append(ConfigError(f"{msg} (variant {v.name})", hint=p.hint))
    gates = check(spec.gate_config)
    if gates is not None:
        problems += _unpassable_splits(spec, gates)
    check(spec.drift_config)
    alias = spec.drift.get("alias")
    problems += name_problems(
        model_name=spec.registry.model_name,
        alias=spec.promote.alias,
        where={"model name": "registry.model_name", "alias": "promote.alias"},
    ) + (name_problems(alias=alias, where={"alias": "drift.alias"}) if isinstance(alias, str) else [])
    return problems
