"""The router sends an instance the request's priority as the engine orders it (vLLM's integers,
disagg.request.PRIORITY_VALUES), keeps it for a live move, and keeps it across a migration
after a failure: only admission treats a later attempt as critical. (No Ray, no link: the
instance is a fake with the calls the orchestrator makes.)"""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

from disagg.config import ServingConfig
from disagg.errors import WorkerLinkError
from disagg.placement.policies import Choice
from disagg.request import PRIORITY_VALUES, SamplingParams
from disagg.router.orchestrator import Orchestrator
from disagg.router.prompt_queue import PromptQueue
from disagg.router.streams import Mailbox
from disagg.rpc.messages import TokenDelta


class FakeInstance:
    """A colocated instance whose first `failures` submits break its link."""

    def __init__(self, failures: int = 0):
        self.instance_id = "colocated-0"
        self.outstanding_requests = self.outstanding_context_tokens = 0
        self.prompt_queue = PromptQueue()
        self.prefix_hashes: set = set()
        self.decode_service = self
        self.failures = failures
        self.submitted: list[tuple[str, int]] = []  # (attempt id, priority) of each submit

    async def submit(self, request_id, prompt_token_ids, params, priority=0, *, timeout_s):
        self.submitted.append((request_id, priority))
        if len(self.submitted) <= self.failures:
            raise WorkerLinkError("link broke", self.instance_id)

    async def abort(self, request_id, *, timeout_s):
        return True

    def admit(self, num_prompt_tokens: int, num_blocks: int = 0) -> None:
        self.outstanding_requests += 1
        self.outstanding_context_tokens += num_prompt_tokens

    def release(self, num_prompt_tokens: int) -> None:
        self.outstanding_requests -= 1
        self.outstanding_context_tokens -= num_prompt_tokens


def run_one(instance: FakeInstance, priority: str) -> tuple[list[str], list[int]]:
    """One request through the orchestrator; returns the admission priorities the policy saw and
    the engine priorities of the request as placed when its tokens were read (a live move's)."""
    admitted_as, live_priorities = [], []
    orchestrator = None

    class Streams:
        def open(self, instance, request_id):
            box = Mailbox(request_id)
            box.get = lambda timeout_s: delivered(request_id)
            return box

        def close(self, instance_id, request_id):
            pass

    async def delivered(request_id) -> TokenDelta:
        live_priorities.append(orchestrator.live[request_id].priority)
        return TokenDelta(request_id, [7], finished=True, finish_reason="length")

    def choose_pair(prefills, decodes, request):
        admitted_as.append(request.priority)
        return Choice(instance, instance, math.nan, math.nan, math.inf, admitted=True)

    async def wait_healthy(role, timeout_s):
        return True

    directory = SimpleNamespace(
        healthy=lambda role: [instance],
        recovering=lambda role: False,
        is_failed=lambda instance: False,
        mark_failed=lambda peer: None,
        wait_healthy=wait_healthy,
    )
    orchestrator = Orchestrator(
        ServingConfig(mode="colocated"), directory, SimpleNamespace(choose_pair=choose_pair), Streams(), block_size=16
    )

    async def scenario():
        params = SamplingParams(max_tokens=1)
        return [d async for d in orchestrator.generate("r", [1, 2, 3], params, priority=priority)]

    deltas = asyncio.run(scenario())
    assert [d.token_ids for d in deltas] == [[7]]
    return admitted_as, live_priorities


def test_the_instance_gets_the_engines_priority_and_a_live_move_would_too():
    instance = FakeInstance()
    admitted_as, live = run_one(instance, "sheddable")
    assert admitted_as == ["sheddable"]
    assert instance.submitted == [("r", PRIORITY_VALUES["sheddable"])]
    assert live == [PRIORITY_VALUES["sheddable"]]  # what LiveMoves.move sends the target


def test_a_migrated_request_keeps_its_priority_in_the_engines():
    instance = FakeInstance(failures=1)
    admitted_as, live = run_one(instance, "sheddable")
    assert admitted_as == ["sheddable", "critical"]  # once admitted, it is not refused again
    assert instance.submitted == [("r", 1), ("r~1", 1)]  # but it does not pass others in the queue
    assert live == [1]
