"""Evaluation: held-out split, eval loss against a hand computation and across world sizes,
no change to the weights, the eval schedule across a resume, scores per step, sharded batched
generation against one row at a time on one process."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import build_model
from multiproc import check_ranks
from transformers import Qwen2_5_VLForConditionalGeneration

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.data.template import IGNORE_INDEX
from qwenkit.distributed import fsdp
from qwenkit.engine import objective
from qwenkit.engine.checkpoints import export as hf_export
from qwenkit.engine.generation import answers, eval_command, evaluate, placement
from qwenkit.engine.generation import generate as qgen
from qwenkit.engine.run import metrics, train
from qwenkit.errors import COMMAND_ENV
from qwenkit.model.processor import Processor

BASE = ["train.resume=none", "data.tiny_samples=16", "data.tiny_eval_samples=5", "train.micro_batch_size=2"]


# ---------------------------------------------------------------------------------------------
# Scores of a step


def test_mean_scores_and_the_logged_names():
    rows = [qgen.Generation(i, "", [], "A circle.", g, scores={"exact": float(i != 1), "anls": 0.5 * i})
            for i, g in enumerate(["a circle.", "A square.", "A CIRCLE."])]  # fmt: skip
    means = qgen.mean_scores(rows)
    assert means == pytest.approx({"exact": 2 / 3, "anls": 0.5})
    assert qgen.mean_scores([]) == {}
    assert evaluate.accuracy_values({"exact": 0.25}) == {"eval_accuracy": 0.25}  # one metric: as before
    assert evaluate.accuracy_values(means) == {"eval_accuracy": means["exact"], "eval_accuracy/exact": means["exact"],
                                               "eval_accuracy/anls": 0.5}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Eval data


def test_config_refuses_two_eval_sets_and_bad_ranges():
    with pytest.raises(qconfig.ConfigError) as e:
        qconfig.load(overrides=["data.eval_path=x.json", "data.eval_fraction=0.1", "data.tiny_eval_samples=-1",
                                "train.eval_every=-1", "train.eval_max_new_tokens=0", "train.eval_samples=-2",
                                "train.eval_accuracy_every=-1"])  # fmt: skip
    for key in ("data.eval_path", "data.tiny_eval_samples", "train.eval_every", "train.eval_max_new_tokens",
                "train.eval_samples", "train.eval_accuracy_every"):  # fmt: skip
        assert key in str(e.value)
    with pytest.raises(qconfig.ConfigError, match="train.report_to"):
        qconfig.load(overrides=["train.report_to=[wandb]"])
    with pytest.raises(qconfig.ConfigError, match="data.eval_fraction must be in"):
        qconfig.load(overrides=["data.eval_fraction=1.0"])


# ---------------------------------------------------------------------------------------------
# Eval loss


def _hand_eval_loss(model, dataset) -> float:
    """Sum of every label token's cross-entropy over the eval set / their number, one row at a time."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(dataset)):
            row = dataset[i]
            batch = {k: v[None] if k in ("input_ids", "labels", "mm_token_type_ids") else v for k, v in row.items()}
            labels = batch.pop("labels")
            logits = Qwen2_5_VLForConditionalGeneration.forward(model, **batch).logits  # [1, S, V]
            target = labels[0, 1:]
            total += F.cross_entropy(logits[0, :-1].double(), target, ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += int((target != IGNORE_INDEX).sum())
    return total / count


@pytest.mark.parametrize("chunk", [True, False])
def test_eval_loss_is_the_token_mean_over_the_whole_set_and_leaves_the_weights_alone(processor, chunk):
    cfg = qconfig.load(overrides=BASE + ["loss.loss_type=sample_mean"])  # eval is a token mean anyway
    bundle = data.build(cfg, processor)
    model = build_model(chunk=chunk, seed=3)
    model.qwenkit_loss_type = "sample_mean"
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = evaluate.eval_loss(model, bundle.eval_dataset, bundle.collator, 2, 0, 1, torch.device("cpu"))
    assert got == pytest.approx(_hand_eval_loss(model, bundle.eval_dataset), rel=1e-5)
    assert model.training and model.qwenkit_loss_type == "sample_mean"  # restored
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _eval_worker(rank, out):
    dist.init_process_group("gloo")
    cfg = qconfig.load(
        overrides=BASE + ["train.steps=2", "train.eval_every=1", "train.eval_samples=3", "train.eval_max_new_tokens=6",
                          f"train.output_dir={out / 'two'}", "checkpoint.save_final=true", "train.eval_batch_size=2",
                          "train.eval_metrics=[exact, normalized, anls]", "train.eval_generation=lockstep"]
    )  # fmt: skip
    trainer = train.Trainer(cfg)
    trainer.run()
    if rank == 0:
        (out / "two-evals.json").write_text(json.dumps(trainer.evals))
    # the trained sharded model's replies again, from a gathered copy on each rank this time
    gather = copy.deepcopy(cfg)
    gather.train.eval_generation = "gather"
    ev = trainer.evaluator
    evaluate.Evaluator(gather, ev.dataset, ev.collator, rank, 2, ev.device, out / "gather").accuracy(2, trainer.model)
    # then, in the same ranks, no training: the same random weights on both, the mixed held-out
    # set (images, a video, text only, prompts of different lengths), each rank its share in batches of 2
    from engine.generation.test_generate import NEW_TOKENS

    processor = Processor.from_pretrained(out / "tiny")
    dataset, _ = data.read_checked(MIXED.data, processor, str(out / "mixed" / "eval.json"), rank, 2)
    model = torch.load(out / "model.pt", weights_only=False)
    means = evaluate.generate_and_score(model, dataset, list(range(len(dataset))), qgen.Sampling(NEW_TOKENS, batch_size=2),
                                        ["exact", "anls"], rank, 2, out / "mixed.jsonl")  # fmt: skip
    torch.save(means, out / f"means-{rank}.pt")
    # lockstep on those weights sharded by FSDP2: rank 0's share a two-image row and a video, rank
    # 1's one text-only row (each prefill: rank 0 calls the tower once or twice, rank 1 idles as
    # often; batches of 1: rank 1's second call is a dummy one)
    sharded = build_model(chunk=True, seed=7)  # the weights of model.pt, as training holds them
    sharded.vision_calls_per_step = 1
    fsdp.shard(sharded, MIXED.parallel, fsdp.build_mesh(fsdp.Runtime(rank, 2, rank, torch.device("cpu"), "gloo", False)))
    for batch_size in (1, 2):
        evaluate.generate_and_score(sharded, dataset, LOCKSTEP_ROWS, qgen.Sampling(NEW_TOKENS, batch_size=batch_size),
                                    ["exact"], rank, 2, out / f"lockstep-{batch_size}.jsonl", lockstep=True)  # fmt: skip
    assert (sharded.chunk_loss, sharded.vision_calls_per_step) == (True, 1)  # the training settings are back
    # and qwenkit eval --nproc 2's ranks on the run's last checkpoint, in this process group
    request = eval_command.EvalRequest(str(out / "two"), samples=3, out=str(out / "cli.jsonl"),
                                   metric=("exact", "normalized", "anls"), nproc=2)  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        eval_command.eval_main(request)
    if rank == 0:
        (out / "cli.txt").write_text(printed.getvalue())
    dist.barrier()
    dist.destroy_process_group()


MIXED = qconfig.load(overrides=["data.max_length=2048"])  # the mixed set's rows fit
LOCKSTEP_ROWS = [4, 3, 5]  # shares: rank 0 [4, 5] (two images; a video), rank 1 [3] (text only)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_path, processor):
    from engine.generation.test_generate import write_mixed_eval_set

    out = tmp_path_factory.mktemp("eval")
    (out / "mixed").mkdir()
    write_mixed_eval_set(out / "mixed")
    stock = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_path).eval()
    stock.load_state_dict(build_model(seed=7).state_dict())
    torch.save(stock, out / "model.pt")
    processor.save_pretrained(out / "tiny")
    check_ranks(_eval_worker, 2, out, timeout=300)  # a lockstep hang fails here (x QWENKIT_TEST_TIMEOUT_SCALE)
    return out


