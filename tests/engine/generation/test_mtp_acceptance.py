"""Qwen3.5's MTP acceptance (:mod:`qwenkit.engine.generation.mtp_acceptance`).

- the drafts, the model's tokens they are compared with and the per-reply counts = a reference written
  out here, each row alone with full logits: the draft of vLLM's layer by hand (fc over concat(norm(embed of token t+1), norm(h_t)), the decoder layer, the norm,
  the shared lm_head) against the main head's argmax at t+1, at every t whose token t+2 is a reply token;
  the trainer's chunk-loss model and HF's class given the checkpoint's mtp.* agree;
- a packed row (the trainer's eval rows with data.packing) = the padded batch, per sample;
- a head whose draft is the model's own next hidden state is accepted everywhere (1.0 exactly);
- through the trainer: ``eval_mtp_acceptance`` logged at the eval steps (beside generated replies from a
  gathered copy of HF's class, which has no MTP layer), and ``qwenkit eval --metric
  mtp_acceptance`` on the run's checkpoint (its trained mtp.*) and on the base (its own) prints the
  trainer's values at the last step and at step 0;
- a family without an MTP layer, or the metric beside answer metrics: refused in one line, exit 2.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import over_families, tiny_checkpoint

from qwenkit import cli
from qwenkit import config as qconfig
from qwenkit.engine.checkpoints import dcp as ckpt
from qwenkit.engine.generation import mtp_acceptance
from qwenkit.model.families import mtp
from qwenkit.model.families import registry as families
from qwenkit.model.families.build import build
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX


def _model(family):
    cfg = qconfig.load(overrides=[f"model.path={tiny_checkpoint(family)}", f"model.name={family}", "model.mtp.train=true"])
    return build(cfg.model, cfg.loss).eval()


@torch.no_grad()
def _reference(model, ids: torch.Tensor, labels: torch.Tensor) -> tuple[list[int], list[int]]:
    """One row ``ids [L]`` alone, by hand with [L, V] logits: the drafts and the model's own tokens t+2
    at the positions t drafted."""
    lm, head = model.model.language_model, model.mtp
    hidden = model.model(input_ids=ids[None], use_cache=False).last_hidden_state
    greedy = model.lm_head(hidden)[0].argmax(-1)  # greedy[t]: the model's token t+1
    nxt = torch.cat([ids[1:], ids[-1:]])[None]
    x = head.fc(torch.cat([head.pre_fc_norm_embedding(lm.embed_tokens(nxt)), head.pre_fc_norm_hidden(hidden)], dim=-1))
    pos = torch.arange(len(ids))[None, None].expand(3, 1, -1)  # text-only mRoPE: t, h, w alike
    x = head.layers[0](x, position_embeddings=lm.rotary_emb(x, pos), attention_mask=None, position_ids=pos[0])
    draft = model.lm_head(head.norm(x))[0].argmax(-1)
    drafted = [t for t in range(len(ids) - 2) if labels[t + 2] != IGNORE_INDEX]
    return [int(draft[t]) for t in drafted], [int(greedy[t + 1]) for t in drafted]


def _spied(monkeypatch, model, batch) -> tuple[list, list, list]:
    """``agreement``'s counts, and the drafts and greedy tokens it compared (its two top-1 calls, in order)."""
    seen = []
    real = mtp.top1
    monkeypatch.setattr(mtp, "top1", lambda head, hidden: seen.append(real(head, hidden)) or seen[-1])
    accepted, drafted = mtp_acceptance.agreement(model, batch)
    return [accepted.tolist(), drafted.tolist()], seen[0].tolist(), seen[1].tolist()


