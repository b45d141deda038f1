"""Entry point: `qgate --help`. Heavy libraries load inside the commands, never at import.

Exit codes: 0 done or passed, 1 error (including usage errors), 2 gate failed or promotion refused,
3 drift found (`qgate drift`; see cli/drift.py).
Set QGATE_DEBUG=1 for tracebacks.
"""

from __future__ import annotations

import errno
import functools
import os
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from typer._click.exceptions import NoArgsIsHelpError  # typer 0.29 vendors click: its classes, not click's

from qgate.cli import calibrate, drift, engine, gate, model, quantize, registry, run, search
from qgate.device import out_of_memory
from qgate.errors import EXIT_ERROR, GateFailed, PromotionRefused, QgateError, free_bytes, human_bytes
from qgate.registry.transport import server_failure

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Quantize LLMs, gate them on real traffic, promote only what passes.",
)


def version_line() -> str:
    """qgate's version and those of the libraries whose behaviour a gate verdict depends on (read from package
    metadata: nothing heavy is imported)."""
    from qgate.execute import LIBRARIES, versions

    libs = ", ".join(f"{n} {v}" for n, v in versions(LIBRARIES).items())
    return f"qgate {versions(('qgate',))['qgate']} (python {sys.version.split()[0]}; {libs})"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print qgate's version and its libraries' versions, then exit.",
        ),
    ] = False,
) -> None:
    pass


app.add_typer(calibrate.app, name="calibrate")
app.add_typer(model.app, name="model")
app.add_typer(engine.app, name="engine")
app.add_typer(drift.app, name="drift")
app.command("quantize")(quantize.quantize_cmd)
app.command("gate")(gate.gate_cmd)
app.command("register")(registry.register_cmd)
app.command("promote")(registry.promote_cmd)
app.command("verify")(registry.verify_cmd)
app.command("status")(registry.status_cmd)
app.command("rollback")(registry.rollback_cmd)
app.command("run")(run.run_cmd)
app.command("search")(search.search_cmd)


@functools.cache
def _command_tree():
    """qgate's click command tree, built once: typer builds it anew on every call."""
    return typer.main.get_command(app)


def named_command(words: Sequence[str]) -> tuple[Any, list[str]]:
    """The deepest qgate command the leading words name, and those words: (its command, ["calibrate", "sample"]) for
    `calibrate sample --traffic t`; (the group, []) where the first word names no command."""
    cmd, named = _command_tree(), []
    for word in words:
        sub = getattr(cmd, "commands", {}).get(word)
        if sub is None:
            break
        cmd, named = sub, [*named, word]
    return cmd, named


def _command_path(argv: list[str] | None) -> str:
    """`qgate calibrate sample` from argv, for usage errors the parser raises without a context."""
    return " ".join(["qgate", *named_command(argv if argv is not None else sys.argv[1:])[1]])


def _message(e: BaseException, argv: list[str] | None = None) -> tuple[str, int]:
    """The one table from exceptions to one-line messages and exit codes."""
    if isinstance(e, GateFailed | PromotionRefused):
        return f"refused: {e}", e.exit_code
    if isinstance(e, QgateError):
        return f"error: {e}", e.exit_code
    if isinstance(e, typer.Abort | KeyboardInterrupt):
        return "aborted", 130
    if isinstance(e, typer.TyperException):  # UsageError, BadParameter, NoSuchOption, MissingParameter, ...
        msg = f"usage error: {e.format_message()}"
        ctx = getattr(e, "ctx", None)
        return msg + f"\n  see: {ctx.command_path if ctx is not None else _command_path(argv)} --help", EXIT_ERROR
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:  # a write outside a stage's output (caches, logs)
        free = free_bytes(e.filename) if e.filename else None
        where = e.filename or "a file"
        left = "" if free is None else f" ({human_bytes(free)} free there now)"
        return f"error: no space left on the device holding {where}{left}: free space and run again", EXIT_ERROR
    if (failed := server_failure(e)) is not None:
        return f"error: {failed}", EXIT_ERROR
    if isinstance(e, FileNotFoundError):
        return f"error: file not found: {e.filename}", EXIT_ERROR
    if isinstance(e, MemoryError):
        return "error: out of memory; lower calibration or shadow sizes", EXIT_ERROR
    if (oom := _device_out_of_memory(e)) is not None:
        return f"error: {oom}", oom.exit_code
    return f"internal error: {type(e).__name__}: {e} (set QGATE_DEBUG=1 for the traceback)", EXIT_ERROR


def _device_out_of_memory(e: BaseException) -> QgateError | None:
    """torch's OutOfMemoryError (a GPU allocation failed part way, when another process took the card's memory or
    the work does not fit) as an error with what to do, else None. torch is looked up, not imported: if it was never
    imported, this is not its error."""
    if isinstance(e, MemoryError) or not out_of_memory(e):
        return None
    said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return QgateError(
        f"out of memory on the GPU (torch: {said})",
        hint="another process may hold the card's memory (nvidia-smi lists it): free it, or pick a card with more "
        "free memory (--device cuda:N where the command takes it, else CUDA_VISIBLE_DEVICES)",
    )


def _dispatch(argv: list[str] | None):
    return typer.main.get_command(app).main(args=argv, prog_name="qgate", standalone_mode=False)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from qgate.cli import output

    output.EMITTED = False  # per invocation (tests and embedders call main() more than once per process)
    try:
        rc = _dispatch(argv)
        return rc if isinstance(rc, int) else 0
    except typer.Exit as e:
        return e.exit_code
    except NoArgsIsHelpError:  # a group or command called bare: its help is already on screen
        return EXIT_ERROR
    except BaseException as e:  # noqa: BLE001 - the CLI boundary turns every failure into a message + exit code
        if isinstance(e, SystemExit):
            return int(e.code or 0)
        if os.environ.get("QGATE_DEBUG") == "1":
            raise
        msg, code = _message(e, argv)
        from qgate.cli.output import error_doc
        from qgate.progress import console_err, console_out

        print(msg, file=console_err())
        groups = tuple(g.name for g in app.registered_groups)
        doc = error_doc(list(argv if argv is not None else sys.argv[1:]), e, msg, code, groups)
        if doc is not None:
            print(doc, file=console_out())
        return code


def entry() -> None:
    sys.exit(main())
