"""A profile from first principles: a model's shape and a device's datasheet, no measurement.

Each step model has DistServe's form (see `placement.latency_model`); its coefficients come from:

- prefill, compute-bound: a = weights read once + LM head + per-step costs; b = linear-layer FLOPs
  per token; c = attention FLOPs per l^2 (causal: half of l^2 query-key pairs);
- decode, memory-bound while the batch is small: a = weights read once + per-step costs;
  b = a context token's KV read; c = a sequence's linear-layer FLOPs, of which `decode_overlap`
  hides under the weight reads. From the ridge batch (weights-read time = compute time) on the
  large-batch triple applies, with the hidden share of the weight read moved out of the intercept
  so that the two triples meet at the ridge;
- TP: FLOPs and bytes split over the ranks, plus two ring all-reduces of the hidden state per
  layer (2 (tp - 1) / tp * bytes / link bandwidth + link latency): latency to the intercept,
  bytes to the per-token (prefill) or per-sequence (decode) term. Across nodes when TP exceeds a node;
- PP as our engine runs it: stages one after another, so a step takes the TP-only time plus one
  activation hand-off per stage boundary (`Profile.pp_handoff_ms` is its fixed part);
- a fixed per-step overhead (launches, scheduling, sampling);
- a mixture of experts: the weights above are all but the experts, which every step reads; the
  experts a step's tokens touch are read on top (`ExpertReads`: the k of one token at batch 1, up
  to all of them as the batch grows), and FLOPs count a token's k experts only (active, not
  total, parameters). Memory holds every expert (planner/memory.py). Experts split over TP as the
  dense MLP does; expert parallelism's all-to-all is not priced (the MLP's all-reduce is).

Real kernels reach a fraction of the datasheet: `Efficiency`, fitted by `calibrate` against a
measured or published profile. Pure Python: the planner runs on any laptop.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from disagg.engine.model_config import ModelConfig
from disagg.placement.latency_model import Coefficients, ExpertReads, StepModel
from disagg.placement.profile import Profile
from disagg.planner import models
from disagg.planner.hardware import Hardware, hardware_spec
from disagg.planner.memory import check_shape


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet that real kernels reach, and what every step costs regardless.

    Defaults: `calibrate` against DistServe's A100-80GB OPT-13B profile at TP 1, 2 and 4, rounded.
    """

    compute: float = 0.80  # GEMM FLOP/s / peak
    attention: float = 0.43  # prefill attention FLOP/s / peak (OPT's attention kernels are slower than GEMMs)
    memory: float = 0.75  # achieved / datasheet memory bandwidth
    link: float = 0.19  # all-reduce bus bandwidth / link bandwidth (small messages fall far short)
    overhead_ms: float = 5.1  # per step: kernel launches, scheduling, sampling
    # Share of small-batch decode compute hidden under weight reads. DistServe's A100 steps fit best
    # with none hidden (the fit finds 0 from any start): weight reads and compute add up.
    decode_overlap: float = 0.0

    def __post_init__(self) -> None:
        fractions = (self.compute, self.attention, self.memory, self.link)
        if not all(0 < f <= 1 for f in fractions) or not 0 <= self.decode_overlap <= 1 or self.overhead_ms < 0:
            raise ValueError(f"efficiency: fractions must be in (0, 1] and overhead >= 0, got {self}")


@dataclass(frozen=True)
class _Costs:
    """The roofline's unit costs for one TP x PP, in milliseconds."""

    weights: float  # reading every weight once (all stages, one after another), experts aside
    expert: float  # reading one expert's weights in every MoE layer (0: dense)
    per_token: float  # linear layers for one token
    lm_head: float  # the LM head for one sequence
    attention: float  # prefill attention per unit of l^2
    kv_read: float  # one context token's KV
    step_fixed: float  # overhead + all-reduce and hand-off latencies
    per_token_comm: float  # all-reduce and hand-off bytes of one token's hidden state


