"""GRPO training end to end on the tiny model: 2 gloo ranks equal 1 process on the same prompts and
seeds, a resumed run equals the uninterrupted one bit for bit (also in the middle of a
``num_iterations`` cycle, and after a crash that lost the later checkpoints), step 1's KL is 0 (the
policy is its reference), TRL's metric names are logged (a user's reward under its function's name),
and the completions file holds a sample of each logged step's completions with their rewards.

The tiny model starts from random weights: the exact-match and format rewards are 0 for its
completions, so :func:`vowels` (a ``module:function`` reward read from this module) gives the
groups different rewards, hence non-zero advantages and gradients.
"""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_runs, build_model, families_allowing, over_families
from multiproc import check_ranks

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.distributed import fsdp
from qwenkit.engine.checkpoints import dcp as checkpoint
from qwenkit.engine.generation.generate import model_inputs
from qwenkit.engine.objectives import completions, grpo
from qwenkit.engine.rollouts.completion import Completion, completion, completion_seed, media_tokens
from qwenkit.engine.run import metrics, train
from qwenkit.model.families import registry as families

BASE = ["train.objective=grpo", "data.tiny_samples=16", "train.steps=3", "train.max_grad_norm=0", "train.lr=0.01",
        "train.warmup_steps=0", "grpo.num_generations=4", "grpo.max_new_tokens=6", "grpo.beta=0.04",
        "grpo.rewards=[exact, format, engine.objectives.test_grpo:vowels]", "grpo.reward_weights=[1, 1, 2]",
        "checkpoint.save_final=false", "train.resume=auto", "train.log_every=2"]  # fmt: skip
TIMING = ("step_time", "tokens_per_s", "samples_per_s", "peak_memory", "rollout_time")


def vowels(prediction: str, reference: str, **row) -> float:
    """A reward the random tiny model's completions differ by: their share of vowels."""
    assert "messages" in row, f"a user's reward gets the row's columns, got {sorted(row)}"
    return sum(c in "aeiou" for c in prediction) / max(1, len(prediction))


def _worker(rank, out, runs):
    dist.init_process_group("gloo")
    logging.getLogger("qwenkit").addHandler(logging.FileHandler(out / f"warnings-{rank}.log"))  # warnings and up
    for name, extra, lose_after in runs:
        trainer = train.Trainer(qconfig.load(overrides=BASE + extra + [f"train.output_dir={out / name}"]))
        trainer.run()
        weights = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in trainer.model.named_parameters()}
        if rank == 0:  # (full_tensor is collective: every rank gathers)
            path = out / f"{name}.json"
            before = json.loads(path.read_text()) if path.exists() else []
            path.write_text(json.dumps(before + [{k: v for k, v in h.items() if k not in TIMING} for h in trainer.history]))
            torch.save({n: w.detach().clone() for n, w in weights.items()}, out / f"{name}.pt")
            for step in range(lose_after + 1, trainer.step + 1) if lose_after else ():  # a crash lost them
                shutil.rmtree(checkpoint.step_dir(checkpoint.checkpoint_root(out / name), step))
        dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def out(tmp_path_factory, tiny_path):
    """one: 1 process, 2 prompts a micro-batch; resumed: the same, stopped after step 2 and run again;
    lora: one with LoRA adapters; two: 2 ranks, 1 prompt each (the same 2 prompts a step).
    iter: two updates per rollout (rollouts at steps 1 and 3); iter_lost: the same, checkpointed every
    step, its checkpoints after step 1 lost and run again from there (in the middle of a cycle);
    iter_ranks: on 2 ranks, stopped after step 1, resumed on 1 process; iter_changed: stopped after
    step 1 (in the middle of a cycle), resumed with a longer grpo.max_new_tokens; cold: sampled at
    grpo.temperature=1e-6 (every completion of a group its greedy one); bf16: rolled out with its GEMMs in bf16."""
    out = tmp_path_factory.mktemp("grpo")
    one = ["train.micro_batch_size=2"]
    cut = one + ["checkpoint.save_final=true"]  # the checkpoint at the stop
    lora = one + ["lora.r=8", "train.steps=2"]  # the reference: the policy with its adapters disabled
    cycle = one + ["grpo.num_iterations=2"]
    lost = cycle + ["checkpoint.every=1", "checkpoint.keep_last=3"]
    ranks = ["grpo.num_iterations=2", "checkpoint.save_final=true"]
    check_ranks(_worker, 2, out, [("two", ["train.micro_batch_size=1"], 0),
                                  ("iter_ranks", [*ranks, "train.micro_batch_size=1", "train.stop_after=1"], 0)])  # fmt: skip
    check_ranks(_worker, 1, out, [("one", one, 0), ("resumed", cut + ["train.stop_after=2"], 0), ("resumed", cut, 0),
                                  ("lora", lora, 0), ("iter", cycle, 0), ("iter_lost", lost, 1), ("iter_lost", lost, 0),
                                  ("iter_ranks", [*ranks, "train.micro_batch_size=2"], 0),
                                  ("iter_changed", [*cycle, "checkpoint.save_final=true", "train.stop_after=1"], 0),
                                  ("iter_changed", [*cycle, "grpo.max_new_tokens=7"], 0),
                                  ("cold", [*one, "grpo.temperature=1e-6", "train.steps=1"], 0),
                                  ("bf16", [*one, "grpo.rollout_dtype=bfloat16", "train.steps=2"], 0)])  # fmt: skip
    return out


