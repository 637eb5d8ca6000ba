"""The router's targets call for an early-started prefill: when it fails, the request's stream
ends with an error instead of waiting for KV that will never come. (Pure asyncio logic: the
prefill actor is a stand-in with the one remote method the router calls.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from disagg.config import ServingConfig
from disagg.router.orchestrator import Orchestrator
from disagg.router.streams import Mailbox


def prefill_instance(outcome):
    async def answer():
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    actor = SimpleNamespace(set_kv_targets=SimpleNamespace(remote=lambda request_id, reservation: answer()))
    return SimpleNamespace(instance_id="prefill-0", actor=actor)


@pytest.mark.parametrize("outcome,error", [(True, None), (False, "dropped the request"), (RuntimeError("actor died"), "actor died")])
def test_targets_call_outcome_reaches_the_stream(outcome, error):
    async def scenario():
        orchestrator = Orchestrator(ServingConfig(), directory=None, policy=None, streams=None, block_size=16)
        mailbox = Mailbox("r1")
        await orchestrator._send_targets(prefill_instance(outcome), "r1", reservation=None, mailbox=mailbox)
        if error is None:
            with pytest.raises(asyncio.TimeoutError):
                await mailbox.get(0.05)  # nothing to report: the decode stream goes on
            return
        delta = await mailbox.get(1.0)
        assert delta.finished and error in delta.error

    asyncio.run(scenario())
