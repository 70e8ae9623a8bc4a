"""The rules of ``distill``: a teacher exactly when ``train.objective: distill``, no key of GRPO's loss, no tools.

Whether the teacher exists and shares the student's tokenizer is a file check, made before any process
starts (:mod:`qwenkit.engine.checkpoints.teacher`), not here.
"""

from __future__ import annotations

from qwenkit.config.distill import GRPO_ONLY
from qwenkit.config.grpo import GrpoConfig
from qwenkit.config.schema import Config, Need


def check(cfg: Config, need: Need) -> None:
    """``distill.teacher`` set exactly for ``train.objective: distill``; GRPO's loss keys (:data:`GRPO_ONLY`) and
    the agentic rollouts' (``grpo.tools``, ``grpo.environment``) unset."""
    teacher = cfg.distill.teacher
    if cfg.train.objective != "distill":
        need(teacher is None, f"distill.teacher={teacher!r} set but train.objective={cfg.train.objective!r}; "
             "set train.objective=distill")  # fmt: skip
        return
    need(bool(teacher), "train.objective=distill needs distill.teacher: a run folder, a step-N directory or a "
         "Hugging Face checkpoint directory of the teacher")  # fmt: skip
    default = GrpoConfig()
    changed = [k for k in GRPO_ONLY if getattr(cfg.grpo, k) != getattr(default, k)]
    need(not changed, f"grpo.{', grpo.'.join(changed)} set but train.objective=distill reads only the grpo sampling "
         "and reward keys (its loss is the reverse KL to distill.teacher, no advantages); unset "
         f"{'it' if len(changed) == 1 else 'them'}")  # fmt: skip
    agentic = [k for k in ("tools", "environment") if getattr(cfg.grpo, k)]
    need(not agentic, f"grpo.{', grpo.'.join(agentic)} cannot go with train.objective=distill: the teacher scoring "
         "multi-turn trajectories (their model tokens between the tools' replies) is not built; unset it")  # fmt: skip
