"""The KV transfer protocol between a PREFILL and a DECODE worker, over the in-process transport."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from support import run_transfers as run, submit_transfer as submit

from disagg import LLM, SamplingParams
from disagg.config import EngineConfig
from disagg.decode_worker.role import DecodeRequest, DecodeRole
from disagg.engine.block_manager import PLACEHOLDER
from disagg.engine.kv_cache import KVCache
from disagg.engine.partition import head_range, layer_range
from disagg.kv_transfer.tally import RankTally
from disagg.kv_transfer.inproc import InProcessHub, InProcessTransport
from disagg.kv_transfer.layout import KVLayout
from disagg.kv_transfer.messages import HEADER_LEN, MsgType
from disagg.kv_transfer.receiver import KVReceiver
from disagg.kv_transfer.resharding import ParallelPlan, plan_kv_routes
from disagg.kv_transfer.layout import KVTarget
from disagg.kv_transfer.sender import KVSender
from disagg.prefill_worker.role import PrefillRole
from disagg.request import priority_value

MODEL = "random:tiny"
PROMPT_LENGTHS = [1, 7, 16, 33, 100, 250]  # 250 is chunked by the prefill budget below


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def colocated_tokens() -> list[list[int]]:
    llm = LLM(MODEL, num_kv_blocks=256)
    return [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts()], greedy(), use_tqdm=False)
    ]


@pytest.fixture
def pair(request):
    """By default the prefill cache is in shared memory, so KV goes by reference (KV_REF);
    parametrize indirectly with False for packed KV messages."""
    shared = getattr(request, "param", True)
    hub = InProcessHub()
    prefill = PrefillRole(
        EngineConfig(model=MODEL, max_num_batched_tokens=64, num_kv_blocks=128, kv_shared_memory=shared),
        InProcessTransport("prefill-0", hub),
        kv_timeout=5.0,
    )
    decode = DecodeRole(
        EngineConfig(model=MODEL, num_kv_blocks=128), InProcessTransport("decode-0", hub), kv_timeout=5.0
    )
    yield hub, prefill, decode
    prefill.close()
    decode.close()


def message_kinds(monkeypatch) -> list[MsgType]:
    """Record the type of every protocol header any in-process transport sends."""
    kinds = []
    send = InProcessTransport.send

    def spy(self, peer_id, tensor, timeout):
        if tensor.dtype == torch.int64 and tensor.shape == (HEADER_LEN,):
            kinds.append(MsgType(int(tensor[0])))
        return send(self, peer_id, tensor, timeout)

    monkeypatch.setattr(InProcessTransport, "send", spy)
    return kinds


# One message per layer; small chunks grouped, larger ones per layer; everything in one message.
@pytest.mark.parametrize("min_message_bytes", [1, 10_000, 1 << 30])
@pytest.mark.parametrize("pair", [True, False], indirect=True, ids=["by-reference", "packed"])
def test_disaggregated_tokens_equal_colocated(pair, colocated_tokens, monkeypatch, min_message_bytes, request):
    monkeypatch.setattr("disagg.kv_transfer.sender.MIN_MESSAGE_BYTES", min_message_bytes)
    kinds = message_kinds(monkeypatch)
    _, prefill, decode = pair
    for i, p in enumerate(prompts()):
        submit(prefill, decode, f"r{i}", p, greedy())
    finished = run(prefill, decode)
    assert [finished[f"r{i}"] for i in range(len(PROMPT_LENGTHS))] == colocated_tokens
    for engine in (prefill.engine, decode.engine):
        assert engine.num_free_blocks == engine.num_total_blocks
    by_reference = request.node.callspec.params["pair"]
    assert (MsgType.KV_REF in kinds, MsgType.KV in kinds) == (by_reference, not by_reference)


@pytest.mark.parametrize("min_message_bytes", [1, 1 << 30])
def test_a_reference_goes_once_a_step_and_the_last_with_the_done(
    pair, colocated_tokens, monkeypatch, min_message_bytes
):
    """By reference, whatever the packed protocol's message size: a one-step prompt's KV moves in
    one message (KV_REF_DONE) and its ACK; a prompt of four chunks in one KV_REF per earlier
    chunk, then KV_REF_DONE and the ACK. Before, a reference went every few layers, then a DONE."""
    monkeypatch.setattr("disagg.kv_transfer.sender.MIN_MESSAGE_BYTES", min_message_bytes)
    kinds = message_kinds(monkeypatch)
    _, prefill, decode = pair
    chunks = []
    forward_done = prefill.sender.forward_done
    monkeypatch.setattr(prefill.sender, "forward_done", lambda step: (chunks.extend(step), forward_done(step)))
    for length in (33, 250):  # one chunk; several of at most 64 tokens
        index = PROMPT_LENGTHS.index(length)
        kinds.clear(), chunks.clear()
        submit(prefill, decode, f"r{length}", prompts()[index], greedy())
        assert run(prefill, decode)[f"r{length}"] == colocated_tokens[index]
        assert (length == 33) == (len(chunks) == 1), chunks
        assert kinds == [MsgType.KV_REF] * (len(chunks) - 1) + [MsgType.KV_REF_DONE, MsgType.ACK], f"{length} tokens"


@pytest.mark.parametrize("pair", [True, False], indirect=True, ids=["by-reference", "packed"])
def test_a_prefill_step_that_fails_on_one_request_streams_the_others_intact(pair, colocated_tokens, monkeypatch):
    """The step fails after layer 0 went out, whenever one request is in it: that request fails
    alone (both sides free its blocks at once) and the others, rerun from their first layer, decode
    exactly the colocated tokens."""
    monkeypatch.setattr("disagg.kv_transfer.sender.MIN_MESSAGE_BYTES", 1)  # layer 0 goes out on its own
    _, prefill, decode = pair
    hook = prefill.sender.save_kv_layer

    def save_kv_layer(local_layer, chunks):
        hook(local_layer, chunks)
        if local_layer == 0 and any(c.request.request_id == "bad" for c in chunks):
            raise RuntimeError("this request breaks the step")

    monkeypatch.setattr(prefill.sender, "save_kv_layer", save_kv_layer)
    for i, p in enumerate(prompts()[:3]):
        submit(prefill, decode, f"r{i}", p, greedy())
    submit(prefill, decode, "bad", prompts()[3], greedy())
    failed = []
    step = prefill.engine.step

    def recording_step():
        outputs = step()
        failed.extend(o.request_id for o in outputs if o.error)
        return outputs

    monkeypatch.setattr(prefill.engine, "step", recording_step)
    started = time.monotonic()
    finished = run(prefill, decode)
    assert failed == ["bad"] and "bad" not in finished
    # Its receiver was told (ABORT) and freed the reservation, not left waiting for its 5 s deadline.
    assert time.monotonic() - started < 4.0
    assert [finished[f"r{i}"] for i in range(3)] == colocated_tokens[:3]
    for engine in (prefill.engine, decode.engine):
        assert engine.num_free_blocks == engine.num_total_blocks


def late_reservation(prefill: PrefillRole, decode: DecodeRole, request_id: str, prompt: list[int]):
    reservation = decode.reserve(request_id, prompt, greedy(), prefill.kv_layout())
    assert reservation is not None and reservation.layout == KVLayout.single("decode-0", decode.address())
    return reservation


def late_targets(prefill: PrefillRole, decode: DecodeRole, request_id: str, prompt: list[int]) -> None:
    """The router's handshake answer, arriving after the prefill started: in force after the next step."""
    answered = prefill.set_kv_targets(request_id, late_reservation(prefill, decode, request_id, prompt))
    assert not answered.done()  # resolved on the engine thread
    prefill.step()
    assert answered.result(timeout=0) is True


