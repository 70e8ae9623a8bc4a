"""Chunked loss vs HF's full-logits loss on one model and one batch: what notebook 03 reports.

The reference is what ``tests/model/families/test_chunked.py`` compares against: HF's own forward for
``token_mean``, and :func:`qwenkit.model.losses.cross_entropy.full_cross_entropy` on HF's logits for ``sample_mean``.
The same model is switched between the two heads
(:meth:`qwenkit.model.families.chunked.ChunkLossMixin.configure_loss`), so the weights are
identical by construction and any difference is the loss head's.

1. :func:`validation_batches` takes real samples from a dataset (:func:`qwenkit.bench.step.sample_batches`);
   the ``text`` modality is the same samples with their vision spans and pixels removed.
2. :func:`compare` runs full and chunked heads over chunk sizes x loss types x modalities and
   reports, per case, the loss difference and the largest gradient difference over all
   parameters, with a pass/fail against tolerances justified by the dtype.
3. :func:`adamw_curves` trains twice from the same seed on the same batches, once per head,
   and returns both loss curves (their difference is the drift the chunked head adds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from qwenkit import config as qconfig
from qwenkit.bench.step import loss_and_grads, sample_batches, to_device
from qwenkit.config import DTYPES
from qwenkit.model.families import build as registry
from qwenkit.model.families import registry as family
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX
from qwenkit.model.paths import load_processor
from qwenkit.model.processor import Processor
from qwenkit.notebooks import kernel, plots, results

MODALITIES = ("text", "image-text")
# (rtol, atol) per dtype: fp32 sums in another order differ by a few ulps of the sums; bf16 and
# fp16 are torch.testing's defaults for those dtypes (the chunked head upcasts as HF's does).
TOLERANCES = {
    torch.float32: (1e-5, 1e-7),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}


# Largest |loss difference| allowed between the two AdamW curves: the per-step differences above,
# carried through the optimizer for a few dozen steps (fp32: what tests/model/families/test_chunked.py asserts).
CURVE_TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


# fp32 through Qwen3.5's Gated DeltaNet layers (a triangular solve per 64-token chunk, HF's fallback):
# the heads' few-ulp differences in d(hidden) come out of them up to ~3e-7 absolute in the embedding
# gradient (measured: 2.6e-7, text, sample_mean, chunk 7), as tests/model/families/test_chunked.py's HYBRID_FP32
HYBRID_FP32 = (1e-5, 1e-6)


def tolerance(dtype: torch.dtype, mixers: Sequence[str] = ("attention",)) -> tuple[float, float]:
    """(rtol, atol) for ``dtype`` on a model whose decoder layers are of the kinds ``mixers``."""
    return HYBRID_FP32 if dtype == torch.float32 and "linear_attention" in mixers else TOLERANCES[dtype]


def validation_batches(
    cfg: qconfig.Config, processor: Processor, modality: str, count: int, batch_size: int
) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of ``batch_size`` samples in ``modality`` (:func:`qwenkit.bench.step.sample_batches`)."""
    if modality not in MODALITIES:
        raise ValueError(f"modality must be one of {MODALITIES}, got {modality!r}")
    return sample_batches(cfg, processor, count, batch_size, text=modality == "text")


