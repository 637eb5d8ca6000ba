"""The one load client of the benchmarks: requests sent over gRPC (`Generate`) or the
OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`, streamed), in an open
loop (each request due at its arrival time, whatever the server's progress, as vLLM's `bench
serve`) or a closed loop (`streams` clients, each sending its next request as its last one ends),
every request timed as `bench serve` times it (disagg.bench.metrics.RequestRecord).

A request is described once, as the public API's `GenerateRequest` (disagg.client.
generate_request): the gRPC API gets it as it is, the HTTP API the same request as JSON.

    async with GrpcApi(address) as api:
        run = await closed_loop(api, requests, streams=8)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import grpc

from disagg.bench.metrics import RequestRecord, TokenTimer
from disagg.bench.openai_stream import StreamTimer
from disagg.client import api_key_metadata, generate_request, tls_credentials
from disagg.v1 import serving_pb2, serving_pb2_grpc

CONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class LoadRequest:
    message: serving_pb2.GenerateRequest  # what is sent
    prompt_len: int = 0  # its prompt's tokens, for the record (0: not known here)

    @property
    def max_tokens(self) -> int:
        return self.message.sampling.max_tokens


def load_requests(bench_requests, temperature: float = 0.0, ignore_eos: bool = True) -> list[LoadRequest]:
    """A workload's requests (disagg.bench.workloads.BenchRequest): its text, its output length."""
    return [
        LoadRequest(
            generate_request(r.prompt, temperature=temperature, max_tokens=r.output_len, ignore_eos=ignore_eos),
            r.prompt_len,
        )
        for r in bench_requests
    ]


@dataclass
class LoadRun:
    """What one loop sent and got: every request's record (in the order of the requests sent),
    from its start to its last request's end."""

    records: list[RequestRecord]
    duration_s: float
    started_at: float  # time.time() at its start

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.success]


# ---- the two APIs ---------------------------------------------------------------------------------
class GrpcApi:
    """`Generate` over `connections` channels to one frontend or several (client lane k sends
    through channel k mod N, channel i to address i mod the addresses). With `failover`, a
    request that fails is sent once more through the next channel (another frontend, where there
    are several), as a client of a replicated deployment would."""

    name = "grpc"

    def __init__(
        self,
        addresses: str | list[str],
        *,
        api_key: str | None = None,
        tls_ca: str | None = None,
        connections: int = 1,
        timeout_s: float = 600.0,
        failover: bool = False,
    ):
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        self.failover = failover
        self.metadata = api_key_metadata(api_key)
        self.credentials = tls_credentials(tls_ca)
        self.connections = max(connections, len(self.addresses))
        self.timeout_s = timeout_s
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[serving_pb2_grpc.ServingStub] = []
        self._targets: list[str] = []  # each channel's address

    async def __aenter__(self) -> GrpcApi:
        options = [("grpc.max_receive_message_length", 64 << 20)]
        if self.connections > 1:  # separate connections, as separate clients would open
            options.append(("grpc.use_local_subchannel_pool", 1))
        for i in range(self.connections):
            address = self.addresses[i % len(self.addresses)]
            self._targets.append(address)
            self._channels.append(
                grpc.aio.insecure_channel(address, options=options)
                if self.credentials is None
                else grpc.aio.secure_channel(address, self.credentials, options=options)
            )
        await asyncio.gather(*(asyncio.wait_for(c.channel_ready(), CONNECT_TIMEOUT_S) for c in self._channels))
        self._stubs = [serving_pb2_grpc.ServingStub(c) for c in self._channels]
        return self

    async def __aexit__(self, *exc) -> None:
        for channel in self._channels:
            await channel.close(grace=None)

    async def send(self, request: LoadRequest, record: RequestRecord, zero: float, lane: int = 0) -> RequestRecord:
        """Stream one request; its record filled (a failure is a record too, never an exception).
        `zero`: the loop's start (perf_counter), which `sent_at` and `token_times` count from."""
        record = await self._send(request, record, zero, lane)
        if record.success or not self.failover or len(self._stubs) < 2:
            return record
        again = await self._send(request, new_record(record.index, request), zero, lane + 1)
        again.retried = True
        return again

    async def _send(self, request: LoadRequest, record: RequestRecord, zero: float, lane: int) -> RequestRecord:
        stub, target = self._stubs[lane % len(self._stubs)], self._targets[lane % len(self._stubs)]
        sent = time.perf_counter()
        record.sent_at = sent - zero
        timer = TokenTimer(sent)
        try:
            async for msg in stub.Generate(request.message, timeout=self.timeout_s, metadata=self.metadata):
                now = time.perf_counter()
                timer.on_message(len(msg.token_ids), now)
                _received(record, msg, now - zero)
            if record.finish_reason:
                record.server["frontend"] = target  # which of a deployment's frontends answered
                return timer.finish(record, time.perf_counter())
            record.error_code, record.error = "UNKNOWN", "the stream ended without a final message"
        except grpc.aio.AioRpcError as exc:
            record.error_code, record.error = exc.code().name, exc.details() or ""
        except Exception as exc:  # noqa: BLE001 -- one broken request must not end the run
            record.error_code, record.error = "CLIENT_ERROR", f"{type(exc).__name__}: {exc}"
        record.e2el = time.perf_counter() - sent
        return record


