"""``qwenkit train`` as clusters start it (qwenkit/cluster.py, examples/, docs/CLUSTERS.md).

Two "nodes" on this machine, each a ``qwenkit train --config <tiny_cpu.yaml, shortened>`` with
nothing else on its command line and the variables Slurm sets (a static rendezvous), then the
variables the Kubeflow operator sets for examples/kubernetes/pytorchjob.yaml (c10d, restarts),
whose rank is SIGKILLed mid-run: the group restarts and ends with the Slurm run's losses. The
manifest is checked against the operator's own models (the ``kubeflow-training`` SDK), the sbatch
script against what cluster.py reads."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from multiproc import free_port, scaled

from qwenkit import cluster
from qwenkit import config as qconfig
from qwenkit.engine.run import events, metrics

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "examples" / "kubernetes" / "pytorchjob.yaml"
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
STEPS = 4  # the kill lands after step 2, the restart resumes from a checkpoint of step 1..3
HANG = 300  # seconds (x QWENKIT_TEST_TIMEOUT_SCALE): a run waiting longer has hung


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of rank ``rank`` under ``launcher`` (launcher -> torchrun -> ranks), None before it starts."""
    stack = [launcher]
    while stack:
        pid = stack.pop()
        try:
            stack += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"qwenkit.engine.run.rank" in cmdline and f"RANK={rank}".encode() in env:
            return pid
    return None


def _losses(out: Path) -> list[float]:
    """Rank 0's loss per step, the last row of a step logged twice (the steps redone after a restart)."""
    loss = metrics.series(metrics.read(out), "loss")
    return [loss[step] for step in sorted(loss)]