def _history(out, name):
    """The run's metrics by step; a step run twice (resumed after a crash) keeps its last run."""
    return list({h["step"]: h for h in json.loads((out / f"{name}.json").read_text())}.values())


def test_trl_metric_names_and_step_one_kl_is_zero(out):
    history = _history(out, "one")
    assert len(history) == 3
    names = set(history[0])
    want = {"loss", "reward", "reward_std", "kl", "entropy", "frac_reward_zero_std", "completions/mean_length",
            "completions/min_length", "completions/max_length", "completions/clipped_ratio", "clip_ratio/low_mean",
            "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max",
            *(f"rewards/{r}/{s}" for r in ("exact", "format", "vowels") for s in ("mean", "std"))}  # fmt: skip
    assert want <= names, want - names
    assert all(math.isfinite(v) for h in history for v in h.values())
    first = history[0]
    assert first["kl"] == 0 and first["clip_ratio/region_mean"] == 0  # policy = reference = rollout policy
    assert first["grad_norm"] > 0 and history[-1]["kl"] > 0  # the vowel reward moved the policy off its start
    assert first["reward"] == pytest.approx(2 * first["rewards/vowels/mean"] + first["rewards/exact/mean"]
                                            + first["rewards/format/mean"])  # fmt: skip
    rows = metrics.read(out / "one" / "metrics" / "rank-00000.jsonl")
    rollout, step = metrics.series(rows, "rollout_time"), metrics.series(rows, "step_time")
    assert sorted(rollout) == [1, 2, 3] and all(0 < rollout[k] < step[k] for k in rollout)  # a rollout every step
    assert {r["unit"] for r in rows if r["metric"] == "rollout_time"} == {"s"}
    cycle = metrics.series(metrics.read(out / "iter" / "metrics" / "rank-00000.jsonl"), "rollout_time")
    assert cycle[1] > 0 and cycle[2] == 0 and cycle[3] > 0  # num_iterations=2: step 2 reuses step 1's rollout


def test_entropy_and_log_probs_belong_to_the_tempered_distribution_the_rollout_sampled(out):
    """At T = 1e-6 a group's completions are one (greedy) completion: the distribution sampled has no
    entropy, and so must the one the loss reads (untempered, the tiny model's reads ~log V = 6)."""
    (first,) = _history(out, "cold")
    assert first["frac_reward_zero_std"] == 1  # every group's completions alike
    assert first["entropy"] < 1e-3
    assert first["kl"] == 0 and first["loss"] == 0  # the policy is its reference; equal rewards: no advantage


