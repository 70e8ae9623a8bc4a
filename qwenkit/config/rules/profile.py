"""The rules of ``profile``."""

from __future__ import annotations

from qwenkit.config.schema import Config, Need


def check(cfg: Config, need: Need) -> None:
    profile = cfg.profile
    for name in ("wait", "warmup"):
        need(getattr(profile, name) >= 0, f"profile.{name} must be >= 0, got {getattr(profile, name)}")
    need(profile.active >= 1, f"profile.active must be >= 1, got {profile.active}")
