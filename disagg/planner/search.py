"""The search for each pool's plan (DistServe's Algorithms 1 and 2, with colocated alternatives).

For every candidate the simulator finds the highest request rate at which the SLOs hold: at
least `attainment`% of the requests meet both TTFT and TPOT, and the `percentile`-th TTFT and
TPOT are within them. Goodput per device is that rate over the devices the candidate uses.

- Disaggregated, high node affinity (Algorithm 1): the phases are sized independently. A prefill
  instance shape is simulated alone (the decode side ideal: instant, unbounded) against the TTFT
  SLO, a decode shape alone (the prefill side ideal) against the TPOT SLO; the best shape per
  device of each phase is kept, their instance counts are matched (P:D ratio), and the pair is
  simulated together to find the rate it really sustains. KV moves over the inter-node link.
- Disaggregated, low node affinity (Algorithm 2): the model is split into PP stages and each
  stage's prefill and decode segments share a node (`segments.py`), so KV moves over the node's
  own link. A pair of shapes is a candidate only when a prefill TP plus a decode TP fit one node;
  each phase is simulated alone to rank the pairs and their P:D ratios per node, then the unit
  (one node's worth of segments per stage) is simulated whole at the best few ratios, the best
  kept, and replicated over no more nodes than the cluster has.
- Colocated: each shape with chunked prefill (at several token budgets) and prefill-first.
- Mixed hardware (Splitwise): each phase may run on any kind of device the cluster has.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from disagg.config import ServingConfig
from disagg.placement.factory import placement_policy
from disagg.placement.latency_model import Coefficients, HostSharing, StepModel, TransferModel
from disagg.placement.profile import Profile
from disagg.planner import memory
from disagg.planner.hardware import Hardware
from disagg.planner.models import kv_bytes_per_token
from disagg.planner.segments import SegmentUnit, node_ratios, segments_fit_node
from disagg.planner.simulator import SimPool, Simulator, percentile, slo_attainment
from disagg.planner.workload import SimRequest, with_rate
from disagg.slo import SLO, met

CPU_KV_CAP_BYTES = 1 << 30  # a CPU worker's KV stays at the engine's default: its RAM is the host's
INSTANT = StepModel(Coefficients(0, 0, 0), Coefficients(0, 0, 0), Coefficients(0, 0, 0))
CHUNKED_BUDGETS = (512, 2048)
STEADY_TAIL = 3  # the SLO must hold over the last 1/STEADY_TAIL of each simulated run too
SEGMENT_PAIRS = 2  # Algorithm 2: segment pairs simulated whole, the best by their phases' rates
SEGMENT_RATIOS = 3  # and P:D ratios per pair


@dataclass(frozen=True)
class NodeKind:
    hardware: Hardware
    profile: Profile  # this model on this hardware
    num_nodes: int
    devices_per_node: int


@dataclass(frozen=True)
class PoolPlan:
    tp: int
    pp: int
    instances: int
    hardware: str
    scheduling_policy: str = "chunked"
    max_num_batched_tokens: int = 512
    num_kv_blocks: int = 0

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.instances

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "instances": self.instances, "hardware": self.hardware}


@dataclass(frozen=True)
class PhaseOption:
    """One instance shape of one phase, simulated alone: the rate it sustains."""

    tp: int
    pp: int
    kind: NodeKind
    rate: float

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    @property
    def rate_per_device(self) -> float:
        return self.rate / self.devices


@dataclass
class Candidate:
    mode: str  # "disaggregated" | "colocated"
    pools: dict[str, PoolPlan]
    max_rate: float = 0.0
    algorithm: str = ""
    notes: dict = field(default_factory=dict)

    @property
    def devices(self) -> int:
        return sum(p.devices for p in self.pools.values())

    @property
    def goodput_per_device(self) -> float:
        return self.max_rate / self.devices if self.devices else 0.0

    def to_dict(self) -> dict:
        data = {"mode": self.mode, **{role: p.to_dict() for role, p in self.pools.items()}}
        return {
            **data,
            "algorithm": self.algorithm,
            "devices": self.devices,
            "max_rate": round(self.max_rate, 4),
            "goodput_per_device": round(self.goodput_per_device, 4),
            **({"notes": self.notes} if self.notes else {}),
        }


@dataclass
class Search:
    """Everything a search needs; `run()` returns the candidates, best first."""

    model_config: object  # ModelConfig
    kinds: list[NodeKind]
    requests: list[SimRequest]  # lengths; arrivals are redrawn at each rate tried
    slo: SLO  # both targets given
    block_size: int = 16
    max_model_len: int = 8192
    rate_tolerance: float = 0.05  # relative precision of each binary search
    # Arrivals last at least this long: a decode side filling its KV cache takes tens of seconds
    # to reach the steady state (DistServe's measured runs lose attainment after ~50 s at 6 req/s).
    min_duration_s: float = 90.0
    seed: int = 0
    simulations: int = 0
    # Whose placement settings the written config keeps (plan_config sets only the SLO beside the
    # pools: the default placement, goodput with SLO admission): every candidate is simulated
    # with the policy that config runs, admitting by the search's SLO.
    placement_config: ServingConfig = field(default_factory=ServingConfig)
    percentile: float = 90.0  # the SLO holds at a rate when this percentile's TTFT and TPOT meet it ...
    attainment: float = 90.0  # ... and at least this percent of the requests meet it

    def holds(self, records, check_ttft: bool = True, check_tpot: bool = True) -> bool:
        """Whether a simulated run at some rate meets the SLO (only the targets checked), over the
        whole run and over its last third: a queue that grows (a rate the deployment cannot
        sustain) shows at the end of a run first, however well its start went."""
        slo = SLO(self.slo.ttft_ms if check_ttft else 0.0, self.slo.tpot_ms if check_tpot else 0.0)
        tail = records[-max(1, len(records) // STEADY_TAIL) :]
        return all(self._holds(slo, part) for part in (records, tail))

    def _holds(self, slo: SLO, records) -> bool:
        """`attainment`% met, and the `percentile`-th TTFT and TPOT (of the requests of two or
        more tokens) met too."""
        if slo_attainment(records, slo) < self.attainment:
            return False
        multi = [r.tpot_s * 1e3 for r in records if r.success and r.output_len > 1]
        ttft = percentile([r.ttft_s * 1e3 for r in records], self.percentile)
        return met(slo, ttft, percentile(multi, self.percentile) if multi else 0.0)

    # ---- the max rate of one deployment ------------------------------------------------------
    def max_rate(self, pools: list[SimPool], transfer: TransferModel, check_ttft=True, check_tpot=True) -> float:
        """Binary search on the rate: the highest at which `pools` meets the SLO (0 if none)."""

        def ok(rate: float) -> bool:
            return self.holds(self.simulate(pools, transfer, rate), check_ttft, check_tpot)

        low, high = 0.0, self._first_guess(pools)
        while ok(high):
            low, high = high, high * 2
            if high > 1e6:
                return low
        if low == 0.0:  # even the guess fails: look below it
            low = high / 64
            if not ok(low):
                return 0.0
        while high - low > self.rate_tolerance * low:
            mid = (low + high) / 2
            low, high = (mid, high) if ok(mid) else (low, mid)
        return low

    @property
    def host_sharing(self) -> HostSharing | None:
        """A cluster of one node: its instances share that host's cores (for a CPU host, as its
        profile measured; a GPU's profile shares nothing). On several nodes they spread out."""
        if len(self.kinds) != 1 or self.kinds[0].num_nodes != 1:
            return None
        return self.kinds[0].profile.host_sharing

    def simulate(self, pools: list[SimPool], transfer: TransferModel, rate: float):
        self.simulations += 1
        profile = self.kinds[0].profile
        sim = Simulator(
            pools,
            policy=placement_policy(self.placement_config),
            slo=self.slo,
            transfer=transfer,
            kv_bytes_per_token=profile.kv_bytes_per_token or kv_bytes_per_token(self.model_config),
            num_layers=self.model_config.num_hidden_layers,
            router_overhead_ms=profile.frontend_ms,
            host_sharing=self.host_sharing,
        )
        return sim.run(with_rate(self._requests_for(rate), rate, seed=self.seed))

    def _requests_for(self, rate: float) -> list[SimRequest]:
        """At least `min_duration_s` of arrivals (the workload's lengths, cycled): a short burst at a
        high rate ends before queues and batches reach their steady state and flatters the rate."""
        wanted = max(len(self.requests), math.ceil(rate * self.min_duration_s))
        n = len(self.requests)
        return [replace(self.requests[i % n], index=i) for i in range(wanted)]

    def _first_guess(self, pools: list[SimPool]) -> float:
        """Requests/s one instance of the slowest pool could serve with nothing else running."""
        mean_prompt = sum(r.prompt_len for r in self.requests) / len(self.requests)
        mean_output = sum(r.output_len for r in self.requests) / len(self.requests)
        guesses = []
        for pool in pools:
            m = pool.step_model
            prefill_s = m.prefill_ms([int(mean_prompt)]) / 1e3
            decode_s = m.decode_ms(1, int(mean_prompt + mean_output / 2)) * mean_output / 1e3 / 16  # some batching
            per_request = (prefill_s if pool.role == "prefill" else 0) + (decode_s if pool.role != "prefill" else 0)
            if pool.role == "colocated":
                per_request += prefill_s
            if per_request > 0:
                guesses.append(pool.num_instances / per_request)
        return max(min(guesses, default=1.0), 1e-3)

    @property
    def total_devices(self) -> int:
        return sum(k.num_nodes * k.devices_per_node for k in self.kinds)

    # ---- building pools ------------------------------------------------------------------------
    def pool(self, role: str, kind: NodeKind, tp: int, pp: int, instances: int = 1, **engine) -> SimPool:
        budget = engine.get("max_num_batched_tokens", 16384 if role == "prefill" else 2048)
        tokens = memory.kv_capacity_tokens(self.model_config, kind.hardware, tp, pp)
        if self.model_config.architecture != "opt":  # a model our engine runs: as much KV as it starts with
            tokens = min(tokens, memory.worker_kv_tokens(self.model_config, kind.hardware, tp, pp, budget))
        if kind.hardware.name.startswith("cpu"):
            per_token = memory.kv_bytes_per_token_per_device(self.model_config, tp, pp, 4)  # float32 on CPU
            tokens = min(tokens, int(CPU_KV_CAP_BYTES // per_token))
        policy = engine.get("scheduling_policy", "prefill_first" if role == "prefill" else "chunked")
        return SimPool(
            role=role,
            num_instances=instances,
            step_model=kind.profile.step_model(tp, pp),
            num_kv_blocks=max(1, tokens // self.block_size),
            block_size=self.block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=engine.get("max_num_seqs", 512),
            max_model_len=self.max_model_len,
            scheduling_policy=policy,
            long_prefill_token_threshold=engine.get("long_prefill_token_threshold"),  # None: the engine's default
            long_prefill_by_work=engine.get("long_prefill_by_work", True),
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            name=kind.hardware.name,
            sliding_window=self.model_config.shared_window,
        )

    def ideal(self, role: str) -> SimPool:
        """A pool that takes no time and never runs out of room: isolates the other phase."""
        everything = sum(-(-(r.prompt_len + r.output_len) // self.block_size) for r in self.requests)
        budget = sum(r.prompt_len for r in self.requests)
        return SimPool(
            role,
            1,
            INSTANT,
            num_kv_blocks=everything,
            block_size=self.block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=len(self.requests),
            max_model_len=self.max_model_len,
        )

    def shapes(self, kind: NodeKind, max_devices: int) -> list[tuple[int, int]]:
        """Every TP x PP that divides the model, fits its weights with room for KV, and fits the
        devices. PP only where no TP alone fits: our engine runs a step's stages one after
        another, so PP adds memory, not speed, and a PP shape is dominated by its TP-only twin."""
        longest = max(r.prompt_len + r.output_len for r in self.requests)
        held = memory.kv_tokens_held(self.model_config, longest, self.block_size)  # (fewer under a window)
        fitting = [
            (tp, pp)
            for pp in (1, 2, 4, 8)
            for tp in (1, 2, 4, 8, 16)
            if tp <= kind.devices_per_node and tp * pp <= max_devices and kind.profile.has(tp, pp)
            if memory.fits(self.model_config, kind.hardware, tp, pp, kv_tokens=4 * held)
        ]
        smallest_pp = min((pp for _, pp in fitting), default=1)
        return [(tp, pp) for tp, pp in fitting if pp == smallest_pp]

    # ---- the candidates --------------------------------------------------------------------------
    def run(
        self, target_rate: float | None = None, progress: Callable[[str], None] = lambda _: None
    ) -> list[Candidate]:
        candidates = []
        for kind in self.kinds:
            candidates += self.colocated(kind, target_rate)
            progress(f"colocated on {kind.hardware.name}: {len(candidates)} candidates")
        candidates += self.disaggregated(target_rate, progress)
        candidates.sort(key=lambda c: (-c.goodput_per_device, c.devices))
        unique = {}  # Algorithms 1 and 2 often arrive at the same plan: keep its first
        for c in candidates:
            unique.setdefault((c.mode, tuple(sorted((r, p) for r, p in c.pools.items()))), c)
        return list(unique.values())

    def colocated(self, kind: NodeKind, target_rate: float | None) -> list[Candidate]:
        out = []
        for tp, pp in self.shapes(kind, kind.num_nodes * kind.devices_per_node):
            variants = [("chunked", b) for b in CHUNKED_BUDGETS] + [("prefill_first", 16384)]
            for policy, budget in variants:
                pool = self.pool("colocated", kind, tp, pp, scheduling_policy=policy, max_num_batched_tokens=budget)
                rate = self.max_rate([pool], kind.hardware.kv_transfer())
                plan = PoolPlan(tp, pp, 1, kind.hardware.name, policy, budget, pool.num_kv_blocks)
                out.append(
                    self._replicated(Candidate("colocated", {"colocated": plan}, rate, "colocated"), target_rate)
                )
        return out

    def disaggregated(self, target_rate: float | None, progress) -> list[Candidate]:
        return self.high_affinity(target_rate, progress) + self.low_affinity(target_rate, progress)

    def high_affinity(self, target_rate: float | None, progress) -> list[Candidate]:
        """Algorithm 1: the best shapes of each phase, their counts matched, KV over the network."""
        prefills, decodes = self._best_phase("prefill", "high"), self._best_phase("decode", "high")
        progress(f"disaggregated (high affinity): {len(prefills)} prefill and {len(decodes)} decode shapes")
        pairs = [self._pair(p, d, target_rate) for p in prefills[:2] for d in decodes[:2]]
        return [c for c in pairs if c is not None]

    def low_affinity(self, target_rate: float | None, progress) -> list[Candidate]:
        """Algorithm 2: prefill and decode segments of each stage on one node, sized together."""
        prefills, decodes = self._best_phase("prefill", "low"), self._best_phase("decode", "low")
        pairs = self.segment_pairs(prefills, decodes)
        progress(f"disaggregated (low affinity): {len(pairs)} prefill/decode segment pairs fit a node")
        units = [self.segment_candidate(p, d, target_rate) for p, d in pairs[:SEGMENT_PAIRS]]
        return [c for c in units if c is not None]

    def _best_phase(self, role: str, affinity: str) -> list[PhaseOption]:
        """One instance of each shape of this phase, the other phase ideal; best per device first."""
        other = self.ideal("decode" if role == "prefill" else "prefill")
        options = []
        for kind in self.kinds:
            transfer = kind.hardware.kv_transfer(inter_node=affinity == "high")
            for tp, pp in self.shapes(kind, kind.num_nodes * kind.devices_per_node):
                pools = [self.pool(role, kind, tp, pp), other]
                rate = self.max_rate(pools, transfer, check_ttft=role == "prefill", check_tpot=role == "decode")
                if rate > 0:
                    options.append(PhaseOption(tp, pp, kind, rate))
        return sorted(options, key=lambda o: (-o.rate_per_device, o.devices))

    def _pair(self, p: PhaseOption, d: PhaseOption, target_rate: float | None) -> Candidate | None:
        n_p, n_d = _ratio(p, d, target_rate, self.total_devices)
        if n_p * p.devices + n_d * d.devices > self.total_devices and not target_rate:
            return None
        pools = [self.pool("prefill", p.kind, p.tp, p.pp, n_p), self.pool("decode", d.kind, d.tp, d.pp, n_d)]
        rate = self.max_rate(pools, p.kind.hardware.kv_transfer(inter_node=True))
        notes = {"prefill_rate_per_instance": round(p.rate, 4), "decode_rate_per_instance": round(d.rate, 4)}
        return Candidate("disaggregated", pool_plans(pools), rate, "distserve-alg1", notes)

    # ---- Algorithm 2: instance segments ------------------------------------------------------------
    def segment_pairs(self, prefills: list[PhaseOption], decodes: list[PhaseOption]) -> list[tuple]:
        """(prefill, decode) shapes whose segments can share a node, best estimated unit first."""
        pairs = [(p, d) for p in prefills for d in decodes if _segments_fit(p, d)]
        return sorted(pairs, key=lambda pair: -max(_unit_estimate(*pair, r) for r in _ratios(*pair)))

    def segment_candidate(self, p: PhaseOption, d: PhaseOption, target_rate: float | None) -> Candidate | None:
        """The pair's best unit, by simulating its most promising P:D ratios whole, replicated
        for the target rate on the cluster's nodes (None when they cannot hold it)."""
        kind = p.kind
        ratios = sorted(_ratios(p, d), key=lambda r: (-_unit_estimate(p, d, r), sum(r)))
        units = [SegmentUnit(p.pp, p.tp, d.tp, n_p, n_d) for n_p, n_d in ratios]
        units = [u for u in units if u.max_replicas(kind.num_nodes, kind.devices_per_node) >= 1][:SEGMENT_RATIOS]
        simulated = [(self.unit_rate(kind, unit), unit) for unit in units]
        rate, unit = max(simulated, key=lambda s: (s[0] / s[1].devices, -s[1].devices))
        replicas = math.ceil(target_rate / rate) if target_rate and rate > 0 else 1
        if rate <= 0 or replicas > unit.max_replicas(kind.num_nodes, kind.devices_per_node):
            return None
        pools = self.unit_pools(kind, unit, replicas)
        notes = {
            "segments_per_stage": f"{unit.num_prefill}x tp{unit.prefill_tp} + {unit.num_decode}x tp{unit.decode_tp}",
            "replicas": replicas,
            "nodes": unit.nodes_needed(replicas, kind.devices_per_node),
        }
        return Candidate("disaggregated", pool_plans(pools), rate * replicas, "distserve-alg2", notes)

    def unit_pools(self, kind: NodeKind, unit: SegmentUnit, replicas: int = 1) -> list[SimPool]:
        return [
            self.pool("prefill", kind, unit.prefill_tp, unit.pp, unit.num_prefill * replicas),
            self.pool("decode", kind, unit.decode_tp, unit.pp, unit.num_decode * replicas),
        ]

    def unit_rate(self, kind: NodeKind, unit: SegmentUnit) -> float:
        """One unit simulated whole, its KV over the node's own link."""
        return self.max_rate(self.unit_pools(kind, unit), kind.hardware.kv_transfer(inter_node=False))

    def _replicated(self, candidate: Candidate, target_rate: float | None) -> Candidate:
        """With a target rate: as many replicas as it needs (goodput per device is unchanged)."""
        if not target_rate or candidate.max_rate <= 0:
            return candidate
        replicas = math.ceil(target_rate / candidate.max_rate)
        pools = {role: replace(p, instances=p.instances * replicas) for role, p in candidate.pools.items()}
        return replace(candidate, pools=pools, max_rate=candidate.max_rate * replicas)


def pool_plans(pools: list[SimPool]) -> dict[str, PoolPlan]:
    """The simulated pools as the plan writes them."""
    return {
        pool.role: PoolPlan(
            pool.tensor_parallel_size,
            pool.pipeline_parallel_size,
            pool.num_instances,
            pool.name,
            pool.scheduling_policy,
            pool.max_num_batched_tokens,
            pool.num_kv_blocks,
        )
        for pool in pools
    }


def _segments_fit(p: PhaseOption, d: PhaseOption) -> bool:
    """Algorithm 2's condition: same node kind, same stages, both segments on one of its nodes,
    and the cluster holds at least one unit."""
    if p.kind is not d.kind or p.pp != d.pp or not segments_fit_node(p.tp, d.tp, p.kind.devices_per_node):
        return False
    return SegmentUnit(p.pp, p.tp, d.tp).max_replicas(p.kind.num_nodes, p.kind.devices_per_node) >= 1


def _ratios(p: PhaseOption, d: PhaseOption) -> list[tuple[int, int]]:
    return node_ratios(p.tp, d.tp, p.kind.devices_per_node)


def _unit_estimate(p: PhaseOption, d: PhaseOption, ratio: tuple[int, int]) -> float:
    """A unit's rate per device from its phases' rates alone: the slower side bounds it."""
    n_p, n_d = ratio
    return min(n_p * p.rate, n_d * d.rate) / (n_p * p.devices + n_d * d.devices)


def _ratio(p: PhaseOption, d: PhaseOption, target_rate: float | None, devices: int) -> tuple[int, int]:
    """Instance counts of the two phases: for a target rate, enough of each; otherwise the counts
    within the cluster's devices with the most matched rate per device, the fewest devices first."""
    if target_rate:
        return max(1, math.ceil(target_rate / p.rate)), max(1, math.ceil(target_rate / d.rate))
    counts = [
        (n_p, n_d)
        for n_p in range(1, devices // p.devices + 1)
        for n_d in range(1, devices // d.devices + 1)
        if n_p * p.devices + n_d * d.devices <= devices
    ] or [(1, 1)]

    def score(n: tuple[int, int]) -> tuple[float, int]:
        devices = n[0] * p.devices + n[1] * d.devices
        return -min(n[0] * p.rate, n[1] * d.rate) / devices, devices

    return min(counts, key=score)