@pytest.mark.parametrize("prefill_steps_first", [0, 2, 50])  # before it starts, mid-chunks, after the first token
def test_targets_that_arrive_after_the_prefill_started(pair, colocated_tokens, prefill_steps_first):
    _, prefill, decode = pair
    index = len(PROMPT_LENGTHS) - 1  # 250 tokens: four chunks at this budget
    prompt = prompts()[index]
    prefill.prefill("late", prompt, greedy())
    for _ in range(prefill_steps_first):
        prefill.step()
    if prefill_steps_first:  # blocks are allocated when scheduled, and held without targets
        assert prefill.engine.num_free_blocks < prefill.engine.num_total_blocks
    late_targets(prefill, decode, "late", prompt)
    assert run(prefill, decode)["late"] == colocated_tokens[index]
    for engine in (prefill.engine, decode.engine):
        assert engine.num_free_blocks == engine.num_total_blocks


def test_targets_that_overtake_their_request_wait_for_it(pair, colocated_tokens):
    """The request link may hand over the targets before the engine thread added the request."""
    _, prefill, decode = pair
    prompt = prompts()[3]
    answered = prefill.set_kv_targets("early", late_reservation(prefill, decode, "early", prompt))
    prefill.step()
    assert not answered.done()
    prefill.prefill("early", prompt, greedy())
    prefill.step()
    assert answered.result(timeout=0) is True
    assert run(prefill, decode)["early"] == colocated_tokens[3]


