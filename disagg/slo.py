"""A request's latency targets (its SLO) and the one rule that says whether a request met them.

TTFT is the time from sending a request to its first token; TPOT is vLLM's `bench serve`
definition, (E2E latency - TTFT) / (output tokens - 1), 0 for a request of fewer than two
tokens. A target of 0 is none. The router places and admits by an SLO and counts who met it,
the simulator and the planner judge simulated requests by it, and every benchmark judges the
requests it measured by it: all through `met`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from disagg.errors import InvalidRequestError


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = 0.0  # time to first token target, in ms; 0: no target
    tpot_ms: float = 0.0  # time per output token target, in ms; 0: no target

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRequestError(name, f"must be a number, got {value!r}")
            if not value >= 0:  # NaN too
                raise InvalidRequestError(name, "must be >= 0 (0: no target)")

    @property
    def any(self) -> bool:
        """Whether there is a target at all."""
        return self.ttft_ms > 0 or self.tpot_ms > 0

    def to_dict(self) -> dict[str, float]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms}

    @classmethod
    def from_dict(cls, data: dict | None) -> SLO:
        """From a mapping of targets (a config's, a trace's, a result file's); a key it does not
        know is refused, not dropped: a target silently ignored would judge by less than asked."""
        data = dict(data or {})
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidRequestError("slo", f"unknown target(s) {unknown}; known: ttft_ms, tpot_ms")
        return cls(**data)

    @classmethod
    def of(cls, message, default: SLO | None = None) -> SLO:
        """A request's own targets from its wire form (the proto's `Slo`, or anything with
        `ttft_ms` and `tpot_ms`); each one it leaves at 0 is `default`'s."""
        default = default or cls()
        return cls(message.ttft_ms or default.ttft_ms, message.tpot_ms or default.tpot_ms)

    # ---- placement's view: how far a prediction is from a target -----------------------------------
    def headroom(self, ttft_ms: float, tpot_ms: float) -> float:
        return min(self.ttft_room(ttft_ms), self.tpot_room(tpot_ms))

    def ttft_room(self, ttft_ms: float) -> float:
        """(target - predicted) / target; inf without a target. A pair's headroom is the smaller
        of its prefill instance's TTFT room and its decode instance's TPOT room."""
        return _room(self.ttft_ms, ttft_ms)

    def tpot_room(self, tpot_ms: float) -> float:
        return _room(self.tpot_ms, tpot_ms)


def _room(target: float, predicted: float) -> float:
    return math.inf if target <= 0 else (target - predicted) / target


def met(slo: SLO, ttft_ms: float, tpot_ms: float) -> bool:
    """Whether a request with this TTFT and TPOT met every target of `slo` (0: none)."""
    return (slo.ttft_ms <= 0 or ttft_ms <= slo.ttft_ms) and (slo.tpot_ms <= 0 or tpot_ms <= slo.tpot_ms)


def missed(slo: SLO, ttft_ms: float, tpot_ms: float) -> list[str]:
    """What `met` found missed, e.g. ["TTFT > 500 ms"] (the same text for every miss of a target,
    so that reports group them); [] exactly when `met`."""
    if met(slo, ttft_ms, tpot_ms):
        return []
    found = [("TTFT", slo.ttft_ms, ttft_ms), ("TPOT", slo.tpot_ms, tpot_ms)]
    return [f"{name} > {target:g} ms" for name, target, value in found if target > 0 and value > target]


def tpot_s(e2e_s: float, ttft_s: float, output_tokens: int) -> float:
    """vLLM's TPOT of one request: (E2E - TTFT) / (output tokens - 1); 0 with fewer than two."""
    return (e2e_s - ttft_s) / (output_tokens - 1) if output_tokens > 1 else 0.0


def parse_slo(text: str | None) -> SLO:
    """'ttft_ms=500,tpot_ms=100' (or vLLM's 'ttft:500 tpot:100'); each target given must be > 0."""
    targets: dict[str, float] = {}
    for item in (text or "").replace(",", " ").split():
        key, sep, value = item.replace(":", "=").partition("=")
        key = key if key.endswith("_ms") else f"{key}_ms"
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or key not in ("ttft_ms", "tpot_ms") or not number > 0:
            raise ValueError(f"slo: {item!r} is not KEY=MILLISECONDS with KEY ttft_ms or tpot_ms and a positive value")
        targets[key] = number
    return SLO(**targets)
