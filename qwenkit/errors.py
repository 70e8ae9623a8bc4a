"""How the ``qwenkit`` commands report an input error: one line naming what to fix, exit 2; with
``--traceback`` (every subcommand has it) the full traceback above that line, for a bug report.

And the kinds of failure a rank of ``qwenkit train`` reports in one line, its traceback in its log only
(:func:`qwenkit.engine.run.rank.report_failure`): :class:`KnownCause` (a full disk at a save, an engine's
known error) and :class:`EveryRank` (a failure every rank raises at the same point, which rank 0 says)."""

from __future__ import annotations

import os
import sys
import traceback

TRACEBACK_ENV = "QWENKIT_TRACEBACK"  # "1": set by --traceback, for this process and the ones it starts
COMMAND_ENV = "QWENKIT_COMMAND"  # the subcommand that started torchrun (default train): its wrapper's lines name it


class OwnShareError(ValueError):
    """An input error found in one rank's own share of the rows (a user's scoring function on them):
    the rank that meets it says it. Any other input error every rank meets alike, and rank 0 says it."""


class EveryRank(Exception):
    """A mixin: every rank raises this failure at the same point of its step, having agreed on it over a
    collective (a reward that failed on one rank, a non-finite loss, a save that failed). The ranks are
    still in step, so the trainer may finish collective work first (a ``checkpoint.async`` save in flight),
    and rank 0 alone says it."""


class KnownCause(RuntimeError):
    """A rank's failure whose cause is known, raised as ``<cause>; <fix>``: one line (``qwenkit train: rank N
    failed: ...``), its traceback in the rank's log. Like an input error, what the user fixes (their disk,
    their engine settings): restarting the group would meet it again."""


def said_by_another_rank(error: BaseException) -> bool:
    """Whether this process is a rank of a subcommand's torchrun (``qwenkit eval --nproc``) other
    than rank 0, and ``error`` one that rank 0 meets too and says (:class:`OwnShareError` and a rank's
    own :class:`KnownCause`, its engine's, aside)."""
    ranked = os.environ.get(COMMAND_ENV) is not None and os.environ.get("RANK", "0") != "0"
    own = isinstance(error, OwnShareError) or (isinstance(error, KnownCause) and not isinstance(error, EveryRank))
    return ranked and not own


def print_user_error(command: str, error: BaseException) -> None:
    """``qwenkit <command>: <error>`` on stderr; the traceback first when ``--traceback`` was given."""
    if os.environ.get(TRACEBACK_ENV) == "1":
        traceback.print_exception(error, file=sys.stderr)
    print(f"qwenkit {command}: {error}", file=sys.stderr)