def test_a_bf16_rollout_is_corrected_for_as_vllms_is(out):
    """``grpo.rollout_dtype=bfloat16``: the rollout's sampler is not the fp32 policy, so every step logs TRL's
    importance-sampling metrics: log-prob gaps above 0 and within bf16's rounding of the tiny model's logits
    (below 1: tests/engine/rollouts/test_hf.py bounds it per family), ratios around 1; the policy still trains. The fp32 run
    has nothing to correct and logs none."""
    history = _history(out, "bf16")
    assert len(history) == 2
    for h in history:
        assert 0 < h["sampling/sampling_logp_difference/mean"] <= h["sampling/sampling_logp_difference/max"] < 16 * 2**-8
        assert h["sampling/importance_sampling_ratio/min"] <= h["sampling/importance_sampling_ratio/mean"]
        assert h["sampling/importance_sampling_ratio/mean"] <= h["sampling/importance_sampling_ratio/max"]
        assert h["sampling/importance_sampling_ratio/max"] < math.exp(16 * 2**-8)
        assert h["sampling/importance_sampling_ratio/min"] > math.exp(-16 * 2**-8)
    assert history[0]["grad_norm"] > 0 and history[-1]["kl"] > 0
    assert not any(k.startswith("sampling/") for k in _history(out, "one")[0])


@families_allowing("GRPO")
def test_grpo_trains_every_family_from_its_own_start(family, family_path, tmp_path):
    """One process, two steps from the family's tiny model, the frozen copy as reference: the rollouts (the
    family's generate, chat template and media keys) complete, step 1's KL is 0 (the policy is its
    reference) and the vowel reward moves the policy off it by step 2."""
    cfg = qconfig.load(overrides=BASE + [f"model.name={family}", f"model.path={family_path}", "train.steps=2",
                                         "train.micro_batch_size=2", "data.tiny_samples=4", "train.resume=none",
                                         f"train.output_dir={tmp_path / 'run'}"])  # fmt: skip
    first, second = train.run(cfg).history
    assert all(math.isfinite(v) for h in (first, second) for v in h.values())
    assert first["kl"] == 0 and first["grad_norm"] > 0 and first["completions/mean_length"] > 0
    assert second["kl"] > 0


# the policy losses and the settings beyond TRL's grpo (loss_type: its extra keys), each trained by one short run
NEW_LOSSES = {"cispo": ["grpo.loss_type=cispo", "grpo.epsilon_high=5"],
              "sapo": ["grpo.loss_type=sapo", "grpo.sapo_temperature_pos=0.5", "grpo.sapo_temperature_neg=2"],
              "gmpo": ["grpo.loss_type=gmpo", "grpo.epsilon=0.4"],
              "dapo_top_entropy_overlong": ["grpo.top_entropy_quantile=0.2", "grpo.overlong_buffer=3",
                                            "grpo.rewards=[exact, format, engine.objectives.test_grpo:vowels, overlong]",
                                            "grpo.reward_weights=[1, 1, 2, 1]"]}  # fmt: skip


def _short_run(tmp_path, name, extra):
    cfg = qconfig.load(overrides=BASE + ["train.steps=2", "train.micro_batch_size=2", "data.tiny_samples=4", "train.resume=none",
                                         f"train.output_dir={tmp_path / name}", *extra])  # fmt: skip
    return train.run(cfg).history


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_every_new_loss_trains_the_tiny_model(name, tmp_path, tiny_path):
    """Two steps of the tiny recipe with each loss: the run completes, every metric is finite, step 1's KL
    is 0 and its gradient not, and the policy has moved off its reference by step 2. ``overlong``: every
    completion cut at ``max_new_tokens`` scores -1, the others at most 0. ``top_entropy_quantile``: step 1's
    rollout is the plain run's (the same seeds) but fewer tokens carry its loss."""
    first, second = _short_run(tmp_path, name, NEW_LOSSES[name])
    assert all(math.isfinite(v) for h in (first, second) for v in h.values())
    assert first["kl"] == 0 and first["grad_norm"] > 0 and second["kl"] > 0
    if "grpo.overlong_buffer=3" in NEW_LOSSES[name]:
        for h in (first, second):
            assert -1 <= h["rewards/overlong/mean"] <= -h["completions/clipped_ratio"] < 0
        (plain,) = _short_run(tmp_path, "plain", NEW_LOSSES[name][1:] + ["train.steps=1"])
        assert plain["reward"] == first["reward"] and plain["loss"] != first["loss"]