@pytest.mark.slow
def test_eval_loss_and_accuracy_do_not_depend_on_world_size(two_ranks, tmp_path):
    cfg = qconfig.load(
        overrides=BASE + ["train.steps=2", "train.eval_every=1", "train.eval_samples=3", "train.eval_max_new_tokens=6",
                          f"train.output_dir={tmp_path}", "train.micro_batch_size=4"]  # the same global batch
    )  # fmt: skip
    one = train.Trainer(cfg)
    one.run()
    two = json.loads((two_ranks / "two-evals.json").read_text())
    assert [e["step"] for e in two] == [e["step"] for e in one.evals] == [0, 1, 2]
    # step 0: same weights, 5 rows split 3 + 2 (one rank runs an ignored filler row) vs one process
    assert two[0]["eval_loss"] == pytest.approx(one.evals[0]["eval_loss"], rel=1e-6)
    for a, b in zip(two[1:], one.evals[1:]):  # after training steps: fp32 sums in another order
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-4)
    assert {"eval_accuracy"} <= two[0].keys() and {"eval_accuracy"} <= two[2].keys() and "eval_accuracy" not in two[1]
    assert {"eval_accuracy/exact", "eval_accuracy/normalized", "eval_accuracy/anls"} <= two[2].keys()
    assert two[2]["eval_accuracy"] == two[2]["eval_accuracy/exact"]
    for rank in (0, 1):  # every rank logs the eval metrics at x = step
        path = two_ranks / "two" / "metrics" / f"rank-{rank:05d}.jsonl"
        assert metrics.series(metrics.read(path), "eval_loss", rank).keys() == {0, 1, 2}
        assert metrics.series(metrics.read(path), "eval_accuracy", rank).keys() == {0, 2}


