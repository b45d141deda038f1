"""Names -> objects, with suggestions: a generic registry, and config construction from mappings.

    SCHEMES = Registry("quantization scheme"); SCHEMES.register("awq-w4a16", AWQConfig)
    cfg = build_config(ShadowConfig, {"kl_p99_max": 0.5}, where="gates.shadow")

Every unknown name or key fails with its path (one style: `variants[1].options.group_size`) and
the closest known name.
"""

from __future__ import annotations

import difflib
import functools
import typing
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any, Generic, TypeVar

from qgate.errors import ConfigError, config_problems

T = TypeVar("T")


def suggest(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(name), list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def key_path(*parts: Any) -> str:
    """('variants', 1, 'options') -> 'variants[1].options'."""
    out = ""
    for p in parts:
        if p in ("", None):
            continue
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def check_keys(data: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    """ConfigError naming every key of `data` not in `allowed`, each with its closest allowed key."""
    allowed = sorted(allowed)
    unknown = [
        ConfigError(f"{key_path(where, k)}: unknown key{suggest(k, allowed)}", hint=f"allowed: {', '.join(allowed)}")
        for k in data
        if k not in allowed
    ]
    if unknown:
        raise config_problems(unknown)


@functools.cache
def _adapter(cls: type, name: str):
    from pydantic import TypeAdapter

    return TypeAdapter(typing.get_type_hints(cls)[name])


def typed_values(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`data` as `cls`'s keyword arguments (YAML's lists as tuples), or a ConfigError naming every value that is not
    of its field's declared type, strictly (no "3" or 4.5 for an int, no 1 for a bool; an int is a number): a
    config's own checks compare values, they do not check types."""
    from pydantic import ValidationError

    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    problems = []
    for k, v in data.items():
        try:
            _adapter(cls, k).validate_python(kwargs[k], strict=True)
        except ValidationError as e:
            err = e.errors()[0]
            msg = "Input should be a list" if err["type"] == "tuple_type" else err["msg"]
            optional = type(None) in typing.get_args(typing.get_type_hints(cls)[k])
            problems.append(
                ConfigError(f"{key_path(where, k, *err['loc'])}: {msg}{' or null' if optional else ''} (got {v!r})")
            )
    if problems:
        raise config_problems(problems)
    return kwargs


def build_config(cls, data: Mapping[str, Any], where: str, fixed: Mapping[str, Any] | None = None, field_name=None):
    """A frozen dataclass config from a mapping (lists become tuples), with `where` in every error: unknown keys and
    values of the wrong type first, then the config's own checks. A check's message that starts with one of the
    config's fields (bare, or after `where.` or the class name) names it `where.field`, or `field_name(field)` when
    given (a command names its flag: `--max-seq-len`)."""
    fixed = dict(fixed or {})
    check_keys(data, [f.name for f in fields(cls) if f.name not in fixed], where)
    kwargs = typed_values(cls, data, where)
    try:
        return cls(**fixed, **kwargs)
    except ConfigError as e:  # each problem once, named by its path
        named = [ConfigError(_named(p.message, cls, where, field_name), hint=p.hint) for p in e.problems]
        raise config_problems(named) from e
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from e


def field_namer(where: str, field_name=None):
    """How an error names a config's field: `field_name` when given (a command names its flag), else `where.field`."""
    return field_name or (lambda f: f"{where}.{f}")


def _named(message: str, cls, where: str, field_name) -> str:
    """`message` with the field it starts with named by its path (see build_config), else under `where`."""
    name = field_namer(where, field_name)
    for f in sorted((f.name for f in fields(cls)), key=len, reverse=True):
        for head in (f"{where}.{f}", f"{cls.__name__}.{f}", f):
            if message.startswith(head) and message[len(head) : len(head) + 1] in (" ", ":"):
                return name(f) + message[len(head) :]
    return message if message.startswith(f"{where}.") else f"{where}: {message}"


class Registry(Generic[T]):
    def __init__(self, what: str):
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if name in self._items:
            raise ValueError(f"{self.what} {name!r} registered twice")
        self._items[name] = item
        return item

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.what} {name!r}{suggest(name, self._items)}",
                hint=f"choose one of: {', '.join(sorted(self._items))}",
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._items))