@over_families(*(n for n in families.FAMILIES if families.get(n).audio_tokens))
def test_grpo_rolls_out_and_trains_on_videos_heard_with_their_track(family, family_path, tmp_path):
    """``data.use_audio_in_video``: prompts of a video heard with its audio track (and an audio) roll out through
    the thinker's generate (placed as HF's class places them: test_generate.py) and train: the rollout's
    log-probs and the loss read the heard span off the ids, step 1's KL is 0 and the vowel reward moves the
    policy off its reference by step 2."""
    from tests.data.test_audio_rows import HEARD_ROW, write_heard_set

    rows = write_heard_set(tmp_path, (HEARD_ROW, HEARD_ROW))
    (tmp_path / "set.json").write_text(json.dumps(rows))
    cfg = qconfig.load(overrides=BASE + [f"model.name={family}", f"model.path={family_path}", "train.steps=2",
                                         "train.micro_batch_size=2", f"data.path={tmp_path / 'set.json'}",
                                         "data.use_audio_in_video=true", f"data.cache_dir={tmp_path / 'cache'}",
                                         "train.resume=none", f"train.output_dir={tmp_path / 'run'}"])  # fmt: skip
    first, second = train.run(cfg).history
    assert all(math.isfinite(v) for h in (first, second) for v in h.values())
    assert first["kl"] == 0 and first["grad_norm"] > 0 and first["completions/mean_length"] > 0
    assert second["kl"] > 0


def test_lora_reference_is_the_policy_without_adapters(out):
    first, second = _history(out, "lora")
    assert first["kl"] == 0 and first["grad_norm"] > 0  # adapters start at B = 0: the policy is its reference
    assert second["kl"] > 0


def test_two_ranks_equal_one_process_on_the_same_prompts_and_seeds(out):
    assert_same_runs(_history(out, "two"), _history(out, "one"))  # one micro-batch of 8 completions pads more than two of 4


def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(out):
    assert _history(out, "resumed") == _history(out, "one")
    assert completions.read_completions(out / "resumed") == completions.read_completions(out / "one")


def _weights(out, name):
    return torch.load(out / f"{name}.pt", weights_only=True)


def test_a_resume_in_the_middle_of_a_cycle_is_bit_identical(out):
    """Checkpoint 1 holds the rollout that step 2 trains on again: resumed from it, steps 2 and 3
    (written twice to the files) equal the uninterrupted run's, and so do the final weights."""
    history = _history(out, "iter_lost")
    assert [h["step"] for h in history] == [1, 2, 3] and history == _history(out, "iter")
    assert history[0]["reward"] == history[1]["reward"] != history[2]["reward"]  # rollouts at steps 1 and 3
    want, got = _weights(out, "iter"), _weights(out, "iter_lost")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    lines = (out / "iter_lost" / "metrics" / completions.SAMPLE_FILE).read_text().splitlines()
    assert len(lines) == 2 * len((out / "iter" / "metrics" / completions.SAMPLE_FILE).read_text().splitlines())
    assert completions.read_completions(out / "iter_lost") == completions.read_completions(out / "iter")  # the last write of each


def test_a_resume_on_another_rank_count_in_the_middle_of_a_cycle_rolls_out_again(out):
    saved_step, resumed_step, _ = _history(out, "iter_ranks")
    assert resumed_step["step"] == 2 and resumed_step["reward"] != saved_step["reward"]  # a new rollout, not step 1's
    assert "this run rolls out again at its first step" in (out / "warnings-0.log").read_text()
    assert {line["rollout"] for line in completions.read_completions(out / "iter_ranks")[2]} == {1}  # the next one, not 0 again


def test_a_resume_with_other_rollout_settings_in_the_middle_of_a_cycle_rolls_out_again(out):
    """The cached rollout was sampled with grpo.max_new_tokens=6: the resumed run (7) never trains on it."""
    saved_step, resumed_step, last = _history(out, "iter_changed")
    assert saved_step == _history(out, "iter")[0]
    assert resumed_step["step"] == 2 and resumed_step["reward"] != saved_step["reward"]  # a new rollout
    assert resumed_step["reward"] == last["reward"]  # its own cycle: steps 2 and 3 train on it
    warned = (out / "warnings-0.log").read_text()
    assert "rollout made under other settings (grpo.max_new_tokens=6, now 7)" in warned
    assert {line["rollout"] for line in completions.read_completions(out / "iter_changed")[3]} == {1}


