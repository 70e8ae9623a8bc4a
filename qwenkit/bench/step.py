"""A model step as measured and compared: fixed batches, one forward + backward, its FLOPs.

The notebooks (03 compares the chunked head with HF's, 04 times and counts a step), the
benchmarks and the tests take their batches, their loss-and-gradients pass and their FLOP
count from here, so a notebook's MFU and a benchmark's MFU count the same FLOPs.

- :func:`sample_batches` / :func:`text_only` / :func:`to_device`: fixed batches of a dataset's
  first samples (no sampler, no shuffling), with their vision spans removed for a text case;
- :func:`loss_and_grads`: the loss and every parameter gradient of one forward + backward;
- :func:`step_flops`: the FLOPs of one forward + backward as ``torch.utils.flop_counter`` counts
  them (every matmul, attention and convolution the step runs: a head that skips ignored labels
  is credited with the rows it projects). MFU is those FLOPs per second over a matmul peak
  measured in the same run (:func:`qwenkit.bench.measure.matmul_peak`). Count on the model
  without activation recompute: recomputed FLOPs are not model FLOPs.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from qwenkit.config import Config
from qwenkit.data import Collator, read_dataset
from qwenkit.model.processor import Processor


def text_only(sample: dict[str, torch.Tensor], processor: Processor) -> dict[str, torch.Tensor]:
    """The sample without its vision spans (start, pad and end tokens) and pixels."""
    vision = torch.tensor([processor.vision_start_id, processor.image_token_id, processor.vision_end_id])
    keep = ~torch.isin(sample["input_ids"], vision)  # [S]
    return {k: v[keep] for k, v in sample.items() if k in ("input_ids", "labels", "mm_token_type_ids")}


def sample_batches(
    cfg: Config, processor: Processor, count: int, batch_size: int, text: bool = False
) -> list[dict[str, torch.Tensor]]:
    """``count`` collated batches of ``batch_size`` consecutive samples of ``cfg.data.path``.

    ``text``: the same samples with their vision spans removed (:func:`text_only`). The batches
    carry no ``num_items``/``num_samples``: the model counts a lone batch itself.
    """
    dataset, _ = read_dataset(cfg.data, processor)
    if len(dataset) == 0:
        raise ValueError(f"data.path={cfg.data.path!r} has no usable samples")
    collate = Collator(processor)
    out = []
    for b in range(count):
        samples = [dataset[(b * batch_size + i) % len(dataset)] for i in range(batch_size)]
        if text:
            samples = [text_only(s, processor) for s in samples]
        batch = collate(samples)
        del batch["num_items"], batch["num_samples"]
        out.append(batch)
    return out


def to_device(batch: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``batch`` on ``device``, its floating-point tensors (pixels) in ``dtype``."""
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in batch.items()}


def loss_and_grads(model, batch: dict, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward: the loss and every gradient that exists, as fp32 copies on the CPU.

    ``kwargs`` go to the forward. Parameters without a gradient (a vision tower on a text-only
    batch, frozen ones) are left out, so two runs compare key for key.
    """
    model.zero_grad(set_to_none=True)
    loss = model(**batch, **kwargs).loss
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float().cpu(), grads


def step_flops(model, batch: dict) -> int:
    """FLOPs of one forward + backward, as counted by ``torch.utils.flop_counter``; gradients are dropped."""
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def mfu(flops: float, step_s: float, peak_flops_per_s: float) -> float | None:
    """Model FLOPs utilisation, or None when it exceeds 1: a step cannot beat the GEMM peak, so the
    peak was measured too low (a busy moment) and the ratio is a measurement error, not a result."""
    value = flops / step_s / peak_flops_per_s
    return value if value <= 1.0 else None
