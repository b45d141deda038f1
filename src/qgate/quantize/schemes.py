"""One frozen config per quantization scheme, found by name.

    cfg = scheme_config("gptq-w4a16", group_size=64)   # GPTQConfig(num_bits=4, group_size=64, ...)
    modifiers = cfg.modifiers(kv=KVCacheConfig("fp8"))  # llm-compressor recipe, as data

Each config validates in __post_init__ and raises ConfigError with the key at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from qgate.errors import ConfigError, check_each
from qgate.naming import Registry, build_config

DEFAULT_IGNORE = ("lm_head",)


@dataclass(frozen=True)
class KVCacheConfig:
    dtype: str  # "fp8" (E4M3, per-tensor static scales) or "int8" (symmetric per-tensor)
    VERSION: ClassVar[int] = 1

    def __post_init__(self):
        if self.dtype not in ("fp8", "int8"):
            raise ConfigError(f"dtype must be 'fp8' or 'int8', got {self.dtype!r}")

    def scheme_args(self):
        from compressed_tensors.quantization import QuantizationArgs

        kind = "float" if self.dtype == "fp8" else "int"
        return QuantizationArgs(num_bits=8, type=kind, strategy="tensor", dynamic=False, symmetric=True)


def power_of_two(n) -> bool:
    """Whether n is an int (not a bool) of the form 2**k."""
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and not n & (n - 1)


@dataclass(frozen=True)
class FallbackConfig:
    """Per-layer precision overrides (what `qgate search` chooses). `layers` keep `bits` instead of the scheme's: 8,
    group-wise int8 weights (W8A16) with the scheme's group size; 16, not quantized at all. `fine` layers keep the
    scheme's bits with the smaller `fine_group_size`: a step between the scheme and W8 that costs a scale and a zero
    point per group. `head` names the output projection (lm_head) when it is quantized too, to W8A16 at the scheme's
    group size; a tied head is untied for it, and the input embedding keeps its full-precision weights."""

    layers: tuple[str, ...] = ()
    bits: int = 8
    fine: tuple[str, ...] = ()
    fine_group_size: int | None = None
    head: tuple[str, ...] = ()
    VERSION: ClassVar[int] = 3

    def __post_init__(self):
        if self.bits not in (8, 16):
            raise ConfigError(f"search.fallback_bits must be 8 (W8A16) or 16 (unquantized), got {self.bits}")
        for what, names in (("fallback", self.layers), ("fine-group", self.fine)):
            if len(set(names)) != len(names) or not all(isinstance(x, str) and x for x in names):
                raise ConfigError(f"{what} layers must be unique module names, got {list(names)[:5]}")
        if both := sorted(set(self.layers) & set(self.fine)):
            raise ConfigError(f"a layer is either a fallback or a fine-group layer, not both: {both[:3]}")
        if len(self.head) > 1 or not all(isinstance(x, str) and x for x in self.head):
            raise ConfigError(f"head names at most one output projection, got {list(self.head)}")
        if both := sorted(set(self.head) & set(self.layers + self.fine)):
            raise ConfigError(f"the output head is quantized on its own, not as a fallback or fine-group layer: {both}")
        if self.fine and not power_of_two(self.fine_group_size):
            raise ConfigError(
                f"fine-group layers need a fine_group_size that is a power of two, got {self.fine_group_size!r}"
            )

    def names(self) -> tuple[str, ...]:
        """Every layer this config overrides."""
        return self.layers + self.fine + self.head


def _weight_scheme(
    num_bits: int, group_size: int, symmetric: bool, actorder: str | None = None, targets: tuple[str, ...] = ("Linear",)
):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(
        num_bits=num_bits, type="int", symmetric=symmetric, strategy="group", group_size=group_size, actorder=actorder
    )
    return QuantizationScheme(targets=list(targets), weights=args)


@dataclass(frozen=True)
class _GroupWise:
    group_size: int = 128
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    needs_calibration: ClassVar[bool] = True
    num_bits: ClassVar[int] = 4

    def __post_init__(self):
        check_each(*self.rules())

    def rules(self) -> list[tuple[bool, str]]:
        """(broken, message) for each of the config's own checks (errors.check_each)."""
        return [
            (not power_of_two(self.group_size), f"group_size must be a positive power of two, got {self.group_size}")
        ]

    def check_model(self, model) -> None:
        """Every quantized Linear's input width must be a multiple of group_size."""
        import torch

        bad, widths = [], set()
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and not any(name == i or name.endswith("." + i) for i in self.ignore):
                widths.add(mod.in_features)
                if mod.in_features % self.group_size:
                    bad.append(f"{name} (in_features={mod.in_features})")
        if bad:
            ok = [g for g in (32, 64, 128, 256) if all(w % g == 0 for w in widths)]
            raise ConfigError(
                f"group_size={self.group_size} does not divide the input width of {len(bad)} layers, e.g. {bad[0]}",
                hint=f"use a group_size dividing all widths {sorted(widths)}: "
                f"{ok or 'none of 32..256; add the layers to ignore'}",
            )

    def groups(
        self, fallback: FallbackConfig | None, symmetric: bool, actorder: str | None = None
    ) -> tuple[dict, list[str]]:
        """(config_groups, ignore): the scheme on every Linear; fallback and fine-group layers named exactly, which
        compressed-tensors matches before the class name, so they take the W8 group (or join the ignore list when
        unquantized) or the scheme's bits at the fine group size. A quantized head leaves the ignore list for a W8
        group of its own."""
        groups = {"group_0": _weight_scheme(self.num_bits, self.group_size, symmetric, actorder)}
        head = fallback.head if fallback else ()
        ignore = [x for x in self.ignore if x not in head]
        if fallback and fallback.layers:
            if fallback.bits == 16:
                ignore += list(fallback.layers)
            else:
                groups["group_1"] = _weight_scheme(8, self.group_size, symmetric, actorder, fallback.layers)
        if fallback and fallback.fine:
            groups["group_2"] = _weight_scheme(
                self.num_bits, fallback.fine_group_size, symmetric, actorder, fallback.fine
            )
        if head:
            groups["group_3"] = _weight_scheme(8, self.group_size, symmetric, actorder, head)
        return groups, ignore


