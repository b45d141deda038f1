"""The small exception hierarchy every stage raises, and the exit code each maps to.

    raise InputError("traffic.jsonl:12: record has neither 'messages' nor 'prompt'", hint="...")

Exit codes: 0 done/passed, 1 error, 2 gate failed or promotion refused, 3 drift found (`qgate drift`).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_REFUSED = 2
EXIT_DRIFT = 3


class QgateError(Exception):
    """Base class: `message` says what and where, `hint` says what to do."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message

    @property
    def problems(self) -> list[QgateError]:
        """Each problem this error reports, on its own: itself, unless it gathers several (ConfigProblems)."""
        return [self]


class ConfigError(QgateError):
    """A config, recipe or pipeline spec is invalid (names the key path)."""


class ConfigProblems(ConfigError):
    """Several independent problems in one config, each a ConfigError of its own (`problems`), so one run of a bad
    spec shows all of them."""

    def __init__(self, problems: list[ConfigError], prefix: str = ""):
        self._problems = problems
        lines = [f"{prefix}{len(problems)} problems"]
        for e in problems:
            lines.append(f"  - {e.message}")
            lines += [f"    hint: {e.hint}"] if e.hint else []
        super().__init__("\n".join(lines))

    @property
    def problems(self) -> list[ConfigError]:
        return self._problems


def config_problems(errors: list[ConfigError], prefix: str = "") -> ConfigError:
    """One ConfigError for all of `errors` (a ConfigProblems among them counts as its problems): the only one as it
    is, with `prefix` before its message; several as a ConfigProblems."""
    flat = [p for e in errors for p in e.problems]
    if len(flat) == 1:
        return ConfigError(f"{prefix}{flat[0].message}", hint=flat[0].hint)
    return ConfigProblems(flat, prefix)


def check_each(*rules: tuple[bool, str]) -> None:
    """A config's own checks as (broken, message) pairs: one ConfigError for every broken rule, so one run shows
    them all."""
    if broken := [ConfigError(message) for bad, message in rules if bad]:
        raise config_problems(broken)


class InputError(QgateError):
    """An input file or directory is missing or malformed (names file:line or record)."""


class BackendUnavailable(QgateError):
    """A backend was chosen by name but cannot run on this host (says why and how to install)."""


class GateFailed(QgateError):
    """A gate ran and the candidate did not pass."""

    exit_code = EXIT_REFUSED


class RegistryError(QgateError):
    """The model registry refused or failed an operation."""


class PromotionRefused(RegistryError):
    """Promotion was refused because the evidence does not allow it."""

    exit_code = EXIT_REFUSED


class DiskFull(QgateError):
    """A write ran out of disk space (names the output, what it wrote before and what is free)."""


class LockHeld(QgateError):
    """Another live process holds the job's lock (names it and the lock file)."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def free_bytes(path) -> int | None:
    """Free bytes on the filesystem holding `path` (its nearest existing parent); None if it cannot be read."""
    import shutil
    from pathlib import Path

    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def in_one_line(e: BaseException, limit: int = 200) -> str:
    """'TypeName: the first line of its message' (at most `limit` characters of it): an exception in a warning or a
    record, where a traceback would not fit."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:limit]}"
