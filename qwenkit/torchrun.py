"""torchrun, without its summary of a failed rank: what ``qwenkit train`` starts (``python -m qwenkit.torchrun``).

A module of its own so that the launcher process imports only torch's elastic launcher, not the
training kit (``qwenkit.launch`` pulls in transformers and distributed checkpointing, ~2 s more
of every ``qwenkit train`` on a 2-core machine).
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main


def quiet_torchrun(argv: list[str]) -> int:
    """torchrun, without its summary of a failed rank (a second and third copy of its traceback).

    A qwenkit rank reports its own failure, one line then the traceback (see
    ``qwenkit.engine.train.report_failure``), and exits with status 1; torchrun then stops the other
    ranks and raises ``ChildFailedError``, whose printout is dropped here. torchrun's own
    errors (bad arguments, rendezvous) still surface.
    """
    try:
        torchrun_main(argv)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(quiet_torchrun(sys.argv[1:]))
