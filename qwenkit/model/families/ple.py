"""Qwen4-Exp's Per-Layer Embeddings (PLE) on packed rows: each sample's n-grams and dilated conv start afresh.

A PLE layer (``Qwen4ExpTextPLELayer``, on some linear-attention decoder layers) hashes each token's
bigram and trigram (the tokens before it, up to the last EOS) into a table, gates the looked-up values
by the residual streams and adds a dilated causal depthwise conv over them. On an unpacked row both
start at the row's first token (an EOS context before it, a zero conv window); on a packed row HF's
layer would read the previous sample's last tokens into the first n-grams and conv taps of the next
(HF knows no sample boundaries there: its ``conv_mask`` only zeroes padding).

:func:`install` puts two wrappers into HF's module: the decoder layer's forward hands its layer's PLE
module the boundaries it gets (``cu_seq_lens_q``, the keyword the chunk-loss subclass adds for a packed
row, :mod:`qwenkit.model.families.qwen4_exp`), and the PLE forward then runs HF's own forward on the
samples side by side, each right-padded to the longest (``[n, L_max, ...]``, as
:mod:`qwenkit.model.families.linear_attention` runs the delta rule): causal, so what follows a sample
changes nothing in it, and each sample sees exactly what it would alone. Without boundaries HF's
forward runs unchanged. The boundaries are set and cleared by the decoder layer's forward itself, so a
recomputed layer (activation checkpointing) sets them again.
"""

from __future__ import annotations

import functools
import importlib

from qwenkit.model.families.linear_attention import _layout, to_packed, to_padded

MODULE = "transformers.models.qwen4_exp.modeling_qwen4_exp"
_originals: dict[str, object] = {}  # class name -> HF's forward, while installed


def _decoder_forward(hf):
    @functools.wraps(hf)
    def forward(self, hidden_states, *args, **kwargs):
        if self.ple is None:
            return hf(self, hidden_states, *args, **kwargs)
        self.ple.packed_boundaries = kwargs.get("cu_seq_lens_q")
        try:
            return hf(self, hidden_states, *args, **kwargs)
        finally:
            self.ple.packed_boundaries = None

    return forward


def _ple_forward(hf):
    @functools.wraps(hf)
    def forward(self, hidden_states, input_ids, cache=None, conv_mask=None):
        """HF's PLE; on a packed row (boundaries set by the decoder layer) per sample, each from a fresh context."""
        cu = getattr(self, "packed_boundaries", None)
        if cu is None:
            return hf(self, hidden_states, input_ids, cache, conv_mask=conv_mask)
        if hidden_states.shape[0] != 1 or cache is not None or conv_mask is not None:
            raise ValueError("PLE on packed boundaries needs one packed row, no cache and no padding mask (training)")
        layout = _layout(cu, hidden_states.shape[1])
        ids = to_padded(input_ids.unsqueeze(-1), layout).squeeze(-1)  # [n, L_max]; after each sample: 0 (unread)
        out = hf(self, to_padded(hidden_states, layout), ids, None, conv_mask=None)
        return to_packed(out, layout)

    return forward


def install() -> list[str]:
    """Wrap HF's Qwen4-Exp decoder-layer and PLE forwards; returns what it wrapped (nothing on a second call
    or where transformers has no Qwen4-Exp)."""
    try:
        module = importlib.import_module(MODULE)
    except ImportError:  # transformers before 5.23 (the family entry refuses it)
        return []
    done = []
    for name, wrap in (("Qwen4ExpTextDecoderLayer", _decoder_forward), ("Qwen4ExpTextPLELayer", _ple_forward)):
        if name in _originals:
            continue
        cls = getattr(module, name)
        _originals[name] = cls.forward
        cls.forward = wrap(cls.forward)
        done.append(f"{name}.forward")
    return done


def revert() -> None:
    """Put HF's forwards back (tests)."""
    module = importlib.import_module(MODULE)
    for name, original in list(_originals.items()):
        getattr(module, name).forward = original
        del _originals[name]