def _config(tmp_path: Path, out: Path) -> Path:
    """params/tiny_cpu.yaml, shortened to a few steps of one rank per "node" (checkpoint every step)."""
    cfg = yaml.safe_load((ROOT / "params" / "tiny_cpu.yaml").read_text())
    cfg["data"].update(tiny_samples=16, tiny_eval_samples=0)
    cfg["parallel"].update(nproc=1)
    cfg["train"].update(steps=STEPS, warmup_steps=2, eval_samples=0, eval_every=0, eval_accuracy_every=0, output_dir=str(out))
    cfg["checkpoint"] = {"every": 1, "keep_last": 2}
    cfg["train"]["resume"] = "none"  # the first start's; a restart resumes from the newest checkpoint all the same
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _nodes(config: Path, envs: list[dict[str, str]], tmp_path: Path) -> list[subprocess.Popen]:
    """One ``qwenkit train --config CONFIG`` per node environment, nothing else on the command line."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "MASTER_", "RANK", "WORLD_SIZE"))}
    jobs = []
    for i, env in enumerate(envs):
        with open(tmp_path / f"{config.stem}-node{i}.err", "w") as err:
            jobs.append(subprocess.Popen([sys.executable, "-m", "qwenkit.cli", "train", "--config", str(config)], cwd=ROOT,
                                         env={**base, **env}, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))  # fmt: skip
    return jobs


def _finish(jobs: list[subprocess.Popen], config: Path, tmp_path: Path) -> list[str]:
    try:
        codes = [job.wait(scaled(HANG)) for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    errs = [(tmp_path / f"{config.stem}-node{i}.err").read_text() for i in range(len(jobs))]
    assert codes == [0] * len(jobs), "\n".join(e[-2500:] for e in errs)
    return errs


def _slurm_env(node: int, job_id: int) -> dict[str, str]:
    """What Slurm sets in the task of ``srun --ntasks-per-node=1`` on node ``node`` of 2."""
    hosts = "127.0.0.[1-2]"  # the first host holds the rendezvous: this machine
    return {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NAME": "qwenkit", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_JOB_NODELIST": hosts, "SLURM_NODELIST": hosts, "SLURM_STEP_NODELIST": hosts, "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": str(node), "SLURM_PROCID": str(node),
            "SLURM_LOCALID": "0", "SLURMD_NODENAME": f"127.0.0.{node + 1}"}  # fmt: skip


def _operator_env(manifest: dict, pod: int, port: int) -> dict[str, str]:
    """What the training operator (v1.9, pkg/controller.v1/pytorch: envvar.go, elastic.go) sets in
    Worker pod ``pod`` of ``manifest``, with worker 0's service at 127.0.0.1:``port`` and one
    process per pod (this machine has no GPUs)."""
    spec, elastic = manifest["spec"], manifest["spec"]["elasticPolicy"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    name = manifest["metadata"]["name"]
    nnodes = f"{elastic['minReplicas']}:{elastic['maxReplicas']}" if "minReplicas" in elastic else str(worker["replicas"])
    env = {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": "1", "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
           "PET_RDZV_BACKEND": elastic.get("rdzvBackend", "c10d"), "PET_NNODES": nnodes,
           "HOSTNAME": f"{name}-worker-{pod}"}  # fmt: skip
    if "maxRestarts" in elastic:
        env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
    if "rdzvId" in elastic:
        env["PET_RDZV_ID"] = elastic["rdzvId"]
    return env


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory):
    """Two Slurm "nodes" train to the end (static rendezvous); their losses are the reference."""
    tmp_path = tmp_path_factory.mktemp("slurm")
    port = next(p for p in iter(free_port, None) if cluster.SLURM_PORT_BASE <= p < 2 * cluster.SLURM_PORT_BASE)
    config = _config(tmp_path, tmp_path / "slurm")
    jobs = _nodes(config, [_slurm_env(node, port - cluster.SLURM_PORT_BASE) for node in (0, 1)], tmp_path)
    errs = _finish(jobs, config, tmp_path)
    return tmp_path / "slurm", errs


@pytest.mark.slow
def test_two_slurm_nodes_train_with_no_flags(slurm_run):
    out, errs = slurm_run
    assert "rendezvous from Slurm: nnodes=2 (SLURM_STEP_NUM_NODES=2), node_rank=1 (SLURM_NODEID=1)" in errs[1]
    assert len(_losses(out)) == STEPS
    assert {e["world_size"] for e in events.read(out) if e["event"] == "started"} == {2}


@pytest.mark.slow
@pytest.mark.long
def test_two_pytorchjob_pods_restart_after_a_killed_rank_and_end_with_the_uninterrupted_losses(slurm_run, tmp_path):
    manifest = yaml.safe_load(MANIFEST.read_text())
    port, out = free_port(), tmp_path / "pytorchjob"
    config = _config(tmp_path, out)
    jobs = _nodes(config, [_operator_env(manifest, pod, port) for pod in (0, 1)], tmp_path)
    try:
        deadline = time.monotonic() + scaled(HANG)
        while not any(e["event"] == "step" and e["step"] >= 2 for e in events.read(out)):  # mid-run
            assert all(j.poll() is None for j in jobs) and time.monotonic() < deadline, "a pod ended before step 2"
            time.sleep(0.05)
        victim = next(pid for pid in (_rank_pid(j.pid, 1) for j in jobs) if pid is not None)
        os.kill(victim, signal.SIGKILL)
    finally:
        errs = _finish(jobs, config, tmp_path)
    assert all("c10d rendezvous 'qwenkit-7b' at 127.0.0.1:" in e for e in errs)
    assert any("qwenkit train: the group failed; restart 1 of 3" in e for e in errs)
    resumed = events.resumed_step(events.read(out))
    assert resumed is not None and 1 <= resumed < STEPS  # the newest complete checkpoint before the kill
    # the data order and the weights after the restart are the resumed ones: fp32 on two ranks of
    # one machine, equal to the run that was never interrupted up to float rounding
    torch.testing.assert_close(torch.tensor(_losses(out)), torch.tensor(_losses(slurm_run[0])), rtol=1e-6, atol=0)
    assert len(_losses(out)) == STEPS


def _check_against_models(value, kind: str, where: str, models) -> list[str]:
    """Problems of ``value`` as the swagger type ``kind`` of the operator's SDK (``str``,
    ``list[X]``, ``dict(str, X)``, a model class name): unknown keys, wrong types, missing required fields."""
    scalars = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}
    if kind in scalars:
        ok = isinstance(value, scalars[kind]) and not (kind == "int" and isinstance(value, bool))
        return [] if ok else [f"{where}: {value!r} is not {kind}"]
    if kind.startswith("list["):
        if not isinstance(value, list):
            return [f"{where}: not a list"]
        return [p for i, v in enumerate(value) for p in _check_against_models(v, kind[5:-1], f"{where}[{i}]", models)]
    if kind.startswith("dict("):
        inner = kind[kind.index(",") + 1 : -1].strip()
        if not isinstance(value, dict):
            return [f"{where}: not a mapping"]
        return [p for k, v in value.items() for p in _check_against_models(v, inner, f"{where}.{k}", models)]
    model = next(getattr(m, kind) for m in models if hasattr(m, kind))
    if not isinstance(value, dict):
        return [f"{where}: not a {kind} mapping"]
    by_json = {j: a for a, j in model.attribute_map.items()}
    problems = [f"{where}.{k}: no such field in {kind}" for k in value if k not in by_json]
    for key, item in value.items():
        if key in by_json:
            problems += _check_against_models(item, model.openapi_types[by_json[key]], f"{where}.{key}", models)
    return problems


def test_the_pytorchjob_manifest_is_one_the_operator_accepts():
    """Every field of the manifest against the training operator's generated models (kubeflow.org/v1
    and the Kubernetes core types they embed), then built into those models (required fields)."""
    training = pytest.importorskip("kubeflow.training.models")
    kube = pytest.importorskip("kubernetes.client.models")
    # the SDK's client resolves the V1* names to the kubernetes models it imports
    from kubeflow.training.api_client import ApiClient

    manifest = yaml.safe_load(MANIFEST.read_text())
    assert manifest["apiVersion"] == "kubeflow.org/v1" and manifest["kind"] == "PyTorchJob"
    assert _check_against_models(manifest, "KubeflowOrgV1PyTorchJob", "pytorchjob", [training, kube]) == []

    class Response:  # what ApiClient.deserialize reads: the manifest as a server's JSON answer
        data = json.dumps(manifest)

    job = ApiClient().deserialize(Response(), "KubeflowOrgV1PyTorchJob")  # raises on a missing required field
    worker = job.spec.pytorch_replica_specs["Worker"]
    # ExitCode: 1-127 fail the job, 128-255 recreate the pod (the operator's IsRetryableExitCode)
    assert worker.restart_policy == "ExitCode"
    container = next(c for c in worker.template.spec.containers if c.name == "pytorch")  # the operator's default container
    assert "pytorchjob-port" in [p.name for p in container.ports]  # PET_RDZV_ENDPOINT's port comes from it
    script = container.args[0]
    assert 'if [ "$code" -eq 75 ]; then exit 143; fi' in script and "trap 'kill -TERM" in script
    subprocess.run(["bash", "-n", "-c", script], check=True)
    # the grace period covers a step and a checkpoint save after SIGTERM
    assert worker.template.spec.termination_grace_period_seconds >= 300
    mounts = {m.mount_path: m.name for m in container.volume_mounts}
    volumes = {v.name: v for v in worker.template.spec.volumes}
    out = re.search(r"train\.output_dir=(\S+)", script).group(1)
    shared = next(path for path in mounts if out.startswith(path + "/"))
    assert volumes[mounts[shared]].persistent_volume_claim is not None  # one output dir that every pod sees
    # and the environment the operator derives from it is one qwenkit train reads without flags
    rdzv, nproc, _ = cluster.resolve(dict.fromkeys(cluster.FLAGS), _operator_env(manifest, 1, 23456))
    rdzv = cluster.settle(rdzv, qconfig.load().parallel)
    assert (rdzv.backend, rdzv.rdzv_id, rdzv.max_restarts, rdzv.nodes) == ("c10d", "qwenkit-7b", 3, "2")


def test_the_sbatch_script_runs_one_launcher_per_node_on_what_cluster_py_reads():
    text = SBATCH.read_text()
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    directives = dict(
        (line.split()[1].split("=", 1) + [""])[:2] for line in text.splitlines() if line.startswith("#SBATCH ")
    )
    assert directives["--ntasks-per-node"] == "1" and directives["--signal"] == "B:USR1@120" and "--requeue" in directives
    # the srun line: one `qwenkit train` per node, its overrides valid config keys
    srun = " ".join(text.split("\nsrun ", 1)[1].split(" &\n", 1)[0].split("\\\n"))
    words = shlex.split(srun.replace('"$CONFIG"', "CONFIG").replace('"$MAX_RESTARTS"', "3").replace('"$@"', ""))
    assert "--ntasks-per-node=1" in words
    train = words[words.index("qwenkit") :]
    assert train[:4] == ["qwenkit", "train", "--config", "CONFIG"]
    cfg = qconfig.load(None, train[4:])
    assert (cfg.parallel.rendezvous, cfg.parallel.max_restarts) == ("c10d", 3)
    # exit 75 (a checkpoint saved on USR1) requeues the job
    assert "EXIT_RESUMABLE=75" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    # the variables the header says qwenkit reads are the ones qwenkit/cluster.py reads
    said = set(re.findall(r"\b(SLURM_[A-Z_]+)", text.split("#SBATCH", 1)[0]))
    read = set(re.findall(r'"(SLURM_[A-Z_]+)"', (ROOT / "qwenkit" / "cluster.py").read_text()))
    assert said == read


def test_ranks_that_saved_and_stopped_are_not_restarted():
    """Exit 75 is a stop that was asked for (a signal, ``train.stop_after``): torchrun's restart
    budget is emptied so the job ends with 75; any other failure keeps it."""
    from types import SimpleNamespace

    from qwenkit import torchrun

    for codes, left in (([75, 75], 0), ([75], 0), ([75, 1], 3), ([-9], 3), ([], 3)):
        agent = SimpleNamespace(_remaining_restarts=3)
        result = SimpleNamespace(failures={r: SimpleNamespace(exitcode=c) for r, c in enumerate(codes)})
        assert torchrun._stops_are_not_failures(lambda self, group, r=result: r)(agent, None) is result
        assert agent._remaining_restarts == left, codes
