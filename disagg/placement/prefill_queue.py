"""The steps an instance runs from now until a new prompt's first token: the prompts queued ahead
of it, then it, packed as its scheduler packs them (disagg.engine.scheduler), on lengths alone.

Each step the instance's decodes go first, one token each; then the prompts' tokens in the order
they came, until the step's token budget is spent. A prompt that came while a step ran waits for
the next one (an engine takes new work between steps). A prompt whose last chunk is computed
samples its first token; on an instance that decodes too, it decodes from the next step on, and
every decode's context grows by a token a step. Each step is the `StepWork` the engine would
report for it, so the step model prices it as what it is: a prefill step, or a mixed step with a
decode batch riding along. The steps are laid out in time from when the instance began on its
queue, so what it has already spent on them is not waited for again.

Pure Python: the router prices every request this way, the simulator every arrival.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from disagg.placement.latency_model import StepModel
from disagg.step_work import StepWork

# A prompt that comes this soon after the queue's first step began is taken into it: an idle
# engine wakes, and its link hands it what came meanwhile, in about this long.
PICKUP_MS = 5.0


@dataclass(frozen=True)
class QueuedPrompt:
    """A prompt waiting for its first token: `num_tokens` long, of which the first `num_known`
    need no computing (its cached prefix, or the chunks computed already); it came `age_ms` ago
    (inf: before the instance began on its queue)."""

    num_tokens: int
    num_known: int = 0
    age_ms: float = math.inf

    @property
    def num_new(self) -> int:
        return max(0, self.num_tokens - self.num_known)


@dataclass(frozen=True)
class Decodes:
    """The requests decoding on an instance: every step computes one token of each."""

    batch: int = 0
    context_sum: int = 0


@dataclass(frozen=True)
class PrefillForecast:
    """The steps from when the instance began on its queue until a new prompt's first token."""

    steps: tuple[StepWork, ...]
    step_ms: tuple[float, ...]
    own_from: int  # the first step with a chunk of the new prompt: the steps before are the queue's
    end_ms: float  # from now until its last step ends
    under_way_ms: float  # the step it waits for: the queue's last, or the batch's decode step

    @property
    def ms(self) -> float:
        """Until its last step ends; never less than its own steps after the rest of the step
        under way (half of it, on average: the instance is behind the steps laid out)."""
        return max(self.end_ms, sum(self.step_ms[self.own_from :]) + self.under_way_ms / 2)

    def stall_ms(self, model: StepModel) -> float:
        """What its steps take beyond the plain decode steps of the batch riding along: how much
        later every token of that batch comes."""
        own = zip(self.steps[self.own_from :], self.step_ms[self.own_from :])
        return sum(ms - model.decode_ms(w.num_decodes, w.decode_context_sum) for w, ms in own)


def forecast(
    model: StepModel,
    queue: Sequence[QueuedPrompt],
    prompt: QueuedPrompt,
    budget: int,
    decodes: Decodes | None = None,
    progress_ms: float = 0.0,
    arrivals_per_ms: float = 0.0,
) -> PrefillForecast:
    """`queue` ahead of `prompt` (which comes now), in the order they came, in steps of at most
    `budget` tokens. `decodes`: the batch that shares the steps (None on a prefill instance,
    where a prompt leaves at its first token). `progress_ms`: how long ago the instance began
    on the queue. `arrivals_per_ms`: prompt tokens coming to the instance of late: those that
    come after `prompt`, before its last step, share that step (under load, they fill it)."""
    ahead = [p for p in queue if p.num_new]
    prompt = QueuedPrompt(prompt.num_tokens, prompt.num_known, 0.0)
    budget = max(1, budget)
    decode_step = model.decode_ms(decodes.batch, decodes.context_sum) if decodes else 0.0
    layout = _Layout(model, budget, decodes, decode_step)
    prompts = [*ahead, prompt, *_coming(prompt, budget, arrivals_per_ms)]
    layout.run(prompts, len(ahead), start=-progress_ms if ahead else 0.0)
    own_from = layout.own_from
    under_way = layout.times[own_from - 1] if own_from else decode_step
    return PrefillForecast(tuple(layout.steps), tuple(layout.times), own_from, layout.t, under_way)


def _coming(prompt: QueuedPrompt, budget: int, per_ms: float) -> list[QueuedPrompt]:
    """The prompts expected after `prompt` at `per_ms` tokens a ms, taken as long as it, the
    k-th due k - 1/2 intervals from now (so that by any time as many have come as the rate
    says, rounded): as many as its last step could take."""
    if per_ms <= 0:
        return []
    size = max(1, prompt.num_new)
    return [QueuedPrompt(size, 0, -(k - 0.5) * size / per_ms) for k in range(1, min(64, budget // size + 1) + 1)]


class _Layout:
    """The steps in time, from when the instance began on the queue (ms from now) until one
    prompt's last chunk: `steps`, their `times`, the end `t`, and `own_from`, the first step with
    a chunk of that prompt."""

    def __init__(self, model: StepModel, budget: int, decodes: Decodes | None, decode_step_ms: float):
        self.model, self.budget, self.joins, self.decode_step_ms = model, budget, decodes is not None, decode_step_ms
        self.batch, self.context = (decodes.batch, decodes.context_sum) if decodes else (0, 0)
        self.steps: list[StepWork] = []
        self.times: list[float] = []
        self.t, self.own_from = 0.0, 0

    def run(self, prompts: list[QueuedPrompt], ours: int, start: float) -> None:
        """Until `prompts[ours]` is through (those after it only share its steps)."""
        known, came = [p.num_known for p in prompts], [-p.age_ms for p in prompts]
        self.t, head, last = start, 0, len(prompts) - 1
        while head <= ours:
            if came[head] > self.t:  # idle until it comes; where decodes run, it waits for theirs too
                self.t = came[head] + (self.decode_step_ms / 2 if self.batch else 0.0)
                continue
            room, spans = max(1, self.budget - self.batch), []
            for i in range(head, last + 1):
                if came[i] > self.t + (PICKUP_MS if not self.steps else 0.0) or room == 0:
                    break
                spans.append((known[i], min(prompts[i].num_tokens - known[i], room)))
                known[i] += spans[-1][1]
                room -= spans[-1][1]
                if i == ours and spans[-1][0] == prompts[i].num_known:
                    self.own_from = len(self.steps)
            joined = []
            while head <= last and known[head] >= prompts[head].num_tokens:
                joined.append(prompts[head].num_tokens + 1)  # decodes, with its sampled token, from the next step
                head += 1
            self._step(spans, joined)

    def _step(self, spans: list[tuple[int, int]], joined: list[int]) -> None:
        work = StepWork.of(spans)
        work = StepWork(work.chunks, work.num_decodes + self.batch, work.decode_context_sum + self.context)
        self.steps.append(work)
        self.times.append(self.model.step_ms(work))
        self.t += self.times[-1]
        self.context += self.batch  # every decode's context grew by its token
        if self.joins:
            self.batch, self.context = self.batch + len(joined), self.context + sum(joined)
