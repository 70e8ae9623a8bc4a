"""The training loop: one FSDP2 process per rank (started by torchrun as ``python -m qwenkit.engine.run.rank``).

Startup, all before the first step: process group and device (:mod:`qwenkit.distributed.fsdp`), seeds,
processor and data (:mod:`qwenkit.data`), model (HF weights, or meta-device init whose weights
are read straight into the shards), LoRA adapters when ``lora.r > 0`` (:mod:`qwenkit.model.lora`,
added before sharding), parameter counts per part, recompute wrappers, ``fully_shard`` plan,
AdamW over the parameter groups of ``train.param_groups`` with linear warmup + cosine decay
(the same shape for every group), and a resume from a checkpoint.

One optimizer step:

1. the objective (``train.objective``, :mod:`qwenkit.engine.objective`) gives the step's
   ``train.grad_accum`` micro-batches (SFT and DPO: the sampler's); pop their ``num_items`` /
   ``num_samples`` and all-reduce the sums once, and the objective pops and reduces its own: the
   loss of every micro-batch is normalised by the **global** counts (all ranks, all accumulation
   steps), so it does not depend on world size or split;
2. forward and backward each micro-batch (the objective's loss). A rank's loss is its *share* of
   the global mean, so the global gradient is the *sum* of the ranks' gradients; FSDP averages
   them, hence the backward runs on ``loss * world_size`` (exact in fp32 for power-of-two world sizes);
3. grad norm over all shards, one all-reduce of the loss, and one host sync (``.tolist()``) for
   logging and the NaN/inf check: a non-finite loss or grad norm raises :class:`NonFiniteError`
   with the step number *before* the optimizer step, so the weights are not updated;
4. clip to ``train.max_grad_norm``, AdamW step (at the LR logged; first waiting for an async
   checkpoint's copy of the state, which the forward and backward overlapped), LR-scheduler step; with an
   eval set, eval loss and accuracy when due (:mod:`qwenkit.engine.generation.evaluate`; also once before the
   first step); metrics to JSONL (:mod:`qwenkit.engine.run.metrics`), the profiler window
   (:mod:`qwenkit.engine.run.profiling`), and a DCP
   checkpoint every ``checkpoint.every`` steps and at the end (:mod:`qwenkit.engine.checkpoints.dcp`).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.distributed import expert, fsdp, sequence
from qwenkit.engine import objective
from qwenkit.engine.checkpoints import dcp as ckpt
from qwenkit.engine.checkpoints import resume as resume_rule
from qwenkit.engine.objective import Objective
from qwenkit.engine.run import build, events, optim, stopping
from qwenkit.engine.run.expert_load import ExpertLoad
from qwenkit.engine.run.metrics import MetricsWriter, peak_memory_mib, start_step_peak
from qwenkit.engine.run.profiling import ProfileWindow
from qwenkit.errors import EveryRank
from qwenkit.model import lora, paths
from qwenkit.model.families import build as registry
from qwenkit.model.families import registry as families
from qwenkit.rundir import RunDir

log = logging.getLogger("qwenkit.engine.run.train")
STEP_EVENT = ("loss", "grad_norm", "lr", "tokens_per_s", "step_time")  # a step event's values (engine/run/events.py)


class NonFiniteError(FloatingPointError, EveryRank):
    """A NaN/inf loss or gradient norm; raised before the optimizer step, so weights are unchanged."""

    def __init__(self, step: int, loss: float, grad_norm: float):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(
            f"step {step}: non-finite loss {loss} or grad norm {grad_norm}; "
            "stopped before the optimizer step, so the weights were not updated"
        )


# ---------------------------------------------------------------------------------------------
# Pieces


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every accelerator


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clips the (sharded) gradients in place when ``max_norm > 0``; returns their total L2 norm before clipping."""
    # the per-shard partial norms reduced on each mesh (expert parallelism adds the experts' own)
    grads = [p.grad for p in params if p.grad is not None]
    total = expert.total_norm(grads)
    if max_norm > 0:
        for group in expert.by_mesh(params):  # clip_grads_with_norm_ scales the gradients of one mesh at a time
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------
# The run


