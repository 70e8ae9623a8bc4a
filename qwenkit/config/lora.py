"""``lora``: adapters through peft (off at ``r: 0``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from qwenkit.config.schema import Config, Need


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


def check(cfg: Config, need: Need) -> None:
    """Ranges and combinations; target and module paths are checked against the model tree
    (:func:`qwenkit.engine.run.prespawn.check_module_paths`)."""
    lora = cfg.lora
    need(lora.r >= 0, f"lora.r must be >= 0 (0: off), got {lora.r}")
    if lora.r == 0:
        default = LoraConfig()
        changed = [k for k in ("target_modules", "vision", "modules_to_save", "use_dora", "use_rslora", "target_experts")
                   if getattr(lora, k) != getattr(default, k)]  # fmt: skip
        need(not changed, f"lora.{', lora.'.join(changed)} set but lora.r=0 (LoRA off); set lora.r > 0")
        return
    need(lora.alpha > 0, f"lora.alpha must be > 0, got {lora.alpha}")
    need(0.0 <= lora.dropout < 1.0, f"lora.dropout must be in [0, 1), got {lora.dropout}")
    if isinstance(lora.target_modules, list):
        need(bool(lora.target_modules), "lora.target_modules must not be empty (or 'all-linear')")
        need("lm_head" not in lora.target_modules,
             "lora.target_modules: lm_head computes the chunked loss and takes no adapter; "
             "train it fully with lora.modules_to_save=[lm_head]")  # fmt: skip
    if lora.target_experts:  # what peft's adapters of a parameter (ParamWrapper) refuse
        need(lora.dropout == 0, f"lora.target_experts=true needs lora.dropout=0 (peft cannot drop out the input "
             f"of a fused weight's adapter), got {lora.dropout}")  # fmt: skip
        need(not lora.use_dora, "lora.target_experts=true does not work with lora.use_dora=true (peft has no DoRA "
             "for fused expert weights)")  # fmt: skip
    need(
        not (lora.use_dora and cfg.model.init_device == "meta"),
        "lora.use_dora=true needs model.init_device=cpu: DoRA's magnitude is computed from the full "
        "base weights when the adapters are added, which meta init does not have yet",
    )
