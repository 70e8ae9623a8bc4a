"""Qwen3.5's multi-token-prediction (MTP) layer, trained beside the backbone (``model.mtp.train``).

The layer as the released checkpoints hold it (``mtp.*``) and vLLM's ``qwen3_5_mtp.py`` runs it:
``fc`` [H, 2H] over ``concat(pre_fc_norm_embedding(embed(token t+1)), pre_fc_norm_hidden(h_t))`` (the
embedding first), one full-attention decoder layer of the backbone's kind per depth, the final ``norm``,
then the model's own ``lm_head`` (through the chunked loss: no full logits). Depth ``d`` (0-based) predicts
token ``t+d+2``; a deeper one takes the previous depth's output as its hidden state, as vLLM's proposer
feeds it back. The embeddings are the backbone's ``embed_tokens`` (the checkpoint has none of its own).

The decoder layer runs with what the backbone's first full-attention layer was given in this forward
(rotary cos/sin of the same positions, the same causal or packed mask, the packing keywords): captured by a
pre-forward hook, so positions and document boundaries are the backbone's. Targets are masked where
``t`` and ``t+d+2`` lie in different documents of a packed row: no prediction crosses a boundary.
The loss of each depth is normalised as the main loss (``num_items_in_batch``: the step's global label
tokens), averaged over the depths and added with ``model.mtp.loss_weight`` (MindSpeed-MM's
``mtp_loss_scaling_factor``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from qwenkit.model.losses.cross_entropy import IGNORE_INDEX

PREFIX = "mtp."  # the checkpoint's names: the module sits at the model's top level as ``mtp``


class MTPHead(nn.Module):
    """``fc``, the two input norms, ``layers`` (full-attention decoder layers) and ``norm``: the checkpoint's keys."""

    def __init__(self, text_config, layer_cls: type, full_idx: int, norm_cls: type, layers: int):
        super().__init__()
        hidden, eps = text_config.hidden_size, text_config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.layers = nn.ModuleList(layer_cls(text_config, full_idx) for _ in range(layers))
        self.norm = norm_cls(hidden, eps=eps)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, depth: int, layer_kwargs: dict) -> torch.Tensor:
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.layers[depth](self.fc(x), **layer_kwargs)
        return self.norm(x)


def attach(model, layers: int, loss_weight: float) -> MTPHead:
    """Give ``model`` (a Qwen3.5 subclass) its MTP module ``model.mtp`` (on the device its parameters are on,
    meta included) and the hook that records the backbone's full-attention layer inputs."""
    text = model.model.language_model
    full = next(i for i, kind in enumerate(text.config.layer_types) if kind == "full_attention")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    with torch.device(device):
        head = MTPHead(text.config, type(text.layers[full]), full, type(text.norm), layers).to(dtype)
    model.mtp = head
    model.mtp_loss_weight = loss_weight
    model.last_mtp_loss = None

    def record(module, args, kwargs):
        model._mtp_layer_kwargs = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "cache", "past_key_values")}

    text.layers[full].register_forward_pre_hook(record, with_kwargs=True)
    return head


def load_from_checkpoint(model, path) -> int:
    """Fill ``model.mtp`` from the ``mtp.*`` tensors of the checkpoint at ``path`` (HF's ``from_pretrained``
    skips them); returns how many. A missing one is refused by name."""
    wanted = {k for k in model.state_dict() if k.startswith(PREFIX)}
    files = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            files |= {k: file for k in f.keys() if k.startswith(PREFIX)}
    if missing := sorted(wanted - set(files)):
        raise KeyError(f"model.path={str(path)!r}: model.mtp.train needs the checkpoint's {missing[0]} (and "
                       f"{len(missing) - 1} more mtp.* tensors)")  # fmt: skip
    state = {}
    for key in wanted:
        with safe_open(str(files[key]), framework="pt") as f:
            state[key[len(PREFIX):]] = f.get_tensor(key)
    model.mtp.load_state_dict(state)
    return len(state)


def doc_ids(labels: torch.Tensor, packed_seq_lens: torch.Tensor | None) -> torch.Tensor | None:
    """``[1, S]`` the document (sample index) of each position of a packed row; None for a padded batch."""
    if packed_seq_lens is None:
        return None
    lens = packed_seq_lens.to(labels.device)
    return torch.repeat_interleave(torch.arange(lens.numel(), device=labels.device), lens)[None, :]


