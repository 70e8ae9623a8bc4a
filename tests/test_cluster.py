"""The rendezvous read from a scheduler's environment (qwenkit/cluster.py): what each one sets,
flags against it, and the contradictions refused before any process starts."""

from __future__ import annotations

import re

import pytest

from qwenkit import cli, cluster, launch

NO_FLAGS = dict.fromkeys(cluster.FLAGS)
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09,11]",
         "SLURM_GPUS_ON_NODE": "8"}  # fmt: skip
PYTORCHJOB = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1",
              "PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1"}  # fmt: skip
DLC = {"MASTER_ADDR": "dlc-master", "MASTER_PORT": "29500", "WORLD_SIZE": "3", "RANK": "2"}
# a PyTorchJob with an elasticPolicy (Worker replicas only): the operator's elastic.go variables, no node rank
ELASTIC = {"PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "1:2",
           "PET_MAX_RESTARTS": "3", "PET_RDZV_ID": "job", "PET_NPROC_PER_NODE": "4"}  # fmt: skip


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("gpu[8-10]-ib", ["gpu8-ib", "gpu9-ib", "gpu10-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x[009-011],y", ["x009", "x010", "x011", "y"]),
    ],
)
def test_slurm_nodelists_expand_like_scontrol_show_hostnames(text, hosts):
    assert cluster.expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    ("env", "want", "nproc"),
    [
        (SLURM, cluster.Rendezvous(4, 2, "gpu07", cluster.SLURM_PORT_BASE + 4242, rdzv_id="slurm-4242"), 8),
        (SLURM | {"MASTER_PORT": "31000", "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NUM_TASKS": "4"},
         cluster.Rendezvous(4, 2, "gpu07", 31000, rdzv_id="slurm-4242"), 8),
        (PYTORCHJOB, cluster.Rendezvous(2, 1, "job-master-0", 23456), 4),
        (PYTORCHJOB | {"WORLD_SIZE": "8", "RANK": "5"}, cluster.Rendezvous(2, 1, "job-master-0", 23456), 4),  # processes
        (DLC, cluster.Rendezvous(3, 2, "dlc-master", 29500), None),
        (ELASTIC, cluster.Rendezvous(1, 0, "job-worker-0", 23456, 2, "c10d", "job", 3,
                                     "PET_RDZV_BACKEND=c10d, PET_MAX_RESTARTS=3"), 4),
        ({}, cluster.Rendezvous(), None),
    ],
)  # fmt: skip
def test_each_scheduler_environment_gives_the_rendezvous(env, want, nproc):
    rdzv, got_nproc, said = cluster.resolve(NO_FLAGS, env)
    assert (rdzv, got_nproc) == (want, nproc)
    assert (said is None) == (not env)
    if env:
        assert said.startswith(f"rendezvous from {cluster.from_environment(env).scheduler}: nnodes={want.nodes} (")


def test_flags_win_for_address_port_and_processes():
    flags = NO_FLAGS | {"master_addr": "10.0.0.7", "master_port": 1234, "nproc": 2, "nnodes": "4", "node_rank": 2}
    rdzv, nproc, said = cluster.resolve(flags, SLURM)
    assert rdzv == cluster.Rendezvous(4, 2, "10.0.0.7", 1234, rdzv_id="slurm-4242") and nproc == 2
    assert "master_addr=10.0.0.7 (--master-addr)" in said and "nnodes=4 (--nnodes)" in said


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        (SLURM, {"nnodes": 2}, "--nnodes 2 contradicts Slurm: SLURM_NNODES=4"),
        (SLURM, {"node_rank": 0}, "--node-rank 0 contradicts Slurm: SLURM_NODEID=2"),
        (SLURM | {"SLURM_JOB_NODELIST": "gpu[07-08]"}, {}, "SLURM_NNODES=4 but SLURM_JOB_NODELIST='gpu[07-08]' names 2"),
        (SLURM | {"SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NUM_TASKS": "32"}, {}, "run one per node (srun --ntasks-per-node=1)"),
        (PYTORCHJOB | {"WORLD_SIZE": "3"}, {}, "WORLD_SIZE=3 is neither the pods (PET_NNODES=2) nor the processes"),
        (PYTORCHJOB | {"RANK": "0"}, {}, "RANK=0 (the pod's index) but PET_NODE_RANK=1"),
        (PYTORCHJOB | {"PET_NNODES": "1:2"}, {}, "PET_NNODES=1:2 asks for an elastic job (MIN:MAX nodes) without a c10d"),
        (PYTORCHJOB | {"PET_NNODES": "3:2"}, {}, "PET_NNODES='3:2' must be a number of nodes N or a range MIN:MAX"),
        (ELASTIC | {"PET_RDZV_BACKEND": "etcd"}, {}, "PET_RDZV_BACKEND=etcd: qwenkit train supports the c10d"),
        (ELASTIC, {"nnodes": "2"}, "--nnodes 2 contradicts PyTorchJob: PET_NNODES=1:2"),
        ({}, {"nnodes": "0:2"}, "--nnodes='0:2' must be a number of nodes N or a range MIN:MAX with 1 <= MIN <= MAX"),
        (DLC | {"RANK": "3"}, {}, "node rank 3 outside [0, 3)"),
        (SLURM | {"SLURM_NNODES": "four"}, {}, "SLURM_NNODES='four' is not a whole number"),
    ],
)  # fmt: skip
def test_contradictions_are_refused_naming_what_was_found_where(env, flags, message):
    with pytest.raises(cluster.ClusterError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        cluster.resolve(NO_FLAGS | flags, env)


def test_train_refuses_a_contradiction_before_spawning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("torchrun must not start"))
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["train", "--nnodes", "2", f"train.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("qwenkit train: --nnodes 2 contradicts Slurm: SLURM_NNODES=4; drop --nnodes "
                           "(the scheduler started one launcher per node)")  # fmt: skip


