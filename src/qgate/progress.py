"""Progress that suits where it is read: a live bar on a terminal, a few plain lines in a CI log.

    for row in progress(rows, "shadow: baseline answers", unit="prompt"): ...

On a TTY this is tqdm. Without one (CI, cron, a pipe) it prints `desc: 12/48 (25%) 31s` at most once per 10% of the work
or per 30 s, whichever comes first, and a last line at the end: no carriage-return redraws. `quiet_console()` is what
`qgate run` and `qgate drift` call when stderr is not a TTY: from then on file descriptors 1 and 2 (every library's
prints, warnings, C++ logs, progress bars) go to a log file, and only qgate's own lines reach the console, through
`console_out()` / `console_err()`. Third-party bars are switched off as well, so the log stays readable.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
STEP_FRACTION = 0.10
STEP_SECONDS = 30.0


_CONSOLE: dict[str, object] = {}


def console_out():
    """Where qgate's own stdout goes (the real stdout, even after quiet_console moved fd 1 to the log)."""
    return _CONSOLE.get("out", sys.stdout)


def console_err():
    return _CONSOLE.get("err", sys.stderr)


def interactive() -> bool:
    return sys.stderr.isatty() and os.environ.get("QGATE_PLAIN_PROGRESS") != "1"


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if interactive():
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, total=total, unit=f" {unit}", disable=False)
        return
    yield from _lines(items, desc, total, unit)


class StageBar:
    """A stage-count bar on a terminal; nothing without one (each stage already logs its start and end line)."""

    def __init__(self, total: int, desc: str):
        self.bar = None
        if interactive():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=" stage", position=0, leave=True)

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _lines(items: Iterable[T], desc: str, total: int | None, unit: str) -> Iterator[T]:
    start = last_t = time.monotonic()
    last_done, done = 0, 0
    for item in items:
        yield item
        del item  # the consumer has it: holding it through the next step would keep two alive
        done += 1
        now = time.monotonic()
        # a line only when 30 s have passed and another 10% is done: a fast step logs just its final line
        due = now - last_t >= STEP_SECONDS and (not total or (done - last_done) >= STEP_FRACTION * total)
        if due and (not total or done < total):
            print(_line(desc, done, total, unit, now - start), file=console_err(), flush=True)
            last_t, last_done = now, done
    print(_line(desc, done, total, unit, time.monotonic() - start) + " done", file=console_err(), flush=True)


def _line(desc: str, done: int, total: int | None, unit: str, secs: float) -> str:
    of = f"/{total} ({100 * done / total:.0f}%)" if total else ""
    plural = unit + ("es" if unit.endswith(("s", "sh", "ch", "x")) else "s")
    return f"    {desc}: {done}{of} {plural}, {secs:.0f}s"


def _real_std_streams() -> bool:
    """sys.stdout/err still write to fds 1/2 (not replaced by a test harness or an embedding program): only then are
    the fds ours to move."""
    try:
        return sys.stdout.fileno() == 1 and sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


def silence_tqdm() -> None:
    """Every tqdm bar disabled, in this process and its children: libraries that call tqdm directly (transformers'
    GGUF loader) or pass disable=False. TQDM_DISABLE alone is not enough: tqdm reads it once, when first imported."""
    os.environ["TQDM_DISABLE"] = "1"
    import tqdm.std

    if not getattr(tqdm.std.tqdm.__init__, "_qgate_quiet", False):
        init = tqdm.std.tqdm.__init__

        def quiet_init(self, *args, **kwargs):
            kwargs["disable"] = True
            init(self, *args, **kwargs)

        quiet_init._qgate_quiet = True
        quiet_init._qgate_original = init
        tqdm.std.tqdm.__init__ = quiet_init


class _WrittenBelow:
    """A filter for the root logger's handlers that drops a record a handler below the root already wrote to fd 1 or
    2: some libraries (datasets) add their own stderr handler and still propagate, which put each of their lines in
    the log twice, once without a timestamp."""

    def filter(self, record) -> bool:
        import logging

        logger = logging.getLogger(record.name)
        while logger.parent is not None:  # the root alone has none
            if any(_to_std_fd(h) and record.levelno >= h.level for h in logger.handlers):
                return False
            if not logger.propagate:
                break
            logger = logger.parent
        return True


def _to_std_fd(handler) -> bool:
    try:
        return handler.stream.fileno() in (1, 2)
    except (AttributeError, OSError, ValueError):
        return False


def quiet_console(log_file: Path) -> Path:
    """Send fds 1 and 2 to `log_file` and keep the console for qgate's own lines. Returns the log's path."""
    import logging

    log_file.parent.mkdir(parents=True, exist_ok=True)
    if "out" not in _CONSOLE and _real_std_streams():
        sys.stdout.flush()
        sys.stderr.flush()
        _CONSOLE["out"] = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
        _CONSOLE["err"] = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8")
        log = open(log_file, "a", buffering=1, encoding="utf-8")
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        _CONSOLE["log"] = log
    os.environ["QGATE_PLAIN_PROGRESS"] = "1"
    os.environ["MLFLOW_CONFIGURE_LOGGING"] = "false"
    silence_tqdm()
    logging.captureWarnings(True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for name in ("datasets", "lm_eval", "lm-eval", "mlflow", "alembic", "llmcompressor", "onnxruntime", "qgate"):
        logging.getLogger(name).setLevel(logging.INFO)  # INFO and up; their handlers now write to the log
    if not root.handlers:
        logging.basicConfig(
            stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    for handler in root.handlers:
        if not any(isinstance(f, _WrittenBelow) for f in handler.filters):
            handler.addFilter(_WrittenBelow())
    os.environ["LLM_COMPRESSOR_LOG_LEVEL"] = "INFO"  # llm-compressor's console sink is stdout, fd 1: the log
    logging.getLogger("qgate").info("library logs of this run: %s", log_file)
    return log_file
