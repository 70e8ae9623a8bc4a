"""Gated DeltaNet on packed rows: the conv window and the recurrent state restart at every sample.

Qwen3.5's linear-attention layer (transformers' ``Qwen3_5GatedDeltaNet``) carries two things along
the sequence that position ids cannot reset: a depthwise causal conv1d over the last
``linear_conv_kernel_dim`` tokens and the delta rule's recurrent state. On a packed row both would
run from one sample into the next. HF's layer hands the sample boundaries (``cu_seq_lens_q``, which
the chunk-loss subclass passes for a packed row, :mod:`qwenkit.model.families.qwen3_5`) to two module-level
functions, ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``; its PyTorch fallbacks refuse
the boundaries (``can't keep packed sequences apart``). :func:`install` puts in their place
functions that keep the samples apart, chosen per call by the tensor's device:

    call                      cuda, kernels installed                  any other device
    no boundaries             HF's own function (unchanged)            HF's own function
    causal conv1d, packed     causal-conv1d with ``seq_idx``           HF's fallback per sample
    delta rule, packed        flash-linear-attention with cu_seqlens   HF's fallback per sample

"Per sample" runs HF's own PyTorch fallback on the samples side by side, each right-padded to the
longest (``[n, L_max, ...]``): causal, so the padding after a sample changes nothing in it, and
each sample starts from a zero conv window and a zero state, exactly as it would alone. Cost: the
padded batch HF would run on unpacked rows; memory ``n x L_max`` instead of ``ΣL`` for the layer's
conv and delta-rule tensors.

fla-core's own PyTorch references (``fla/ops/gated_delta_rule/naive.py``, 0.4.2) take no
``cu_seqlens``: on CPU they would mix samples as HF's fallback does, hence the per-sample run here.
Under Ulysses sequence parallelism each rank holds a slice of the sequence; the layer's functions
then get the group (``sequence_parallel``, the attention's context) and exchange the projected
streams for whole sequences: the conv runs on this rank's ``C/N`` channels, the delta rule on its
``heads/N`` key and value heads (contiguous, so each value head keeps its key head), and the
results go back to the slice layout. Four all-to-alls per layer; the state never sees a slice.

The kernel libraries are optional (``pip install qwenkit[cuda]``); they are imported on the first
CUDA call with boundaries, and a missing one is remembered and that route runs the fallback.
"""

from __future__ import annotations

import importlib
import inspect
import logging

import torch

log = logging.getLogger(__name__)

# transformers' modules whose Gated DeltaNet calls these module-level functions (Qwen3.5 dense and MoE, Qwen4-Exp)
MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
           "transformers.models.qwen4_exp.modeling_qwen4_exp")  # fmt: skip