def _received(record: RequestRecord, msg, at: float) -> None:
    record.request_id = record.request_id or msg.request_id  # the server's name for it, where we gave none
    record.token_ids += msg.token_ids
    record.token_times += [at] * len(msg.token_ids)
    record.text += msg.text
    if msg.finished:
        record.finish_reason = msg.finish_reason
        record.server = server_fields(msg)


def server_fields(msg) -> dict:
    """Usage and timings of a final response message, as plain data."""
    u, t = msg.usage, msg.timings
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "cached_prompt_tokens": u.cached_prompt_tokens,
        "queue_s": t.queue_s,
        "prefill_s": t.prefill_s,
        "transfer_s": t.transfer_s,
        "decode_s": t.decode_s,
        "ttft_s": t.ttft_s,
        "e2e_s": t.e2e_s,
        "prefill_instance": t.prefill_instance,
        "decode_instance": t.decode_instance,
        "predicted_ttft_s": t.predicted_ttft_s,
        "predicted_tpot_s": t.predicted_tpot_s,
    }


class HttpApi:
    """The OpenAI-compatible API at `url` (disagg's, or another server's such as llama.cpp's):
    a chat request to /v1/chat/completions, any other to /v1/completions, streamed with usage.
    `model`: what each body names (None: the first of the server's GET /v1/models).
    `connection_per_request`: a fresh connection each time (a server that may close a kept-alive
    one as the next request goes out on it, as llama-server does)."""

    name = "http"

    def __init__(
        self, url: str, *, model: str | None = None, timeout_s: float = 600.0, connection_per_request: bool = False
    ):
        self.url, self.model, self.timeout_s = url.rstrip("/"), model, timeout_s
        self.connection_per_request = connection_per_request
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HttpApi:
        connector = aiohttp.TCPConnector(limit=0, force_close=self.connection_per_request)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        if self.model is None:
            async with self._session.get(f"{self.url}/v1/models") as response:
                response.raise_for_status()
                self.model = (await response.json())["data"][0]["id"]
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def send(self, request: LoadRequest, record: RequestRecord, zero: float, lane: int = 0) -> RequestRecord:
        path, body = http_body(request.message, self.model)
        sent = time.perf_counter()
        record.sent_at = sent - zero
        stream = StreamTimer(sent, zero)
        try:
            async with self._session.post(f"{self.url}{path}", json=body) as response:
                if response.status != 200:
                    return _refused(record, response.status, await response.text(), sent)
                async for line in response.content:
                    stream.on_line(line, time.perf_counter())
            return stream.finish(record, time.perf_counter())
        except asyncio.TimeoutError:
            record.error_code, record.error = "DEADLINE_EXCEEDED", f"no answer in {self.timeout_s:g} s"
        except (aiohttp.ClientError, ValueError) as exc:  # no answer, or not one we can read
            record.error_code, record.error = "UNAVAILABLE", f"{type(exc).__name__}: {exc}"
        record.e2el = time.perf_counter() - sent
        return record


