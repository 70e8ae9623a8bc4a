"""Expert load of a MoE run: how evenly the router spreads each layer's tokens over its experts.

Each experts module (the family entry's ``experts``) is called with the router's choice, ``top_k_index``
``[T, k]`` (global expert ids); a forward pre-hook counts it per expert, for the forwards that train
only: in training mode with gradients (not evaluation, generation or GRPO's no-grad log-probs), and
not a recomputed forward, which runs inside backward. At the step's end the counts are summed over the ranks (one all-reduce
of ``[layers, E]``), so the figures are the global step's, whatever the data, sequence or expert
parallelism. Padding positions are routed like any token and counted with them.

- metrics, every step: ``expert_load/layer_NN`` = a layer's busiest expert's tokens / the mean per
  expert (1 = perfectly even, ``E`` = one expert takes every token), ``expert_load/max_over_mean``
  the largest of them;
- ``metrics/expert_load.jsonl`` (rank 0, at the logged steps): per layer the fraction of the step's
  (token, expert) pairs each expert got, read by :func:`read` (notebook 02 draws them).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import nn

from qwenkit.distributed.expert import experts_modules
from qwenkit.model.families import registry as families
from qwenkit.records import read_jsonl
from qwenkit.rundir import RunDir

FILE = "expert_load.jsonl"  # in the run's metrics/ folder


def file_of(run_dir) -> object:
    return RunDir(run_dir).metrics / FILE


class ExpertLoad:
    """Counts of the step's routed tokens per layer and expert; None-like (:meth:`of`) for a dense model."""

    def __init__(self, model: nn.Module, device: torch.device, out_dir=None):
        modules = experts_modules(model, families.of_model(model).experts)
        experts = model.config.get_text_config().num_experts
        self.counts = torch.zeros(len(modules), experts, dtype=torch.float64, device=device)  # [layers, E]
        self.fractions: list[list[float]] = []  # the last step's, per layer
        self.file = file_of(out_dir) if out_dir is not None else None
        self.hooks = [m.register_forward_pre_hook(self._counter(i), with_kwargs=True) for i, (_, m) in enumerate(modules)]

    @classmethod
    def of(cls, model: nn.Module, device: torch.device, out_dir=None) -> ExpertLoad | None:
        """The counter of a MoE model (its family names ``experts``), else None."""
        return cls(model, device, out_dir) if families.of_model(model).experts else None

    def _counter(self, layer: int):
        def count(module, args, kwargs) -> None:
            if not (module.training and torch.is_grad_enabled()) or torch._C._current_graph_task_id() != -1:
                return  # not a forward that trains, or one recomputed inside backward
            index = next(t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and not t.is_floating_point())
            self.counts[layer] += torch.bincount(index.reshape(-1), minlength=self.counts.shape[1]).to(self.counts)

        return count

    def values(self) -> dict[str, float]:
        """The step's metrics (collective: sums every rank's counts), then zero the counts for the next step."""
        counts = self.counts.clone()
        self.counts.zero_()
        if dist.is_initialized():
            dist.all_reduce(counts)
        per_layer = (counts.max(1).values / counts.mean(1).clamp(min=1e-12)).tolist()
        self.fractions = (counts / counts.sum(1, keepdim=True).clamp(min=1)).tolist()
        out = {f"expert_load/layer_{i:02d}": v for i, v in enumerate(per_layer)}
        out["expert_load/max_over_mean"] = max(per_layer)
        return out

    def log(self, step: int) -> None:
        """Rank 0: the last step's fractions per layer, one line per logged step."""
        if self.file is None:
            return
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.file, "a") as f:
            f.write(json.dumps({"step": step, "fractions": self.fractions}) + "\n")

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def read(run_dir) -> list[dict]:
    """The lines of a run's ``metrics/expert_load.jsonl`` (none for a dense run); a step logged twice
    (a resume repeats it) keeps its last line."""
    path = file_of(run_dir)
    rows = read_jsonl(path) if path.is_file() else []
    return list({r["step"]: r for r in rows}.values())