@dataclass(frozen=True)
class AWQConfig(_GroupWise):
    symmetric: bool = False
    duo_scaling: bool = True
    n_grid: int = 20  # scale candidates searched per layer; calibration time is linear in it
    VERSION: ClassVar[int] = 1
    name: ClassVar[str] = "awq-w4a16"

    def rules(self) -> list[tuple[bool, str]]:
        return super().rules() + [(self.n_grid < 2, f"n_grid must be >= 2, got {self.n_grid}")]

    def modifiers(self, kv: KVCacheConfig | None, fallback: FallbackConfig | None = None) -> list:
        """AWQ's smoothing transform, then the group-wise quantization it searched scales for."""
        from llmcompressor.modifiers.transform.awq import AWQModifier

        return [AWQModifier(duo_scaling=self.duo_scaling, n_grid=self.n_grid)] + self.rtn_modifiers(kv, fallback)

    def rtn_modifiers(self, kv: KVCacheConfig | None, fallback: FallbackConfig | None = None) -> list:
        """The quantization step alone: group-wise round-to-nearest with min-max scales, what AWQ runs after its
        smoothing (on weights already smoothed: quantize/smoothing.py)."""
        from llmcompressor.modifiers.quantization import QuantizationModifier

        groups, ignore = self.groups(fallback, self.symmetric)
        return [
            QuantizationModifier(config_groups=groups, ignore=ignore, kv_cache_scheme=kv.scheme_args() if kv else None)
        ]


