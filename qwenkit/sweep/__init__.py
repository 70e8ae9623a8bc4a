"""``qwenkit sweep``: many training runs from one file, each a normal ``qwenkit train`` run, kept in a ledger.

A sweep file (``params/sweeps/<name>.yaml``)::

    base: params/tiny_cpu.yaml          # the run config every trial starts from
    overrides: [train.steps=40]         # applied to every trial
    grid: {train.lr: [0.001, 0.003]}    # every combination is a trial
    trials: [{loss.chunk: false}]       # and/or an explicit list of override sets (crossed with the grid)
    seeds: [1, 2]                       # each trial repeated with train.seed set
    name: lr                            # optional: the sweep's name (default: the file's stem)

Trials are ``trials x grid x seeds`` (a missing part counts as one empty set), named from what
they vary (``lr0.003-seed1``), and run in ``<sweep dir>/<trial>/`` by the launcher of
``qwenkit train`` (a child ``python -m qwenkit.cli train``), with ``train.resume=auto``.
A trial folder whose ``config.yaml`` differs from what the sweep file now asks for is refused.

The package, one job a module:

- :mod:`qwenkit.sweep.file`: the sweep file, its trials named, resolved and validated (``load``);
- :mod:`qwenkit.sweep.ledger`: ``<sweep dir>/sweep.jsonl``, each trial's state; its table; the result line;
- :mod:`qwenkit.sweep.scheduler`: the trials run on device slots (``run``), the ``qwenkit sweep`` commands;
- :mod:`qwenkit.sweep.progress`: the terminal's line per trial.
"""

from qwenkit.sweep.file import KEYS, Sweep, SweepError, Trial, load, override_text, trial_name
from qwenkit.sweep.ledger import result_text
from qwenkit.sweep.progress import TerminalProgress
from qwenkit.sweep.scheduler import device_slots, run, run_command, status_command, train_command

__all__ = [
    "KEYS", "Sweep", "SweepError", "TerminalProgress", "Trial", "device_slots", "load", "override_text", "result_text",
    "run", "run_command", "status_command", "train_command", "trial_name",
]  # fmt: skip