def test_aborting_a_request_refuses_the_targets_that_wait_for_it(pair):
    _, prefill, decode = pair
    answered = prefill.set_kv_targets("gone", late_reservation(prefill, decode, "gone", prompts()[1]))
    prefill.step()
    assert not prefill.abort("gone")
    assert answered.result(timeout=0) is False
    decode.abort("gone")


@pytest.mark.parametrize("chunk", [0, 2])  # during the first chunk, or a later one
def test_targets_that_arrive_during_a_prefill_step_stream_from_the_next_layer(
    pair, colocated_tokens, chunk, monkeypatch
):
    """As a link thread does: set_kv_targets while the step runs (here: from the layer hook,
    after layer 0). The engine thread registers this rank's targets at the next layer: the
    layers computed before go first, the rest as computed; the answer comes after the step."""
    _, prefill, decode = pair
    index = len(PROMPT_LENGTHS) - 1
    prompt = prompts()[index]
    prefill.prefill("mid", prompt, greedy())
    for _ in range(chunk):
        prefill.step()
    reservation = late_reservation(prefill, decode, "mid", prompt)
    hook = prefill.sender.save_kv_layer
    answered = []

    def save_kv_layer(local_layer, chunks):
        hook(local_layer, chunks)
        if local_layer == 0 and not answered:
            answered.append(prefill.set_kv_targets("mid", reservation))

    monkeypatch.setattr(prefill.sender, "save_kv_layer", save_kv_layer)
    prefill.step()
    monkeypatch.setattr(prefill.sender, "save_kv_layer", hook)
    assert prefill.sender.num_bytes_total > 0  # streamed during the step, not after it
    assert answered[0].result(timeout=0) is True
    assert run(prefill, decode)["mid"] == colocated_tokens[index]
    for engine in (prefill.engine, decode.engine):
        assert engine.num_free_blocks == engine.num_total_blocks


def test_targets_that_never_arrive_free_the_blocks(pair):
    _, prefill, _ = pair
    prefill.kv_timeout = 0.3  # how long a request waits for its targets
    prefill.prefill("orphan", prompts()[2], greedy())
    (first,) = prefill.step()
    assert first.finished and prefill.engine.num_free_blocks < prefill.engine.num_total_blocks
    assert not prefill.needs_sync()  # nothing to do until the deadline
    deadline = time.monotonic() + 5
    while prefill.engine.num_free_blocks != prefill.engine.num_total_blocks:
        assert time.monotonic() < deadline, "blocks still held without targets"
        if prefill.needs_sync():
            prefill.step()
        time.sleep(0.01)
    # Targets for a request that is gone: refused, at the latest once they waited the kv timeout
    # for it (targets may overtake their request's add_request on the way to the engine thread).
    answered = prefill.set_kv_targets("orphan", None)
    deadline = time.monotonic() + 5
    while not answered.done():
        assert time.monotonic() < deadline, "targets for a gone request never answered"
        if prefill.needs_sync():
            prefill.step()
        time.sleep(0.01)
    assert answered.result() is False