@pytest.mark.slow
def test_generation_under_fsdp_equals_generation_from_the_export(two_ranks, tmp_path, processor):
    cfg = qconfig.load(overrides=BASE)
    exported = hf_export.export(two_ranks / "two" / "checkpoints" / "step-00000002", tmp_path / "hf", cfg)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(exported)
    eval_set = data.build(cfg, processor).eval_dataset
    rows = [r.to_json() for r in qgen.generate_rows(model, eval_set, [0, 1, 2], qgen.Sampling(6))]  # one row at a time
    logged = qgen.read_jsonl(evaluate.generations_path(two_ranks / "two", 2))  # 2 ranks, batches of 2
    unscored = [{k: v for k, v in r.items() if k != "scores"} for r in rows]
    assert [{k: v for k, v in r.items() if k != "scores"} for r in logged] == unscored
    assert all(r["images"] and r["reference"] for r in rows)
    for r in logged:  # every metric per row
        assert r["scores"] == {"exact": answers.exact(r["generated"], r["reference"]),
                               "normalized": answers.normalized(r["generated"], r["reference"]),
                               "anls": answers.anls(r["generated"], r["reference"])}  # fmt: skip


@pytest.mark.slow
def test_sharded_batched_generation_equals_one_row_on_one_process(two_ranks, processor):
    from engine.generation.test_generate import NEW_TOKENS, todays_replies

    dataset, _ = data.read_checked(MIXED.data, processor, str(two_ranks / "mixed" / "eval.json"))
    rows = qgen.read_jsonl(two_ranks / "mixed.jsonl")
    assert [r["index"] for r in rows] == list(range(len(dataset)))  # row order kept
    stock = torch.load(two_ranks / "model.pt", weights_only=False)
    assert [r["tokens"] for r in rows] == todays_replies(stock, dataset, range(len(dataset)), NEW_TOKENS)
    means = torch.load(two_ranks / "means-0.pt")
    assert means == torch.load(two_ranks / "means-1.pt")  # every rank has the values rank 0 computed
    assert means == pytest.approx({"exact": sum(r["scores"]["exact"] for r in rows) / len(rows),
                                   "anls": sum(r["scores"]["anls"] for r in rows) / len(rows)})  # fmt: skip