@dataclass(frozen=True)
class GPTQConfig(_GroupWise):
    num_bits: int = 4
    symmetric: bool = True
    actorder: str | None = "static"  # "group" stores a g_idx permutation the CPU engine cannot repack
    dampening_frac: float = 0.01
    VERSION: ClassVar[int] = 1

    def rules(self) -> list[tuple[bool, str]]:
        return super().rules() + [
            (self.num_bits not in (4, 8), f"num_bits must be 4 or 8, got {self.num_bits}"),
            (
                self.actorder not in (None, "static", "group"),
                f"actorder must be null, 'static' or 'group', got {self.actorder!r}",
            ),
            (not 0 < self.dampening_frac < 1, f"dampening_frac must be in (0, 1), got {self.dampening_frac}"),
        ]

    @property
    def name(self) -> str:
        return f"gptq-w{self.num_bits}a16"

    def modifiers(self, kv: KVCacheConfig | None, fallback: FallbackConfig | None = None) -> list:
        from llmcompressor.modifiers.quantization import GPTQModifier

        groups, ignore = self.groups(fallback, self.symmetric, self.actorder)
        return [
            GPTQModifier(
                config_groups=groups,
                ignore=ignore,
                dampening_frac=self.dampening_frac,
                kv_cache_scheme=kv.scheme_args() if kv else None,
            )
        ]


@dataclass(frozen=True)
class FP8Config:
    """FP8 E4M3 weights (per-channel) with dynamic per-token activation scales: no calibration for weights."""

    ignore: tuple[str, ...] = DEFAULT_IGNORE
    needs_calibration: ClassVar[bool] = False
    num_bits: ClassVar[int] = 8
    VERSION: ClassVar[int] = 1
    name: ClassVar[str] = "fp8-dynamic"

    def check_model(self, model) -> None:
        return None

    def modifiers(self, kv: KVCacheConfig | None, fallback: FallbackConfig | None = None) -> list:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        if fallback and fallback.layers:
            raise ConfigError(
                "fp8-dynamic has no per-layer fallback; search a group-wise int scheme (awq-w4a16, gptq-w4a16)"
            )
        return [
            QuantizationModifier(
                targets="Linear",
                scheme="FP8_DYNAMIC",
                ignore=list(self.ignore),
                kv_cache_scheme=kv.scheme_args() if kv else None,
            )
        ]


SCHEMES: Registry[tuple[type, dict]] = Registry("quantization scheme")
SCHEMES.register("awq-w4a16", (AWQConfig, {}))
SCHEMES.register("gptq-w4a16", (GPTQConfig, {"num_bits": 4}))
SCHEMES.register("gptq-w8a16", (GPTQConfig, {"num_bits": 8}))
SCHEMES.register("fp8-dynamic", (FP8Config, {}))


def scheme_config(name: str, where: str = "options", field_name=None, **overrides: Any):
    """The config for scheme `name`; `overrides` with value None are ignored; errors name `where`
    (naming.build_config)."""
    cls, fixed = SCHEMES.get(name)
    return build_config(cls, {k: v for k, v in overrides.items() if v is not None}, where, fixed, field_name)


def weight_format(cfg, fallback: FallbackConfig | None = None) -> str:
    """'w4a16' / 'w8a16' / 'fp8', or a per-layer mix joined by '+': 'w4a16+w8a16', 'w4a16+unquantized', with
    'w4a16g32' for fine-group layers (e.g. 'w4a16+w4a16g32+w8a16'). What an engine needs to pick a kernel path."""
    if isinstance(cfg, FP8Config):
        return "fp8"
    parts = [f"w{cfg.num_bits}a16"]
    if fallback and fallback.fine:
        parts.append(f"w{cfg.num_bits}a16g{fallback.fine_group_size}")
    if fallback and fallback.layers and cfg.num_bits < fallback.bits:
        parts.append("w8a16" if fallback.bits == 8 else "unquantized")
    if fallback and fallback.head and "w8a16" not in parts:
        parts.append("w8a16")
    return "+".join(parts)


