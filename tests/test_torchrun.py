"""qwenkit.torchrun's pure parts: the variables a rank gets, exit codes as a shell reports them, the first failure."""

from __future__ import annotations

import signal
import subprocess
import sys
from types import SimpleNamespace

from qwenkit import torchrun
from qwenkit.engine import stopping


def test_rank_env_is_what_torchrun_gives_a_rank():
    env = torchrun.rank_env(1, 4, 29500)
    assert env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "4",
                   "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}  # fmt: skip


def test_shell_code_is_what_a_shell_reports_for_a_signal_death():
    proc = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
    assert proc.returncode == -signal.SIGTERM  # subprocess's spelling
    shell = subprocess.run(["sh", "-c", f"{sys.executable} -c 'import os, signal; os.kill(os.getpid(), 15)'; echo $?"],
                           capture_output=True, text=True)  # fmt: skip
    assert stopping.shell_code(proc.returncode) == int(shell.stdout.split()[-1]) == 143
    assert stopping.shell_code(0) == 0 and stopping.shell_code(stopping.EXIT_RESUMABLE) == 75
    assert torchrun.describe(-9) == "killed by SIGKILL" and torchrun.describe(75).startswith("stopped with a checkpoint")


def test_first_failure_is_the_earliest_seen_then_a_signal_death():
    failures = {0: SimpleNamespace(pid=10, exitcode=1), 1: SimpleNamespace(pid=11, exitcode=-9)}
    assert torchrun.first_failure(failures)[0] == 1  # seen in the same poll (never): the signal death first
    torchrun._first_seen.update({10: (1, 0.0), 11: (2, 0.0)})
    try:
        assert torchrun.first_failure(failures)[0] == 0  # rank 0 failed a poll earlier
    finally:
        torchrun._first_seen.clear()