@pytest.mark.parametrize("by_reference", [True, False], ids=["by-reference", "packed"])
def test_the_layer_hook_does_work_only_at_layers_where_some_is_due(tiny_untied_dir, monkeypatch, by_reference):
    """Between layers the CPU caches are cold: each layer's bookkeeping cost ~20 us, 0.6 ms a
    prefill. By reference, one message's layers need work only at its first and last layer;
    packed, every layer is copied."""
    monkeypatch.setattr("disagg.kv_transfer.sender.MIN_MESSAGE_BYTES", 1 << 30)  # one message
    hub = InProcessHub()
    prefill = PrefillRole(
        EngineConfig(model=tiny_untied_dir, num_kv_blocks=32, kv_shared_memory=by_reference),
        InProcessTransport("prefill-0", hub),
        kv_timeout=5.0,
    )
    decode = DecodeRole(
        EngineConfig(model=tiny_untied_dir, num_kv_blocks=32), InProcessTransport("decode-0", hub), kv_timeout=5.0
    )
    visited = []
    due_layer = KVSender._due_layer
    monkeypatch.setattr(
        KVSender, "_due_layer", staticmethod(lambda tr, layer: visited.append(layer) or due_layer(tr, layer))
    )
    try:
        submit(prefill, decode, "r", prompts()[3], greedy(2))
        prefill.step()
        num_layers = prefill.engine.model_config.num_hidden_layers
        assert num_layers >= 3
        assert visited == ([0, num_layers - 1] if by_reference else list(range(num_layers)))
        assert len(run(prefill, decode)["r"]) == 2
        assert prefill.engine.num_free_blocks == prefill.engine.num_total_blocks
    finally:
        prefill.close()
        decode.close()


def test_prefix_cached_prompt_still_sends_every_block(pair, colocated_tokens):
    _, prefill, decode = pair
    long_prompt = prompts()[-1]
    submit(prefill, decode, "first", long_prompt, greedy())
    run(prefill, decode)
    submit(prefill, decode, "again", long_prompt, greedy())  # the prefill side hits its prefix cache
    finished = run(prefill, decode)
    assert finished["again"] == colocated_tokens[-1]
    assert prefill.engine.num_free_blocks == prefill.engine.num_total_blocks


def test_receive_loops_are_kept_across_transfers(pair, colocated_tokens):
    """One receive thread per peer on each side (KV on decode, ACKs on prefill), parked between
    transfers, not one started per transfer (that cost the engine thread 1-2 ms each time)."""
    _, prefill, decode = pair

    def receive_threads() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("kv-recv-")}

    for i, prompt in enumerate(prompts()[:3]):
        submit(prefill, decode, f"r{i}", prompt, greedy())
        assert run(prefill, decode)[f"r{i}"] == colocated_tokens[i]
        if i == 0:
            first = receive_threads()
    assert {t.name for t in first} == {"kv-recv-prefill-0", "kv-recv-decode-0"}
    assert receive_threads() == first and all(t.is_alive() for t in first)


def test_dead_receiver_fails_the_transfer_and_frees_prefill_blocks(pair):
    hub, prefill, decode = pair
    submit(prefill, decode, "doomed", prompts()[-1], greedy())
    hub.kill("decode-0")
    started = time.monotonic()
    while not prefill.is_idle():
        prefill.step()
        assert time.monotonic() - started < 6.0, "sender did not give up within its timeout"
        time.sleep(0.005)
    assert prefill.engine.num_free_blocks == prefill.engine.num_total_blocks


def test_dead_sender_fails_the_transfer_and_frees_decode_blocks(pair):
    hub, prefill, decode = pair
    submit(prefill, decode, "orphan", prompts()[2], greedy())
    hub.kill("prefill-0")
    started = time.monotonic()
    while not decode.is_idle():
        decode.step()
        assert time.monotonic() - started < 6.0
        time.sleep(0.005)
    assert [f.request_id for f in decode.failed] == [
        "orphan"
    ] or decode.engine.num_free_blocks == decode.engine.num_total_blocks
    assert decode.engine.num_free_blocks == decode.engine.num_total_blocks


def test_decode_abort_drops_late_kv_without_writing(pair):
    _, prefill, decode = pair
    submit(prefill, decode, "cancelled", prompts()[3], greedy())
    decode.abort("cancelled")
    assert decode.engine.num_free_blocks == decode.engine.num_total_blocks
    submit(prefill, decode, "next", prompts()[1], greedy())
    # The receiver answers the cancelled transfer's DONE with an ABORT: the prefill frees its
    # blocks then, well before its 5 s acknowledgement timeout.
    finished = run(prefill, decode, timeout=2.5)
    assert "next" in finished and "cancelled" not in finished
    assert prefill.engine.num_free_blocks == prefill.engine.num_total_blocks
    assert decode.engine.num_free_blocks == decode.engine.num_total_blocks


