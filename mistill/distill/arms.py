"""Arms as data: one YAML file each under ``projects/configs/arms/``.

Every ablation names its ``base`` (Mistill or another arm) and the one flag it changes, so its
resolved configuration differs from its base exactly there (a test checks it). The resolved
:class:`ArmConfig` goes, with every other argument, into the run's ``config.json``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from mistill.config import Config
from mistill.errors import MistillInputError

ARMS_DIR = Path(__file__).resolve().parents[2] / "projects" / "configs" / "arms"
OBJECTIVES = ("cot", "mistill", "feature_kd", "distillm2")
POOL_MODES = ("top", "bottom", "random", "random_all", "uniform")
TERMS = ("attention", "interaction", "write")


@dataclass(frozen=True)
class ArmConfig(Config):
    """What distinguishes one arm from another (App. J.3, M)."""

    objective: str = "mistill"
    precision: str = "bf16"
    lambda_p1: float = 0.1
    lambda_p2: float = 0.1
    terms: tuple[str, ...] = ("attention", "interaction")
    write_norm: bool = False
    pool_mode: str = "top"
    pool_k: int = 40
    pool_seed: int = 0
    positions: str = "events"
    window: int = 8
    event_weight: float = 1.0
    kl_weight: float = 1.0
    # c divides by the margin: events whose teacher or student margin is below this (nats) are
    # left out of the interaction and write terms, so a near-tie cannot blow the term up
    min_abs_margin: float = 0.5

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise MistillInputError(f"objective must be one of {OBJECTIVES}", field="objective")
        if self.pool_mode not in POOL_MODES:
            raise MistillInputError(f"pool_mode must be one of {POOL_MODES}", field="pool_mode")
        if self.positions not in ("events", "random"):
            raise MistillInputError("positions must be 'events' or 'random'", field="positions")
        bad = [t for t in self.terms if t not in TERMS]
        if bad:
            raise MistillInputError(f"unknown terms {bad}; known {TERMS}", field="terms")
        if self.precision not in ("bf16", "fp32"):
            raise MistillInputError("precision must be 'bf16' or 'fp32'", field="precision")

    @property
    def lambdas(self) -> dict[str, float]:
        return {"P1": self.lambda_p1, "P2": self.lambda_p2, "P2C": self.lambda_p2}


def arm_names(arms_dir: Path = ARMS_DIR) -> list[str]:
    return sorted(p.stem for p in arms_dir.glob("*.yaml"))


def read_arm_file(name: str, arms_dir: Path = ARMS_DIR) -> dict:
    path = arms_dir / f"{name}.yaml"
    if not path.exists():
        raise MistillInputError(f"unknown arm {name!r}; arms: {arm_names(arms_dir)}", file=str(path), field="arm")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise MistillInputError(f"malformed arm file: {exc}", file=str(path), field="arm") from None
    if not isinstance(data, dict):
        raise MistillInputError("arm file must be a mapping", file=str(path), field="arm")
    return data


def arm_values(name: str, arms_dir: Path = ARMS_DIR, _seen: tuple[str, ...] = ()) -> dict:
    """The arm's flags with its bases resolved (description and base dropped)."""
    if name in _seen:
        raise MistillInputError(f"arm bases form a cycle: {' -> '.join(_seen + (name,))}", field="arm")
    data = read_arm_file(name, arms_dir)
    base = data.pop("base", None)
    data.pop("description", None)
    values = arm_values(base, arms_dir, _seen + (name,)) if base else {}
    values.update(data)
    return values


def parse_overrides(text: str) -> dict[str, str]:
    """``"lambda_p1=0.03,window=0"`` -> {"lambda_p1": "0.03", "window": "0"} (``terms=a+b`` for lists)."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise MistillInputError(f"override {item!r} is not key=value", field="overrides")
        out[key.strip()] = value.strip().replace("+", ",")
    return out


def resolve_arm(name: str, overrides: str | dict = "", arms_dir: Path = ARMS_DIR) -> ArmConfig:
    """The arm's configuration: defaults <- its file (and bases) <- overrides."""
    values = arm_values(name, arms_dir)
    values.update(parse_overrides(overrides) if isinstance(overrides, str) else overrides)
    known = {f.name for f in dataclasses.fields(ArmConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise MistillInputError(f"unknown arm flag(s) {unknown}", file=str(arms_dir / f"{name}.yaml"),
                                field=unknown[0])
    return ArmConfig.from_dict(values, source=str(arms_dir / f"{name}.yaml"))