@pytest.mark.slow
def test_lockstep_generation_on_two_ranks_equals_one_row_on_one_process(two_ranks, processor):
    """The sharded model stepped by both ranks together (HF's synced_gpus, idle vision calls on
    the rank without images, a dummy call on the rank with fewer batches) gives every row's
    one-row greedy tokens of one process, in row order, in batches of 1 and of 2."""
    from engine.generation.test_generate import NEW_TOKENS, todays_replies

    dataset, _ = data.read_checked(MIXED.data, processor, str(two_ranks / "mixed" / "eval.json"))
    shares = [qgen.share(LOCKSTEP_ROWS, rank, 2) for rank in (0, 1)]
    media = [[{k for k in dataset.prompt(i)[0] if k.startswith("pixel_values")} for i in rows] for rows in shares]
    assert media == [[{"pixel_values"}, {"pixel_values_videos"}], [set()]]  # rank 1: no image, one row fewer
    stock = torch.load(two_ranks / "model.pt", weights_only=False)
    want = todays_replies(stock, dataset, sorted(LOCKSTEP_ROWS), NEW_TOKENS)
    for batch_size in (1, 2):
        rows = qgen.read_jsonl(two_ranks / f"lockstep-{batch_size}.jsonl")
        assert [r["index"] for r in rows] == sorted(LOCKSTEP_ROWS)
        assert [r["tokens"] for r in rows] == want, batch_size


@pytest.mark.slow
def test_the_trainers_lockstep_generation_equals_a_gathered_copys(two_ranks):
    """train.eval_generation=lockstep through the trainer (2 ranks, shares of 2 and 1 rows): the
    same rows and replies as the copy gathered from the same sharded weights; the generation
    time is logged on every rank at each accuracy step."""
    lockstep = qgen.read_jsonl(evaluate.generations_path(two_ranks / "two", 2))
    assert qgen.read_jsonl(evaluate.generations_path(two_ranks / "gather", 2)) == lockstep
    assert [r["index"] for r in lockstep] == [0, 1, 2]
    for rank in (0, 1):
        rows = metrics.read(two_ranks / "two" / "metrics" / f"rank-{rank:05d}.jsonl")
        assert metrics.series(rows, "eval_generation_time", rank).keys() == {0, 2}
        assert all(v > 0 for v in metrics.series(rows, "eval_generation_time", rank).values())


@pytest.mark.slow
def test_qwenkit_eval_on_two_ranks_equals_the_trainers_evaluation(two_ranks):
    """``qwenkit eval --nproc 2``'s ranks (eval_main under RANK/WORLD_SIZE) on the run's last
    checkpoint: the rows, replies and every metric per row the 2-rank trainer wrote at that
    step, and each metric printed."""
    trained = qgen.read_jsonl(evaluate.generations_path(two_ranks / "two", 2))
    assert qgen.read_jsonl(two_ranks / "cli.jsonl") == trained
    printed = (two_ranks / "cli.txt").read_text()
    means = qgen.mean_scores([qgen.Generation(**r) for r in trained])
    for name, value in means.items():
        assert f"eval_accuracy/{name} {value:.4f}" in printed
    assert f"eval_accuracy {means['exact']:.4f} (" in printed and "on 2 rank(s)" in printed


def test_qwenkit_eval_nproc_starts_itself_under_torchrun(monkeypatch, tmp_path):
    started = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(eval_command, "eval_source", lambda target, config: SimpleNamespace(cfg=qconfig.load()))  # the checks
    # before spawn: tested below
    monkeypatch.setattr(eval_command.subprocess, "call", lambda cmd, env: started.append((cmd, env[COMMAND_ENV])) or 0)
    request = eval_command.EvalRequest(str(tmp_path), samples=3, nproc=3, batch_size=4, metric=("exact", "anls"))
    assert eval_command.eval_main(request) == 0
    assert started == [([sys.executable, "-m", "qwenkit.torchrun", "--standalone", "--nproc-per-node=3", "-m", "qwenkit.cli",
                         "eval", str(tmp_path), "--samples=3", "--batch-size=4", "--metric", "exact", "anls"], "eval")]  # fmt: skip


def test_eval_arguments_are_checked_before_any_rank_starts(capsys, tmp_path):
    from qwenkit import cli

    assert cli.main(["eval", str(tmp_path), "--nproc", "2", "--metric", "exact", "vqa"]) == 2
    assert "qwenkit eval: --metric: 'vqa' is neither a built-in metric" in capsys.readouterr().err
    assert cli.main(["eval", str(tmp_path), "--nproc", "0"]) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err
    assert cli.main(["eval", str(tmp_path / "nowhere"), "--nproc", "2"]) == 2
    assert "no such run, checkpoint or export" in capsys.readouterr().err


