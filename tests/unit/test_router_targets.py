"""The router's targets call for an early-started prefill: when it fails, the request's stream
ends with an error instead of waiting for KV that will never come. (No Ray: the prefill
worker is a request-link server with the one method the router calls.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from disagg.config import ServingConfig
from disagg.router.orchestrator import Orchestrator
from disagg.router.streams import Mailbox
from disagg.rpc.client import RpcClient
from disagg.rpc.server import RpcServer
from disagg.rpc.services import PrefillService
from disagg.rpc.stubs import PrefillStub
from tests.support import LINK_KEY


def prefill_server(outcome) -> RpcServer:
    class Prefill(PrefillService):
        def set_kv_targets(self, request_id, reservation):
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

    return RpcServer(Prefill(), PrefillService, LINK_KEY, "127.0.0.1")


@pytest.mark.parametrize(
    "outcome,error", [(True, None), (False, "dropped the request"), (RuntimeError("actor died"), "actor died")]
)
def test_targets_call_outcome_reaches_the_stream(outcome, error):
    server = prefill_server(outcome)

    async def scenario():
        failed = []  # the instances the router takes out of placement
        directory = SimpleNamespace(mark_failed=failed.append)
        orchestrator = Orchestrator(ServingConfig(), directory=directory, policy=None, streams=None, block_size=16)
        mailbox = Mailbox("r1")
        link = RpcClient(server.address, LINK_KEY, name="prefill-0")
        prefill = SimpleNamespace(instance_id="prefill-0", prefill_service=PrefillStub(link))
        await orchestrator._send_targets(prefill, "r1", reservation=None, mailbox=mailbox)
        await link.close()
        if error is None:
            with pytest.raises(asyncio.TimeoutError):
                await mailbox.get(0.05)  # nothing to report: the decode stream goes on
            return
        delta = await mailbox.get(1.0)
        assert delta.finished and error in delta.error
        # A worker that failed (UNAVAILABLE) is out of placement; one that merely dropped the request is not.
        assert failed == (["prefill-0"] if isinstance(outcome, Exception) else [])

    try:
        asyncio.run(scenario())
    finally:
        server.close()
