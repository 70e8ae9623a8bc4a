"""The sweep file: its trials, named from what they vary, each resolved and validated like a run.

See :mod:`qwenkit.sweep` for the file's keys. Every trial's config goes through ``config.load``
(the sweep file, its overrides and ``trials`` are read by the same YAML 1.2 reader as configs,
:func:`qwenkit.config.parse_yaml`) and the launcher's pre-spawn checks before the first trial
starts: a bad value in trial 7 fails the sweep at once, naming the trial and the key.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from qwenkit import config as qconfig
from qwenkit.engine.run.prespawn import check_before_spawn
from qwenkit.rundir import RunDir

KEYS = ("base", "overrides", "grid", "trials", "seeds", "name")


class SweepError(ValueError):
    """A sweep file or folder that cannot run; the message is one line for the user."""


@dataclass
class Trial:
    index: int  # 1-based, in the sweep file's order
    name: str
    varied: dict[str, Any]  # the keys this trial sets beyond the common overrides (seed included)
    overrides: list[str]  # every override of the trial (common first), as key=value
    cfg: qconfig.Config  # resolved and validated
    first_step: int = 0  # the step the running attempt started from (a resumed trial's ETA)

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.train.output_dir)


@dataclass
class Sweep:
    file: Path
    name: str
    base: Path | None
    out_dir: Path
    trials: list[Trial] = field(default_factory=list)

    @property
    def varied_keys(self) -> list[str]:
        return list(dict.fromkeys(k for t in self.trials for k in t.varied))


def override_text(key: str, value: Any) -> str:
    """``key=value`` that ``config.load`` parses back to ``value`` (YAML flow style, one line)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    text = text.removesuffix("...").strip()
    return f"{key}={text}"


def trial_name(varied: dict[str, Any]) -> str:
    """``lr0.003-seed1`` from ``{train.lr: 0.003, train.seed: 1}``: each key's last part and its
    value (the whole key where two keys end alike); ``base`` when nothing varies."""
    lasts = [k.split(".")[-1] for k in varied]
    parts = []
    for key, last in zip(varied, lasts):
        label = last if lasts.count(last) == 1 else key.replace(".", "_")
        value = varied[key]
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        parts.append(label + re.sub(r"[^A-Za-z0-9.,+_-]", "_", text))
    return "-".join(parts) or "base"


def _resolve_base(base: str, file: Path) -> Path:
    """``base`` as given, else relative to the working directory, else to a folder above the sweep file."""
    p = Path(base).expanduser()
    if p.is_absolute() or p.is_file():
        return p.resolve()
    for d in file.resolve().parents:
        if (d / p).is_file():
            return (d / p).resolve()
    raise SweepError(f"{file}: base {base!r} does not exist (looked in {Path.cwd()} and above {file.parent})")


def _mapping_list(value: Any, where: str) -> list[dict[str, Any]]:
    """The ``trials`` list: each entry a mapping ``{key: value}`` or a list of ``key=value`` strings."""
    if not isinstance(value, list) or not value:
        raise SweepError(f"{where}: trials must be a non-empty list of override sets, got {value!r}")
    out = []
    for i, item in enumerate(value, 1):
        if isinstance(item, dict):
            out.append({str(k): v for k, v in item.items()})
        elif isinstance(item, list) and all(isinstance(s, str) and "=" in s for s in item):
            out.append({s.split("=", 1)[0].strip(): qconfig.parse_yaml(s.split("=", 1)[1]) for s in item})
        else:
            raise SweepError(f"{where}: trials[{i}] must be a mapping or a list of key=value, got {item!r}")
    return out


def load(file: str | Path, out_dir: str | Path | None = None) -> Sweep:
    """Read a sweep file, expand its trials and validate every one; raises :class:`SweepError`."""
    file = Path(file)
    if not file.is_file():
        raise SweepError(f"sweep file {str(file)!r} does not exist")
    try:
        raw = qconfig.parse_yaml(file.read_text(), str(file)) or {}  # YAML 1.2, as configs: `off` is a string
    except yaml.YAMLError as e:
        raise SweepError(f"{file}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise SweepError(f"{file}: top level must be a mapping of {', '.join(KEYS)}")
    unknown = [k for k in raw if k not in KEYS]
    if unknown:
        raise SweepError(f"{file}: unknown key {unknown[0]!r}; allowed: {', '.join(KEYS)}")
    name = str(raw.get("name") or file.stem)
    base = _resolve_base(raw["base"], file) if raw.get("base") else None
    common = raw.get("overrides") or []
    if not isinstance(common, list) or not all(isinstance(s, str) and "=" in s for s in common):
        raise SweepError(f"{file}: overrides must be a list of key=value strings, got {common!r}")
    grid = raw.get("grid") or {}
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise SweepError(f"{file}: grid must map keys to non-empty lists of values, got {grid!r}")
    explicit = _mapping_list(raw["trials"], str(file)) if raw.get("trials") is not None else [{}]
    seeds = raw.get("seeds")
    if seeds is not None and (not isinstance(seeds, list) or not seeds or
                              not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):  # fmt: skip
        raise SweepError(f"{file}: seeds must be a non-empty list of integers, got {seeds!r}")
    out = Path(out_dir or Path("runs") / "sweeps" / name).resolve()
    sweep = Sweep(file.resolve(), name, base, out)
    points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    for index, (ex, point, seed) in enumerate(itertools.product(explicit, points, seeds or [None]), 1):
        varied = {**ex, **point, **({"train.seed": seed} if seed is not None else {})}
        sweep.trials.append(_trial(sweep, index, varied, common))
    names = [t.name for t in sweep.trials]
    for t in sweep.trials:
        if names.count(t.name) > 1:
            twin = next(u for u in sweep.trials if u.name == t.name and u is not t)
            raise SweepError(f"{file}: trials {t.index} and {twin.index} are both {t.name!r} (the same overrides)")
    return sweep


def _trial(sweep: Sweep, index: int, varied: dict[str, Any], common: list[str]) -> Trial:
    name = trial_name(varied)
    # a key the trial varies replaces the common override of that key (no override given twice)
    common = [o for o in common if o.split("=", 1)[0].strip() not in varied]
    overrides = [*common, *(override_text(k, v) for k, v in varied.items())]
    where = f"trial {index} ({name})"
    try:
        cfg = qconfig.load(sweep.base, [*overrides, f"train.output_dir={sweep.out_dir / name}", "train.resume=auto"])
    except qconfig.ConfigError as e:
        raise SweepError(f"{sweep.file}: {where}: {'; '.join(e.problems)}") from None
    problems = check_before_spawn(cfg)
    if problems:
        raise SweepError(f"{sweep.file}: {where}: {'; '.join(problems)}")
    written = RunDir(cfg.train.output_dir).config
    if written.is_file() and _ran_with(written) != cfg.to_dict():
        raise SweepError(f"{where}: {written} was run with another config than the sweep file now gives; "
                         "use another --out or remove that folder")  # fmt: skip
    return Trial(index, name, varied, overrides, cfg)


def _ran_with(written: Path) -> dict | None:
    """The config a trial folder's ``config.yaml`` ran with, as this qwenkit reads it: a setting added since it was
    written (absent from it) is its default, which is what the run did; None where this qwenkit cannot read it
    (a setting it no longer knows, a value it refuses): not the run the sweep file gives."""
    try:
        return qconfig.load(written, rewards=False).to_dict()
    except qconfig.ConfigError:
        return None