def test_qwenkit_eval_of_a_dpo_run_refuses_metric_it_cannot_score():
    """A dpo run is evaluated on pairs, nothing generated: ``--metric`` is refused in one line (it was ignored);
    ``--samples`` takes the first pairs (tests/test_preference_train.py, on a trained run)."""
    cfg = qconfig.load(overrides=["train.objective=dpo"])
    request = eval_command.EvalRequest("run", metric=("exact",))
    with pytest.raises(ValueError, match=r"--metric exact: a dpo run is evaluated on its held-out pairs .* leave --metric out"):
        objective.entry("dpo").evaluate_cli(request, None, None, cfg, "run", 0, 1, "cpu")


def test_resume_keeps_the_eval_schedule(tmp_path):
    common = BASE + ["train.steps=4", "train.eval_every=3", "train.eval_samples=0", "checkpoint.every=1"]
    whole = train.Trainer(qconfig.load(overrides=common + [f"train.output_dir={tmp_path / 'whole'}"]))
    whole.run()
    first = train.Trainer(qconfig.load(overrides=common + ["train.stop_after=2", f"train.output_dir={tmp_path / 'cut'}"]))
    first.run()
    second = train.Trainer(qconfig.load(overrides=common + ["train.resume=auto", f"train.output_dir={tmp_path / 'cut'}"]))
    second.run()
    assert [e["step"] for e in whole.evals] == [0, 3, 4]
    assert [e["step"] for e in first.evals] == [0] and [e["step"] for e in second.evals] == [3, 4]
    assert first.evals + second.evals == whole.evals  # DCP resume is bit-identical


def test_eval_accuracy_every_adds_accuracy_between_the_ends(tmp_path, monkeypatch, caplog):
    """The schedule; and train.eval_generation=auto with no free memory: the trainer's model
    generates in place (lockstep), says why, and replies as a gathered copy of it does."""
    common = BASE + ["train.steps=4", "train.eval_every=3", "train.eval_samples=2", "train.eval_max_new_tokens=3"]
    cfg = qconfig.load(overrides=common + ["train.eval_accuracy_every=2", f"train.output_dir={tmp_path}"])
    trainer = train.Trainer(cfg)
    with monkeypatch.context() as m, caplog.at_level("INFO", logger="qwenkit.engine.generation.evaluate"):
        m.setattr(placement, "free_memory_bytes", lambda device: 0)
        trainer.run()
    # eval_loss wherever an evaluation runs: step 0, every 3, every accuracy step, the end
    assert [e["step"] for e in trainer.evals] == [0, 2, 3, 4]
    assert [e["step"] for e in trainer.evals if "eval_accuracy" in e] == [0, 2, 4]
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == [f"step-{s:06d}.jsonl" for s in (0, 2, 4)]
    rows = metrics.read(tmp_path / "metrics" / "rank-00000.jsonl")
    assert metrics.series(rows, "eval_accuracy").keys() == metrics.series(rows, "eval_generation_time").keys() == {0, 2, 4}
    assert caplog.text.count("(lockstep; then generation, scores)") == 3 and "does not fit the 0.0 MiB free" in caplog.text
    ev = trainer.evaluator
    caplog.clear()
    with caplog.at_level("INFO", logger="qwenkit.engine.generation.evaluate"):
        evaluate.Evaluator(cfg, ev.dataset, ev.collator, 0, 1, ev.device, tmp_path / "gather").accuracy(4, trainer.model)
    assert "(copy gathered in" in caplog.text and "margin fits the" in caplog.text
    replies = qgen.read_jsonl(evaluate.generations_path(tmp_path, 4))
    assert len(replies) == 2 and replies == qgen.read_jsonl(evaluate.generations_path(tmp_path / "gather", 4))


def test_report_to_tensorboard_writes_every_metric_next_to_the_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = qconfig.load(overrides=BASE + ["train.steps=1", "train.eval_samples=1", "train.eval_max_new_tokens=2",
                                         "train.report_to=[tensorboard]", f"train.output_dir={tmp_path}"])  # fmt: skip
    train.run(cfg)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    jsonl = metrics.read(tmp_path / "metrics" / "rank-00000.jsonl")
    assert set(events.Tags()["scalars"]) == {r["metric"] for r in jsonl}
    for row in jsonl:
        (point,) = [e for e in events.Scalars(row["metric"]) if e.step == row["x"]]
        assert point.value == pytest.approx(row["value"], rel=1e-6)



