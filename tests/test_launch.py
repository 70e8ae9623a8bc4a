"""``qwenkit train`` end to end through torchrun (2 gloo ranks), its failures, and the cluster script."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multiproc import free_port, scaled
from transformers import Qwen2_5_VLForConditionalGeneration

from qwenkit import cli, launch
from qwenkit import config as qconfig
from qwenkit.engine.generation import generate
from qwenkit.engine.run import events, metrics, prespawn

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["train.steps=3", "data.tiny_samples=16", "checkpoint.every=0", "data.tiny_eval_samples=4", "train.eval_samples=2",
         "parallel.allow_oversubscribe=true"]  # 2 ranks pass on a machine with fewer cores too (slowly)


def _qwenkit(*args, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "qwenkit.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=scaled(timeout)
    )


def _train(tmp_path, *overrides, nproc=2):
    out = tmp_path / "run"
    proc = _qwenkit(
        "train", "--config", "params/tiny_cpu.yaml", "--nproc", str(nproc), "--master-port", str(free_port()),
        *SMALL, f"train.output_dir={out}", *overrides,
    )  # fmt: skip
    return proc, out


@pytest.mark.slow
def test_train_then_export(tmp_path):
    # also the keys other launches leave at their defaults: torchrun's c10d rendezvous with restarts
    # allowed, and replies generated in lockstep from the sharded model
    proc, out = _train(tmp_path, "train.eval_accuracy_every=2", "parallel.rendezvous=c10d", "parallel.rdzv_id=export7",
                       "parallel.max_restarts=1", "train.eval_generation=lockstep")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "c10d rendezvous 'export7'" in proc.stderr and "1 restart(s)" in proc.stderr
    assert "--rdzv-backend=c10d" in proc.stdout and "--max-restarts=1" in proc.stdout
    assert "(lockstep; then generation" in (out / "logs" / "rank-00000.log").read_text()
    assert (out / "config.yaml").is_file()
    assert (out / "checkpoints" / "step-00000003" / "COMPLETE.json").is_file()
    for rank in (0, 1):
        rows = [r for r in metrics.read(out) if r["rank"] == rank]
        assert {r["metric"] for r in rows} == set(metrics.RUN_UNITS)
        assert sorted({r["x"] for r in rows}) == [0, 1, 2, 3]  # x = 0: the eval before the first step
        assert sorted(metrics.series(rows, "eval_accuracy", rank)) == [0, 2, 3]  # and every 2 steps
        assert sorted(metrics.series(rows, "eval_loss", rank)) == [0, 2, 3]
        assert all(r["rank"] == rank and r["device"] == "cpu" for r in rows)
    written = events.read(out)  # what the run tells other programs; its console lines are for people
    assert [e["step"] for e in written if e["event"] == "step"] == [1, 2, 3] and "step 3/3  loss" in proc.stdout
    assert [(e["step"], "eval_loss" in e) for e in written if e["event"] == "eval"] == [(0, True), (2, True), (3, True)]
    assert events.last(written, "stopped")["reason"] == "completed"
    assert len(generate.read_jsonl(out / "eval" / "step-000003.jsonl")) == 2
    assert len(generate.read_jsonl(out / "eval" / "step-000002.jsonl")) == 2
    assert "part" in proc.stderr and "trainable" in proc.stderr  # the parameter manifest is logged

    exported = _qwenkit("export", str(out), str(tmp_path / "hf"))  # finds out/config.yaml itself
    assert exported.returncode == 0, exported.stderr
    Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "hf")

    # qwenkit eval on the run (its newest checkpoint, its own eval set) gives the trainer's numbers
    evaluated = _qwenkit("eval", str(out), "--samples", "2")
    assert evaluated.returncode == 0, evaluated.stderr
    logged = {m: metrics.series(metrics.read(out / "metrics" / "rank-00000.jsonl"), m)[3] for m in ("eval_loss", "eval_accuracy")}
    assert f"eval_loss {logged['eval_loss']:.4f}" in evaluated.stdout
    assert f"eval_accuracy {logged['eval_accuracy']:.4f}" in evaluated.stdout
    assert generate.read_jsonl(out / "eval" / "cli-step-00000003.jsonl") == generate.read_jsonl(
        out / "eval" / "step-000003.jsonl"
    )
    held_out = out / "eval" / "held_out.jsonl"  # the export, with another data file and sample count
    held_out.write_text("".join(json.dumps(r) + "\n" for r in _tiny_rows(3)))
    evaluated = _qwenkit("eval", str(tmp_path / "hf"), "--data", str(held_out), "--samples", "3",
                         "--config", str(out / "config.yaml"))  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    assert "eval_loss " in evaluated.stdout and "/3 exact matches)" in evaluated.stdout
    assert len(generate.read_jsonl(tmp_path / "hf" / "eval" / "cli-hf.jsonl")) == 3


OMNI = ["train.steps=2", "data.tiny_samples=16", "data.tiny_eval_samples=4", "train.eval_samples=4", "checkpoint.every=0",
        "parallel.allow_oversubscribe=true"]  # fmt: skip


def _omni_train(out, *overrides):
    return _qwenkit("train", "--config", "params/tiny_qwen3_omni_cpu.yaml", "--nproc", "2", "--master-port",
                    str(free_port()), f"train.output_dir={out}", *overrides)  # fmt: skip


@pytest.mark.slow
def test_the_omni_tone_run_trains_on_audio_and_scores_its_held_out_tones(tmp_path):
    """params/tiny_qwen3_omni_cpu.yaml, two steps: audio rows reach both ranks' thinker and the held-out tones are
    generated and scored (the full run, which learns them: the long test below)."""
    proc = _omni_train(tmp_path / "run", *OMNI)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = metrics.read(tmp_path / "run")
    assert sorted(metrics.series(rows, "eval_accuracy", 0)) == [0, 2]
    replies = generate.read_jsonl(tmp_path / "run" / "eval" / "step-000002.jsonl")
    assert len(replies) == 4 and all(r["reference"] in ("Low.", "Mid.", "High.") for r in replies)


@pytest.mark.slow
@pytest.mark.long
def test_the_omni_tone_run_learns_to_hear(tmp_path):
    """The whole params/tiny_qwen3_omni_cpu.yaml (~3 min on 2 cores): held-out accuracy from chance or below at
    step 0 to at least 0.9 at the end (three pitches: a model that does not hear stays near a third)."""
    proc = _omni_train(tmp_path / "run", "parallel.allow_oversubscribe=true")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accuracy = metrics.series(metrics.read(tmp_path / "run"), "eval_accuracy", 0)
    first, last = accuracy[0], accuracy[max(accuracy)]
    assert first < 0.5 and last >= 0.9, accuracy


def _tiny_rows(n):
    """The first n rows of the tiny eval set, with absolute image paths (so the file may live anywhere)."""
    from qwenkit.model.tiny.data import EVAL_SEED, ensure_dataset

    path = ensure_dataset(4, seed=EVAL_SEED)
    rows = json.loads(path.read_text())[:n]
    for row in rows:
        row["images"] = [str(path.parent / image) for image in row["images"]]
    return rows


def test_bad_eval_keys_are_refused_before_any_process_starts(tmp_path):
    out = tmp_path / "run"
    proc = _qwenkit("train", "train.eval_accuracy_every=-1", "train.eval_every=-2", f"train.output_dir={out}")
    assert proc.returncode == 2
    assert "train.eval_accuracy_every must be >= 0" in proc.stderr and "train.eval_every must be >= 0" in proc.stderr
    assert not out.exists() and "torchrun" not in proc.stdout  # nothing written, nothing started


@pytest.mark.slow
def test_a_failing_rank_fails_the_command(tmp_path):
    # a mistake only the ranks can find: the launcher checks module paths, not what they leave trainable
    proc, out = _train(tmp_path, "model.freeze=[model, lm_head]")
    assert proc.returncode != 0
    error = "ValueError: no trainable parameters: model.freeze froze the whole model"
    # the first line about the failure names the rank, the exception and that rank's log
    first = next(line for line in proc.stderr.splitlines() if "Error" in line or "failed" in line)
    found = re.fullmatch(rf"qwenkit train: rank (\d) failed: {re.escape(error)}[^(]* \(log: (.+)\)", first)
    assert found, proc.stderr[-3000:]
    log = Path(found.group(2))
    assert log == out / "logs" / f"rank-0000{found.group(1)}.log"
    assert first in log.read_text() and "Traceback (most recent call last)" in log.read_text()
    # the details below it, once per failed rank: no torchelastic summary repeating them
    failed = len(re.findall(r"^qwenkit train: rank \d failed: ", proc.stderr, flags=re.M))
    assert 1 <= failed <= 2
    assert proc.stderr.count("Traceback (most recent call last)") == failed, proc.stderr[-3000:]
    assert "ChildFailedError" not in proc.stderr


@pytest.mark.slow
def test_nan_is_reported_with_its_step(tmp_path):
    proc, out = _train(tmp_path, "train.lr=1.0e+30", "train.warmup_steps=0", "train.max_grad_norm=0")
    assert proc.returncode != 0
    failed = next((e for e in events.read(out) if e["event"] == "failed"), None)
    found = failed and re.match(r"step (\d+): non-finite loss", failed["message"])
    assert found and failed["error"] == "NonFiniteError", proc.stderr[-3000:]
    logged = metrics.series(metrics.read(out), "loss")
    assert max(logged, default=0) == int(found.group(1)) - 1  # the bad step was never completed


def test_config_is_validated_before_spawning(tmp_path, monkeypatch, capsys):
    def no_spawn(*a, **k):
        raise AssertionError("torchrun must not start on an invalid config")

    monkeypatch.setattr(launch, "spawn", no_spawn)
    out = tmp_path / "run"
    assert cli.main(["train", "train.steps=0", f"train.output_dir={out}"]) == 2
    assert "train.steps must be > 0" in capsys.readouterr().err
    assert cli.main(["train", "model.path=/nowhere", f"train.output_dir={out}"]) == 2
    assert "model.path='/nowhere'" in capsys.readouterr().err
    assert cli.main(["train", "--nnodes", "2", "--node-rank", "2", f"train.output_dir={out}"]) == 2
    assert "--node-rank must be in [0, --nnodes=2)" in capsys.readouterr().err
    assert not out.exists()


def test_a_missing_extra_is_refused_before_spawning_naming_it(tmp_path, monkeypatch, capsys):
    """peft, tensorboard, PyAV, datasets and Liger made unimportable (as when not installed): each
    run that needs one fails before torchrun starts, in one line naming the pip extra."""
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("torchrun must not start"))
    for name in ("peft", "tensorboard", "av", "datasets", "liger_kernel"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    videos = tmp_path / "videos.jsonl"
    row = {"messages": [{"role": "user", "content": "<video>What moves?"}, {"role": "assistant", "content": "A square."}],
           "videos": ["clip.avi"]}  # fmt: skip
    videos.write_text(json.dumps(row) + "\n")
    prompts = tmp_path / "prompts.jsonl"  # GRPO's: a prompt alone, its answer column the reference
    prompts.write_text(json.dumps({"problem": "<video>What moves?", "answer": "a square", "videos": ["clip.avi"]}) + "\n")
    hf = tmp_path / "hf"  # what datasets' save_to_disk writes
    hf.mkdir()
    (hf / "state.json").write_text("{}")
    (hf / "dataset_info.json").write_text("{}")
    out = tmp_path / "run"
    cases = [
        ("lora", ["lora.r=8"]),
        ("tensorboard", ["train.report_to=[tensorboard]"]),
        ("video", [f"data.path={videos}"]),
        ("video", [f"data.path={prompts}", "train.objective=grpo"]),
        ("datasets", [f"data.path={hf}"]),
        ("cuda", ["model.fused_backend=cuda"]),
    ]
    for extra, overrides in cases:
        assert cli.main(["train", *overrides, f"train.output_dir={out}"]) == 2, extra
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if f"pip install 'qwenkit[{extra}]'" in line]
        assert len(lines) == 1, (extra, err)
        assert "Traceback" not in err
    assert not (out / "config.yaml").exists()


def test_readme_install_line_lists_every_extra():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if x.startswith("pip install -e"))
    assert set(extras) <= set(re.findall(r"[\w-]+", line.split("# extras:", 1)[1])), line  # an extra may hold a hyphen


def test_module_paths_are_checked_on_the_meta_model_before_spawning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: 0)
    from qwenkit.model.families import registry as family

    reads = []  # no weights are read: the check builds the module tree on meta, never from_pretrained
    cls = family.get("qwen2_5_vl").load("subclass")
    monkeypatch.setattr(cls, "from_pretrained", classmethod(lambda *a, **k: reads.append(a)))
    out = tmp_path / "run"
    bad = ["parallel.shard_patterns=[model.visual.blocks.*, model.decoder.layers.*, lm_head]",
           "parallel.recompute=[model.language_model.layer.*]", "model.freeze=[model.visual, model.vision]"]  # fmt: skip
    assert cli.main(["train", *bad, f"train.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "parallel.shard_patterns: pattern 'model.decoder.layers.*' matches no module" in err
    assert "parallel.recompute: pattern 'model.language_model.layer.*' matches no module" in err
    assert "model.freeze: no module 'model.vision'" in err
    assert "model.visual.blocks" not in err and "'model.visual'" not in err  # the good ones pass
    assert not out.exists() and not reads
    good = ["parallel.recompute=[model.language_model.layers.*]", "model.freeze=[model.visual]"]
    assert cli.main(["train", *good, f"train.output_dir={out}"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("version, refused", [("2.7.1", True), ("2.7.1+cpu", True), ("2.13.0", False)])
def test_hsdp_on_gloo_is_refused_before_spawning_on_old_torch(tmp_path, monkeypatch, capsys, version, refused):
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: 0)  # a run that would start reports success
    out = tmp_path / "run"
    code = cli.main(["train", "--nproc", "2", "parallel.hsdp_replicas=2", "parallel.device=cpu", f"train.output_dir={out}"])
    err = capsys.readouterr().err
    assert (code == 2) == refused, err
    assert ("parallel.hsdp_replicas=2 on gloo needs torch >= 2.8" in err) == refused
    assert (not out.exists()) == refused


def test_more_ranks_than_cores_or_accelerators_are_refused_before_spawning(tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(launch, "spawn", lambda cmd, *a, **k: started.append(cmd) or 0)
    monkeypatch.setattr(prespawn, "device_count", lambda device: {"cpu": 2, "cuda": 1}[device])
    out = tmp_path / "run"
    common = ["parallel.device=cpu", f"train.output_dir={out}"]
    assert cli.main(["train", "--nproc", "64", *common]) == 2
    err = capsys.readouterr().err
    assert "parallel.nproc=64 CPU ranks, but this process may use 2 core(s)" in err and "allow_oversubscribe" in err
    assert not out.exists() and not started
    assert cli.main(["train", "--nproc", "2", *common]) == 0  # as many ranks as cores
    assert cli.main(["train", "--nproc", "3", "parallel.allow_oversubscribe=true", *common]) == 0  # asked for
    assert [c[c.index("-m") + 1] for c in started] == ["qwenkit.torchrun"] * 2
    assert "--nproc-per-node=3" in started[1]
    monkeypatch.setattr(prespawn, "resolve_device", lambda name, key="parallel.device": "cuda")
    assert cli.main(["train", "--nproc", "2", "parallel.device=cuda", "parallel.allow_oversubscribe=true",
                     f"train.output_dir={tmp_path / 'gpu'}"]) == 2  # fmt: skip
    assert "parallel.nproc=2 ranks on cuda, but this node sees 1 cuda device(s)" in capsys.readouterr().err
    assert len(started) == 2


def test_torchrun_command_for_multi_node():
    rdzv = launch.Rendezvous(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=6000)
    cmd = launch.torchrun_command(Path("runs/x/config.yaml"), 8, rdzv)
    assert cmd[1:3] == ["-m", "qwenkit.torchrun"]  # torchrun, through quiet_torchrun
    for flag in ("--nnodes=2", "--nproc-per-node=8", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=6000"):
        assert flag in cmd
    assert cmd[-4:] == ["-m", "qwenkit.engine.run.rank", "--config", "runs/x/config.yaml"]
    assert "--rdzv-backend=static" in cmd and "--max-restarts=0" in cmd  # given: torchrun's PET_* defaults never apply


def test_torchrun_command_for_c10d():
    rdzv = launch.Rendezvous(1, 0, "h0", 29400, max_nnodes=4, backend="c10d", rdzv_id="job7", max_restarts=3)
    cmd = launch.torchrun_command(Path("c.yaml"), 8, rdzv)
    for flag in ("--nnodes=1:4", "--rdzv-backend=c10d", "--rdzv-endpoint=h0:29400", "--rdzv-id=job7", "--max-restarts=3"):
        assert flag in cmd
    assert not any(f.startswith(("--node-rank", "--master-addr")) for f in cmd)  # c10d numbers the nodes itself
    from torch.distributed.run import parse_args

    parsed = parse_args(cmd[3:])  # torchrun's own parser takes it as given
    assert (parsed.nnodes, parsed.rdzv_endpoint, parsed.rdzv_id, parsed.max_restarts) == ("1:4", "h0:29400", "job7", 3)


def test_rendezvous_port_is_free_on_one_node_and_agreed_across_nodes():
    # Two single-node jobs on one machine each take a free port (a fixed default collided).
    ports = {launch.rendezvous_port(launch.Rendezvous()) for _ in range(2)}
    assert 6000 not in ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free: nothing was left listening
    assert launch.rendezvous_port(launch.Rendezvous(nnodes=2, node_rank=1, master_addr="10.0.0.1")) == 6000
    assert launch.rendezvous_port(launch.Rendezvous(master_port=29511)) == 29511  # the user's port wins
    cmd = launch.torchrun_command(Path("c.yaml"), 1, launch.Rendezvous(master_port=29511))
    assert "--master-port=29511" in cmd
    parsed = cli.build_parser().parse_args(["train"])
    assert parsed.master_port is None


def test_cluster_script(tmp_path):
    script = ROOT / "scripts" / "finetune_qwen2_5_vl.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(script)], check=True)
    env = {**os.environ, "QWENKIT": f"{sys.executable} -m qwenkit.cli"}
    usage = subprocess.run([str(script)], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "NNODES" in usage.stderr
    bad = subprocess.run(
        [str(script), "params/tiny_cpu.yaml", "train.steps=0"], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2 and "train.steps must be > 0" in bad.stderr


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    import torch

    return torch.npu.is_available()


def _accelerator_run(tmp_path, device: str, count: int):
    """bf16 compute, meta init, profiler and memory snapshot on up to 2 accelerators."""
    proc, out = _train(
        tmp_path, f"parallel.device={device}", "parallel.param_dtype=bfloat16", "parallel.reduce_dtype=float32",
        "model.init_device=meta", "profile.enabled=true", "profile.memory_snapshot=true", "profile.wait=0",
        "profile.warmup=1", "profile.active=1", nproc=min(2, count),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = metrics.read(out / "metrics" / "rank-00000.jsonl")
    assert {r["device"] for r in rows} == {f"{device}:0"}
    assert (out / "memory" / "rank-00000.pickle").is_file()
    return out


@pytest.mark.cuda
def test_train_on_cuda(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = _accelerator_run(tmp_path, "cuda", torch.cuda.device_count())
    assert (out / "profile" / "rank-00000.json").is_file()


@pytest.mark.npu
def test_train_on_npu(tmp_path):
    if not _npu_available():
        pytest.skip("needs an Ascend NPU with torch_npu")
    import torch

    out = _accelerator_run(tmp_path, "npu", torch.npu.device_count())
    assert (out / "profile").is_dir()


def test_cpu_ranks_get_a_pinned_mmap_threshold_unless_the_user_set_one():
    from qwenkit import config as qconfig
    from qwenkit.device import CPU_MALLOC_ENV
    from qwenkit.launch import rank_environment

    cpu = qconfig.load(overrides=["parallel.device=cpu"])
    assert rank_environment(cpu, {"PATH": "/bin"}) == {"PATH": "/bin", **CPU_MALLOC_ENV}
    assert rank_environment(cpu, {"MALLOC_MMAP_THRESHOLD_": "4096"})["MALLOC_MMAP_THRESHOLD_"] == "4096"
    cuda = qconfig.load(overrides=["parallel.device=cuda"])
    assert "MALLOC_MMAP_THRESHOLD_" not in rank_environment(cuda, {})


def test_launcher_writes_fail_in_one_line(tmp_path, monkeypatch, capsys):
    def full(cfg, output_dir, name="config.yaml"):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / name))

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("must not start"))
    monkeypatch.setattr(qconfig, "write_config", full)
    assert cli.main(["train", f"train.output_dir={tmp_path / 'run'}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("qwenkit")]
    rank_config = tmp_path / "run" / f".config-{socket.gethostname()}-{os.getpid()}.yaml"
    assert err == [f"qwenkit train: cannot write {rank_config}: No space left on device ({rank_config})"]
    assert not (tmp_path / "run" / "config.yaml").exists()  # the run's record is rank 0's, once the start is accepted


def test_the_launcher_start_does_not_load_the_dcp_checkpoint_code():
    """``qwenkit train``'s start and the pre-spawn checks import no DCP code of qwenkit's (the chain
    launch -> init_from -> export -> checkpoint is cut). transformers 5 itself imports
    torch.distributed.checkpoint with its modeling code (``transformers.distributed.checkpoint``);
    4.57 does not, so there the torch module must stay out too."""
    probe = ("import sys, json, qwenkit.launch, qwenkit.engine.run.prespawn, qwenkit.sweep.file; "
             "print(json.dumps([m for m in sys.modules if m.startswith(('qwenkit.', 'torch.distributed.checkpoint', "
             "'transformers.distributed.checkpoint'))]))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    assert not loaded & {"qwenkit.engine.checkpoints.dcp", "qwenkit.engine.checkpoints.export"}, sorted(loaded)
    assert "torch.distributed.checkpoint" not in loaded or "transformers.distributed.checkpoint" in loaded


def test_the_lock_is_held_and_taken_over_when_its_holder_is_gone(tmp_path):
    fd = launch.acquire_lock(tmp_path)
    with pytest.raises(launch.OutputDirBusy, match=f"pid {os.getpid()} on "):
        launch.acquire_lock(tmp_path)
    os.close(fd)  # the holder exits: the kernel drops the flock; the file with its pid stays
    assert json.loads(launch.lock_path(tmp_path).read_text())["pid"] == os.getpid()
    os.close(launch.acquire_lock(tmp_path))
    # a stale file naming a dead process: taken over
    launch.lock_path(tmp_path).write_text(json.dumps({"pid": 999999999, "host": "elsewhere"}))
    os.close(launch.acquire_lock(tmp_path))
