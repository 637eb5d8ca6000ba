"""How long an engine step takes, and how long a request's KV takes to move (DistServe's fitted form).

One `StepModel` describes one instance shape (model, hardware, TP, PP); all times in milliseconds:

- prefill step over prompts (or chunks) of lengths l_i:  a + b * sum(l_i) + c * sum(l_i^2)
- decode step over a batch with contexts ctx_i:           a + b * sum(ctx_i) + c * batch
  with one triple below `decode_threshold` requests and another from there on (DistServe's split:
  small batches are bound by weight reads, large ones start to be bound by compute);
- mixed step (prompt chunks with decodes, Sarathi-Serve): either the prefill form of its chunks
  plus the decode form's per-token and per-request terms (one step, the prefill's intercept:
  "sum", the form the router's online fit learns), or a fit of its own over
  [1, new tokens, chunk attention, decode context, decodes], whichever predicted better where it
  was measured (`mixed_form`).

A mixture-of-experts model adds one term that is not linear (`ExpertReads`): each step reads the
weights of the experts its tokens touch, the k a token is routed to at one token, all of them once
the step has enough tokens: E * (1 - (1 - k/E)^tokens) experts expected (routes taken as
independent and uniform). It applies to every kind of step, with the step's tokens (a decode
step's batch, a prefill's prompt tokens, a mixed step's both).

A step's work is a `disagg.step_work.StepWork`: its prompt chunks and its decodes. A chunk of n
tokens starting at position s has attention work n * (2s + n) (`Chunk.attention`); for a whole
prompt (s = 0) that is l^2, DistServe's term, so a chunk after cached or earlier tokens is a
prefill step of the same form.

Pure Python (no numpy): the router evaluates this on every request, the simulator on every step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from disagg.step_work import Chunk, StepWork

__all__ = [
    "Chunk",
    "Coefficients",
    "ExpertReads",
    "HostSharing",
    "StepModel",
    "TransferModel",
]  # Chunk: where its users found it before

MIXED_FORMS = ("sum", "fit")


@dataclass(frozen=True)
class Coefficients:
    """a + b * x + c * y, in milliseconds."""

    a: float
    b: float
    c: float

    def __call__(self, x: float, y: float) -> float:
        return self.a + self.b * x + self.c * y

    def to_list(self) -> list[float]:
        return [self.a, self.b, self.c]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> "Coefficients":
        if len(values) != 3 or not all(math.isfinite(float(v)) for v in values):
            raise ValueError(f"coefficients: expected three finite numbers [a, b, c], got {values!r}")
        return cls(*(float(v) for v in values))


def expected_experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """How many distinct experts `tokens` tokens are routed to, each to `top_k` of `num_experts`
    (uniform, independent routes): k at one token, E as tokens grow."""
    if tokens <= 0 or num_experts <= 0:
        return 0.0
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class ExpertReads:
    """A mixture-of-experts step's expert weights: `ms_per_expert` to read one expert's weights
    in every MoE layer, times the experts a step's tokens are expected to touch."""

    ms_per_expert: float
    num_experts: int
    top_k: int

    def __post_init__(self) -> None:
        if not (self.ms_per_expert >= 0 and math.isfinite(self.ms_per_expert)):
            raise ValueError(f"expert reads: ms_per_expert must be finite and >= 0, got {self.ms_per_expert}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"expert reads: need 1 <= top_k <= num_experts, got {self.top_k} of {self.num_experts}")

    def ms(self, tokens: int) -> float:
        return self.ms_per_expert * expected_experts_touched(self.num_experts, self.top_k, tokens)

    def to_dict(self) -> dict:
        return {"ms_per_expert": self.ms_per_expert, "num_experts": self.num_experts, "top_k": self.top_k}

    @classmethod
    def from_dict(cls, data: dict | None) -> "ExpertReads | None":
        if not data:
            return None
        return cls(float(data["ms_per_expert"]), int(data["num_experts"]), int(data["top_k"]))


@dataclass(frozen=True)
class StepModel:
    prefill: Coefficients
    decode_small: Coefficients
    decode_large: Coefficients
    decode_threshold: int = 95  # the large-batch triple applies from this batch size on
    mixed_form: str = "sum"
    mixed: tuple[float, ...] = ()  # "fit": [intercept, new tokens, chunk attention, decode context, decodes]
    experts: ExpertReads | None = None  # a mixture of experts' expert weights read per step

    def __post_init__(self) -> None:
        if self.mixed_form not in MIXED_FORMS:
            raise ValueError(f"mixed_form: must be one of {MIXED_FORMS}, got {self.mixed_form!r}")
        if self.mixed_form == "fit" and len(self.mixed) != 5:
            raise ValueError("mixed: a fitted mixed-step model needs 5 coefficients")
        if self.decode_threshold < 1:
            raise ValueError("decode_threshold must be >= 1")

    @property
    def attention_context_tokens(self) -> float | None:
        """The context at which a prompt token's attention costs what its other work does, as
        fitted (ModelConfig.attention_context_tokens counts FLOPs); None where the fit has no
        attention term."""
        b, c = self.prefill.b, self.prefill.c
        return b / (2 * c) if b > 0 and c > 0 else None

    # ---- the three kinds of step -------------------------------------------------------------
    def prefill_ms(self, lengths: Sequence[int]) -> float:
        """A batch of whole prompts."""
        if not lengths:
            return 0.0
        return self.prefill(sum(lengths), sum(n * n for n in lengths)) + self.expert_ms(sum(lengths))

    def decode_ms(self, batch: int, context_sum: int) -> float:
        """One decode step of `batch` requests whose contexts add up to `context_sum`."""
        if batch <= 0:
            return 0.0
        return self._decode_triple(batch)(context_sum, batch)

    def expert_ms(self, tokens: int) -> float:
        """A step's expert weight reads (`ExpertReads`; 0 for a dense model)."""
        return 0.0 if self.experts is None else self.experts.ms(tokens)

    def decode_steps_ms(self, batch: int, context_sum: int, steps: int) -> float:
        """`steps` decode steps of the same batch, every context growing by one token a step."""
        if batch <= 0 or steps <= 0:
            return 0.0
        t = self._decode_triple(batch)
        # sum over j < steps of a + b (context_sum + j batch) + c batch
        return steps * (t.a + t.b * context_sum + t.c * batch) + t.b * batch * steps * (steps - 1) / 2

    def decode_steps_within(self, batch: int, context_sum: int, budget_ms: float) -> int:
        """How many whole decode steps of this batch fit in `budget_ms` (at least 0)."""
        if batch <= 0 or budget_ms <= 0:
            return 0
        t = self._decode_triple(batch)
        first = t.a + t.b * context_sum + t.c * batch
        growth = t.b * batch  # each step costs this much more than the one before
        if growth <= 1e-12:
            steps = int(budget_ms // first) if first > 0 else 1 << 40
        else:  # largest k with k*first + growth*k(k-1)/2 <= budget
            p = first - growth / 2
            steps = int((-p + math.sqrt(p * p + 2 * growth * budget_ms)) / growth)
        while steps > 0 and self.decode_steps_ms(batch, context_sum, steps) > budget_ms:
            steps -= 1
        while self.decode_steps_ms(batch, context_sum, steps + 1) <= budget_ms:
            steps += 1
        return steps

    def step_ms(self, work: StepWork) -> float:
        """Any step: prompt chunks and decodes together (either may be empty)."""
        if work.kind == "decode":
            return self.decode_ms(work.num_decodes, work.decode_context_sum)
        return self.linear_step_ms(work) + self.expert_ms(work.prefill_tokens + work.num_decodes)

    def linear_step_ms(self, work: StepWork) -> float:
        """A step with prompt chunks, without its expert reads: the terms a fit learns."""
        tokens, attention = work.prefill_tokens, work.prefill_attention
        if work.kind == "prefill":
            return self.prefill(tokens, attention)
        batch, context = work.num_decodes, work.decode_context_sum
        if self.mixed_form == "fit":
            w = self.mixed
            return w[0] + w[1] * (tokens + batch) + w[2] * attention + w[3] * context + w[4] * batch
        decode = self._decode_triple(batch)
        return self.prefill(tokens, attention) + decode.b * context + decode.c * batch

    def _decode_triple(self, batch: int) -> Coefficients:
        """The decode form at this batch, the batch's expert reads in its intercept (a decode
        batch's steps all read the same expected number of experts)."""
        triple = self.decode_small if batch < self.decode_threshold else self.decode_large
        if self.experts is None:
            return triple
        return Coefficients(triple.a + self.experts.ms(batch), triple.b, triple.c)

    # ---- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = {
            "prefill": self.prefill.to_list(),
            "decoding_smallbs": self.decode_small.to_list(),
            "decoding_largebs": self.decode_large.to_list(),
            "decoding_large_small_bs_threshold": self.decode_threshold,
            "mixed_form": self.mixed_form,
        }
        if self.mixed:
            data["mixed"] = list(self.mixed)
        if self.experts is not None:
            data["moe_expert_reads"] = self.experts.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "StepModel":
        """Our profile entries, and DistServe's (the same keys, without the mixed model)."""
        try:
            return cls(
                prefill=Coefficients.from_list(data["prefill"]),
                decode_small=Coefficients.from_list(data["decoding_smallbs"]),
                decode_large=Coefficients.from_list(data["decoding_largebs"]),
                decode_threshold=int(data.get("decoding_large_small_bs_threshold", 95)),
                mixed_form=data.get("mixed_form", "sum"),
                mixed=tuple(float(v) for v in data.get("mixed", ())),
                experts=ExpertReads.from_dict(data.get("moe_expert_reads")),
            )
        except KeyError as exc:
            raise ValueError(f"profile entry: missing {exc.args[0]!r}") from None

    def scaled(self, factor: float) -> "StepModel":
        """Every time multiplied by `factor` (e.g. one pipeline stage's share of a step)."""
        scale = lambda c: Coefficients(c.a * factor, c.b * factor, c.c * factor)  # noqa: E731
        return StepModel(
            scale(self.prefill),
            scale(self.decode_small),
            scale(self.decode_large),
            self.decode_threshold,
            self.mixed_form,
            tuple(w * factor for w in self.mixed),
            None if self.experts is None else replace(self.experts, ms_per_expert=self.experts.ms_per_expert * factor),
        )


@dataclass(frozen=True)
class TransferModel:
    """Moving a request's KV from a prefill to a decode instance: latency + bytes / bandwidth.

    The sender streams layer by layer while the prefill computes, so what the request waits for
    after its prefill step is the last layer's share, unless the link is slower than the compute.
    """

    bandwidth_bytes_per_s: float = math.inf
    latency_ms: float = 0.0
    # Measured where a profile says so; a roofline fills in the hardware's link.
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or self.latency_ms < 0:
            raise ValueError("kv transfer: bandwidth must be > 0 and latency >= 0")

    def transfer_ms(self, num_bytes: float) -> float:
        """The whole transfer, not overlapped with anything."""
        return self.latency_ms + num_bytes / self.bandwidth_bytes_per_s * 1e3

    def wait_after_prefill_ms(self, num_bytes: float, prefill_ms: float, num_layers: int) -> float:
        """From the end of the prefill step to the KV being complete at the decode side."""
        wire = num_bytes / self.bandwidth_bytes_per_s * 1e3
        layers = max(1, num_layers)
        # Layer i can leave once it is computed, at (i+1)/L of the step; the link sends one at a time.
        behind = max(0.0, wire - prefill_ms * (layers - 1) / layers)
        return self.latency_ms + max(wire / layers, behind)

    def to_dict(self) -> dict:
        bandwidth = self.bandwidth_bytes_per_s
        return {"bandwidth_gb_s": None if math.isinf(bandwidth) else bandwidth / 1e9, "latency_ms": self.latency_ms}

    @classmethod
    def from_dict(cls, data: dict | None) -> "TransferModel":
        data = data or {}
        gb_s = data.get("bandwidth_gb_s")
        return cls(math.inf if gb_s is None else float(gb_s) * 1e9, float(data.get("latency_ms", 0.0)))


@dataclass(frozen=True)
class HostSharing:
    """How much longer a step takes while another instance on the same host is mid-step.

    A profile times the engine alone. On a CPU host the instances of a deployment are threads on
    the cores of one machine: two engines computing at once share its memory bandwidth and, under
    a hypervisor, the physical cores behind its vCPUs, so a step runs slower than alone, by how
    much depending on what the other computes (prompt chunks, bound by compute, take the shared
    core's cycles; decodes, bound by weight reads, far fewer) and a little on what it computes
    itself. `slowdown[own][other]` for a step of kind `own` ("prefill": with prompt chunks;
    "decode": decodes only) beside one of kind `other`. Measured by
    `loadtest/host/sharing.py`; 1 everywhere (nothing shared) for separate devices such as GPUs.
    """

    slowdown: dict = field(default_factory=dict, hash=False)  # {own: {other: factor}}; missing: 1

    def __post_init__(self) -> None:
        for own, row in self.slowdown.items():
            for other, factor in row.items():
                if own not in STEP_KINDS or other not in STEP_KINDS or not (0 < factor < math.inf):
                    raise ValueError(f"host sharing: slowdown[{own!r}][{other!r}] = {factor!r} is not a factor")

    @property
    def shares(self) -> bool:
        return any(f != 1.0 for row in self.slowdown.values() for f in row.values())

    def factor(self, own: str, others: Iterable[str]) -> float:
        """Of a step of kind `own` while steps of kinds `others` run beside it: the worst partner's."""
        row = self.slowdown.get(own, {})
        return max((row.get(other, 1.0) for other in others), default=1.0)

    def to_dict(self) -> dict:
        return {own: dict(row) for own, row in self.slowdown.items()}

    @classmethod
    def from_dict(cls, data: dict | None) -> "HostSharing":
        return cls({own: {other: float(f) for other, f in row.items()} for own, row in (data or {}).items()})


STEP_KINDS = ("prefill", "decode")  # as HostSharing tells them: with prompt chunks, or decodes only


def sharing_kind(work: StepWork | None) -> str:
    """A step's kind for HostSharing (None: a run of plain decode steps)."""
    return "decode" if work is None or work.kind == "decode" else "prefill"
