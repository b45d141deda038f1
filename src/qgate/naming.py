"""A generic name -> object registry whose misses suggest the closest name.

    SCHEMES = Registry("quantization scheme"); SCHEMES.register("awq-w4a16", AWQConfig)
"""
from __future__ import annotations

import difflib
from typing import Generic, TypeVar

from qgate.errors import ConfigError

T = TypeVar("T")


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
            close = difflib.get_close_matches(name, self._items, n=1)
            guess = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown {self.what} {name!r}{guess}",
                hint=f"choose one of: {', '.join(sorted(self._items))}",
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._items))
