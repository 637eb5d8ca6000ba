"""How fast a prefill instance gets through the prompt tokens sent to it, as the router sees it.

Each first token tells the router how long the instance took to get through the work it had
queued when the request was sent (that request's prompt included). The moving average of seconds
per queued token predicts when a new request's KV starts to flow: the decode side waits that
long (with margin) for the first KV, so a request queued behind a long prompt is not failed by
a fixed deadline meant for a short one. Pure: the router runs it online, the simulator could too.
"""

from __future__ import annotations


class PrefillRate:
    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.seconds_per_token: float | None = None  # None until a first token was seen

    def observe(self, queued_tokens: int, seconds: float) -> None:
        """`seconds` from sending a request to its first token, with `queued_tokens` ahead of and
        including it."""
        if queued_tokens <= 0 or seconds < 0:
            return
        rate = seconds / queued_tokens
        if self.seconds_per_token is None:
            self.seconds_per_token = rate
        else:
            self.seconds_per_token += self.smoothing * (rate - self.seconds_per_token)

    def predict(self, queued_tokens: int) -> float:
        """Seconds until `queued_tokens` are through (0 before any observation)."""
        return (self.seconds_per_token or 0.0) * max(0, queued_tokens)
