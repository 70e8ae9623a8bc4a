"""How the ``qwenkit`` commands report an input error: one line naming what to fix, exit 2; with
``--traceback`` (every subcommand has it) the full traceback above that line, for a bug report."""

from __future__ import annotations

import os
import sys
import traceback

TRACEBACK_ENV = "QWENKIT_TRACEBACK"  # "1": set by --traceback, for this process and the ones it starts
COMMAND_ENV = "QWENKIT_COMMAND"  # the subcommand that started torchrun (default train): its wrapper's lines name it


def print_user_error(command: str, error: BaseException) -> None:
    """``qwenkit <command>: <error>`` on stderr; the traceback first when ``--traceback`` was given."""
    if os.environ.get(TRACEBACK_ENV) == "1":
        traceback.print_exception(error, file=sys.stderr)
    print(f"qwenkit {command}: {error}", file=sys.stderr)
