"""The prompts this router sent to one instance and has not seen the first token of, in the order
sent: the queue the predictor prices there (disagg.placement.prefill_queue), each prompt with its
own length and the cached prefix it was predicted to find.

Each prompt also keeps when it was sent and when it was through (its first token came, or the
request ended), so that the router can tell how long the instance has worked on the queue, and
how many of the prompt tokens in the instance's last load report were its own.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, replace

from disagg.placement.prefill_queue import QueuedPrompt

RATE_WINDOW_S = 5.0  # the arrival rate is over the prompts sent this long ago at most


@dataclass(eq=False)  # one prompt sent: found by identity
class SentPrompt:
    prompt: QueuedPrompt
    sent_at: float  # time.time(), as load reports are stamped
    through_at: float = math.inf


class PromptQueue:
    def __init__(self, history: int = 256):
        self._waiting: list[SentPrompt] = []
        self._through: deque[SentPrompt] = deque(maxlen=history)  # the latest through, for `tokens_at`
        self.last_through_at = 0.0

    def add(self, num_tokens: int, num_cached: int) -> SentPrompt:
        sent = SentPrompt(QueuedPrompt(num_tokens, num_cached), time.time())
        self._waiting.append(sent)
        return sent

    def remove(self, sent: SentPrompt) -> None:
        """Its first token came, or its request ended (again: nothing)."""
        if sent in self._waiting:
            self._waiting.remove(sent)
            sent.through_at = self.last_through_at = time.time()
            self._through.append(sent)

    @property
    def prompts(self) -> list[QueuedPrompt]:
        """In the order sent, each as old as it is since it was sent."""
        now = time.time()
        return [replace(sent.prompt, age_ms=(now - sent.sent_at) * 1e3) for sent in self._waiting]

    @property
    def num_new_tokens(self) -> int:
        """The tokens its prompts were predicted to compute (their uncached ones)."""
        return sum(sent.prompt.num_new for sent in self._waiting)

    def progress_ms(self, busy_since: float = math.inf) -> float:
        """How long the instance has worked on the queue: since its first prompt came, or the one
        before it was through if later. `busy_since`: a time it was known to be computing what is
        ahead of the queue (its report of a backlog)."""
        start = busy_since
        if self._waiting:
            start = min(start, max(self._waiting[0].sent_at, self.last_through_at))
        return 0.0 if math.isinf(start) else max(0.0, time.time() - start) * 1e3

    def tokens_per_ms(self) -> float:
        """The uncached prompt tokens sent of late (in the last RATE_WINDOW_S), per ms."""
        since = time.time() - RATE_WINDOW_S
        recent = [s for s in (*self._through, *self._waiting) if s.sent_at >= since]
        return sum(s.prompt.num_new for s in recent) / (RATE_WINDOW_S * 1e3)

    def tokens_at(self, stamp: float) -> int:
        """Prompt tokens of the prompts it held at `stamp` (a load report's time), whole: an
        engine counts a waiting prompt's cached tokens too, until it is admitted."""
        held = [s for s in (*self._through, *self._waiting) if s.sent_at <= stamp < s.through_at]
        return sum(s.prompt.num_tokens for s in held)