# ---- resharding through the protocol ---------------------------------------------------------
LAYERS, HEADS, BLOCKS = 4, 4, 8


def rank_cache(plan: ParallelPlan, rank: tuple[int, int], full: torch.Tensor | None, shared: bool = False) -> KVCache:
    (l0, l1), (h0, h1) = layer_range(LAYERS, rank[1], plan.pp), head_range(HEADS, rank[0], plan.tp)
    cache = KVCache(
        l1 - l0,
        BLOCKS,
        4,
        h1 - h0,
        8,
        torch.float32,
        torch.device("cpu"),
        shared=shared,
        layer_offset=l0,
        head_offset=h0,
    )
    if full is not None:
        cache.tensor.copy_(full[l0:l1, :, h0:h1])
    return cache


def wait_for(endpoint, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if results := endpoint.poll():
            return results
        time.sleep(0.002)
    raise AssertionError("transfer did not finish")


# Under a sliding window a block table starts with placeholders: the receiver's (blocks its window
# left behind: never sent) or the sender's (blocks it released: the receiver goes on from its
# state, so they are out of its window too). Either way only blocks 1 and 2 move.
RELEASED = {
    "none": ([5, 1, 6], [2, 7, 0]),
    "receiver": ([5, 1, 6], [PLACEHOLDER, 7, 0]),
    "sender": ([PLACEHOLDER, 1, 6], [2, 7, 0]),
}


@pytest.mark.parametrize("released", RELEASED)
@pytest.mark.parametrize("by_reference", [True, False], ids=["by-reference", "packed"])
@pytest.mark.parametrize("src,dst", [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 2), (1, 1)), ((2, 2), (1, 2))])
def test_resharded_transfer_rebuilds_each_decode_rank(src, dst, by_reference, released):
    src_plan, dst_plan = ParallelPlan(*src), ParallelPlan(*dst)
    full = torch.randn(LAYERS, 2, HEADS, BLOCKS, 4, 8, generator=torch.Generator().manual_seed(1))
    hub = InProcessHub()
    src_block_ids, dst_block_ids = RELEASED[released]
    sent = slice(0 if released == "none" else 1, 3)
    receivers, dst_caches = {}, {}
    routes = plan_kv_routes(LAYERS, HEADS, src_plan, dst_plan)
    for rank in dst_plan.ranks():
        cache = rank_cache(dst_plan, rank, None)
        dst_caches[rank] = cache
        receivers[rank] = KVReceiver(InProcessTransport(f"d{rank}", hub), timeout=5)
        receivers[rank].register_kv_cache(cache)
    senders = {}
    for rank in src_plan.ranks():
        senders[rank] = KVSender(InProcessTransport(f"p{rank}", hub), timeout=5)
        senders[rank].register_kv_cache(rank_cache(src_plan, rank, full, shared=by_reference))
    transfer_ids = {
        rank: rx.expect("r", dst_block_ids, {f"p{r.src}": senders[r.src].address() for r in routes if r.dst == rank})
        for rank, rx in receivers.items()
    }
    chunk = SimpleNamespace(
        request=SimpleNamespace(request_id="r", block_ids=src_block_ids),
        start=0,
        num_new_tokens=len(src_block_ids) * 4,
        samples=True,
        generates=False,
    )
    for rank, tx in senders.items():
        targets = [
            KVTarget(f"d{r.dst}", receivers[r.dst].address(), transfer_ids[r.dst], dst_block_ids, r.layers, r.heads)
            for r in routes
            if r.src == rank
        ]
        tx.add("r", targets)
        for local_layer in range(tx.kv_cache.num_layers):
            tx.save_kv_layer(local_layer, [chunk])
        tx.forward_done([chunk])
        tx.finish("r", first_token=3)
    for rank, rx in receivers.items():
        [result] = wait_for(rx)
        assert result.ok and result.first_token == 3
        expected, got = rank_cache(dst_plan, rank, full), dst_caches[rank]
        assert torch.equal(got.export_blocks(dst_block_ids[sent]), expected.export_blocks([5, 1, 6][sent])), (
            f"decode rank {rank}"
        )
        if released == "sender":  # the block it released: never written here
            assert not got.export_blocks(dst_block_ids[:1]).any()
        heads = (got.head_offset, got.head_offset + got.num_kv_heads)
        assert rx.num_bytes_total == got.slice_bytes(got.num_layers, heads, len(dst_block_ids[sent]))
    for tx in senders.values():
        assert all(r.ok for r in wait_for(tx))
    for endpoint in (*senders.values(), *receivers.values()):
        endpoint.close()


