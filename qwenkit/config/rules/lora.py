"""The rules of ``lora``."""

from __future__ import annotations

from qwenkit.config.lora import LoraConfig
from qwenkit.config.schema import Config, Need


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
