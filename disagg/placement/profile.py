"""A profile: the step models of one model on one kind of hardware, for each TP x PP, in a file.

Three sources write the same structure: `disagg profile` (measured on the machine at hand),
`disagg.planner.roofline` (from the model's shape and the hardware's spec), and DistServe's
published A100 profiles, read as they are ({model: {tp: {"prefill": [a, b, c], ...}}}).

Our file:
    {"format": "disagg-profile/1", "model": ..., "hardware": ..., "source": "measured" | "roofline"
     | "distserve", "kv_bytes_per_token": ..., "num_layers": ..., "kv_transfer": {"bandwidth_gb_s":
     ..., "latency_ms": ...}, "pp_handoff_ms": ..., "entries": {"tp1-pp1": {StepModel}, ...},
     "fit": {...held-out errors...}, "host_sharing": {"prefill": ..., "decode": ...} (optional:
     how much slower a step runs while another instance on its host computes; 1 when absent)}

A TP x PP without an entry of its own is derived from the same TP at PP 1: our engine runs the
stages of a step one after another, so the step takes as long as on one stage group, plus one
hand-off of activations per stage boundary (`pp_handoff_ms`). Stages do not overlap batches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from disagg.placement.latency_model import Coefficients, HostSharing, StepModel, TransferModel
from disagg.placement.published_profiles import FITTED, ServedStep, engine_of

FORMAT = "disagg-profile/1"
SOURCES = ("measured", "roofline", "distserve")


def shape_key(tp: int, pp: int) -> str:
    return f"tp{tp}-pp{pp}"


def parse_shape_key(key: str) -> tuple[int, int]:
    try:
        tp, pp = key.split("-")
        return int(tp.removeprefix("tp")), int(pp.removeprefix("pp"))
    except ValueError:
        raise ValueError(f"profile: {key!r} is not a TP x PP key like 'tp2-pp1'") from None


@dataclass
class Profile:
    model: str
    hardware: str
    source: str
    entries: dict[tuple[int, int], StepModel]
    kv_bytes_per_token: int = 0  # K and V of one token over all layers, in bytes (0: unknown)
    num_layers: int = 1
    kv_transfer: TransferModel = field(default_factory=TransferModel)
    pp_handoff_ms: float = 0.0
    fit: dict = field(default_factory=dict)  # how well a measured profile predicts held-out steps
    frontend_ms: float = 0.0  # per request, outside the engine, before its prefill (0: not known)
    host_sharing: HostSharing = field(default_factory=HostSharing)  # steps while another instance computes

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"profile source: must be one of {SOURCES}, got {self.source!r}")
        if not self.entries:
            raise ValueError("profile: no TP x PP entries")

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return sorted(self.entries)

    def has(self, tp: int, pp: int) -> bool:
        return (tp, pp) in self.entries or (tp, 1) in self.entries

    def step_model(self, tp: int, pp: int) -> StepModel:
        if (tp, pp) in self.entries:
            return self.entries[(tp, pp)]
        base = self.entries.get((tp, 1))
        if base is None:
            have = ", ".join(f"TP {t} PP {p}" for t, p in self.shapes)
            raise ValueError(f"profile {self.model} on {self.hardware} has no TP {tp} (it has {have})")
        if pp == 1 or self.pp_handoff_ms == 0:
            return base
        return _with_intercept(base, (pp - 1) * self.pp_handoff_ms)

    # ---- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "model": self.model,
            "hardware": self.hardware,
            "source": self.source,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "num_layers": self.num_layers,
            "kv_transfer": self.kv_transfer.to_dict(),
            "pp_handoff_ms": self.pp_handoff_ms,
            "frontend_ms": self.frontend_ms,
            "host_sharing": self.host_sharing.to_dict(),
            "entries": {shape_key(tp, pp): m.to_dict() for (tp, pp), m in sorted(self.entries.items())},
            "fit": self.fit,
        }

    def save(self, path: str) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        return cls(
            model=data["model"],
            hardware=data["hardware"],
            source=data["source"],
            entries={parse_shape_key(k): StepModel.from_dict(v) for k, v in data["entries"].items()},
            kv_bytes_per_token=int(data.get("kv_bytes_per_token", 0)),
            num_layers=int(data.get("num_layers", 1)),
            kv_transfer=TransferModel.from_dict(data.get("kv_transfer")),
            pp_handoff_ms=float(data.get("pp_handoff_ms", 0.0)),
            fit=data.get("fit", {}),
            frontend_ms=float(data.get("frontend_ms", 0.0)),
            host_sharing=HostSharing.from_dict(data.get("host_sharing")),
        )


def load_profile(path: str, model: str | None = None, hardware: str | None = None, served: bool = True) -> Profile:
    """Our profile file, or DistServe's published one (then `model` picks one of its models; with
    `served`, its forward-pass times become served steps: disagg.placement.published_profiles)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"profile {path}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"profile {path}: not a JSON object")
    if data.get("format") == FORMAT:
        return Profile.from_dict(data)
    profile = _from_distserve(data, path, model, hardware or _hardware_from_name(path))
    engine = engine_of(path)
    return as_served(profile, FITTED[engine]) if served and engine in FITTED else profile


def as_served(profile: Profile, served: ServedStep) -> Profile:
    """A forward-pass profile with what its engine's served steps cost beyond it."""
    entries = {shape: served.apply(model) for shape, model in profile.entries.items()}
    return replace(profile, entries=entries, frontend_ms=served.frontend_ms)


def _from_distserve(data: dict, path: str, model: str | None, hardware: str) -> Profile:
    models = sorted(data)
    if model is None and len(models) == 1:
        model = models[0]
    chosen = next((m for m in models if model and (m == model or m.split("/")[-1] == model.split("/")[-1])), None)
    if chosen is None:
        raise ValueError(f"profile {path}: holds {', '.join(models)}; choose one with --model")
    entries = {(int(tp), 1): StepModel.from_dict(entry) for tp, entry in data[chosen].items()}
    return Profile(model=chosen, hardware=hardware, source="distserve", entries=entries)


def _hardware_from_name(path: str) -> str:
    name = Path(path).name.lower()
    return "a100-80gb" if "a100" in name else "unknown"


def _with_intercept(model: StepModel, extra_ms: float) -> StepModel:
    add = lambda c: Coefficients(c.a + extra_ms, c.b, c.c)  # noqa: E731
    mixed = (model.mixed[0] + extra_ms, *model.mixed[1:]) if model.mixed else ()
    return StepModel(
        add(model.prefill),
        add(model.decode_small),
        add(model.decode_large),
        model.decode_threshold,
        model.mixed_form,
        mixed,
        model.experts,
    )
