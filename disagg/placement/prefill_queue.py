"""The steps an instance runs from now until a new prompt's first token: the prompts queued ahead
of it, then it, packed as its scheduler packs them (disagg.engine.scheduler), on lengths alone.

Each step the instance's decodes go first, one token each; then the prompts' tokens in the order
they came, until the step's token budget is spent: each prompt's chunk first capped at the
instance's `chunk_cap` (fair prefill), then what the caps left to the prompts it finishes, the
fewest tokens left first, and only in a step that finishes none to the others (with no cap, the
first come takes the whole budget). Under fair prefill the caps are of work, as the scheduler's
(a chunk deep in a long prompt carries fewer tokens), with the step model's own ratio of a
token's attention to its other work. A prompt
that came while a step ran waits for
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
from disagg.step_work import StepWork, chunk_work, tokens_within_work

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
    under_way_end_ms: float = 0.0  # when that step ends as laid out (<= 0: it should have ended)

    @property
    def ms(self) -> float:
        """Until its last step ends. Where the step it waits for should have ended already (the
        instance is behind the steps laid out), never less than its own steps after the rest of
        that step: half of it, on average. (Under fair prefill a prompt's steps often follow the
        step under way at once: while the instance keeps to the layout, its end is the layout's.)"""
        if self.under_way_end_ms > 0:
            return self.end_ms
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
    chunk_cap: int | None = None,
    by_work: bool = True,
) -> PrefillForecast:
    """`queue` ahead of `prompt` (which comes now), in the order they came, in steps of at most
    `budget` tokens. `decodes`: the batch that shares the steps (None on a prefill instance,
    where a prompt leaves at its first token). `progress_ms`: how long ago the instance began
    on the queue. `arrivals_per_ms`: prompt tokens coming to the instance of late: those that
    come after `prompt`, before its last step, share that step (under load, they fill it).
    `chunk_cap`: a prompt chunk's first share of a step (disagg.config.prefill_chunk_cap; None:
    no cap); `by_work`: whether the cap and a step's rest count work (EngineConfig.long_prefill_by_work)."""
    ahead = [p for p in queue if p.num_new]
    prompt = QueuedPrompt(prompt.num_tokens, prompt.num_known, 0.0)
    budget = max(1, budget)
    cap = budget if chunk_cap is None else max(1, min(chunk_cap, budget))
    decode_step = model.decode_ms(decodes.batch, decodes.context_sum) if decodes else 0.0
    layout = _Layout(model, budget, cap, decodes, decode_step, by_work)
    prompts = [*ahead, prompt, *_coming(prompt, budget, arrivals_per_ms)]
    layout.run(prompts, len(ahead), start=-progress_ms if ahead else 0.0)
    own_from = layout.own_from
    # With a queue ahead, its first step is the prompt's own only when the instance began on it
    # as the prompt came (fair prefill shares it): then no step is under way for it to wait for.
    under_way = layout.times[own_from - 1] if own_from else (0.0 if ahead else decode_step)
    under_way_end = layout.starts[own_from - 1] + under_way if own_from else 0.0
    return PrefillForecast(tuple(layout.steps), tuple(layout.times), own_from, layout.t, under_way, under_way_end)


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

    def __init__(
        self, model: StepModel, budget: int, cap: int, decodes: Decodes | None, decode_step_ms: float, by_work: bool
    ):
        self.model, self.budget, self.cap, self.joins = model, budget, cap, decodes is not None
        self.context_tokens = model.attention_context_tokens if by_work and cap < budget else None
        self.decode_step_ms = decode_step_ms
        self.batch, self.context = (decodes.batch, decodes.context_sum) if decodes else (0, 0)
        self.steps: list[StepWork] = []
        self.times: list[float] = []
        self.starts: list[float] = []  # ms from now each step begins
        self.t, self.own_from = 0.0, 0

    def run(self, prompts: list[QueuedPrompt], ours: int, start: float) -> None:
        """Until `prompts[ours]` is through (those after it only share its steps)."""
        known, came = [p.num_known for p in prompts], [-p.age_ms for p in prompts]
        self.t, head = start, 0
        while known[ours] < prompts[ours].num_tokens:
            while known[head] >= prompts[head].num_tokens:  # the oldest not through
                head += 1
            if came[head] > self.t:  # idle until it comes; where decodes run, it waits for theirs too
                self.t = came[head] + (self.decode_step_ms / 2 if self.batch else 0.0)
                continue
            chunks = self._chunks(prompts, known, came, head)
            if known[ours] == prompts[ours].num_known and any(i == ours for i, _ in chunks):
                self.own_from = len(self.steps)
            spans, joined = [], []
            for i, n in chunks:
                spans.append((known[i], n))
                known[i] += n
                if known[i] >= prompts[i].num_tokens:
                    joined.append(prompts[i].num_tokens + 1)  # decodes, with its sampled token, from the next step
            self._step(spans, joined)

    def _chunks(self, prompts: list[QueuedPrompt], known: list[int], came: list[float], head: int) -> list[list[int]]:
        """This step's chunks, [prompt index, tokens], as the scheduler splits the room the
        decodes leave: each prompt that has come capped at `cap` in turn, then what is left to
        those it finishes, the fewest tokens left first, and only in a step that finishes none to
        the others (stable: in the order they came)."""
        room, chunks = max(1, self.budget - self.batch), []
        latest = self.t + (PICKUP_MS if not self.steps else 0.0)
        k = self.context_tokens
        cap_work = chunk_work(0, self.cap, k)
        for i in range(head, len(prompts)):
            if came[i] > latest or room == 0:
                break
            n = min(prompts[i].num_tokens - known[i], max(1, tokens_within_work(known[i], cap_work, k)), room)
            if n:
                chunks.append([i, n])
                room -= n

        def left(chunk: list[int]) -> int:
            return prompts[chunk[0]].num_tokens - known[chunk[0]] - chunk[1]

        # What the step may still compute within a whole budget's work (counted only by work).
        work = chunk_work(0, self.budget, k) - self.batch - sum(chunk_work(known[i], n, k) for i, n in chunks)
        cut = sorted((c for c in chunks if left(c) > 0), key=left)
        for chunk in cut:  # first to the prompts the rest finishes (in work too, where it counts)
            start, n, extra = known[chunk[0]], chunk[1], left(chunk)
            added = chunk_work(start, n + extra, k) - chunk_work(start, n, k)
            if extra <= room and (k is None or added <= work):
                chunk[1], room, work = n + extra, room - extra, work - added
        if all(left(c) > 0 for c in chunks):  # a step that finishes a prompt gives the others their cap
            for chunk in cut:
                start, n = known[chunk[0]], chunk[1]
                extra = min(left(chunk), room)
                if k is not None:
                    extra = min(extra, tokens_within_work(start, chunk_work(start, n, k) + work, k) - n)
                if extra > 0:
                    chunk[1], room, work = (
                        n + extra,
                        room - extra,
                        work - (chunk_work(start, n + extra, k) - chunk_work(start, n, k)),
                    )
        return chunks

    def _step(self, spans: list[tuple[int, int]], joined: list[int]) -> None:
        work = StepWork.of(spans)
        work = StepWork(work.chunks, work.num_decodes + self.batch, work.decode_context_sum + self.context)
        self.steps.append(work)
        self.starts.append(self.t)
        self.times.append(self.model.step_ms(work))
        self.t += self.times[-1]
        self.context += self.batch  # every decode's context grew by its token
        if self.joins:
            self.batch, self.context = self.batch + len(joined), self.context + sum(joined)
