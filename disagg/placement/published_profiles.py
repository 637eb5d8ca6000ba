"""DistServe's published A100 profiles, as the engines they were measured on serve.

Those files (../shared/data/distserve/profiler-a100-80g.{distserve,vllm}.json) time each engine's
forward pass. A served step costs more: the engine's loop schedules, samples, detokenizes and
returns every request's token, and takes in migrated KV; each request also spends time in the
frontend (API server, tokenizer, queues) before its prefill starts. None of that is in the
files. It was fitted on the measured runs beside them (loadtest/planner/fit_profiles.py, which
prints how well every run is then replayed); runs kept aside check it:

- `frontend_ms`: per request, outside the engine, before its prefill;
- `prefill_scale`: the profile's prefill against the TTFT its isolated requests took (vLLM's
  profile prices a prompt token dearer than vLLM served it);
- `decode_per_step_ms`, `decode_per_request_ms`: the decode loop's time beyond the forward pass,
  per step and per request in the batch.

Loading such a file (`disagg.placement.profile.load_profile`) applies these, so that the planner,
the simulator and a router seeded from it all price served steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from disagg.placement.latency_model import Coefficients, StepModel


@dataclass(frozen=True)
class ServedStep:
    """What one engine's served steps cost beyond its profiled forward pass."""

    frontend_ms: float = 0.0
    prefill_scale: float = 1.0
    decode_per_step_ms: float = 0.0
    decode_per_request_ms: float = 0.0

    def apply(self, forward: StepModel) -> StepModel:
        p, scale = forward.prefill, self.prefill_scale
        return replace(
            forward,
            prefill=Coefficients(p.a * scale, p.b * scale, p.c * scale),
            decode_small=self._decode(forward.decode_small),
            decode_large=self._decode(forward.decode_large),
        )

    def _decode(self, c: Coefficients) -> Coefficients:
        return Coefficients(c.a + self.decode_per_step_ms, c.b, c.c + self.decode_per_request_ms)


# Fitted 2026-11-25 on the six given runs (loadtest/planner/fit_profiles.py): mean error 0.36
# of the targets for DistServe's three runs; vLLM's fit is loosely determined (other starting
# points end at 12-26 ms frontend, 0.8-0.95 prefill scale with errors within 5%: loadtest/RESULTS.md).
FITTED = {
    "distserve": ServedStep(frontend_ms=8.0, decode_per_step_ms=2.0, decode_per_request_ms=0.12),
    "vllm": ServedStep(frontend_ms=26.5, prefill_scale=0.8, decode_per_step_ms=4.0, decode_per_request_ms=0.4),
}


def engine_of(path: str) -> str | None:
    """Which engine a published profile file times, by its name ("....vllm.json": vLLM)."""
    name = Path(path).name.lower()
    if ".vllm." in name:
        return "vllm"
    return "distserve" if "distserve" in name else None