@dataclasses.dataclass
class Diff:
    """How far ``a`` is from the reference ``b``: max |a-b|, that over max |b|, and within (rtol, atol)?"""

    max_abs: float
    max_rel: float
    ok: bool

    @classmethod
    def of(cls, a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> Diff:
        d = (a - b).abs()
        scale = b.abs().max().item()
        max_abs = d.max().item() if d.numel() else 0.0
        ok = bool((d <= atol + rtol * b.abs()).all())
        return cls(max_abs, max_abs / scale if scale > 0 else max_abs, ok)


def compare(
    cfg: qconfig.Config,
    chunk_sizes: Sequence[int],
    loss_types: Sequence[str] = ("token_mean", "sample_mean"),
    modalities: Sequence[str] = MODALITIES,
    batch_size: int = 4,
    device: str = "auto",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Chunked vs full head: ``(cases, per_param)``.

    ``cases``: one row per modality x loss_type x chunk size with ``loss_full``, ``loss_chunk``,
    ``loss_abs_diff``, ``loss_rel_diff``, ``grad_max_abs_diff``, ``grad_max_rel_diff`` (over all
    parameters; relative = max |a-b| / max |ref| of the worst tensor), ``worst_param``, ``rtol``,
    ``atol`` and ``passed`` (loss and every gradient element within tolerance).
    ``per_param``: the gradient differences of each parameter, for the chunk-size view.
    """
    dev = kernel.device(device)
    processor = load_processor(cfg)
    model = registry.build(cfg.model, cfg.loss, device=dev)
    dtype = DTYPES[cfg.model.dtype]
    rtol, atol = tolerance(dtype, family.of_model(model).mixers)
    cases, per_param = [], []
    for modality in modalities:
        batch = to_device(validation_batches(cfg, processor, modality, 1, batch_size)[0], dev, dtype)
        tokens = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        for loss_type in loss_types:
            model.configure_loss(chunk=False, loss_type=loss_type)
            ref_loss, ref_grads = loss_and_grads(model, batch)
            for chunk in chunk_sizes:
                model.configure_loss(chunk=True, chunk_size=int(chunk), loss_type=loss_type)
                loss, grads = loss_and_grads(model, batch)
                if grads.keys() != ref_grads.keys():
                    raise RuntimeError(f"chunk mode produced gradients for other parameters: {grads.keys() ^ ref_grads.keys()}")
                loss_diff = Diff.of(loss, ref_loss, rtol, atol)
                diffs = {n: Diff.of(grads[n], ref_grads[n], rtol, atol) for n in ref_grads}
                worst = max(diffs, key=lambda n: diffs[n].max_abs)
                for name, d in diffs.items():
                    per_param.append(dict(modality=modality, loss_type=loss_type, chunk_size=int(chunk),
                                          param=name, max_abs_diff=d.max_abs, max_rel_diff=d.max_rel, passed=d.ok))
                cases.append(
                    dict(
                        modality=modality,
                        loss_type=loss_type,
                        chunk_size=int(chunk),
                        tokens=tokens,
                        loss_full=ref_loss.item(),
                        loss_chunk=loss.item(),
                        loss_abs_diff=loss_diff.max_abs,
                        loss_rel_diff=loss_diff.max_rel,
                        grad_max_abs_diff=diffs[worst].max_abs,
                        grad_max_rel_diff=max(d.max_rel for d in diffs.values()),
                        worst_param=worst,
                        rtol=rtol,
                        atol=atol,
                        passed=loss_diff.ok and all(d.ok for d in diffs.values()),
                    )
                )
    return cases, per_param


def adamw_curves(
    cfg: qconfig.Config,
    chunk_size: int,
    steps: int = 30,
    lr: float = 2e-3,
    seed: int = 42,
    batch_size: int = 4,
    num_batches: int = 3,
    modality: str = "image-text",
    device: str = "auto",
) -> list[dict[str, Any]]:
    """Train the model ``steps`` AdamW steps per head from the same seed on the same batches.

    Returns ``{"step", "mode", "loss"}`` rows for ``mode`` in ``full`` and ``chunk``; batches are
    used in turn, so both runs see exactly the same data in the same order.
    """
    dev = kernel.device(device)
    processor = load_processor(cfg)
    dtype = DTYPES[cfg.model.dtype]
    batches = [to_device(b, dev, dtype) for b in validation_batches(cfg, processor, modality, num_batches, batch_size)]
    rows = []
    for mode in ("full", "chunk"):
        torch.manual_seed(seed)
        model = registry.build(cfg.model, cfg.loss, device=dev)
        model.configure_loss(chunk=mode == "chunk", chunk_size=chunk_size, loss_type=cfg.loss.loss_type)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = model(**batches[step % len(batches)]).loss
            loss.backward()
            opt.step()
            rows.append({"step": step + 1, "mode": mode, "loss": loss.item()})
    return rows


def curve_difference(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step: ``chunk - full`` loss, from :func:`adamw_curves` rows."""
    full = {r["step"]: r["loss"] for r in rows if r["mode"] == "full"}
    chunk = {r["step"]: r["loss"] for r in rows if r["mode"] == "chunk"}
    return [{"step": s, "diff": chunk[s] - full[s]} for s in sorted(full) if s in chunk]


CASE_METRICS = ("tokens", "loss_full", "loss_chunk", "loss_abs_diff", "loss_rel_diff", "grad_max_abs_diff",
                "grad_max_rel_diff", "passed")  # fmt: skip
CASE_COLUMNS = ["modality", "loss_type", "chunk_size", "tokens", "loss_full", "loss_abs_diff", "loss_rel_diff",
                "grad_max_abs_diff", "grad_max_rel_diff", "worst_param", "passed"]  # fmt: skip
CASE_FORMATS = {"loss_abs_diff": ".1e", "loss_rel_diff": ".1e", "grad_max_abs_diff": ".1e", "grad_max_rel_diff": ".1e",
                "loss_full": ".5f"}  # fmt: skip


def write_cases(out_dir, cases, per_param, device: str = "cpu") -> None:
    """``chunk_vs_full.csv`` (one row per case and metric) and ``grad_diff_per_param.csv``, long format."""
    results.write_csv(
        [results.record(metric, float(c[metric]), series=f"{c['modality']}/{c['loss_type']}",
                        x_name="chunk_size", x=c["chunk_size"], device=device)  # fmt: skip
         for c in cases for metric in CASE_METRICS],
        f"{out_dir}/chunk_vs_full.csv",
    )
    results.write_csv(
        [results.record(metric, r[metric], series=f"{r['modality']}/{r['loss_type']}/{r['param']}",
                        x_name="chunk_size", x=r["chunk_size"], device=device)  # fmt: skip
         for r in per_param for metric in ("max_abs_diff", "max_rel_diff")],
        f"{out_dir}/grad_diff_per_param.csv",
    )


def write_curves(out_dir, curves, device: str = "cpu") -> None:
    """``adamw_curves.csv``: the loss of both heads per step, long format."""
    results.write_csv(
        [results.record("loss", r["loss"], unit="nat", series=r["mode"], x_name="step", x=r["step"], device=device)
         for r in curves],
        f"{out_dir}/adamw_curves.csv",
    )


def read_cases(out_dir) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(cases, per_param)`` as :func:`compare` returned them, from the two CSVs :func:`write_cases` wrote."""
    per_param: dict[tuple, dict[str, Any]] = {}
    for r in results.read_csv(f"{out_dir}/grad_diff_per_param.csv"):
        modality, loss_type, param = r["series"].split("/", 2)
        row = per_param.setdefault((modality, loss_type, r["x"], param), dict(
            modality=modality, loss_type=loss_type, chunk_size=r["x"], param=param))  # fmt: skip
        row[r["metric"]] = r["value"]
    cases: dict[tuple, dict[str, Any]] = {}
    for r in results.read_csv(f"{out_dir}/chunk_vs_full.csv"):
        modality, loss_type = r["series"].split("/", 1)
        row = cases.setdefault((modality, loss_type, r["x"]), dict(modality=modality, loss_type=loss_type, chunk_size=r["x"]))
        row[r["metric"]] = r["value"]
    for (modality, loss_type, chunk), row in cases.items():
        row["tokens"], row["passed"] = int(row["tokens"]), bool(row["passed"])
        params = [p for (m, red, c, _), p in per_param.items() if (m, red, c) == (modality, loss_type, chunk)]
        row["worst_param"] = max(params, key=lambda p: p["max_abs_diff"])["param"]  # first of equals, as compare()
    return list(cases.values()), list(per_param.values())


def read_curves(out_dir) -> list[dict[str, Any]]:
    return [{"step": r["x"], "mode": r["series"], "loss": r["value"]} for r in results.read_csv(f"{out_dir}/adamw_curves.csv")]


# ---------------------------------------------------------------------------------------------
# Figures, drawn from the result files alone


def cases_table(out_dir):
    return plots.table(read_cases(out_dir)[0], CASE_COLUMNS, title="Chunked vs full head (max over all parameters)",
                       formats=CASE_FORMATS)  # fmt: skip


def chunk_figure(out_dir):
    return plots.grad_diff_by_chunk(read_cases(out_dir)[0])


def chunk_sizes(out_dir) -> list[int]:
    return sorted({r["chunk_size"] for r in read_cases(out_dir)[1]})


def param_figure(out_dir, chunk_size: int):
    return plots.grad_diff_per_param(read_cases(out_dir)[1], chunk_size)


def curves_figure(out_dir, title: str = "AdamW training: full vs chunked loss head"):
    return plots.loss_curves(read_curves(out_dir), title=title)


def figures(out_dir) -> list:
    """Every figure of notebook 03, in the order it shows them (the per-parameter view at its static choice)."""
    return [cases_table(out_dir), chunk_figure(out_dir), param_figure(out_dir, chunk_sizes(out_dir)[0]),
            curves_figure(out_dir)]  # fmt: skip


def save(out_dir, cases, per_param, curves, dtype: str = "float32", device: str = "cpu") -> dict[str, Any]:
    """``metrics.json`` with the worst differences (the CSVs are written as each part is computed:
    :func:`write_cases`, :func:`write_curves`); returns the metrics' values."""
    torch_dtype = DTYPES[dtype]
    rtol, atol = cases[0]["rtol"], cases[0]["atol"]  # what compare checked against (the family's)
    diff = [abs(d["diff"]) for d in curve_difference(curves)]
    chunk_losses = [r["loss"] for r in curves if r["mode"] == "chunk"]
    values = {
        "cases": len(cases),
        "cases_passed": sum(c["passed"] for c in cases),
        "max_loss_abs_diff": max(c["loss_abs_diff"] for c in cases),
        "max_grad_abs_diff": max(c["grad_max_abs_diff"] for c in cases),
        "max_grad_rel_diff": max(c["grad_max_rel_diff"] for c in cases),
        "rtol": rtol,
        "atol": atol,
        "curve_steps": len(chunk_losses),
        "curve_max_abs_diff": max(diff),
        "curve_tolerance": CURVE_TOLERANCES[torch_dtype],
        "curve_first_loss": chunk_losses[0],
        "curve_last_loss": chunk_losses[-1],
    }
    values["loss_decreased"] = values["curve_last_loss"] < values["curve_first_loss"]
    passed = values["cases_passed"] == values["cases"] and values["curve_max_abs_diff"] <= values["curve_tolerance"]
    summary = (
        f"{values['cases_passed']}/{values['cases']} chunk-vs-full cases within {dtype} tolerance; "
        f"max |loss diff| {values['max_loss_abs_diff']:.1e}, max |grad diff| {values['max_grad_abs_diff']:.1e}; "
        f"{values['curve_steps']}-step AdamW curves differ by <= {values['curve_max_abs_diff']:.1e} "
        f"(loss {values['curve_first_loss']:.2f} -> {values['curve_last_loss']:.2f})"
    )
    results.write_metrics(out_dir, "03_chunk_loss_validation", summary, passed, **values)
    return values