def _part(weights: dict, acts: dict | None) -> str:
    """One config group's weight_format name: 'w4a16', 'w8a8', 'fp8' (FP8 weights and activations), 'fp8a16'."""
    wbits, abits = weights.get("num_bits"), (acts or {}).get("num_bits", 16)
    if weights.get("type") == "float":
        return "fp8" if wbits == 8 and abits == 8 and (acts or {}).get("type") == "float" else f"fp{wbits}a{abits}"
    return f"w{wbits}a{abits}"


def quantization_config(path) -> dict:
    """config.json's `quantization_config` in the checkpoint at `path`; {} for an unquantized one."""
    qc = json.loads((Path(path) / "config.json").read_text()).get("quantization_config")
    return qc if isinstance(qc, dict) else {}


def stored_format(path) -> tuple[str | None, str | None]:
    """(weight_format, KV-cache dtype) that a checkpoint's config.json says it stores, in weight_format's and
    KVCacheConfig's names: (None, None) for an unquantized one. For checkpoints qgate did not quantize itself (`qgate
    model import` of another tool's output) and for what an engine builds from, whatever its manifest says.

    Each compressed-tensors config group names one part: int4 groups at a group size below the largest become
    'w4a16g<size>' (finer groups, as a search writes them), and `ignore` entries inside the decoder layers add
    'unquantized' (lm_head alone is every scheme's default). w4a16 parts come first, as the engines read them."""
    qc = quantization_config(path)
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict) and g.get("weights")]
    named = [(_part(g["weights"], g.get("input_activations")), g["weights"].get("group_size")) for g in groups]
    widest = max((size or 0 for name, size in named if name == "w4a16"), default=0)
    parts = {f"{name}g{size}" if name == "w4a16" and size and size < widest else name for name, size in named}
    if any("layers" in str(x) for x in qc.get("ignore") or ()):
        parts.add("unquantized")
    fmt = "+".join(sorted(parts, key=lambda p: (not p.startswith("w4a16"), p == "unquantized", p))) or None
    kv = qc.get("kv_cache_scheme") or {}
    return fmt, f"{'fp' if kv.get('type') == 'float' else kv.get('type')}{kv.get('num_bits')}" if kv else None


def stored_description(path) -> str:
    """stored_format in words, as messages name what a checkpoint stores: "w4a16, KV cache fp8"; "" for an
    unquantized one."""
    fmt, kv = stored_format(path)
    return ", ".join(x for x in (fmt, kv and f"KV cache {kv}") if x)


FUSED = ("weight_input", "weight_output")  # transform locations compressed-tensors folds into the saved weights


def online_transforms(path) -> dict:
    """The rotations a checkpoint's config.json asks to be applied as it runs (`quantization_config.transform_config`,
    as llm-compressor's QuIP and SpinQuant write it): its config groups, each with only the `apply` entries at run-time
    locations (a Linear's input or output, attention's query, the KV cache's keys). The FUSED entries are left out:
    they are in the saved weights already, and applying them again would rotate twice. {} when there are none.
    Transformers applies none of them on load; a model scored without them is not the model that is served."""
    groups = (quantization_config(path).get("transform_config") or {}).get("config_groups") or {}
    online = {}
    for name, scheme in groups.items():
        keep = [a for a in scheme.get("apply") or () if a.get("location") not in FUSED]
        if keep:
            online[name] = scheme | {"apply": keep}
    return online


BUILT = "rtn on AWQ-smoothed weights"  # how a checkpoint made from cached AWQ smoothing says it was made


def smooths(scheme, kv) -> bool:
    """Whether this scheme's checkpoints can be built from cached smoothing: AWQ without a KV-cache scheme (whose
    scales need calibration data at quantization time)."""
    return hasattr(scheme, "rtn_modifiers") and kv is None


__all__ = [
    "AWQConfig",
    "GPTQConfig",
    "FP8Config",
    "FallbackConfig",
    "KVCacheConfig",
    "SCHEMES",
    "scheme_config",
    "weight_format",
    "quantization_config",
    "stored_format",
    "stored_description",
    "online_transforms",
    "BUILT",
    "smooths",
]