def _unit_costs(config: ModelConfig, hw: Hardware, tp: int, pp: int, dtype_bytes: int, eff: Efficiency) -> _Costs:
    flops_ms = 1e3 / (tp * hw.peak_flops * eff.compute)  # ms per FLOP, split over the TP ranks
    bytes_ms = 1e3 / (tp * hw.memory_bandwidth * eff.memory)
    hidden_bytes = config.hidden_size * dtype_bytes
    reduce_fixed, reduce_per_token = _all_reduce_ms(config, hw, tp, hidden_bytes, eff)
    handoff_fixed, handoff_per_token = _handoff_ms(hw, tp, pp, hidden_bytes, eff)
    return _Costs(
        weights=models.dense_weight_bytes(config, dtype_bytes) * bytes_ms,
        expert=models.expert_bytes(config, dtype_bytes) * bytes_ms,
        per_token=models.flops_per_token(config) * flops_ms,
        lm_head=models.lm_head_flops(config) * flops_ms,
        attention=models.attention_flops_per_pair(config) / 2 * flops_ms * eff.compute / eff.attention,
        kv_read=models.kv_bytes_per_token(config, dtype_bytes) * bytes_ms,
        step_fixed=eff.overhead_ms + reduce_fixed + (pp - 1) * handoff_fixed,
        per_token_comm=reduce_per_token + (pp - 1) * handoff_per_token,
    )


def _all_reduce_ms(config: ModelConfig, hw: Hardware, tp: int, hidden_bytes: int, eff: Efficiency):
    """(fixed, per token) ms of the two ring all-reduces per layer (after attention, after the MLP)."""
    if tp == 1:
        return 0.0, 0.0
    bandwidth, latency_ms = hw.link(inter_node=tp > hw.devices_per_node)
    count = 2 * config.num_hidden_layers
    per_token = count * 2 * (tp - 1) / tp * hidden_bytes / (bandwidth * eff.link) * 1e3
    return count * latency_ms, per_token


def _handoff_ms(hw: Hardware, tp: int, pp: int, hidden_bytes: int, eff: Efficiency):
    """(fixed, per token) ms of one stage boundary: the hidden state to the next stage's ranks."""
    bandwidth, latency_ms = hw.link(inter_node=tp * pp > hw.devices_per_node)
    return latency_ms, hidden_bytes / (bandwidth * eff.link) * 1e3


def _step_model(costs: _Costs, overlap: float, config: ModelConfig) -> StepModel:
    per_sequence = costs.per_token + costs.lm_head
    prefill = Coefficients(
        costs.step_fixed + costs.weights + costs.lm_head, costs.per_token + costs.per_token_comm, costs.attention
    )
    small = Coefficients(
        costs.step_fixed + costs.weights, costs.kv_read, (1 - overlap) * per_sequence + costs.per_token_comm
    )
    # From the ridge on, compute no longer hides: the large triple meets the small one there
    # (for a mixture of experts, where every expert is read).
    ridge = (costs.weights + config.num_experts * costs.expert) / per_sequence
    large = Coefficients(
        costs.step_fixed + (1 - overlap) * costs.weights, costs.kv_read, per_sequence + costs.per_token_comm
    )
    experts = ExpertReads(costs.expert, config.num_experts, config.num_experts_per_tok) if config.is_moe else None
    return StepModel(prefill, small, large, decode_threshold=max(1, math.ceil(ridge)), experts=experts)


def _resolve(model: str | ModelConfig, hardware: str | Hardware) -> tuple[ModelConfig, Hardware]:
    config = models.model_spec(model) if isinstance(model, str) else model
    hw = hardware_spec(hardware) if isinstance(hardware, str) else hardware
    return config, hw


def roofline_profile(
    model: str | ModelConfig,
    hardware: str | Hardware,
    shapes: Sequence[tuple[int, int]] = ((1, 1),),
    dtype_bytes: int = 2,
    efficiency: Efficiency | None = None,
) -> Profile:
    """A roofline step model per (tp, pp); a shape the model cannot run raises ValueError."""
    config, hw = _resolve(model, hardware)
    eff = efficiency or Efficiency()
    entries = {}
    for tp, pp in shapes:
        check_shape(config, tp, pp)
        entries[(tp, pp)] = _step_model(_unit_costs(config, hw, tp, pp, dtype_bytes, eff), eff.decode_overlap, config)
    handoff_fixed, _ = _handoff_ms(hw, 1, 2, config.hidden_size * dtype_bytes, eff)
    return Profile(
        model=config.name or str(model),
        hardware=hw.name,
        source="roofline",
        entries=entries,
        kv_bytes_per_token=models.kv_bytes_per_token(config, dtype_bytes),
        num_layers=config.num_hidden_layers,
        kv_transfer=hw.kv_transfer(),
        pp_handoff_ms=handoff_fixed,
        fit={"efficiency": asdict(eff), "dtype_bytes": dtype_bytes},
    )