def test_prefill_without_targets_frees_its_blocks_after_the_first_token(pair):
    _, prefill, _ = pair
    prefill.kv_timeout = 0.2
    prefill.prefill("alone", prompts()[3], greedy())
    outputs = []
    deadline = time.monotonic() + 5
    while not prefill.is_idle() and time.monotonic() < deadline:
        outputs += prefill.step()
        time.sleep(0.01)
    assert prefill.is_idle(), "blocks held for a transfer that has no destination"
    assert [o.request_id for o in outputs if o.finished] == ["alone"]
    assert prefill.engine.num_free_blocks == prefill.engine.num_total_blocks


def test_a_stale_expectation_does_not_fail_other_transfers_from_the_same_peer():
    """A transfer whose KV never comes expires alone; the pair and its other transfers live on."""
    hub = InProcessHub()
    prefill = PrefillRole(
        EngineConfig(model=MODEL, num_kv_blocks=128), InProcessTransport("prefill-0", hub), kv_timeout=5.0
    )
    decode = DecodeRole(
        EngineConfig(model=MODEL, num_kv_blocks=128), InProcessTransport("decode-0", hub), kv_timeout=5.0
    )
    try:
        # "stale": reserved, but its prefill never comes; it must expire alone (after 1 s, here).
        stale_blocks = decode.engine.reserve_for_remote_prefill("stale", prompts()[1], greedy())
        decode.receiver.expect("stale", stale_blocks, {"prefill-0": prefill.address()}, timeout=1.0)
        decode.requests["stale"] = DecodeRequest(tally=RankTally(1))
        reservation = decode.reserve("live", prompts()[4], greedy(), prefill.kv_layout())
        failed = []
        while not failed:  # the stale one expires on its own
            failed += [f.request_id for f in decode.step() and [] or decode.failed]
            time.sleep(0.05)
        assert failed == ["stale"]
        prefill.prefill("live", prompts()[4], greedy())  # only now does its KV flow
        prefill.set_kv_targets("live", reservation)
        finished = run(prefill, decode, timeout=10)
        assert len(finished["live"]) == 12
        assert decode.engine.num_free_blocks == decode.engine.num_total_blocks
    finally:
        prefill.close()
        decode.close()


def slow_run(prefill: PrefillRole, decode: DecodeRole, step_gap_s: float, failed: list, timeout: float = 30.0) -> dict:
    """`run`, with each prefill step `step_gap_s` apart: a prefill far slower than the kv timeout.
    The decode side's transfer failures go to `failed`."""
    finished: dict[str, list[int]] = {}
    deadline, next_prefill = time.monotonic() + timeout, 0.0
    while not (prefill.is_idle() and decode.is_idle()):
        assert time.monotonic() < deadline, "transfer did not complete"
        if time.monotonic() >= next_prefill:
            prefill.step()
            next_prefill = time.monotonic() + step_gap_s
        for out in decode.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        failed += decode.failed
        time.sleep(0.005)
    return finished


def test_kv_that_keeps_arriving_is_waited_for_however_long_the_prefill(pair, colocated_tokens):
    """The deadline measures lack of progress: a chunked prefill (5 steps here) that takes far
    longer than the kv timeout, each chunk's KV arriving within it, completes."""
    _, prefill, decode = pair
    # Gaps of half the timeout: room for a step slowed by a loaded machine (at 3/4, a step
    # 150 ms slower than usual failed the test on a loaded 2-core host).
    prefill.sender.timeout = decode.receiver.timeout = 1.2
    submit(prefill, decode, "long", prompts()[-1], greedy())
    started, failed = time.monotonic(), []
    finished = slow_run(prefill, decode, step_gap_s=0.6, failed=failed)
    assert time.monotonic() - started > 1.5  # longer than the kv timeout (4 chunks, 3 gaps)
    assert not failed, failed
    assert finished["long"] == colocated_tokens[-1]