def _batch(model, lengths=(13, 9)):
    """A right-padded batch of rows of random tokens, the first 3 of each a prompt (no label)."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, model.config.text_config.vocab_size, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, :3] = IGNORE_INDEX
    return rows, {"input_ids": ids, "attention_mask": mask, "labels": labels}


@over_families("qwen3_5", "qwen3_5_moe")
@torch.no_grad()
def test_drafts_and_counts_equal_a_full_logits_reference_of_each_row_alone(family, monkeypatch):
    model = _model(family)
    rows, batch = _batch(model)
    counts, drafts, greedy = _spied(monkeypatch, model, batch)
    ref = [_reference(model, row, batch["labels"][i, : len(row)]) for i, row in enumerate(rows)]
    assert drafts == [d for r in ref for d in r[0]] and greedy == [g for r in ref for g in r[1]]
    assert counts == [[sum(map(int.__eq__, *r)) for r in ref], [len(r) - 3 for r in rows]]  # t+2 in the labels 3..L-1
    # HF's own class (qwenkit eval's) with the checkpoint's mtp.* on it: the same drafts
    hf = families.get(family).load("hf_class").from_pretrained(tiny_checkpoint(family)).eval()
    mtp.attach(hf, 1, 0.0)
    assert mtp.load_from_checkpoint(hf, tiny_checkpoint(family)) > 0
    assert _spied(monkeypatch, hf, batch) == (counts, drafts, greedy)


@over_families("qwen3_5")
@torch.no_grad()
def test_a_packed_row_drafts_as_the_padded_batch(family, monkeypatch):
    """The trainer's eval rows packed (data.packing): per sample, the same drafts, tokens and counts;
    no draft across the boundary."""
    model = _model(family)
    rows, batch = _batch(model)
    # the second sample labelled from its token 1: a draft at the first one's end would reach into it
    batch["labels"][1, 1 : len(rows[1])] = rows[1][1:]
    padded = _spied(monkeypatch, model, batch)
    row = torch.cat(rows)[None]
    labels = torch.cat([batch["labels"][i, : len(r)] for i, r in enumerate(rows)])[None]
    packed = {"input_ids": row, "labels": labels, "packed_seq_lens": torch.tensor([len(r) for r in rows])}
    assert _spied(monkeypatch, model, packed) == padded


class _NextHidden(torch.nn.Module):
    """A head whose output at t is the backbone's h_{t+1}: its draft is the model's own token t+2."""

    layers = [None]

    def forward(self, hidden, embeds, depth, layer_kwargs):
        return torch.cat([hidden[:, 1:], hidden[:, -1:]], dim=1)


@over_families("qwen3_5")
def test_a_head_drafting_the_models_own_token_is_accepted_everywhere(family):
    model = _model(family)
    model.mtp = _NextHidden()
    _, batch = _batch(model)
    accepted, drafted = mtp_acceptance.agreement(model, batch)
    assert drafted.tolist() == [10, 6] and accepted.tolist() == drafted.tolist()


@over_families("qwen3_5")
def test_logged_by_the_trainer_and_measured_by_qwenkit_eval(family, tmp_path, capsys):
    from qwenkit.engine.run import metrics, train

    base = tmp_path / "base"
    shutil.copytree(tiny_checkpoint(family), base)
    run = tmp_path / "run"
    cfg = qconfig.load(overrides=[f"model.path={base}", f"model.name={family}", "model.mtp.train=true", "train.steps=2",
                                  "data.tiny_samples=8", "data.tiny_eval_samples=6", "train.micro_batch_size=2",
                                  "train.resume=none", "train.warmup_steps=1", "train.lr=2e-2", "train.eval_samples=2",
                                  "train.eval_max_new_tokens=2", "train.eval_generation=gather",
                                  f"train.output_dir={run}"])  # fmt: skip
    train.run(cfg)
    logged = metrics.series(metrics.read(run), mtp_acceptance.LOGGED, 0)
    assert logged.keys() == {0, 2} and 0 < logged[2] < 1  # the tiny base drafts nothing right; 2 steps teach it some
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--metric", "mtp_acceptance"]) == 0
    assert f"mtp_acceptance {logged[2]:.4f} (the mean over 6 replies" in capsys.readouterr().out
    config = ckpt.run_config_path(ckpt.resolve(run))  # the base as an export: its own mtp.*, the run's eval rows
    assert cli.main(["eval", str(base), "--config", str(config), "--metric", "mtp_acceptance"]) == 0
    assert f"mtp_acceptance {logged[0]:.4f} (" in capsys.readouterr().out


@pytest.mark.parametrize(("target", "metric", "said"), [
    ("qwen2_5_vl", ["mtp_acceptance"], "--metric mtp_acceptance: qwen2_5_vl has no multi-token-prediction layer"),
    ("qwen3_5", ["mtp_acceptance", "exact"], "--metric mtp_acceptance is measured alone"),
])  # fmt: skip
def test_refused_in_one_line(target, metric, said, capsys):
    if why := families.get(target).unavailable():
        pytest.skip(why)
    assert cli.main(["eval", str(tiny_checkpoint(target)), "--metric", *metric]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "mtp_acceptance" in line]
    assert len(lines) == 1 and said in lines[0]