# ---- comparing with a measured profile, and calibrating against one ----------------------------
PREFILL_GRID = ((64,), (128,), (256,), (512,), (1024,), (2048,), (128,) * 8, (512,) * 4)
DECODE_GRID = tuple((batch, ctx) for batch in (1, 4, 16, 32, 64, 128, 192, 256) for ctx in (128, 512, 1024))
# Points between and beyond the calibration grid's, for checking a calibration.
HELD_OUT_PREFILL = ((48,), (200,), (700,), (1500,), (300,) * 3, (96,) * 16)
HELD_OUT_DECODE = tuple((batch, ctx) for batch in (2, 8, 24, 48, 96, 160, 224) for ctx in (256, 768, 1536))


def step_errors(
    predicted: StepModel,
    measured: StepModel,
    prefill: Sequence[Sequence[int]] = PREFILL_GRID,
    decode: Sequence[tuple[int, int]] = DECODE_GRID,
) -> list[float]:
    """Relative errors (predicted / measured - 1) over prefill batches and (batch, context per request) decodes."""
    errors = [predicted.prefill_ms(lens) / measured.prefill_ms(lens) - 1 for lens in prefill]
    for batch, ctx in decode:
        errors.append(predicted.decode_ms(batch, batch * ctx) / measured.decode_ms(batch, batch * ctx) - 1)
    return errors


def compare(roofline: Profile, measured: Profile, **grid) -> dict[tuple[int, int], dict[str, float]]:
    """Median and max absolute relative error of the roofline, per shape both profiles have."""
    report = {}
    for shape in measured.shapes:
        if roofline.has(*shape):
            errors = [abs(e) for e in step_errors(roofline.step_model(*shape), measured.step_model(*shape), **grid)]
            report[shape] = {"median": statistics.median(errors), "max": max(errors)}
    return report


def calibrate(
    model: str | ModelConfig, hardware: str | Hardware, measured: Profile, dtype_bytes: int = 2, **grid
) -> Efficiency:
    """The efficiency whose roofline best matches `measured` (mean squared log error, pattern search),
    over `grid` (step_errors' prefill and decode points; default: PREFILL_GRID and DECODE_GRID)."""
    config, hw = _resolve(model, hardware)
    shapes = [(tp, pp) for tp, pp in measured.shapes if not _invalid(config, tp, pp)]
    if not shapes:
        raise ValueError(f"calibrate: {measured.model} has no TP x PP that {config.name} can run")

    def loss(eff: Efficiency) -> float:
        rooflines = roofline_profile(config, hw, shapes, dtype_bytes, eff)
        errors = [e for s in shapes for e in step_errors(rooflines.step_model(*s), measured.step_model(*s), **grid)]
        return sum(math.log1p(e) ** 2 for e in errors) / len(errors)

    return _pattern_search(loss, Efficiency())


def _invalid(config: ModelConfig, tp: int, pp: int) -> bool:
    try:
        check_shape(config, tp, pp)
    except ValueError:
        return True
    return False


_FRACTIONS = ("compute", "attention", "memory", "link")


def _moves(eff: Efficiency, step: float) -> list[Efficiency]:
    """Neighbours of `eff`: each field up and down by `step` (a factor; overlap moves additively)."""
    out = []
    for name in (*_FRACTIONS, "overhead_ms"):
        value = getattr(eff, name)
        for new in (value * step, value / step):
            if name in _FRACTIONS:
                new = min(1.0, max(1e-3, new))
            out.append(replace(eff, **{name: new}))
    delta = (step - 1) / 2
    for new in (eff.decode_overlap + delta, eff.decode_overlap - delta):
        out.append(replace(eff, decode_overlap=min(1.0, max(0.0, new))))
    return out


def _pattern_search(loss: Callable[[Efficiency], float], start: Efficiency) -> Efficiency:
    """Greedy coordinate moves, halving the step (in log terms) when none improves."""
    best, best_loss, step = start, loss(start), 2.0
    while step > 1.002:
        candidates = [(loss(e), e) for e in _moves(best, step)]
        value, eff = min(candidates, key=lambda c: c[0])
        if value < best_loss - 1e-12:
            best, best_loss = eff, value
        else:
            step = math.sqrt(step)
    return best