def _refused(record: RequestRecord, status: int, text: str, sent: float) -> RequestRecord:
    """An answer that is not a stream: its error's code (disagg's HTTP API names it as gRPC does)."""
    error = {}
    with contextlib.suppress(ValueError, AttributeError):
        error = json.loads(text).get("error") or {}
    record.error_code = str(error.get("code") or f"HTTP_{status}").upper()
    record.error = error.get("message", "") or text[:200]
    record.e2el = time.perf_counter() - sent
    return record


def http_body(message: serving_pb2.GenerateRequest, model: str) -> tuple[str, dict]:
    """(path, JSON body) of the OpenAI request that asks what `message` asks over gRPC."""
    sampling = message.sampling
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens", "logprobs"):
        if sampling.HasField(name):
            body[name] = getattr(sampling, name)
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    if message.slo.ttft_ms or message.slo.tpot_ms:
        body["slo"] = {k: v for k, v in (("ttft_ms", message.slo.ttft_ms), ("tpot_ms", message.slo.tpot_ms)) if v}
    kind = message.WhichOneof("input")
    if kind == "chat":
        body["messages"] = [{"role": m.role, "content": m.content} for m in message.chat.messages]
        return "/v1/chat/completions", body
    body["prompt"] = list(message.prompt_token_ids.ids) if kind == "prompt_token_ids" else message.prompt
    return "/v1/completions", body


# ---- the two loops --------------------------------------------------------------------------------
def new_record(index: int, request: LoadRequest) -> RequestRecord:
    rid = request.message.request_id
    return RequestRecord(
        index=index, prompt_len=request.prompt_len, target_output_len=request.max_tokens, request_id=rid
    )


async def open_loop(
    api, requests: list[LoadRequest], arrivals: list[float], max_concurrency: int | None = None
) -> LoadRun:
    """Request i (cycling through `requests`) sent `arrivals[i]` seconds after the start (an
    absolute schedule: slow sends do not stretch it); with `max_concurrency`, a due request waits
    for a free slot, and its latencies count from when it is sent."""
    if arrivals and not requests:
        raise ValueError("the workload is empty")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    zero, wall = time.perf_counter(), time.time()

    async def one(i: int, due: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, zero + due - time.perf_counter()))
        request = requests[i % len(requests)]
        async with slots:
            return await api.send(request, new_record(i, request), zero, lane=i)

    records = await asyncio.gather(*(one(i, due) for i, due in enumerate(arrivals)))
    return LoadRun(list(records), time.perf_counter() - zero, wall)


async def closed_loop(
    api, requests: list[LoadRequest], streams: int, until: Callable[[], bool] | None = None, zero: float | None = None
) -> LoadRun:
    """`streams` clients taking the requests in order (client k on lane k), each sending its next
    as its last ends, until every request was sent once; with `until`, cycling through them until
    it says so. `zero`: the perf_counter the records' times count from (None: the loop's start),
    for a caller that relates them to what else it timed."""
    if streams < 1 or not requests:
        raise ValueError("a closed loop needs at least one stream and one request")
    records: list[RequestRecord] = []
    cursor = iter(range(10**12) if until else range(len(requests)))
    start, wall = time.perf_counter(), time.time()
    zero = start if zero is None else zero

    async def client(lane: int) -> None:
        for i in cursor:
            if until is not None and until():
                return
            request = requests[i % len(requests)]
            records.append(await api.send(request, new_record(i, request), zero, lane))

    await asyncio.gather(*(client(lane) for lane in range(streams)))
    return LoadRun(sorted(records, key=lambda r: r.index), time.perf_counter() - start, wall)


def run_loop(api, loop: Callable, *args, **kwargs):
    """`loop(api, ...)` (a loop, or anything that sends through `api`, such as measure_capacity)
    on a fresh event loop, with `api` opened around it: for scripts that are not asynchronous."""

    async def opened():
        async with api:
            return await loop(api, *args, **kwargs)

    return asyncio.run(opened())
