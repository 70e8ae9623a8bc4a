"""qwenkit.torchrun: the variables a rank gets, exit codes as a shell reports them, the first failure; and on real
``qwenkit train`` jobs (2 gloo ranks, :mod:`jobs`): a killed launcher or torchrun takes the ranks with it, a killed
or hung rank is named (issue #23)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from jobs import ROOT, STEPS, Job, checkpoints, gone

from qwenkit import torchrun
from qwenkit.engine.run import stopping


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


# ---------------------------------------------------------------------------------------------
# a killed launcher or torchrun: no orphan ranks


@pytest.mark.slow
@pytest.mark.long
def test_a_killed_launcher_group_takes_torchrun_and_the_ranks_with_it(tmp_path):
    out = tmp_path / "run"
    job = Job(out)
    ranks, torchrun = job.running()
    os.killpg(job.proc.pid, signal.SIGKILL)  # the launcher's whole process group
    job.wait()
    assert gone([*torchrun, *ranks.values()], timeout=120), "torchrun or ranks still running without the launcher"
    # torchrun got SIGTERM when the launcher died, so the ranks saved on their way out
    assert len(checkpoints(out)) == 1 and 2 <= checkpoints(out)[0] < STEPS  # not orphans that trained on


@pytest.mark.slow
@pytest.mark.long
def test_a_killed_torchrun_takes_the_ranks_with_it(tmp_path):
    out = tmp_path / "run"
    job = Job(out)
    ranks, (torchrun,) = job.running()
    os.kill(torchrun, signal.SIGKILL)
    assert job.wait() == 128 + signal.SIGKILL
    assert gone(ranks.values(), timeout=60), "ranks still training after torchrun died"
    assert checkpoints(out) == []  # they died with it: no orphan trained on to a final save


# ---------------------------------------------------------------------------------------------
# a killed rank, a hung rank: the one that failed first is named


@pytest.mark.slow
def test_the_rank_killed_first_is_named_with_its_signal_and_code(tmp_path):
    out = tmp_path / "run"
    job = Job(out)
    ranks, _ = job.running()
    os.kill(ranks[1], signal.SIGKILL)
    code = job.wait()
    err = job.text("stderr")
    assert code == 128 + signal.SIGKILL, err[-3000:]
    named = re.findall(r"^qwenkit train: rank (\d) \(pid (\d+)\) failed first: killed by (SIG\w+)", err, flags=re.M)
    assert named == [("1", str(ranks[1]), "SIGKILL")], err[-3000:]
    assert "the rank that failed first is named above" in err.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_hung_rank_times_out_and_is_named(tmp_path):
    out = tmp_path / "run"
    job = Job(out, "parallel.timeout_s=8")
    ranks, _ = job.running()
    began = time.monotonic()
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        failed = job.wait_for_event("failed")  # the rank that found the silence reports it in the event stream
    finally:
        try:
            os.kill(ranks[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
    waited = time.monotonic() - began
    found = re.match(r"qwenkit train: rank 0 failed: .*stopped answering: rank 1 \(silent for (\d+) s", failed["summary"])
    assert found and failed["rank"] == 0, failed
    assert int(found.group(1)) >= 4 and waited < 8 + 120  # parallel.timeout_s, not gloo's 30 minutes
    assert job.wait() != 0


def test_torchrun_process_does_not_import_the_training_kit():
    # The launcher process only supervises the ranks; importing transformers and distributed
    # checkpointing there cost every `qwenkit train` ~2 s before any rank started.
    code = "import sys, qwenkit.torchrun; print(sorted(m for m in ('transformers', 'qwenkit.model', 'qwenkit.engine.checkpoints.dcp') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# the launcher's death is one stop, a second signal another (issue 46.5, docs/TESTING.md)

RANK = """import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
open(os.path.join(sys.argv[1], "ready-" + os.environ["RANK"]), "w").close()
while not got:
    time.sleep(0.01)
time.sleep(2.0)  # "saving a checkpoint": a second signal would land here
with open(os.path.join(sys.argv[1], "signals-" + os.environ["RANK"]), "w") as f:
    f.write(str(len(got)))