# ---------------------------------------------------------------------------------------------
# qwenkit eval of what users type (issue 55: GRPO runs, tiny, exports, refusals before any rank)


def _write_yaml(path, overrides):
    """A params file of dotted overrides (nested YAML), as a user writes one."""
    nested: dict = {}
    for item in overrides:
        key, value = item.split("=", 1)
        *sections, leaf = key.split(".")
        node = nested
        for s in sections:
            node = node.setdefault(s, {})
        node[leaf] = qconfig.parse_yaml(value)
    path.write_text(json.dumps(nested))  # JSON is YAML
    return path


def _prompts_file(path, n=4):
    """EasyR1's rows: a prompt and its answer column, no reply (GRPO's data)."""
    path.write_text("".join(json.dumps({"problem": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(n)))
    return path


GRPO_EVAL = ["train.objective=grpo", "train.eval_max_new_tokens=3", "train.eval_samples=2", "grpo.max_new_tokens=3"]


def test_qwenkit_eval_of_a_grpo_run_scores_its_prompts_by_generation_without_an_eval_loss(tmp_path, tiny_path, capsys):
    """A GRPO run's prompt-only eval set (and another prompt-only file): generations and metrics, no
    eval loss, as the trainer evaluates them (it said "no label tokens", or that the rows are "a
    prompt for train.objective=grpo" of a grpo run)."""
    from qwenkit import cli

    prompts = _prompts_file(tmp_path / "prompts.jsonl")
    run = _write_yaml(tmp_path / "grpo.yaml", GRPO_EVAL + [f"data.path={prompts}", "data.eval_fraction=0.5"])
    for extra in ([], ["--data", str(_prompts_file(tmp_path / "other.jsonl", 3))]):
        code = cli.main(["eval", str(tiny_path), "--config", str(run), "--out", str(tmp_path / "g.jsonl"), *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "eval_loss - (no row has a reply" in out and "eval_accuracy 0.0000 (0/2 exact matches)" in out, out


def test_qwenkit_eval_takes_data_tiny_an_exports_own_config_and_a_grpo_run_whose_rewards_do_not_import(
    tmp_path, tiny_path, capsys
):  # fmt: skip
    """``--data tiny`` as ``data.path: tiny`` trains; an export carries its run's config (its eval set:
    a tiny run's data.tiny_eval_samples); a GRPO run's reward module is not imported (eval never calls it)."""
    import shutil

    from qwenkit import cli

    def evaluates(*argv):
        code = cli.main(["eval", *argv, "--samples", "1", "--out", str(tmp_path / "g.jsonl")])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "eval_accuracy" in out and "generation: 1 rows" in out, out

    grpo = _write_yaml(tmp_path / "grpo.yaml", GRPO_EVAL + ["grpo.rewards=[no_such_module:reward]"])
    evaluates(str(tiny_path), "--data", "tiny", "--config", str(grpo))
    exported = tmp_path / "export"
    shutil.copytree(tiny_path, exported)
    qconfig.write_config(qconfig.load(overrides=["data.tiny_eval_samples=2", "train.eval_max_new_tokens=3"]), exported,
                         hf_export.RUN_CONFIG)  # fmt: skip
    evaluates(str(exported))


def test_eval_nproc_refuses_a_family_mismatch_before_any_rank_starts(tmp_path, tiny_path, capsys, monkeypatch):
    """The family check the ranks would each fail (twice, under a 'qwenkit train' heading) is made
    once before torchrun starts: one line, exit 2."""
    from qwenkit import cli

    started = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(eval_command.subprocess, "call", lambda cmd, **kw: started.append(cmd) or 0)
    other = _write_yaml(tmp_path / "other.yaml", ["model.name=qwen3_vl"])
    assert cli.main(["eval", str(tiny_path), "--nproc", "2", "--config", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qwenkit eval: model.name='qwen3_vl' but ") and len(err.strip().splitlines()) == 1, err
    assert started == []
