"""Entry point: `qgate --help`. Heavy libraries load inside the commands, never at import.

Exit codes: 0 done or passed, 1 error (including usage errors), 2 gate failed or promotion refused.
Set QGATE_DEBUG=1 for tracebacks.
"""
from __future__ import annotations

import os
import sys

import click
import typer

from qgate.cli import calibrate, engine, gate, model, quantize, registry, run
from qgate.errors import EXIT_ERROR, GateFailed, PromotionRefused, QgateError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Quantize LLMs, gate them on real traffic, promote only what passes.")
app.add_typer(calibrate.app, name="calibrate")
app.add_typer(model.app, name="model")
app.add_typer(engine.app, name="engine")
app.command("quantize")(quantize.quantize_cmd)
app.command("gate")(gate.gate_cmd)
app.command("register")(registry.register_cmd)
app.command("promote")(registry.promote_cmd)
app.command("run")(run.run_cmd)


def _message(e: BaseException) -> tuple[str, int]:
    """The one table from exceptions to one-line messages and exit codes."""
    if isinstance(e, GateFailed | PromotionRefused):
        return f"refused: {e}", e.exit_code
    if isinstance(e, QgateError):
        return f"error: {e}", e.exit_code
    if isinstance(e, click.exceptions.Abort | KeyboardInterrupt):
        return "aborted", 130
    if isinstance(e, click.ClickException):
        return f"usage error: {e.format_message()}", EXIT_ERROR
    if isinstance(e, FileNotFoundError):
        return f"error: file not found: {e.filename}", EXIT_ERROR
    if isinstance(e, MemoryError):
        return "error: out of memory; lower calibration or shadow sizes", EXIT_ERROR
    return f"internal error: {type(e).__name__}: {e} (set QGATE_DEBUG=1 for the traceback)", EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = typer.main.get_command(app)
    try:
        rc = cmd.main(args=argv, prog_name="qgate", standalone_mode=False)
        return rc if isinstance(rc, int) else 0
    except click.exceptions.Exit as e:
        return e.exit_code
    except BaseException as e:  # noqa: BLE001 - the CLI boundary turns every failure into a message + exit code
        if isinstance(e, SystemExit):
            return int(e.code or 0)
        if os.environ.get("QGATE_DEBUG") == "1":
            raise
        msg, code = _message(e)
        if isinstance(e, click.ClickException) and e.ctx is not None:
            msg += f"\n  see: {e.ctx.command_path} --help"
        print(msg, file=sys.stderr)
        return code


def entry() -> None:
    sys.exit(main())
