"""``lora``: adapters through peft (off at ``r: 0``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class LoraConfig:
    r: int = 0  # adapter rank; 0: LoRA off (every weight not in model.freeze trains)
    alpha: float = 16.0  # LoRA scaling is alpha / r (alpha / sqrt(r) with use_rslora)
    dropout: float = 0.0  # on the adapters' input
    # "all-linear": every nn.Linear of the language model (never lm_head); or a list of names
    # (q_proj: that last segment) and dotted paths with * per segment (model.language_model.layers.*.mlp.down_proj)
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    vision: bool = False  # also adapt the linears of the vision blocks (model.visual.blocks.*)
    modules_to_save: list[str] = field(default_factory=list)  # module paths trained fully, e.g. [model.visual.merger]
    use_dora: bool = False  # weight-decomposed LoRA (peft's DoRA)
    use_rslora: bool = False  # rank-stabilised scaling alpha / sqrt(r)
    # MoE families: also adapt the routed experts' fused 3-D weights (gate_up_proj, down_proj; peft's
    # target_parameters: a rank-r adapter per expert), under FSDP2 and expert parallelism. See docs/LORA.md
    target_experts: bool = False
