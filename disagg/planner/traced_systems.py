"""The systems whose measured runs the simulator replays, as far as a replay depends on them.

A replay checks the simulator's model against a real system that nobody here built: DistServe and
vLLM 0.2 as DistServe ran them on A100-80GB (../shared/data/distserve/). What they ran with is
taken from DistServe's launch script (engine settings, 16-token blocks, 92% of GPU memory); how
each sizes its KV cache from their code (DistServe: memory x 0.92, less 1% and the weights; vLLM:
the same less the activations of a trial step of its whole token budget); how DistServe's decode
instance takes requests from their code (after the prefill, first come first served, the KV
waiting in the prefill's blocks meanwhile: `Simulator.decode_admission = "queue"`).

What their published profiles lack was fitted on the given runs (loadtest/fit_traced_systems.py
reproduces the fit; other runs, kept aside, check it):
- `frontend_ms`: each request's time outside the engine before its prefill (API server,
  tokenization, queues), from the TTFTs of requests that arrived to an idle prefill queue;
- `prefill_scale`: vLLM's profile prices a prompt token 1/0.8 as dear as its isolated requests
  took, from the same requests (DistServe's profile matches its own: 1.0);
- `decode_per_step_ms`, `decode_per_request_ms`: the decode loop's work beyond the forward pass
  (scheduling, sampling, detokenizing and returning each request's token, taking in migrated KV),
  from the runs' TPOT percentiles below saturation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from disagg.placement.latency_model import Coefficients, StepModel


@dataclass(frozen=True)
class TracedSystem:
    name: str
    engine: dict = field(default_factory=dict)  # EngineConfig fields it ran with
    memory_utilization: float = 0.9  # of each device's memory, for weights, activations and KV
    activation_tokens: int = 0  # the cache is sized after a trial step of this many tokens (0: none)
    decode_admission: str = "retry"  # disagg.planner.simulator.DECODE_ADMISSIONS
    frontend_ms: float = 0.0  # fitted
    prefill_scale: float = 1.0  # fitted
    decode_per_step_ms: float = 0.0  # fitted
    decode_per_request_ms: float = 0.0  # fitted

    def step_model(self, profiled: StepModel) -> StepModel:
        """The profile's forward pass as this system's engine steps take it."""
        per_step, per_request = self.decode_per_step_ms, self.decode_per_request_ms
        decode = lambda c: Coefficients(c.a + per_step, c.b, c.c + per_request)  # noqa: E731
        prefill = profiled.prefill
        scaled = Coefficients(
            prefill.a * self.prefill_scale, prefill.b * self.prefill_scale, prefill.c * self.prefill_scale
        )
        return replace(profiled, prefill=scaled, decode_small=decode(profiled.decode_small),
                       decode_large=decode(profiled.decode_large))  # fmt: skip


SYSTEMS = {
    # DistServe: the prefill instance batches whole prompts (at most 128, 32,768 tokens); the decode
    # instance batches every request it holds (at most 1,024).
    "distserve": TracedSystem(
        "distserve",
        engine={"scheduling_policy": "prefill_first", "max_num_batched_tokens": 32768, "max_num_seqs": 1024},
        memory_utilization=0.91,
        decode_admission="queue",
        frontend_ms=11.0,
        decode_per_step_ms=3.0,
        decode_per_request_ms=0.12,
    ),
    # vLLM 0.2: whole prompts first while decodes stall; DistServe launched it with a 65,536-token
    # budget and 1,024 sequences.
    "vllm": TracedSystem(
        "vllm",
        engine={"scheduling_policy": "prefill_first", "max_num_batched_tokens": 65536, "max_num_seqs": 1024},
        memory_utilization=0.92,
        activation_tokens=65536,
        frontend_ms=9.0,
        prefill_scale=0.8,
        decode_per_request_ms=0.3,
    ),
}


def system_of(trace_config: dict) -> TracedSystem:
    """The system a trace's recorded config names (DistServe unless its scheduler says vLLM)."""
    return SYSTEMS["vllm" if "vllm" in str(trace_config.get("scheduler", "")) else "distserve"]