@pytest.mark.parametrize("kv_wait_s", [None, 2.0], ids=["fixed-timeout", "predicted-queue"])
def test_the_first_kv_is_waited_for_as_long_as_the_router_predicts(pair, kv_wait_s):
    """A request queued behind others on its prefill instance: its first KV comes late. With the
    router's prediction it is waited for; with only the kv timeout, it fails and frees its blocks."""
    _, prefill, decode = pair
    prefill.sender.timeout = decode.receiver.timeout = 0.4
    prompt = prompts()[3]
    reservation = decode.reserve("queued", prompt, greedy(), prefill.kv_layout(), kv_wait_s)
    busy_until, failed = time.monotonic() + 0.8, []  # the prefill instance is busy with the requests ahead
    while time.monotonic() < busy_until:
        decode.step()  # the decode engine polls its transfers meanwhile
        failed += decode.failed
        time.sleep(0.01)
    prefill.prefill("queued", prompt, greedy())
    prefill.set_kv_targets("queued", reservation)
    finished = slow_run(prefill, decode, step_gap_s=0.0, failed=failed)
    if kv_wait_s is None:
        assert [f.request_id for f in failed] == ["queued"], failed  # by its deadline or its recv's
    else:
        assert list(finished) == ["queued"] and not failed
    assert decode.engine.num_free_blocks == decode.engine.num_total_blocks


def test_a_request_queued_longer_than_the_kv_timeout_lends_its_blocks_for_long_enough(pair, colocated_tokens):
    """Its targets are in force from the first step, but its prefill starts only after a long
    prompt's chunks, later than the sender's timeout. The blocks it lends by reference must stay
    valid from when they are sent, not from when its targets came: else the receiver's copy is
    refused ("copied after the sender stopped holding it") and the request fails over."""
    _, prefill, decode = pair
    # 0.6 s: longer than a step gap (0.3 s) by enough for a loaded machine, shorter than the long prompt's steps.
    prefill.sender.timeout = decode.receiver.timeout = 0.6
    submit(prefill, decode, "long", prompts()[-1], greedy())  # 250 tokens: 4 steps of 64
    reservation = decode.reserve("queued", prompts()[3], greedy(), prefill.kv_layout(), 5.0)
    prefill.prefill("queued", prompts()[3], greedy())
    prefill.set_kv_targets("queued", reservation)
    failed = []
    finished = slow_run(prefill, decode, step_gap_s=0.3, failed=failed)
    assert not failed, failed
    assert finished == {"long": colocated_tokens[-1], "queued": colocated_tokens[3]}
    assert decode.engine.num_free_blocks == decode.engine.num_total_blocks


def test_an_overdue_transfer_wakes_an_idle_engine(pair):
    """Nothing else to do on the decode side: the engine loop steps (and frees the blocks) only
    if the receiver says something is due, so a transfer past its deadline must say so."""
    _, prefill, decode = pair
    decode.receiver.expect("idle", [0, 1], {"prefill-0": prefill.address()}, timeout=0.2)
    assert not decode.receiver.has_finished()
    time.sleep(0.3)
    assert decode.receiver.has_finished()
    assert [r.request_id for r in decode.receiver.poll()] == ["idle"]


def test_both_workers_queue_a_disaggregated_request_by_its_priority(pair, colocated_tokens):
    """The priority the router sends each side is the engine's on each side (both queue it: the
    prefill instance for its prompt, the decode instance for its batch and preemption)."""
    _, prefill, decode = pair
    critical = priority_value("critical")
    reservation = decode.reserve("r", prompts()[1], greedy(), prefill.kv_layout(), None, critical)
    prefill.prefill("r", prompts()[1], greedy(), critical)
    prefill.set_kv_targets("r", reservation)
    decode.submit("local", prompts()[2], greedy(), priority_value("sheddable"))  # prefilled on the decode side
    assert prefill.engine.scheduler.requests["r"].priority == decode.engine.scheduler.requests["r"].priority == critical
    assert decode.engine.scheduler.requests["local"].priority == priority_value("sheddable")
    assert run(prefill, decode) == {"r": colocated_tokens[1], "local": colocated_tokens[2]}