def test_checkpoints_hold_the_rollout_only_in_the_middle_of_a_cycle(out):
    """A checkpoint at a cycle's end (every one with num_iterations 1) is followed by a new rollout:
    it keeps the count alone, not the micro-batches (pixels and log-probs) of the last rollout."""

    def state(run, step):
        root = checkpoint.checkpoint_root(out / run)
        return torch.load(checkpoint.step_dir(root, step) / "rank-00000.pt", weights_only=False)["objective"]

    assert state("iter_lost", 1)["uses"] == 1 and len(state("iter_lost", 1)["cached"]) == 1
    assert state("iter_lost", 1)["settings"]["grpo.max_new_tokens"] == 6  # what the rollout was made under
    assert state("iter_lost", 2) == {"uses": 2} and state("resumed", 3) == {"uses": 3}


def test_completions_file_holds_a_sample_of_each_logged_step(out):
    by_step = completions.read_completions(out / "one")
    assert sorted(by_step) == [2, 3]  # train.log_every=2, and the last step
    for step, lines in by_step.items():
        assert [line["k"] for line in lines] == list(range(2 * 4))  # 2 prompts x 4 generations
        assert {line["rollout"] for line in lines} == {step - 1}  # one rollout a step
    first = by_step[2][0]
    assert set(first["rewards"]) == {"exact", "format", "vowels"}
    assert first["rewards"]["vowels"] == pytest.approx(vowels(first["completion"], "", messages=[]))
    assert first["reward"] == pytest.approx(sum(w * first["rewards"][n] for n, w in (("exact", 1), ("format", 1), ("vowels", 2))))
    assert len({line["index"] for lines in by_step.values() for line in lines}) == 4  # 2 new prompts per step


def test_completion_seed_depends_on_run_draw_row_and_generation_only():
    assert completion_seed(42, 0, 7, 1) == completion_seed(42, 0, 7, 1)
    seeds = {completion_seed(42, 0, 7, 1), completion_seed(43, 0, 7, 1), completion_seed(42, 1, 7, 1),
             completion_seed(42, 0, 8, 1), completion_seed(42, 0, 7, 0)}  # fmt: skip
    assert len(seeds) == 5


def test_data_check_counts_the_usable_prompts(tmp_path, tiny_path, capsys):
    from qwenkit.data import check

    rows = [
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
        {"conversations": [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                      {"role": "user", "content": "Bye"}]},  # no reference: the scan refuses it
        {"problem": "3+3?", "answer": "6"},  # EasyR1: a prompt alone, its answer column the reference
        {"messages": [{"role": "user", "content": "1+1?"}], "solution": "2"},  # TRL's column
    ]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = qconfig.load(overrides=["train.objective=grpo", f"data.path={path}"])
    assert check.check(cfg) == 1
    out = capsys.readouterr().out
    assert "prompts: 4 usable; references: 1 from 'solution', 1 from 'answer', 2 the last assistant reply" in out
    assert f"{path}: row 2 (line 3): turn_order" in out


def test_prompts_alone_train_with_their_answer_column_as_reference(tmp_path, tiny_path):
    """EasyR1's rows (``problem`` / ``answer`` / ``images``: no reply to learn) through the trainer: the
    completions' references are the ``answer`` column, and the held-out prompts are scored by their
    generations alone (no ``eval_loss``: no row has a reply)."""
    from pathlib import Path

    from qwenkit.model.tiny.data import ensure_dataset

    src = ensure_dataset(8, seed=0)
    rows = [{"problem": r["messages"][0]["content"], "answer": r["messages"][1]["content"],
             "images": [str(Path(src).parent / p) for p in r["images"]]} for r in json.loads(Path(src).read_text())]  # fmt: skip
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = [f"data.path={path}", "data.eval_fraction=0.25", "train.steps=1", "train.micro_batch_size=2", "train.log_every=1",
             "grpo.rewards=[exact]", "grpo.reward_weights=[1]", "train.eval_samples=2"]  # fmt: skip
    check_ranks(_worker, 1, tmp_path, [("prompts", extra, 0)])
    (step,) = _history(tmp_path, "prompts")
    assert step["step"] == 1 and math.isfinite(step["loss"]) and step["completions/mean_length"] > 0
    lines = completions.read_completions(tmp_path / "prompts")[1]
    assert len(lines) == 2 * 4 and {line["reference"] for line in lines} <= {r["answer"] for r in rows}
    evals = [json.loads(line) for line in (tmp_path / "prompts" / "metrics" / "rank-00000.jsonl").read_text().splitlines()]
    names = {e["metric"] for e in evals}
    assert "eval_accuracy" in names and "eval_loss" not in names