sys.exit(75)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sent, each_rank_gets", [
    ([stopping.LAUNCHER_DIED] * 3, 1),  # the kernel's parent-death signal, once per exiting launcher thread
    # a person's second signal (through the launcher): stop at once (CI runs test_stopping's end to end)
    pytest.param([signal.SIGTERM, signal.SIGTERM], 2, marks=pytest.mark.long),
])  # fmt: skip
def test_the_launchers_death_is_one_stop_however_often_it_is_signalled(tmp_path, sent, each_rank_gets):
    """torch's agent stops the ranks again when a signal lands in its shutdown (``run``'s ``finally``):
    the ranks then get SIGTERM twice and stop without their checkpoint. The parent-death signal comes
    once per thread of the dying launcher that exits after the one that started torchrun (measured
    under load: twice in 1 of 30 deaths of a 2-thread parent, two or three times in 10 of 25 of a 65-thread one), so qwenkit.torchrun takes it once; a deliberate second SIGTERM still
    reaches the ranks."""
    from multiproc import free_port

    from qwenkit.launch import torchrun_stop_options

    (tmp_path / "rank.py").write_text(RANK)
    cmd = [sys.executable, "-m", "qwenkit.torchrun", *torchrun_stop_options(), "--nnodes=1", "--nproc-per-node=2",
           "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=0",
           str(tmp_path / "rank.py"), str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    for sig in sent:
        proc.send_signal(sig)
        time.sleep(0.2)  # each one handled before the next: torchrun is in its shutdown from the first on
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == stopping.EXIT_RESUMABLE, out[-3000:]
    assert [(tmp_path / f"signals-{r}").read_text() for r in (0, 1)] == [str(each_rank_gets)] * 2, out[-3000:]


def test_an_eval_rank_that_said_its_input_error_is_not_announced_again(tmp_path):
    """``qwenkit eval --nproc N``'s ranks print a user error in one line and exit 2 (cli.main): the wrapper
    adds no 'qwenkit train: rank 0 ... failed first' line (nor torch's own) to it, and keeps the status."""
    script = tmp_path / "rank.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '0':\n    print('qwenkit eval: --data x.json: row 3 is bad', "
                      "file=sys.stderr)\nsys.exit(2)\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "qwenkit.torchrun", "--standalone", "--nproc-per-node=2", str(script)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), torchrun.COMMAND_ENV: "eval"})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "qwenkit" in line or "exitcode" in line] == [
        "qwenkit eval: --data x.json: row 3 is bad"], proc.stderr  # fmt: skip


def test_a_rank_input_error_is_not_restarted(tmp_path):
    """A bad row or a reward's bad value fails every attempt alike: with ``parallel.max_restarts`` the group is
    not restarted for it (each restart would read the same rows again), the rank's one line is the output."""
    from multiproc import free_port

    from qwenkit.engine.run.events import EventLog

    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys\nfrom pathlib import Path\nfrom qwenkit.engine.run.events import EventLog\n"
        "out = Path(sys.argv[1])\n(out / f\"start-{os.environ['RANK']}-{os.environ['TORCHELASTIC_RESTART_COUNT']}\").touch()\n"
        "if os.environ['RANK'] == '0':\n"
        "    EventLog(out, 0).failed(ValueError('x'), 'qwenkit train: data.json: row 3: bad_format', user_input=True)\n"
        "    print('qwenkit train: data.json: row 3: bad_format', file=sys.stderr)\n"
        "    (out / 'reported').touch()\n"
        "else:  # the others fail after it, as ranks waiting on the failed one do (else the group may fail first)\n"
        "    import time\n"
        "    deadline = time.monotonic() + 120\n"
        "    while not (out / 'reported').exists() and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "sys.exit(1)\n")  # fmt: skip
    EventLog(tmp_path, 0)  # the launcher's events.jsonl exists before the ranks start
    cmd = [sys.executable, "-m", "qwenkit.torchrun", f"--events-dir={tmp_path}", "--nnodes=1", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=2",
           str(script), str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("start-*")) == ["start-0-0", "start-1-0"], proc.stderr[-3000:]
    assert "restart" not in proc.stderr, proc.stderr[-3000:]