def run(cfg, data_builder: Callable | None = None, stop: stopping.StopRequest | None = None) -> Trainer:
    """Train this rank to ``train.steps``; see :class:`Trainer`."""
    trainer = Trainer(cfg, data_builder, stop)
    trainer.run()
    return trainer


class Trainer:
    """One rank's training run. Attributes stay readable after :meth:`run` raises (tests use that).

    ``data_builder(cfg, processor, rank, world_size)`` defaults to ``qwenkit.data.build``.
    """

    def __init__(self, cfg, data_builder: Callable | None = None, stop: stopping.StopRequest | None = None):
        self.cfg, self.data_builder = cfg, data_builder
        self.out_dir = Path(cfg.train.output_dir)
        self.history: list[dict] = []  # one dict of metrics per step run here
        self.start_step = 0  # the step resumed from (0: fresh)
        self.last_step = cfg.train.steps  # this invocation ends here (train.stop_after: set after the resume)
        self.step = 0  # the last step done (the resumed step before any)
        self.stop_request = stop  # a signal noted by the rank's handler (see qwenkit.engine.run.stopping)
        self.stopped_by: str | None = None  # the signal that stopped the run, after it saved
        self.heartbeat: stopping.Heartbeat | None = None
        self.checkpoint: Path | None = None  # the last checkpoint written
        self.evals: list[dict] = []  # {"step", "eval_loss"[, "eval_accuracy"]} per evaluation run here
        self.evaluator = None  # the objective's held-out evaluation (due, run), or None
        self.model = self.optimizer = self.scheduler = self.bundle = self.rt = self.model_path = None
        self.sp: sequence.SequenceParallel | None = None
        self.events: events.EventLog | None = None  # <output_dir>/events.jsonl, rank 0's
        self.objective: Objective | None = None  # train.objective's entry (qwenkit.config.OBJECTIVES)
        self.params: list[nn.Parameter] = []  # the trainable parameters (the clipped gradients')
        self.expert_load: ExpertLoad | None = None  # a MoE model's routed tokens per layer and expert

    def run(self) -> None:
        # model.path=tiny: the launcher already wrote the checkpoint; ensure_checkpoint is safe
        # from any number of ranks anyway (temp dir + rename, rank 0 alone under a process group)
        self.model_path = paths.resolve_path(self.cfg.model)
        self.rt = fsdp.init_distributed(self.cfg.parallel)
        self.heartbeat = stopping.Heartbeat.start_default(self.rt.rank, self.rt.world_size, self.cfg.parallel.timeout_s)
        t = self.cfg.train
        self.events = events.EventLog(self.out_dir, self.rt.rank, enabled=self.rt.rank == 0)
        self.events.write("started", world_size=self.rt.world_size, steps=t.steps)
        try:
            self.setup()
            # train.stop_after: at most that many more steps in this invocation (then run it again)
            self.last_step = min(self.start_step + t.stop_after, t.steps) if t.stop_after else t.steps
            self.step = self.start_step
            if self.start_step < self.last_step:
                self.train()
            elif self.rt.rank == 0:
                log.info("training is complete: at step %d of train.steps=%d, nothing to train", self.start_step, t.steps)
            reason = "signal" if self.stopped_by else "completed" if self.step >= t.steps else "stop_after"
            self.events.write("stopped", step=self.step, reason=reason, exit_code=self.exit_code,
                              **({"signal": self.stopped_by} if self.stopped_by else {}))  # fmt: skip
        finally:
            if self.heartbeat is not None:
                self.heartbeat.stop()
        fsdp.shutdown(self.rt)

    @property
    def exit_code(self) -> int:
        """0 when ``train.steps`` is reached, else :data:`stopping.EXIT_RESUMABLE` (a checkpoint to go on from)."""
        return 0 if self.step >= self.cfg.train.steps else stopping.EXIT_RESUMABLE

    def setup(self) -> None:
        cfg, rt, t = self.cfg, self.rt, self.cfg.train
        main_rank = rt.rank == 0
        if main_rank:
            log.info("rank 0 of %d on %s (%s)", rt.world_size, rt.device, rt.backend)
        set_seed(t.seed)
        sp_size = cfg.parallel.sp_size
        self.sp = sequence.init_groups(rt.rank, rt.world_size, sp_size)  # sp_size 1: one rank per group
        problems = families.problems(cfg, self.model_path)  # as the launcher asked, for ranks started another way
        if problems:
            raise ValueError("; ".join(problems))
        decision = resume_rule.agree(cfg, rt.rank, rt.world_size)  # before anything is built: a refused resume fails fast
        resume = decision.path

        model_path = self.model_path
        processor = paths.load_processor(cfg, model_path)
        build_data = self.data_builder or data.build
        self.bundle = build_data(cfg, processor, rt.rank, rt.world_size)  # dealt over the SP groups (data.make_sampler)

        meshes = build.meshes(cfg, rt)
        if main_rank and meshes.experts is not None:
            log.info("expert parallel: experts split over %d ranks, FSDP-sharded over %d", *meshes.experts.shape[::-1])
        model, plan = build.sharded_model(cfg, rt, meshes, adapt=self._adapt)
        if main_rank:
            log.info("%s", plan.describe())
        model.train()
        self.model = model
        self.expert_load = ExpertLoad.of(model, rt.device, self.out_dir if main_rank else None)
        # before the resume: an objective may keep the starting weights (DPO's reference)
        self.objective = objective.build(cfg, rt, model, self.bundle, self.sp, self.out_dir)
        self.evaluator = self.objective.evaluator
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optim.build_optimizer(model, t)
        if resume is None:
            if main_rank:
                log.info("no checkpoint to resume from (train.resume=%s): starting fresh", t.resume)
        else:
            self.start_step = ckpt.load(
                resume, model, self.optimizer, self.bundle.sampler, rt.device,
                cfg.checkpoint.load_optimizer, cfg.checkpoint.load_rng, self.objective,
            )
            if not decision.same_ranks:  # the saved per-rank RNG states do not map onto these ranks
                set_seed(resume_rule.rank_seed(t.seed, self.start_step, rt.rank))
            if main_rank:
                log.info("resumed from %s at step %d", resume, self.start_step)
                if decision.changes:
                    log.info("resumed on another shape: %s", "; ".join(decision.changes))
            self.events.write("resumed", step=self.start_step, checkpoint=str(resume))
        if main_rank:  # the run's record, once the start is accepted (a refused resume leaves it as it was)
            qconfig.write_config(cfg, self.out_dir)
        self.scheduler = optim.build_scheduler(self.optimizer, t, self.start_step)

    def _adapt(self, model) -> None:
        """The policy's own steps, on the whole model before it is split (:func:`qwenkit.engine.run.build.sharded_model`):
        LoRA adapters (sharded with their base layers), the idle vision calls, sequence parallelism, the parameter counts."""
        cfg, rt, t, sp_size = self.cfg, self.rt, self.cfg.train, self.cfg.parallel.sp_size
        main_rank = rt.rank == 0
        if cfg.lora.r > 0:  # adapters are sharded with their base layers
            targets = lora.apply(model, cfg.lora, t.seed)
            if main_rank:
                log.info("LoRA r=%d on %d targets (%s ...)", cfg.lora.r, len(targets), targets[0])
        model.vision_calls_per_step = (1 + self.bundle.dataset.has_videos) if rt.world_size > 1 else 0
        if sp_size > 1:
            problem = sequence.heads_problem(model.config.get_text_config(), sp_size)
            if problem:
                raise ValueError(problem)
            sequence.enable(model, self.sp)
            if main_rank:
                log.info(
                    "sequence parallel: %d groups of %d ranks (Ulysses attention, vision split over each group)",
                    self.sp.dp_size, sp_size,
                )
        if main_rank:
            counts = registry.parameter_counts(model)
            log.info("parameters:\n%s", registry.format_parameter_counts(counts))
            # read by sweeps and notebooks 02 and 05 (trainable parameters per run), see qwenkit.engine.run.metrics.final_metrics
            RunDir(self.out_dir).parameters.write_text(json.dumps(counts, indent=1) + "\n")

    def train(self) -> None:
        cfg, rt = self.cfg, self.rt
        t, ck = cfg.train, cfg.checkpoint
        main_rank = rt.rank == 0
        batches = self.bundle.batches()  # created after the resume: starts at the restored position
        metrics = MetricsWriter(self.out_dir, rt.rank, rt.device, t.report_to, cfg.to_dict())
        window = ProfileWindow(cfg.profile, rt.device, self.out_dir, rt.rank)
        # disable=None: a bar on a terminal, none in batch logs (which get the step lines below)
        bar = tqdm(total=t.steps, initial=self.start_step, disable=None if main_rank else True, desc="train")
        saves = ckpt.AsyncSaves(rt.device) if ck.async_save else None  # checkpoint.async
        pending: ckpt.Save | None = None  # the background save in flight (one at a time)
        try:
            if self.start_step == 0 and self.evaluator is not None:
                metrics.write(0, self.evaluate(0))
            for step in range(self.start_step + 1, self.last_step + 1):
                began = time.perf_counter()
                start_step_peak(rt.device)
                staged = pending.wait_staged if pending is not None else None  # an async save's copy must end first
                values = self._step(step, batches, staged)
                values["step_time"] = time.perf_counter() - began
                values["tokens_per_s"] = values.pop("tokens") / values["step_time"]
                values["samples_per_s"] = values.pop("samples") / values["step_time"]
                values["peak_memory"] = peak_memory_mib(rt.device)
                if self.evaluator is not None and self.evaluator.due(step):
                    values.update(self.evaluate(step))
                metrics.write(step, values)
                self.history.append({"step": step, **values})
                window.step()
                bar.update(1)
                bar.set_postfix(loss=f"{values['loss']:.4f}", lr=f"{values['lr']:.2e}")
                logged = step % t.log_every == 0 or step == self.last_step
                if logged:
                    self.objective.log(step)
                    if self.expert_load is not None:
                        self.expert_load.log(step)
                if main_rank and logged:
                    self.events.write("step", step=step, steps=t.steps, **{k: values[k] for k in STEP_EVENT})
                    tqdm.write(
                        f"step {step}/{t.steps}  loss {values['loss']:.4f}  grad_norm {values['grad_norm']:.3f}  "
                        f"lr {values['lr']:.2e}  {values['tokens_per_s']:.0f} tok/s  {values['step_time']:.2f} s"
                    )
                self.step = step
                if self.heartbeat is not None:
                    self.heartbeat.step = step
                stop = stopping.agreed(self.stop_request, rt.device)  # every rank, the same step
                if stop:
                    self.stopped_by = (self.stop_request.name if self.stop_request else None) or "a stop signal to another rank"
                    log.info("stop requested (%s) during step %d: saving a checkpoint", self.stopped_by, step)
                save_now = (ck.every and step % ck.every == 0) or (step == self.last_step and ck.save_final) or stop
                if pending is not None and (save_now or ckpt.written_everywhere(pending, rt.device)):
                    pending = self._saved(pending)  # complete once every rank's write has ended: None
                if save_now:
                    pending = ckpt.start_save(
                        ckpt.checkpoint_root(self.out_dir), step, self.model, self.optimizer,
                        self.bundle.sampler, rt.device, ck.keep_last, resume_rule.run_record(cfg, rt.world_size), saves,
                        self.objective,
                    )
                    if saves is None or stop or step == self.last_step:  # a stop or the end waits for the write
                        pending = self._saved(pending)
                if stop:
                    (log.warning if main_rank else log.info)(
                        "stopped by %s after step %d of %d: checkpoint %s saved; run the same command again to continue",
                        self.stopped_by, step, t.steps, self.checkpoint,
                    )
                    break
            if pending is not None:  # written in the background since an earlier step
                pending = self._saved(pending)
        except EveryRank as e:  # every rank stops here, in step: the save in flight (an earlier step's) completes first
            if pending is not None and not isinstance(e, ckpt.SaveError):
                pending = self._finish_before_stopping(pending)
            raise
        finally:
            if saves is not None and pending is None:  # (a write still in flight keeps its stager)
                saves.close()
            bar.close()
            window.close()
            metrics.close()

    def _finish_before_stopping(self, pending: ckpt.Save) -> None:
        """Collective: complete a ``checkpoint.async`` save of an earlier step before a failure every rank
        raised stops the run (:class:`qwenkit.errors.EveryRank`), so no checkpoint it wrote is lost; a save
        that fails then is logged, and the failure that stopped the run is the one reported."""
        try:
            return self._saved(pending)
        except ckpt.CheckpointError as e:
            log.error("the checkpoint in flight was not completed before stopping: %s", e)
            return None

    def _saved(self, pending: ckpt.Save) -> None:
        """Collective: wait for the save's write on every rank and mark it complete
        (:func:`qwenkit.engine.checkpoints.dcp.finish`); None: no save is in flight any more."""
        self.checkpoint = ckpt.finish(pending)
        self.events.write("checkpoint", step=pending.step, path=str(self.checkpoint))
        if self.rt.rank == 0:
            tqdm.write(f"checkpoint saved: {self.checkpoint}")
        return None

    def _step(self, step: int, batches, before_update: Callable | None = None) -> dict:
        """One optimizer step (the module docstring's numbered flow); returns the step's metrics.

        ``batches``: the sampler's micro-batch iterator, from which the objective takes the step's
        micro-batches (:meth:`qwenkit.engine.objective.Objective.micro_batches`);
        ``before_update``: called just before the optimizer changes the weights (an async
        checkpoint still copying them).
        """
        cfg, rt, obj = self.cfg, self.rt, self.objective
        micro = obj.micro_batches(self.model, batches, cfg.train.grad_accum)
        counts = torch.stack([_counts(b) for b in micro]).sum(0).to(rt.device)  # [5] of this rank's step, see _counts
        dist.all_reduce(counts)  # global: every micro-batch's loss is normalised by these
        counts = counts // cfg.parallel.sp_size  # the ranks of an SP group hold the same micro-batch
        obj.begin(micro, counts)
        loss_sum = torch.zeros((), device=rt.device)
        for batch in micro:
            with fsdp.activation_offload(cfg.parallel.activation_offload, rt.device):
                loss = obj.loss(self.model, _to(batch, rt.device))
            (loss * rt.world_size).backward()  # FSDP averages over ranks; the loss is already a share
            loss_sum += loss.detach().float()
        norm = clip_grad_norm(self.params, cfg.train.max_grad_norm)
        dist.all_reduce(loss_sum)
        loss, norm_value, items, samples, tokens, positions, bad = torch.cat(
            [torch.stack([loss_sum, norm.float()]), counts.float()]
        ).tolist()
        if not (math.isfinite(loss) and math.isfinite(norm_value)):
            raise NonFiniteError(step, loss, norm_value)
        optimizer = self.optimizer
        lr = optimizer.param_groups[0]["lr"]  # the LR this step applies (the default group, see build_optimizer)
        group_lrs = {f"lr/{g['name']}": g["lr"] for g in optimizer.param_groups[1:]}
        if before_update is not None:
            before_update()
        optimizer.step()
        self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        load = self.expert_load.values() if self.expert_load is not None else {}  # collective
        return {
            "loss": loss, "grad_norm": norm_value, "lr": lr, "valid_tokens": items, "samples": samples, "tokens": tokens,
            "padding_fraction": 1.0 - tokens / positions, "bad_samples": int(bad), **group_lrs, **obj.metrics(), **load,
        }  # fmt: skip

    def evaluate(self, step: int) -> dict[str, float]:
        """Eval loss (and accuracy) of the current weights; collective, see :mod:`qwenkit.engine.generation.evaluate`."""
        values = self.evaluator.run(step, self.model)
        self.evals.append({"step": step, **values})
        self.events.write("eval", step=step, **values)
        if self.rt.rank == 0:
            tqdm.write(f"eval at step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in values.items()))
        return values


def _counts(batch: dict) -> torch.Tensor:
    """``[label tokens, samples, input tokens, positions, bad samples]`` of a micro-batch; pops the
    collator's ``num_items``, ``num_samples`` and ``num_bad`` (bad samples skipped while loading,
    ``data.on_bad_sample: skip``).

    Input tokens exclude padding (a packed row has none, and no attention_mask); positions are
    what the model computes, padding included.
    """
    mask = batch.get("attention_mask")
    positions = torch.tensor(batch["input_ids"].numel())
    tokens = mask.sum() if mask is not None else positions
    bad = batch.pop("num_bad", torch.tensor(0))
    return torch.stack([batch.pop("num_items"), batch.pop("num_samples"), tokens, positions, bad])