def test_the_trainers_log_probs_and_entropy_are_of_the_distribution_hf_generate_sampled(tiny_path, processor):
    """HF ``generate`` samples a rollout from the logits with the media tokens suppressed (never drawn,
    :func:`~qwenkit.engine.rollouts.completion.media_tokens`), over the temperature, and reports those
    scores (``output_scores``). The trainer's old, reference and current log-probs of the completion, and
    its entropy, must be of that distribution: without the ban each is off by ``-log(1 - banned mass)``,
    ~4 / V = 4e-3 on the random tiny model, far above fp32 rounding."""
    temperature = 0.7
    cfg = qconfig.load(overrides=["train.objective=grpo", f"model.path={tiny_path}", "data.tiny_samples=4",
                                  "train.micro_batch_size=2", "grpo.num_generations=2", "grpo.num_iterations=2",
                                  "grpo.beta=0.04", f"grpo.temperature={temperature}"])  # fmt: skip
    model = build_model(chunk=True, seed=7)
    objective = grpo.GrpoObjective(cfg, fsdp.Runtime(0, 1, 0, torch.device("cpu"), "gloo", False),
                                   data.build(cfg, processor), "pixels", reference=model)  # fmt: skip
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    scores = []  # per completion: [new, V] the processed scores HF sampled from

    def hf_sampled(model, dataset, indices, draw):
        done = []
        for i in indices:
            prompt, conv = dataset.prompt(i)
            for g in range(cfg.grpo.num_generations):
                torch.manual_seed(100 * i + g)
                model.configure_loss(chunk=False)  # HF generates from full logits
                out = model.generate(**{k: v for k, v in prompt.items() if k in model_inputs(model)}, do_sample=True,
                                     temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=6, eos_token_id=end,
                                     pad_token_id=processor.pad_token_id, suppress_tokens=media_tokens(processor),
                                     output_scores=True, return_dict_in_generate=True)  # fmt: skip
                model.configure_loss(chunk=True)
                new, text, truncated = completion(processor.tokenizer, out.sequences[0, prompt["input_ids"].shape[1] :].tolist(), end)
                scores.append(torch.cat(out.scores)[: len(new)])
                done.append(Completion(i, prompt, new, text, truncated, conv.reference, dataset.columns(i)))
        return done

    calls = []  # every (logps, entropies) the trainer computed
    own = model.token_logps
    model.token_logps = lambda **kw: calls.append(own(**kw)) or calls[-1]
    objective.rollouts = hf_sampled
    (batch,) = objective._rollout(model, 1)
    counts = torch.stack([batch.pop("num_items"), batch.pop("num_samples")])
    objective.begin([batch], counts)
    objective.loss(model, batch)
    mask = batch["labels"][:, 1:] != -100  # [B, S - 1] the completion tokens, in order
    want = torch.cat([torch.log_softmax(s.float(), -1).gather(1, batch["labels"][b, 1:][mask[b], None]).squeeze(1)
                      for b, s in enumerate(scores)])  # fmt: skip
    entropy = torch.cat([torch.special.entr(torch.softmax(s.float(), -1)).sum(-1) for s in scores])
    assert len(calls) == 3  # old, reference, the loss's
    for logps, ents in calls:
        torch.testing.assert_close(logps[:, :-1][mask], want, rtol=1e-5, atol=1e-6)  # fp32: softmax sums over V in other orders
        if ents is not None:
            torch.testing.assert_close(ents[:, :-1][mask], entropy, rtol=1e-5, atol=1e-6)
    assert calls[-1][1] is not None
