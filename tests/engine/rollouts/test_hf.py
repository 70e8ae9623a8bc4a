"""qwenkit.engine.rollouts.hf: a completion is cut at its end token and decoded as evaluation decodes
replies (broken bytes as ``\\xNN``), so the rewards of valid text are the tokenizer's text's; rollouts
batched across prompts equal one completion at a time; on 2 FSDP2 ranks, gathered once or in
lockstep, they equal 1 process's, and the gathered rollout's all-gathers do not grow with the
completions' length; a rollout in a lower precision (``grpo.rollout_dtype``) carries the log-probs it
sampled with, for every family."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from conftest import EVERY_FAMILY, build_model, families_allowing
from multiproc import check_ranks
from torch.distributed.fsdp import FSDPModule
from transformers.convert_slow_tokenizer import bytes_to_unicode

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.bench.collectives import count_all_gathers
from qwenkit.distributed import fsdp
from qwenkit.engine.generation.sampling import RowSampler, Sampling
from qwenkit.engine.objectives import rewards
from qwenkit.engine.rollouts import hf as rollout
from qwenkit.engine.rollouts.completion import completion, completion_seed, media_tokens, training_batch
from qwenkit.engine.rollouts.hf import HfRollouts
from qwenkit.model.processor import Processor

MIXED = qconfig.load(overrides=["data.max_length=2048"])  # the mixed set's rows fit
ROWS = [5, 0, 3, 4]  # a video, one image, text only, two images: prompts of different lengths
GROUP = 3


def _rollouts(max_new_tokens=6, **kwargs) -> HfRollouts:
    return HfRollouts(Sampling(max_new_tokens, temperature=1.3, top_p=0.95, seed=3), GROUP, **kwargs)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, processor):
    from engine.generation.test_generate import write_mixed_eval_set

    root = tmp_path_factory.mktemp("mixed")
    path = write_mixed_eval_set(root)
    processor.save_pretrained(root / "tiny")
    return root, data.read_checked(MIXED.data, processor, path)[0]


def test_batched_rollouts_equal_one_completion_at_a_time_and_leave_the_rng_alone(mixed):
    _, dataset = mixed
    model = build_model(chunk=True, seed=7).train()
    state = torch.random.get_rng_state()
    alone = [c.tokens for i in ROWS for c in _rollouts(batch_size=1)(model, dataset, [i], draw=2)]
    for batch_size in (0, 5):  # all 12 completions in one call; calls of 5, 5 and 2
        done = _rollouts(batch_size=batch_size)(model, dataset, ROWS, draw=2)
        assert [c.index for c in done] == [i for i in ROWS for _ in range(GROUP)]
        assert [c.tokens for c in done] == alone, batch_size
    assert torch.equal(torch.random.get_rng_state(), state)  # the training RNG did not move
    assert all(len({tuple(t) for t in alone[k : k + GROUP]}) > 1 for k in range(0, len(alone), GROUP))  # sampled
    assert [c.tokens for c in _rollouts()(model, dataset, ROWS, draw=3)] != alone  # another draw, other samples
    assert model.training and model.chunk_loss  # the training settings are back


def _worker(rank, out):
    dist.init_process_group("gloo")
    dataset, _ = data.read_checked(MIXED.data, Processor.from_pretrained(out / "tiny"), str(out / "eval.json"), rank, 2)
    model = build_model(chunk=True, seed=7)
    fsdp.shard(model, MIXED.parallel, fsdp.build_mesh(fsdp.Runtime(rank, 2, rank, torch.device("cpu"), "gloo", False)))
    share = ROWS[rank::2]
    result = {}
    for where, new in (("gather", 3), ("gather", 6), ("lockstep", 6)):
        with count_all_gathers() as gathers:
            done = _rollouts(new, batch_size=2, where=where)(model, dataset, share, draw=2)
        result[f"{where}-{new}"] = {"tokens": [c.tokens for c in done], "gathers": len(gathers)}
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def params():  # every unit resharded first: the root keeps its parameters whole after a forward
        for unit in units:
            unit.reshard()
        return [(n, id(p), p.dtype) for n, p in model.named_parameters()]

    own = params()
    for where in ("gather", "lockstep"):  # GEMMs in bf16: FSDP's parameters untouched
        done = _rollouts(3, batch_size=2, where=where, dtype=torch.bfloat16)(model, dataset, share, draw=2)
        assert all(len(c.sampling_logps) == len(c.tokens) for c in done)
        assert params() == own, where
    result["units"] = len(units)
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_gathered_once_or_in_lockstep_equal_one_process(mixed):
    root, dataset = mixed
    check_ranks(_worker, 2, root, timeout=300)  # a lockstep hang fails here
    ranks = [json.loads((root / f"rank-{r}.json").read_text()) for r in (0, 1)]
    model = build_model(chunk=True, seed=7)
    for where, new in (("gather", 3), ("gather", 6), ("lockstep", 6)):
        want = [c.tokens for c in _rollouts(new)(model, dataset, ROWS, draw=2)]
        got = {i: ranks[r][f"{where}-{new}"]["tokens"][k * GROUP : (k + 1) * GROUP]
               for r in (0, 1) for k, i in enumerate(ROWS[r::2])}  # fmt: skip
        assert [t for i in ROWS for t in got[i]] == want, (where, new)
    for r in ranks:  # once per unit, whatever the length; lockstep: every unit at every forward
        assert r["gather-3"]["gathers"] == r["gather-6"]["gathers"] == r["units"]
        assert r["lockstep-6"]["gathers"] > 6 * r["units"]


def test_a_completion_is_decoded_as_evaluation_decodes_replies(family_processor):
    tok = family_processor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    valid = tok.encode("<think>round</think><answer>red</answer>", add_special_tokens=False)
    tokens, text, truncated = completion(tok, [*valid, end, *valid], end)
    assert tokens == [*valid, end] and not truncated  # cut after the end token, which is trained on
    assert text == tok.decode(valid, skip_special_tokens=True)  # valid text: the tokenizer's own
    score = rewards.resolve(["exact", "format"], "pixels", ("think", "answer"))
    args = (score, [], [text, tok.decode(valid)], ["red", "red"], [{}, {}], ["row 0", "row 0"])
    per, _ = rewards.score(*args)
    assert per[0].tolist() == per[1].tolist() == [1.0, 1.0]  # the same rewards as the tokenizer's text
    byte_token = {b: tok.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    broken = [byte_token["é".encode()[0]], *tok.encode("red", add_special_tokens=False)]  # half a character
    tokens, text, truncated = completion(tok, broken, end)
    assert tokens == broken and truncated  # no end token: cut at max_new_tokens
    assert text == "\\xc3red" and "\ufffd" in tok.decode(broken)


@families_allowing("GRPO")
def test_a_lower_precision_rollout_carries_the_log_probs_it_sampled_with(family, family_path, family_processor,
                                                                        make_model, monkeypatch):  # fmt: skip
    """With its GEMMs in ``dtype`` each completion carries its sampler's log-prob of every token: exactly the
    tempered log-softmax of the scores HF ``generate`` handed the sampler (media tokens already banned),
    which differ from the fp32 policy's by more than fp32 rounding (the cast ran: GRPO has something to
    correct) and by no more than the cast's rounding allows. Gathered, the weights are cast once
    (``low_precision_gemms``): the very numbers of a cast at every call (lockstep), and the policy keeps its
    own parameters and forwards. A rollout in the weights' own dtype carries none."""
    temperature, seed, draw = 0.7, 3, 1
    cfg = qconfig.load(overrides=[f"model.name={family}", f"model.path={family_path}", "data.tiny_samples=4"])
    dataset = data.build(cfg, family_processor).dataset
    model = make_model(chunk=True, seed=7, path=str(family_path))
    scores: dict[int, list[torch.Tensor]] = {}  # a completion's seed: the scores of each of its steps

    class Seen(RowSampler):
        def __call__(self, input_ids, scores_):
            for b, s in enumerate(self.seeds):
                scores.setdefault(s, []).append(scores_[b].clone())
            return super().__call__(input_ids, scores_)

    monkeypatch.setattr(rollout, "RowSampler", Seen)
    sampling = Sampling(6, temperature=temperature, seed=seed)
    banned = media_tokens(family_processor)
    gaps = {}
    own = [(n, id(p), p.dtype) for n, p in model.named_parameters()]
    for dtype in (None, torch.bfloat16, torch.float16):
        scores.clear()
        done = HfRollouts(sampling, 2, dtype=dtype)(model, dataset, [0, 1], draw)
        assert [(n, id(p), p.dtype) for n, p in model.named_parameters()] == own  # the policy's own, after
        assert not any("forward" in vars(m) for m in model.modules())
        assert all((c.sampling_logps is None) == (dtype is None) for c in done)  # the weights' own: nothing to correct
        assert all(s.dtype == torch.float32 for steps in scores.values() for s in steps)  # HF's fp32 copy of the logits
        sampled = []
        for k, c in enumerate(done):
            steps = torch.stack(scores[completion_seed(seed, draw, c.index, k % 2)][: len(c.tokens)])  # [new, V]
            assert torch.isinf(steps[:, banned]).all()  # banned before the sampler
            sampled.append(torch.log_softmax(steps / temperature, -1).gather(1, torch.tensor(c.tokens)[:, None]).squeeze(1))
            if dtype is not None:
                torch.testing.assert_close(torch.tensor(c.sampling_logps), sampled[-1])
        if dtype is not None:  # weights cast once for the rollout (gathered) = cast at every forward (lockstep)
            locked = HfRollouts(sampling, 2, where="lockstep", dtype=dtype)(model, dataset, [0, 1], draw)
            assert [c.sampling_logps for c in locked] == [c.sampling_logps for c in done]
        batch = training_batch(done, family_processor.pad_token_id)
        with torch.no_grad():
            policy, _ = model.token_logps(**batch, temperature=temperature, banned=banned)
        mask = batch["labels"][:, 1:] != -100
        gaps[dtype] = (policy[:, :-1][mask] - torch.cat(sampled)).abs().max().item()
        finite = torch.cat([torch.stack(s) for s in scores.values()])
        scale = finite[finite.isfinite()].abs().max().item() / temperature  # the largest tempered logit
    for dtype, eps in ((torch.bfloat16, 2**-8), (torch.float16, 2**-11)):
        # the cast's rounding (a few roundings a layer, relative to the logits) dwarfs fp32's and stays within it
        assert 8 * gaps[None] < gaps[dtype] < 8 * eps * (1 + scale), (dtype, gaps, scale)


@EVERY_FAMILY
def test_no_rollout_draws_a_media_placeholder(family_processor):
    """A completion holding an image, video or audio placeholder, or a span's start or end, would make the
    training forward look for features it has not got: every such token of the family's tokenizer is banned
    (the Omni thinkers' audio ones too)."""
    added = family_processor.tokenizer.get_added_vocab()
    placeholders = {i for name, i in added.items() if any(w in name.lower() for w in ("image", "video", "vision", "audio"))}
    assert len(placeholders) >= 4 and placeholders <= set(media_tokens(family_processor))
