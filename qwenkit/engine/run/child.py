"""``qwenkit train`` as a child process, followed: what the sweep and the notebooks start runs with.

:class:`TrainProcess` starts the command in its own session (the launcher, torchrun and every rank
are one process group, stopped together), copies its output into ``<output_dir>/train.log`` (for
people: ``tail -f`` follows it live) and hands the caller each output line and each new event of
the run (:mod:`qwenkit.engine.run.events`) in the calling thread. What the run did is read from its
events, never from the lines.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qwenkit.engine.run import events
from qwenkit.rundir import RunDir


class TrainProcess:
    """One invocation of ``command`` (a ``qwenkit train`` command line) writing to ``output_dir``."""

    def __init__(self, command: list[str], output_dir: str | Path, env: dict[str, str]):
        self.run_dir = RunDir(output_dir)
        self.run_dir.path.mkdir(parents=True, exist_ok=True)
        self.events = events.Follower(self.run_dir.path)  # this invocation's events: from the file's end now
        self.command = command
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**env, "PYTHONUNBUFFERED": "1"}, start_new_session=True)  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def follow(
        self,
        on_line: Callable[[str], None] = lambda line: None,
        on_event: Callable[[dict[str, Any]], None] = lambda event: None,
        timeout_s: float | None = None,
        poll_s: float = 0.05,
    ) -> int:
        """Until the process ends: each output line into train.log and ``on_line``, each new event to
        ``on_event`` (both in this thread); returns the exit status. Past ``timeout_s`` the process
        group is stopped (:meth:`terminate`) and ``TimeoutError`` raised."""
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(self.proc.stdout, lines), daemon=True).start()
        began = time.monotonic()
        with self.run_dir.train_log.open("a") as log:
            while True:
                try:
                    line = lines.get(timeout=poll_s)
                except queue.Empty:
                    line = ""
                if line is None:
                    break
                if line:
                    log.write(line)
                    log.flush()
                    on_line(line.rstrip("\n"))
                for event in self.events.poll():
                    on_event(event)
                if timeout_s is not None and time.monotonic() - began > timeout_s:
                    self.terminate()
                    raise TimeoutError(f"qwenkit train ran over {timeout_s:.0f} s; log: {self.run_dir.train_log}")
        code = self.proc.wait()
        for event in self.events.poll():  # written just before the end
            on_event(event)
        return code

    def signal(self, sig: int) -> None:
        """``sig`` to the whole process group (the launcher forwards a stop signal to every rank)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self, grace_s: float = 15) -> None:
        """SIGTERM to the group; SIGKILL after ``grace_s`` if it has not ended."""
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)

    def wait(self) -> int:
        return self.proc.wait()


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)