CONV, DELTA = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"
KERNELS = {CONV: ("causal_conv1d", "causal_conv1d_fn"), DELTA: ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")}

_originals: dict[tuple[str, str], object] = {}  # (module, function) -> HF's function, while installed
_missing: set[str] = set()
_announced: set[tuple[str, str]] = set()


def _announce(fn: str, route: str) -> None:
    if (fn, route) not in _announced:
        _announced.add((fn, route))
        log.info("linear attention on packed rows: %s runs %s", fn, route)


def _kernel(fn: str):
    """The CUDA kernel of ``fn`` (imported once), or None when its library is missing."""
    module, attr = KERNELS[fn]
    if module in _missing:
        return None
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        _missing.add(module)
        log.warning("%s is not importable (%s): packed rows on CUDA run HF's PyTorch fallback per sample", module, e)
        return None


def _fallback(module, fn: str):
    """HF's PyTorch implementation of ``fn`` itself, under its kernel-selecting wrappers."""
    return inspect.unwrap(_originals.get((module.__name__, fn), getattr(module, fn)))


def boundaries(seq_lens, device) -> dict:
    """HF's varlen keywords of one packed row (``cu_seq_lens_q/k`` ``[n + 1]`` int32, ``max_length_q/k``)."""
    lengths = torch.as_tensor(seq_lens, device=device).to(torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    longest = int(lengths.max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


# --- packed <-> padded ------------------------------------------------------------------------


def _layout(cu_seqlens: torch.Tensor, total: int):
    """``(sample, offset, n, longest)`` of every position of a packed row of ``total`` tokens."""
    cu = cu_seqlens.to(torch.long)
    if int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens end at {int(cu[-1])}, but the packed row has {total} tokens")
    lengths = cu[1:] - cu[:-1]
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)  # [T]
    offset = torch.arange(total, device=cu.device) - cu[sample]  # [T]
    return sample, offset, len(lengths), int(lengths.max())


def to_padded(x: torch.Tensor, layout) -> torch.Tensor:
    """``[1, T, ...]`` packed -> ``[n, L_max, ...]``, each sample from position 0, zeros after it."""
    sample, offset, n, longest = layout
    out = x.new_zeros(n, longest, *x.shape[2:])
    return out.index_put((sample, offset), x[0])


def to_packed(x: torch.Tensor, layout) -> torch.Tensor:
    """``[n, L_max, ...]`` -> ``[1, T, ...]``: the inverse of :func:`to_padded`."""
    sample, offset, _, _ = layout
    return x[sample, offset].unsqueeze(0)


# --- the two functions HF's layer calls -------------------------------------------------------


def _conv_for(module):
    hf = getattr(module, CONV)

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, cu_seq_lens_q=None,
                         sequence_parallel=None, **kwargs):  # fmt: skip
        """HF's causal conv1d ``[B, C, T]``; with ``cu_seq_lens_q`` (one packed row) each sample's window
        starts empty; under Ulysses (``sequence_parallel``) on this rank's channels of the whole sequence."""
        if sequence_parallel is not None:
            return _conv_on_channels(causal_conv1d_fn, hidden_states, weight, bias, activation, cu_seq_lens_q,
                                     sequence_parallel)  # fmt: skip
        if cu_seq_lens_q is None:
            return hf(hidden_states, weight, bias, activation=activation, **kwargs)
        if hidden_states.shape[0] != 1:
            raise ValueError(f"packed boundaries need one packed row, got a batch of {hidden_states.shape[0]}")
        if hidden_states.device.type == "cuda" and (kernel := _kernel(CONV)) is not None:
            _announce(CONV, "causal-conv1d with seq_idx")
            layout = _layout(cu_seq_lens_q, hidden_states.shape[-1])
            seq_idx = layout[0].to(torch.int32).unsqueeze(0)  # [1, T]; the kernel wants channel-last x
            x = hidden_states.transpose(1, 2).contiguous().transpose(1, 2)
            return kernel(x, weight, bias, seq_idx=seq_idx, activation=activation)
        _announce(CONV, "HF's PyTorch fallback per sample")
        layout = _layout(cu_seq_lens_q, hidden_states.shape[-1])
        padded = to_padded(hidden_states.transpose(1, 2), layout).transpose(1, 2)  # [n, C, L_max]
        out = _fallback(module, CONV)(padded, weight, bias, activation=activation)
        return to_packed(out.transpose(1, 2), layout).transpose(1, 2)  # [1, C, T]

    return causal_conv1d_fn


def _conv_on_channels(conv, hidden_states, weight, bias, activation, cu_seq_lens_q, sp):
    """Ulysses: ``[B, C, T/N]`` -> this rank's ``C/N`` channels of the whole sequence, the (depthwise,
    so per-channel exact) conv on them, and back. ``C/N`` contiguous channels: the conv needs no
    head alignment, only ``C % N == 0`` (refused before start otherwise)."""
    n, rank = sp.size, torch.distributed.get_rank(sp.group)
    width = weight.shape[0] // n
    mine = slice(rank * width, (rank + 1) * width)
    x = sp.to_heads(hidden_states.unsqueeze(-1)).squeeze(-1)  # [B, C/N, T]
    out = conv(x, weight[mine], None if bias is None else bias[mine], activation=activation, cu_seq_lens_q=cu_seq_lens_q)
    return sp.to_seq(out.unsqueeze(-1)).squeeze(-1)  # [B, C, T/N]


def _delta_for(module):
    hf = getattr(module, DELTA)

    def torch_chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, sequence_parallel=None,
                                     **kwargs):  # fmt: skip
        """HF's chunked gated delta rule ``[B, T, heads, dim]``; with ``cu_seqlens`` (one packed row)
        each sample starts from a zero state; under Ulysses (``sequence_parallel``) on this rank's heads
        of the whole sequence."""
        common = dict(output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        if sequence_parallel is not None:
            if initial_state is not None or output_final_state:
                raise ValueError("sequence parallelism runs the delta rule without a cache (training)")
            sp = sequence_parallel
            heads = [sp.to_heads(t.transpose(1, 2)).transpose(1, 2) for t in (query, key, value)]  # [B, T, H/N, D]
            gate, b = (sp.to_heads(t.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2) for t in (g, beta))
            out, _ = torch_chunk_gated_delta_rule(*heads, g=gate, beta=b, cu_seqlens=cu_seqlens, **common, **kwargs)
            return sp.to_seq(out.transpose(1, 2)).transpose(1, 2), None  # [B, T/N, H, D]
        if cu_seqlens is None:
            return hf(query, key, value, g=g, beta=beta, initial_state=initial_state, **common, **kwargs)
        if query.shape[0] != 1 or initial_state is not None:
            raise ValueError("packed boundaries need one packed row and no initial state (training, no cache)")
        if query.device.type == "cuda" and (kernel := _kernel(DELTA)) is not None:
            _announce(DELTA, "flash-linear-attention with cu_seqlens")
            return kernel(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens.to(torch.long), **common)
        _announce(DELTA, "HF's PyTorch fallback per sample")
        layout = _layout(cu_seqlens, query.shape[1])
        q, k, v, gate, b = (to_padded(t, layout) for t in (query, key, value, g, beta))
        out, state = _fallback(module, DELTA)(q, k, v, g=gate, beta=b, **common, **kwargs)
        return to_packed(out, layout), state  # state: [n, heads, k_dim, v_dim], one per sample

    return torch_chunk_gated_delta_rule


def install() -> list[str]:
    """Put the boundary-keeping functions into HF's Qwen3.5 and Qwen4-Exp modules; returns what it replaced
    (``module.function``), nothing on a second call or where transformers has no Qwen3.5."""
    done = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # transformers 4.57: no Qwen3.5, before 5.23 no Qwen4-Exp (their entries refuse them)
            continue
        for fn, make in ((CONV, _conv_for), (DELTA, _delta_for)):
            if (name, fn) in _originals:
                continue
            replacement = make(module)
            _originals[(name, fn)] = getattr(module, fn)
            setattr(module, fn, replacement)
            done.append(f"{name}.{fn}")
    return done


def revert() -> None:
    """Put HF's functions back (tests)."""
    for (name, fn), original in list(_originals.items()):
        setattr(importlib.import_module(name), fn, original)
        del _originals[(name, fn)]
