"""The systems whose measured runs the simulator replays, as far as a replay depends on them.

A replay checks the simulator's model against real systems that nobody here built: DistServe and
vLLM 0.2 as DistServe ran them on A100-80GB (../shared/data/distserve/). What they ran with comes
from DistServe's launch script (engine settings, 16-token blocks, 92% of GPU memory); how each
sizes its KV cache and how DistServe's decode instance takes requests, from their code:
- DistServe: memory x 0.92, less 1% and the weights; its decode instance takes a request after
  its prefill, first come first served, when its prompt's blocks are free, the KV waiting in the
  prefill's blocks meanwhile (`Simulator.decode_admission = "queue"`);
- vLLM 0.2: memory x 0.92, less the weights and the activations of a trial step of its whole
  token budget.
Their engines' own time beyond the forward pass belongs to their profiles
(disagg.placement.published_profiles).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TracedSystem:
    name: str
    engine: dict = field(default_factory=dict)  # EngineConfig fields it ran with
    memory_utilization: float = 0.9  # of each device's memory, for weights, activations and KV
    activation_tokens: int = 0  # the cache is sized after a trial step of this many tokens (0: none)
    decode_admission: str = "retry"  # disagg.planner.simulator.DECODE_ADMISSIONS


SYSTEMS = {
    # DistServe: the prefill instance batches whole prompts (at most 128, 32,768 tokens); the decode
    # instance batches every request it holds (at most 1,024).
    "distserve": TracedSystem(
        "distserve",
        engine={"scheduling_policy": "prefill_first", "max_num_batched_tokens": 32768, "max_num_seqs": 1024},
        memory_utilization=0.91,
        decode_admission="queue",
    ),
    # vLLM 0.2: whole prompts first while decodes stall; DistServe launched it with a 65,536-token
    # budget and 1,024 sequences.
    "vllm": TracedSystem(
        "vllm",
        engine={"scheduling_policy": "prefill_first", "max_num_batched_tokens": 65536, "max_num_seqs": 1024},
        memory_utilization=0.92,
        activation_tokens=65536,
    ),
}


def system_of(trace_config: dict) -> TracedSystem:
    """The system a trace's recorded config names (DistServe unless its scheduler says vLLM)."""
    return SYSTEMS["vllm" if "vllm" in str(trace_config.get("scheduler", "")) else "distserve"]