def targets(labels: torch.Tensor, offset: int, docs: torch.Tensor | None) -> torch.Tensor:
    """Pre-shifted targets ``[B, S]``: position t's is ``labels[t + offset]``, ignored past the row's end and
    where ``t + offset`` lies in another document."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-offset] = labels[:, offset:]
    if docs is not None:
        out[:, :-offset][docs[:, :-offset] != docs[:, offset:]] = IGNORE_INDEX
    return out


def shifted_ids(input_ids: torch.Tensor, offset: int) -> torch.Tensor:
    """``input_ids`` moved left by ``offset`` (token t+offset at t), the tail filled with the row's last token
    (its predictions are ignored)."""
    return torch.cat([input_ids[:, offset:], input_ids[:, -1:].expand(-1, offset)], dim=1)


def mtp_loss(model, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, packed_seq_lens, loss_fn,
             view=None) -> torch.Tensor:  # fmt: skip
    """The MTP depths' mean loss on the backbone's ``hidden [B, S, H]``; ``loss_fn``: the main loss's
    :func:`~qwenkit.model.losses.cross_entropy.chunked_linear_cross_entropy` partial (its normaliser), given pre-shifted targets.

    ``view(t [B, S], fill)``: what this rank holds of a whole-sequence tensor under sequence parallelism (its
    slice ``[B, S/N]``, :func:`qwenkit.model.parallel.forward_slice`), ``hidden`` being that slice's. The ids are
    shifted and the targets built on the whole sequence before slicing, so the last positions of a slice take
    the next slice's tokens; the layer's attention is the backbone's (the recorded keywords: Ulysses over the group)."""
    view = view or (lambda t, fill: t)
    docs = doc_ids(labels, packed_seq_lens)
    embed = model.model.get_input_embeddings()
    kwargs = model._mtp_layer_kwargs
    total = 0.0
    for depth in range(len(model.mtp.layers)):
        ids = view(shifted_ids(input_ids, depth + 1), 0)  # the padding: after every real position, its targets ignored
        hidden = model.mtp(hidden, embed(ids), depth, kwargs)
        fn = functools.partial(loss_fn, shifted=view(targets(labels, depth + 2, docs), IGNORE_INDEX))
        total = total + model.lm_head(hidden, labels=None, loss_fn=fn)
    return total / len(model.mtp.layers)


TOP1_ROWS = 1024  # positions projected at once by top1 (their logits [rows, V] exist, the whole row's never)


def _argmax(hidden: torch.Tensor, weight: torch.Tensor, labels=None, bias=None, skip_ignored=True) -> torch.Tensor:
    """``[N]`` the top-1 of ``hidden [N, H]`` under the head ``weight``, in blocks of :data:`TOP1_ROWS` (a head's loss_fn)."""
    if not len(hidden):
        return torch.zeros(0, dtype=torch.long, device=hidden.device)
    return torch.cat([F.linear(block, weight, bias).argmax(-1) for block in hidden.split(TOP1_ROWS)])


def top1(lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``[N]`` the main head's top-1 token of each of ``hidden [N, H]``. The chunked head (the trainer's)
    is called once as a module with :func:`_argmax` as its loss function, whatever N (none included):
    FSDP2 gathers its weight once, and every rank issues the same collectives."""
    if type(lm_head) is nn.Linear:  # HF's own head (qwenkit eval): not sharded
        return _argmax(hidden, lm_head.weight, bias=lm_head.bias)
    return lm_head(hidden, loss_fn=_argmax)


@torch.no_grad()
def draft_agreement(model, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, packed_seq_lens=None):
    """Per sample ``(accepted [N], drafted [N])`` of the first MTP depth (speculative decoding's one-token draft):
    at every position t whose token t+2 is a label token of t's sample, the draft (top-1 of the MTP layer on
    ``h_t`` and token t+1) against the main head's top-1 at t+1 (the model's own greedy token t+2).
    ``hidden [B, S, H]``: the backbone's, from the forward whose decoder-layer keywords ``attach``'s hook kept;
    N: the rows of a padded batch, the samples of a packed row (``packed_seq_lens``)."""
    docs = doc_ids(labels, packed_seq_lens)
    drafted = targets(labels, 2, docs) != IGNORE_INDEX  # [B, S]
    embeds = model.model.get_input_embeddings()(shifted_ids(input_ids, 1))
    draft = top1(model.lm_head, model.mtp(hidden, embeds, 0, model._mtp_layer_kwargs)[drafted])
    greedy = top1(model.lm_head, hidden[:, 1:][drafted[:, :-1]])  # drafted positions leave the last one out
    sample = (docs if docs is not None else torch.arange(len(labels), device=labels.device)[:, None].expand_as(labels))[drafted]
    n = len(packed_seq_lens) if packed_seq_lens is not None else len(labels)
    accepted = torch.zeros(n, dtype=torch.long, device=labels.device).index_add_(0, sample, (draft == greedy).long())
    return accepted, torch.bincount(sample, minlength=n)