def _parallel(**keys):
    from qwenkit import config as qconfig

    return qconfig.load(overrides=[f"parallel.{k}={v}" for k, v in keys.items()]).parallel


@pytest.mark.parametrize(
    ("flags", "env", "keys", "want"),
    [
        ({}, {}, {}, cluster.Rendezvous()),  # one node, no scheduler: static, as before
        ({"nnodes": "2", "master_addr": "10.0.0.1"}, {}, {"rendezvous": "c10d", "rdzv_id": "run7", "max_restarts": 2},
         cluster.Rendezvous(2, 0, "10.0.0.1", None, None, "c10d", "run7", 2)),
        ({"nnodes": "1:4", "master_addr": "h"}, {}, {"rdzv_id": "x"}, cluster.Rendezvous(1, 0, "h", None, 4, "c10d", "x")),
        ({}, SLURM, {"rendezvous": "c10d"}, cluster.Rendezvous(4, 0, "gpu07", 24242, None, "c10d", "slurm-4242")),
        ({}, ELASTIC, {}, cluster.Rendezvous(1, 0, "job-worker-0", 23456, 2, "c10d", "job", 3,
                                             "PET_RDZV_BACKEND=c10d, PET_MAX_RESTARTS=3")),
        ({}, ELASTIC, {"max_restarts": 1}, cluster.Rendezvous(1, 0, "job-worker-0", 23456, 2, "c10d", "job", 1,
                                                              "PET_RDZV_BACKEND=c10d, PET_MAX_RESTARTS=3")),
    ],
)  # fmt: skip
def test_the_config_settles_the_rendezvous(flags, env, keys, want):
    rdzv, _, _ = cluster.resolve(NO_FLAGS | flags, env)
    assert cluster.settle(rdzv, _parallel(**keys)) == want


def test_c10d_on_one_node_makes_up_its_own_id():
    rdzv = cluster.settle(cluster.Rendezvous(), _parallel(rendezvous="c10d", max_restarts=1))
    assert (rdzv.backend, rdzv.max_restarts, rdzv.nodes) == ("c10d", 1, "1") and rdzv.rdzv_id.startswith("qwenkit-")
    assert cluster.settle(cluster.Rendezvous(), _parallel(rendezvous="c10d")).rdzv_id != rdzv.rdzv_id


@pytest.mark.parametrize(
    ("flags", "env", "keys", "message"),
    [
        ({"nnodes": "2"}, {}, {"rendezvous": "c10d"}, "parallel.rendezvous=c10d on 2 nodes needs parallel.rdzv_id"),
        ({"nnodes": "1:2"}, {}, {"rendezvous": "static"}, "--nnodes 1:2 is a range of nodes: it needs parallel.rendezvous=c10d"),
        ({}, ELASTIC, {"rendezvous": "static"},
         "parallel.rendezvous=static, but the scheduler set a c10d rendezvous (PET_RDZV_BACKEND=c10d, PET_MAX_RESTARTS=3)"),
        ({}, ELASTIC | {"PET_RDZV_ID": ""}, {}, "parallel.rendezvous=c10d on 1:2 nodes needs parallel.rdzv_id"),
    ],
)  # fmt: skip
def test_rendezvous_combinations_torchrun_cannot_run_are_refused(flags, env, keys, message):
    rdzv, _, _ = cluster.resolve(NO_FLAGS | flags, env)
    with pytest.raises(cluster.ClusterError, match=re.escape(message)):
        cluster.settle(rdzv, _parallel(**keys))


def test_restarts_on_a_static_rendezvous_are_a_config_error():
    from qwenkit import config as qconfig

    with pytest.raises(qconfig.ConfigError, match=re.escape("parallel.max_restarts=2 needs parallel.rendezvous=c10d")):
        _parallel(rendezvous="static", max_restarts=2)
    with pytest.raises(qconfig.ConfigError, match=re.escape("parallel.max_restarts must be in [0, 100], got -1")):
        _parallel(max_restarts=-1)
