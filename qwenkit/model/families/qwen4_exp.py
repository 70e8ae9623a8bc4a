"""Qwen4-Exp with the chunked loss head.

transformers >= 5.23 only (older ones have no ``qwen4_exp``: the family entry says so before any rank
starts). The backbone runs as HF runs it: Qwen3.5-MoE's hybrid decoder (Gated DeltaNet with a sigmoid
output gate, full attention) where the full-attention layers select their keys with the QSA token
indexer, every decoder layer's residual is ``hc_count`` hyper-connection streams, and some
linear-attention layers add Per-Layer Embeddings of hashed n-grams (PLE). The vision tower is
Qwen3.5's (no DeepStack): the shared :meth:`~qwenkit.model.families.chunked.ChunkLossMixin.vision_tower`
serves. What differs:

- packed rows: the linear-attention layers get the sample boundaries as Qwen3.5's do
  (:mod:`qwenkit.model.families.linear_attention`), the PLE layers run per sample
  (:mod:`qwenkit.model.families.ple`), and the indexer needs nothing: it forms its compressed blocks
  from the keys the block-causal mask lets a query see, which on a packed row (4-row positions,
  :meth:`~qwenkit.model.families.positions.Positions.packed_position_ids`) are its own sample's, from
  its first token, as alone;
- the router's loss as HF's forward adds it (:class:`qwenkit.model.families.qwen3_vl.RouterAuxLoss`).
"""

from __future__ import annotations

from transformers import Qwen4ExpForConditionalGeneration
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

from qwenkit.model.families import ple
from qwenkit.model.families.chunked import ChunkLossMixin
from qwenkit.model.families.qwen3_5 import _Packed
from qwenkit.model.families.qwen3_vl import RouterAuxLoss
from qwenkit.model.families.subclass import finish_subclass


class QwenkitQwen4Exp(_Packed, RouterAuxLoss, ChunkLossMixin, Qwen4ExpForConditionalGeneration):
    """Qwen4-Exp: the chunked head plus the router's auxiliary loss, as HF's forward adds it."""

    output_class = hf.Qwen4ExpCausalLMOutputWithPast
    balancing_loss = staticmethod(hf.load_balancing_loss_func)

    def __init__(self, config):
        super().__init__(config)
        ple.install()  # once per process: PLE layers that keep a packed row's samples apart


finish_subclass(QwenkitQwen4Exp, Qwen4ExpForConditionalGeneration)
