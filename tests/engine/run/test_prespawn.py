"""qwenkit.engine.run.prespawn: a dataset of the wrong layout (a DPO file given to GRPO) is one line.
The first start scans it in the ranks: exit 1, one line naming the file and row, no traceback, not
once per rank. Its index is cached then, so the next start is refused before any rank starts:
exit 2, the same line, a ``refused`` event beside the first start's ``failed``. The same for the
training set and for ``data.eval_path``."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_checkpoint
from jobs import refused, train

from qwenkit import config as qconfig
from qwenkit.engine.run import events, prespawn
from qwenkit.model.families import registry as families
from qwenkit.model.tiny import vllm as tiny_vllm


def _dpo_rows(path):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]} for i in range(6)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ours(err: str) -> list[str]:
    """The launcher's and the ranks' lines (not the command line it echoes, nor logged warnings)."""
    return [line for line in err.splitlines() if line.startswith("qwenkit train:") and "qwenkit.torchrun" not in line]


def _prompt_rows(path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("where", ["data.path", "data.eval_path"])
def test_a_file_of_another_objective_is_one_line_in_the_ranks_then_refused_before_spawn(where, tmp_path, capsys):
    dpo = _dpo_rows(tmp_path / "dpo.jsonl")
    sets = [f"data.path={dpo}"] if where == "data.path" else [f"data.path={_prompt_rows(tmp_path / 'p.jsonl')}",
                                                             f"data.eval_path={dpo}", "train.eval_every=1"]  # fmt: skip
    # one prompt a rank: the 6 rows fill a step on 2 ranks, and their layout is the only fault
    run = ["train.objective=grpo", *sets, f"data.cache_dir={tmp_path / 'cache'}", "grpo.num_generations=2",
           "grpo.max_new_tokens=2", "train.micro_batch_size=1"]  # fmt: skip
    out = tmp_path / "run"
    first = train(out, *run, steps=1, nproc=2)
    assert first.returncode == 1, first.stderr[-3000:]
    assert "Traceback" not in first.stderr, first.stderr[-3000:]
    (line,) = _ours(first.stderr)
    assert line.startswith("qwenkit train: 6 of 6 samples (100.0%) are bad, more than data.max_bad_fraction=0.01")
    assert f"first: {dpo}: row 0 (line 1): bad_format: a preference row" in line
    assert refused(out, *run, steps=1, nproc=2) == 2
    err = capsys.readouterr().err
    (again,) = [x for x in err.splitlines() if x.startswith("qwenkit train:")]
    assert again.startswith("qwenkit train: invalid run: 6 of 6 samples (100.0%) are bad") and "Traceback" not in err, err
    failed = [e for e in events.read(out) if e["event"] == "failed"]
    assert failed[0]["by"] == "rank" and failed[0]["input"] and failed[-1]["error"] == "refused", failed


# ---------------------------------------------------------------------------------------------
# A dataset too small for one optimizer step (issue 66): refused before any rank starts, by the ranks' rule


def test_a_zero_byte_data_file_is_one_line_and_exit_2_before_any_rank_starts(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    out = tmp_path / "run"
    assert refused(out, f"data.path={empty}", f"data.cache_dir={tmp_path / 'cache'}", "train.micro_batch_size=4",
                   steps=20, nproc=2) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "Traceback" not in err and not out.exists()
    (line,) = _ours(err)
    assert line == (f"qwenkit train: invalid run: data.path={str(empty)!r} holds 0 row(s), fewer than one global batch: "
                    "train.micro_batch_size=4 x 2 data-parallel rank(s) x train.grad_accum=1 = 8; add rows, or lower "
                    "train.micro_batch_size, --nproc or train.grad_accum")  # fmt: skip


WORLD = 2  # the ranks the launcher's check and the ranks' own data.build are asked about
# (overrides, rows): each run at one row short of a step's samples and at exactly a step's
STEP_CASES = {
    "sft": (["train.micro_batch_size=2"], 4),
    "dpo pairs": (["train.objective=dpo", "train.micro_batch_size=1", "train.grad_accum=2"], 4),
    "grpo prompts": (["train.objective=grpo", "train.micro_batch_size=2", "grpo.num_generations=2"], 4),
    "token budget": (["data.max_tokens_per_batch=4096", "train.grad_accum=2"], 4),  # one sample at least a micro-batch
    "packed": (["data.max_tokens_per_batch=4096", "data.packing=true"], 2),
    "eval_fraction": (["train.micro_batch_size=2", "data.eval_fraction=0.25"], 5),  # 5 rows: 1 held out, 4 train
    "sequence parallel": (["train.micro_batch_size=2", "parallel.sp_size=2"], 2),  # one data-parallel rank of 2
}


def _ranks_refuse(cfg, processor) -> str | None:
    """What rank 0 of ``WORLD`` ranks raises building its data (``data.build``, the index cached first by a
    one-process scan: a rank of two without a process group would scan half the rows), or None."""
    from qwenkit import data
    from qwenkit.data.reader import DataError

    try:
        data.build(cfg, processor)
    except DataError:
        pass  # too small for one rank too: the index is written all the same
    try:
        data.build(cfg, processor, rank=0, world_size=WORLD)
    except DataError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", STEP_CASES)
@pytest.mark.parametrize("short", [1, 0], ids=["one row short", "exactly a step"])
def test_the_launcher_refuses_what_the_ranks_refuse_and_nothing_else(case, short, tmp_path):
    from qwenkit import config as qconfig
    from qwenkit.engine.run import prespawn
    from qwenkit.model.paths import load_processor

    overrides, rows = STEP_CASES[case]
    cfg = qconfig.load(overrides=[*overrides, f"data.tiny_samples={rows - short}", f"data.cache_dir={tmp_path}",
                                  f"parallel.nproc={WORLD}", "data.tiny_eval_samples=0"])  # fmt: skip
    counted = prespawn.check_data_size(cfg, WORLD)  # the rows of the data file, nothing cached yet
    processor = load_processor(cfg)
    ranks = _ranks_refuse(cfg, processor)
    cached = prespawn.check_data_size(cfg, WORLD, prespawn.indexing_processor(cfg))  # the cached index's samples
    assert bool(counted) == bool(cached) == bool(ranks) == bool(short), (counted, cached, ranks)
    if short:
        (line,) = cached
        assert line.partition(", fewer than")[2] == ranks.partition(", fewer than")[2]  # the same rule, the same words
        assert counted[0].startswith(f"data.path='tiny' (data.tiny_samples={rows - 1}) holds {rows - 1} row(s)")


def test_rows_skipped_as_bad_are_refused_once_their_index_is_cached(tmp_path):
    """A file with a step's rows, one of them bad (skipped): the rows alone do not prove the failure,
    so the first start's ranks say it (one line, :class:`~qwenkit.data.reader.DataError`); once the scan
    is cached, the launcher knows the usable samples and refuses the next start."""
    from qwenkit import config as qconfig
    from qwenkit.engine.run import prespawn
    from qwenkit.model.paths import load_processor

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]} for i in range(3)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    cfg = qconfig.load(overrides=[f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}", "train.micro_batch_size=2",
                                  "data.on_bad_sample=skip", "data.max_bad_fraction=0.5"])  # fmt: skip
    assert prespawn.check_data_size(cfg, WORLD) == []  # 4 rows: maybe enough
    ranks = _ranks_refuse(cfg, load_processor(cfg))
    assert ranks.startswith("the dataset has 3 usable samples, fewer than one global batch")
    (line,) = prespawn.check_data_size(cfg, WORLD, prespawn.indexing_processor(cfg))
    assert line.startswith(f"data.path={str(path)!r} has 3 usable samples, fewer than one global batch")


def test_an_eval_file_without_rows_is_refused_before_spawn(tmp_path):
    from qwenkit import config as qconfig
    from qwenkit.engine.run import prespawn

    empty = tmp_path / "eval.jsonl"
    empty.write_text("\n\n")
    cfg = qconfig.load(overrides=[f"data.eval_path={empty}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert prespawn.check_data_size(cfg, WORLD) == [
        f"the eval set ({empty}) has no usable rows: data.eval_path={str(empty)!r} holds 0 row(s)"]


# vLLM on this device (issue 62): what its CPU backend cannot run is refused before any rank starts


def head_dim_16(tiny_path, out):
    """A checkpoint directory whose ``config.json`` is the tiny default's with 4 attention heads of 16 (its head dim
    before issue 62): all that the checks before the start read."""
    config = json.loads((tiny_path / "config.json").read_text())
    config["text_config"]["num_attention_heads"] = 4
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("key", ["grpo.rollout_engine", "train.eval_engine"])
def test_a_head_dim_vllms_cpu_attention_cannot_run_is_refused_naming_it(key, tiny_path, tmp_path):
    cfg = qconfig.load(overrides=["train.objective=grpo", "parallel.device=cpu"])
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, "vllm")  # as a config with vLLM installed asks (the config check needs it)
    odd = head_dim_16(tiny_path, tmp_path / "odd")
    (problem,) = prespawn.vllm_device_problems(cfg, odd)
    assert problem.startswith(f"{key}=vllm: vLLM's CPU attention runs head dims 32, 64,") and "has 16;" in problem
    assert prespawn.vllm_device_problems(cfg, tiny_path) == []  # the embedded default: vLLM's shapes run
    setattr(getattr(cfg, section), name, "hf")
    assert prespawn.vllm_device_problems(cfg, odd) == []


@pytest.mark.skipif(bool(families.get("qwen3_5").unavailable()), reason="transformers 4.x has no Qwen3.5")
def test_qwen3_5_on_vllm_on_cpu_is_refused_unless_bf16_with_linear_heads_of_128(tmp_path):
    """vLLM's CPU Gated DeltaNet runs bf16 and linear-attention head dims of 128 only: the tiny Qwen3.5 (16) is
    refused in one line naming each, its widened copy (qwenkit.model.tiny.vllm) in bf16 is not."""
    cfg = qconfig.load(overrides=["model.name=qwen3_5", "train.objective=grpo", "parallel.device=cpu"])
    cfg.grpo.rollout_engine = "vllm"
    wide = tiny_vllm.ensure_checkpoint("qwen3_5", root=tmp_path)
    (problem,) = prespawn.vllm_device_problems(cfg, wide)
    assert problem == ("grpo.rollout_engine=vllm: vLLM's CPU backend runs qwen3_5's Gated DeltaNet layers in bfloat16 "
                       "only, and model.dtype=float32; set model.dtype=bfloat16, or use the hf engine")  # fmt: skip
    cfg.model.dtype = "bfloat16"
    assert prespawn.vllm_device_problems(cfg, wide) == []
    (problem,) = prespawn.vllm_device_problems(cfg, tiny_checkpoint("qwen3_5"))
    assert "linear-attention key and value head dims of 128 only" in problem and "has 16 and 16;" in problem


@pytest.mark.parametrize("key", ["grpo.rollout_engine", "train.eval_engine"])
def test_qwen3_vl_moe_experts_in_transformers_layout_are_refused_for_vllm(key, tmp_path):
    """vLLM reads Qwen3-VL-MoE's fused experts in Qwen's published layout and transposes them whatever they hold:
    a checkpoint transformers 5.x saved (the tiny default, the kit's export) fails inside the engine, so it is refused
    in one line; the same model in Qwen's layout (qwenkit.model.tiny.vllm's copy) is not."""
    cfg = qconfig.load(overrides=["model.name=qwen3_vl_moe", "train.objective=grpo", "parallel.device=cpu"])
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, "vllm")
    held = tiny_checkpoint("qwen3_vl_moe")
    (problem,) = prespawn.vllm_device_problems(cfg, held)
    assert problem == (f"{key}=vllm: vLLM reads qwen3_vl_moe's fused experts in Qwen's published layout ([E, hidden, "
                       f"2·inter]), and {held} holds transformers 5.x's (mlp.experts.gate_up_proj [4, 32, 64]: a "
                       "checkpoint transformers 5.x saved); use the hf engine, or the model in Qwen's layout (as published)")  # fmt: skip
    assert prespawn.vllm_device_problems(cfg, tiny_vllm.ensure_checkpoint("qwen3_vl_moe", root=tmp_path)) == []
    setattr(getattr(cfg, section), name, "hf")
    assert prespawn.vllm_device_problems(cfg, held) == []
