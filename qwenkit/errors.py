"""How the ``qwenkit`` commands report an input error: one line naming what to fix, exit 2; with
``--traceback`` (every subcommand has it) the full traceback above that line, for a bug report."""

from __future__ import annotations

import os
import sys
import traceback

TRACEBACK_ENV = "QWENKIT_TRACEBACK"  # "1": set by --traceback, for this process and the ones it starts
COMMAND_ENV = "QWENKIT_COMMAND"  # the subcommand that started torchrun (default train): its wrapper's lines name it


class OwnShareError(ValueError):
    """An input error found in one rank's own share of the rows (a user's scoring function on them):
    the rank that meets it says it. Any other input error every rank meets alike, and rank 0 says it."""


def said_by_another_rank(error: BaseException) -> bool:
    """Whether this process is a rank of a subcommand's torchrun (``qwenkit eval --nproc``) other
    than rank 0, and ``error`` one that rank 0 meets too and says (:class:`OwnShareError` aside)."""
    ranked = os.environ.get(COMMAND_ENV) is not None and os.environ.get("RANK", "0") != "0"
    return ranked and not isinstance(error, OwnShareError)


def print_user_error(command: str, error: BaseException) -> None:
    """``qwenkit <command>: <error>`` on stderr; the traceback first when ``--traceback`` was given."""
    if os.environ.get(TRACEBACK_ENV) == "1":
        traceback.print_exception(error, file=sys.stderr)
    print(f"qwenkit {command}: {error}", file=sys.stderr)
