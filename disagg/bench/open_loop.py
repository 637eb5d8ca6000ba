"""The open-loop benchmark behind `disagg bench`: requests arrive on a Poisson (or gamma, for
burstiness) schedule whatever the server's progress, as vLLM's `bench serve`.

Arrival gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): burstiness 1 is Poisson,
below 1 burstier, above 1 more regular; rate inf sends everything at once. The schedule is
absolute (request i is due at start + t_i), so slow sends do not stretch it. With a concurrency
cap a due request waits for a free slot, and its latencies count from when it is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import platform
import time
from dataclasses import dataclass

import grpc
import numpy as np

from disagg.bench.metrics import RequestRecord, TokenTimer, summarize
from disagg.bench.workloads import BenchRequest
from disagg.client import api_key_metadata, generate_request, tls_credentials
from disagg.v1 import serving_pb2_grpc


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf  # requests/s
    burstiness: float = 1.0
    num_requests: int | None = 100  # or a duration
    duration_s: float | None = None
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0  # per request
    temperature: float = 0.0

    def __post_init__(self):
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of num_requests and duration")
        if not self.request_rate > 0 or not self.burstiness > 0:
            raise ValueError("request_rate and burstiness must be > 0")
        if self.duration_s is not None and math.isinf(self.request_rate):
            raise ValueError("a duration needs a finite request rate")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")


def arrival_times(load: LoadConfig) -> list[float]:
    """Seconds after the start at which each request is due (the first at 0, as vLLM)."""
    if math.isinf(load.request_rate):
        return [0.0] * load.num_requests
    rng = np.random.default_rng(load.seed)
    gaps = lambda n: rng.gamma(load.burstiness, 1.0 / (load.request_rate * load.burstiness), n)  # noqa: E731
    if load.num_requests is not None:
        return np.concatenate([[0.0], np.cumsum(gaps(load.num_requests - 1))])[: load.num_requests].tolist()
    times = [0.0]
    while True:
        for gap in gaps(64):
            if times[-1] + gap >= load.duration_s:
                return times
            times.append(times[-1] + float(gap))


def run_benchmark(
    address: str,
    requests: list[BenchRequest],
    load: LoadConfig,
    slo: dict[str, float] | None = None,
    api_key: str | None = None,
    tls_ca: str | None = None,
) -> dict:
    """Send `requests` on `load`'s schedule (cycling through them for a duration); the result
    dict (metadata, summary and every request's record), ready to save as JSON."""
    arrivals = arrival_times(load)
    records, duration = asyncio.run(_run(address, requests, arrivals, load, api_key, tls_ca))
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "address": address,
        "machine": machine_info(),
        "load": {
            "request_rate": load.request_rate if math.isfinite(load.request_rate) else "inf",
            "burstiness": load.burstiness,
            "num_requests": len(arrivals),
            "duration_s": load.duration_s,
            "max_concurrency": load.max_concurrency,
            "seed": load.seed,
            "temperature": load.temperature,
        },
        "summary": summarize(records, duration, slo),
        "requests": [r.to_dict() for r in records],
    }


async def _run(
    address: str,
    requests: list[BenchRequest],
    arrivals: list[float],
    load: LoadConfig,
    api_key: str | None,
    tls_ca: str | None,
) -> tuple[list[RequestRecord], float]:
    if not requests and arrivals:
        raise ValueError("the workload is empty")
    options = [("grpc.max_receive_message_length", 64 << 20)]
    metadata = api_key_metadata(api_key)
    credentials = tls_credentials(tls_ca)
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    channel = (
        grpc.aio.insecure_channel(address, options=options)
        if credentials is None
        else grpc.aio.secure_channel(address, credentials, options=options)
    )
    async with channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=30)
        stub = serving_pb2_grpc.ServingStub(channel)
        started = time.perf_counter()
        tasks = []
        for i, due in enumerate(arrivals):
            await asyncio.sleep(max(0.0, started + due - time.perf_counter()))
            req = requests[i % len(requests)]
            record = RequestRecord(
                index=i, prompt_len=req.prompt_len, target_output_len=req.output_len, request_id=f"bench-{i}"
            )
            tasks.append(asyncio.create_task(_send(stub, req, record, started, slots, load, metadata)))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - started


async def _send(
    stub, req: BenchRequest, record: RequestRecord, bench_start: float, slots, load: LoadConfig, metadata
) -> RequestRecord:
    async with slots or contextlib.nullcontext():
        message = generate_request(
            req.prompt,
            request_id=record.request_id,
            temperature=load.temperature,
            max_tokens=req.output_len,
            ignore_eos=True,
        )
        sent = time.perf_counter()
        record.sent_at = sent - bench_start
        timer = TokenTimer(sent)
        try:
            async for msg in stub.Generate(message, timeout=load.timeout_s, metadata=metadata):
                timer.on_message(len(msg.token_ids), time.perf_counter())
                if msg.finished:
                    record.finish_reason = msg.finish_reason
                    record.server = server_fields(msg)
            if record.finish_reason:
                return timer.finish(record, time.perf_counter())
            record.error_code, record.error = "UNKNOWN", "the stream ended without a final message"
        except grpc.aio.AioRpcError as exc:
            record.error_code, record.error = exc.code().name, exc.details() or ""
        except Exception as exc:  # noqa: BLE001 -- one broken request must not end the run
            record.error_code, record.error = "CLIENT_ERROR", f"{type(exc).__name__}: {exc}"
        record.e2el = time.perf_counter() - sent
        return record


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


def machine_info() -> dict:
    import os

    memory_gib = None
    with contextlib.suppress(OSError, ValueError):
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "cpus": os.cpu_count(),
        "memory_gib": memory_gib,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }
