"""Fuzz: malformed and edge-case gRPC requests beside steady innocent traffic.

Starts `disagg serve` (the default deployment, gRPC on 127.0.0.1), takes the fault-free greedy
output of the innocent requests, then runs `--innocent-clients` closed-loop streams of them
while `--fuzz-clients` threads send `--requests` requests drawn from CASES: bad sampling
parameters, bad or oversized inputs, bad request ids and SLOs, undecodable bytes, and valid edge
cases. Each case names the status code(s) a correct server answers; any other is unexpected.
Innocent streams: failures, wrong outputs, the largest gap between two streamed messages (a
stall; the time to the first one is TTFT, reported apart). After: a good request answered, KV
blocks leaked, the serve process alive.

    .venv/bin/python -m loadtest.faults.fuzz --requests 10000
    .venv/bin/python -m loadtest.faults.fuzz --requests 50 --cases 'slo|~1'   # a repro

The json has each case's codes and its first unexpected answers; the serve log lands beside it.

The last lines are `fuzz requests: N`, `unexpected codes: N`, `innocent failed: N`,
`innocent max stall s: X`, `innocent ttft p99 s behind a max-length prompt / without: X / Y`
(an innocent request is behind one when a max-length prompt, case "ids at limit", was in flight
at any time between its sending and its first token; `--at-limit` sets how many are sent),
`answers after: yes|no`. Exit code 0 whatever was found.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, NamedTuple

import grpc
from google.protobuf.message import DecodeError

from disagg.bench.launcher import Deployment, add_config_argument, leaked_blocks
from disagg.bench.load_client import GrpcApi, LoadRequest, closed_loop, run_loop
from disagg.bench.results import host_line, write_results
from disagg.client import DisaggClient, generate_request
from disagg.v1 import serving_pb2 as pb

PROMPTS = ["Write a story about a dragon.", "Why is the sky blue?"]
BAD, OK = {"INVALID_ARGUMENT"}, {"OK"}
STALL_S = 0.5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--fuzz-clients", type=int, default=8)
    p.add_argument("--innocent-clients", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32, help="of each innocent request")
    p.add_argument("--max-minutes", type=float, default=20.0, help="the fuzz stops drawing after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", default="", help="only the cases whose name matches this regex (a repro)")
    p.add_argument("--at-limit", type=int, default=2, help="max-length prompts (case 'ids at limit') at most")
    p.add_argument("--out", default="loadtest/out/fuzz.json")
    add_config_argument(p)
    return p.parse_args(argv)


# ---- request builders -------------------------------------------------------------------------
def req(prompt="Say hi.", max_tokens=2, slo=None, **kw) -> pb.GenerateRequest:
    """Greedy, 2 tokens: a bad request the server wrongly runs costs little."""
    r = generate_request(prompt, **{"temperature": 0.0, "max_tokens": max_tokens, **kw})
    if slo:
        r.slo.CopyFrom(pb.Slo(**slo))
    return r


def undecodable(rng: random.Random, make: Callable[[random.Random], bytes]) -> bytes:
    """Bytes that really fail to parse as a GenerateRequest (random bytes often parse)."""
    while True:
        data = make(rng)
        try:
            pb.GenerateRequest.FromString(data)
        except DecodeError:
            return data


GOOD = req("Tell me about ancient Rome, its roads and its aqueducts.").SerializeToString()
UNKNOWN_FIELD = b"\x98\x06\x01\xc2\x3e\x03abc"  # field 99 = 1 and field 1000 = "abc": proto3 ignores them
BAD_UTF8 = b"\x12\x02\xff\xfe" + pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=2)).SerializeToString()
# A prompt, then a chat: members of one oneof on the wire, the last one wins (protobuf's rule).
BOTH = GOOD + pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")])).SerializeToString()


class Ctx:
    """What the cases share: the fuzz client, raw-bytes calls, the model's limits."""

    def __init__(self, address: str, vocab: int, max_len: int):
        self.client, self.vocab, self.max_len = DisaggClient(address), vocab, max_len
        channel, same = self.client.channel, lambda b: b  # bytes go out as they are
        self.raw_generate = channel.unary_stream("/disagg.v1.Serving/Generate", same, pb.GenerateResponse.FromString)
        self.raw_abort = channel.unary_unary("/disagg.v1.Serving/Abort", same, pb.AbortResponse.FromString)
        self.unknown_method = channel.unary_unary("/disagg.v1.Serving/Nope", same)
        self.long_spans: list[tuple[float, float]] = []  # (sent, answered) of each max-length prompt, perf_counter s
        self.long_lock = threading.Lock()

    def gen(self, request, timeout=30.0):
        return drain(self.client.stream(request, timeout))

    def raw(self, data: bytes, timeout=30.0):
        return drain(self.raw_generate(data, timeout=timeout))


def drain(stream):
    last = None
    for last in stream:
        pass
    return last


def g(**kw):
    """The case that sends req(**kw)."""
    return lambda c, r: c.gen(req(**kw))


def in_flight(c: Ctx, request_id: str):
    """A 32-token request whose first message is out: it is in flight for a while yet."""
    stream = c.client.stream(req(max_tokens=32, ignore_eos=True, request_id=request_id), timeout=60)
    next(stream)
    return stream


def duplicate_id(c: Ctx, rng) -> str:
    rid = f"dup-{uuid.uuid4().hex}"
    first = in_flight(c, rid)
    try:
        c.gen(req(request_id=rid))
        code = "OK"
    except grpc.RpcError as exc:
        code = exc.code().name
    try:
        drain(first)
    except grpc.RpcError as exc:
        return f"ORIGINAL_{exc.code().name}"  # the duplicate must not disturb the original
    return code


def abort_in_flight(c: Ctx, rng) -> str:
    rid = f"abort-{uuid.uuid4().hex}"
    stream = in_flight(c, rid)
    found, last = c.client.abort(rid), drain(stream)
    if found and last.finish_reason == "abort" or not found and last.finish_reason == "length":
        return "OK"  # aborted, or finished before the Abort came (a race, not a fault)
    return f"OK_found={found}_reason={last.finish_reason}"


def cancel_mid_stream(c: Ctx, rng) -> str:
    stream = in_flight(c, "")
    stream.cancel()  # its blocks must come back all the same (leaked_blocks after)
    drain(stream)  # raises CANCELLED
    return "OK"


def abort_unknown(c: Ctx, request_id: str) -> str:
    return "OK_FOUND" if c.client.abort(request_id) else "OK"


def at_limit(c: Ctx, rng) -> None:
    """max_len - 1 prompt tokens + 1: exactly the context. Random ids: no prefix cache hit.
    Its time in flight is kept: the innocent requests sent meanwhile are behind it."""
    ids = [rng.randrange(c.vocab) for _ in range(c.max_len - 1)]
    sent = time.perf_counter()
    try:
        c.gen(req(prompt_token_ids=ids, max_tokens=1), timeout=180)
    finally:
        with c.long_lock:
            c.long_spans.append((sent, time.perf_counter()))


class Case(NamedTuple):
    name: str
    fn: Callable[[Ctx, random.Random], object]  # returns a code name, or anything for OK; raises RpcError
    expect: set
    weight: float = 1.0  # valid ones generate tokens on 2 cores: drawn less
    limit: int | None = None  # the heavy ones: at most this many


# fmt: off
CASES = [
    Case("temperature<0", g(temperature=-1.0), BAD),
    Case("temperature=nan", g(temperature=math.nan), BAD),
    Case("temperature=inf", g(temperature=math.inf), BAD),
    Case("top_p=0", g(top_p=0.0), BAD),
    Case("top_p>1", g(top_p=1.5), BAD),
    Case("top_p=nan", g(top_p=math.nan), BAD),
    Case("top_k=-2", g(top_k=-2), BAD),
    Case("top_k=vocab+1", lambda c, r: c.gen(req(top_k=c.vocab + 1)), BAD),
    Case("top_k=2**31-1", g(top_k=2**31 - 1), BAD),
    Case("max_tokens=0", g(max_tokens=0), BAD),
    Case("max_tokens<0", g(max_tokens=-5), BAD),
    Case("max_tokens=2**31-1", g(max_tokens=2**31 - 1), BAD),
    Case("stop_token_ids=vocab", lambda c, r: c.gen(req(stop_token_ids=[c.vocab])), BAD),
    Case("stop_token_ids<0", g(stop_token_ids=[-1]), BAD),
    Case("stop=['']", g(stop=[""]), BAD),
    Case("stop x20000", g(stop=[f"s{i}" for i in range(20000)]), BAD, limit=50),  # no bound on the list
    Case("logprobs=21", g(logprobs=21), BAD),
    Case("logprobs<0", g(logprobs=-1), BAD),
    Case("prompt empty", g(prompt=""), BAD),
    Case("prompt blank", g(prompt=" \n\t "), BAD),
    Case("no input", g(prompt=None), BAD),
    Case("chat empty", g(chat=[]), BAD),
    Case("chat role unknown", g(chat=[{"role": "root", "content": "hi"}]), BAD),
    Case("chat role empty", g(chat=[{"role": "", "content": "hi"}]), BAD),
    Case("ids empty", g(prompt_token_ids=[]), BAD),
    Case("ids=vocab", lambda c, r: c.gen(req(prompt_token_ids=[1, c.vocab])), BAD),
    Case("ids<0", g(prompt_token_ids=[-1, 5]), BAD),
    Case("ids=max_len", lambda c, r: c.gen(req(prompt_token_ids=[7] * c.max_len)), BAD),
    Case("ids+max_tokens>max_len", lambda c, r: c.gen(req(prompt_token_ids=[7] * (c.max_len - 1))), BAD),
    Case("text over context", lambda c, r: c.gen(req("hello " * (c.max_len + 100))), BAD, limit=500),
    Case("text 3MB", g(prompt="a" * 3_000_000), BAD, limit=100),
    Case("chat 3MB", g(chat=[{"role": "user", "content": "b" * 3_000_000}]), BAD, limit=100),
    Case("message 5MB", g(prompt="c" * 5_000_000), {"RESOURCE_EXHAUSTED"}, limit=50),  # gRPC's 4 MB bound
    Case("request_id 1MiB", lambda c, r: c.gen(req(request_id=uuid.uuid4().hex * 2**15)), BAD, limit=30),
    Case("request_id ~1", lambda c, r: c.gen(req(request_id=f"{uuid.uuid4().hex}~1")), BAD),  # a migration's suffix
    Case("request_id odd chars", lambda c, r: c.gen(req(request_id=f"a\x00b\n/../€ 🐉{r.random()}")), OK | BAD, 0.3),
    Case("request_id duplicate", duplicate_id, BAD, 0.2, limit=150),
    Case("slo ttft_ms<0", g(slo={"ttft_ms": -1.0}), BAD),
    Case("slo tpot_ms=nan", g(slo={"tpot_ms": math.nan}), BAD),
    Case("bytes random", lambda c, r: c.raw(undecodable(r, lambda r: r.randbytes(r.randint(1, 200)))), BAD),
    Case("bytes truncated", lambda c, r: c.raw(undecodable(r, lambda r: GOOD[: r.randrange(1, len(GOOD))])), BAD),
    Case("bytes bad utf-8", lambda c, r: c.raw(BAD_UTF8), BAD),
    Case("bytes to Abort", lambda c, r: c.raw_abort(b"\xff" * 11, timeout=10), BAD),
    Case("unknown method", lambda c, r: c.unknown_method(b"", timeout=10), {"UNIMPLEMENTED"}),
    Case("Abort unknown id", lambda c, r: abort_unknown(c, uuid.uuid4().hex), OK),
    Case("Abort empty id", lambda c, r: abort_unknown(c, ""), OK),
    Case("ClusterStatus", lambda c, r: c.client.cluster_status(), OK),
    Case("deadline 1 ms", lambda c, r: c.gen(req(), timeout=0.001), {"DEADLINE_EXCEEDED"}),
    # Valid edge cases: OK, and they run.
    Case("unknown fields", lambda c, r: c.raw(GOOD + UNKNOWN_FIELD), OK, 0.2),
    Case("prompt and chat (last wins)", lambda c, r: c.raw(BOTH), OK, 0.2),
    Case("request_id empty", g(request_id=""), OK, 0.2),
    Case("max_tokens=1", g(max_tokens=1), OK, 0.2),
    Case("top_k=1 top_p=1e-6", g(temperature=1.0, top_k=1, top_p=1e-6), OK, 0.2),
    Case("top_k=vocab", lambda c, r: c.gen(req(temperature=0.7, top_k=c.vocab)), OK, 0.2),
    Case("seed=-2**63 logprobs=20", g(temperature=1.0, seed=-(2**63), logprobs=20), OK, 0.2),
    Case("ids edge", lambda c, r: c.gen(req(prompt_token_ids=[0, c.vocab - 1])), OK, 0.2),
    Case("abort in flight", abort_in_flight, OK, 0.2, limit=150),
    Case("cancel mid-stream", cancel_mid_stream, {"CANCELLED"}, 0.2, limit=150),
    Case("ids at limit", at_limit, OK, 1.0, limit=2),  # the one long case: ~8k tokens of prefill, tens of s
]
# fmt: on


def schedule(n: int, rng: random.Random, pattern: str, at_limit_count: int = 2) -> list[Case]:
    """n cases drawn by weight, none past its limit (the max-length prompts' is `at_limit_count`)."""
    drawn, counts, cases = [], Counter(), [c for c in CASES if re.search(pattern, c.name)]
    limits = {c.name: (at_limit_count if c.fn is at_limit else c.limit) for c in cases}
    cases = [c for c in cases if limits[c.name] != 0]
    while len(drawn) < n and any(limits[c.name] is None or counts[c.name] < limits[c.name] for c in cases):
        case = rng.choices(cases, weights=[c.weight for c in cases])[0]
        if limits[case.name] is None or counts[case.name] < limits[case.name]:
            counts[case.name] += 1
            drawn.append(case)
    return drawn


def call(case: Case, c: Ctx, rng: random.Random) -> tuple[str, str]:
    """(status code name, its details)."""
    try:
        got = case.fn(c, rng)
        return (got if isinstance(got, str) else "OK"), ""
    except grpc.RpcError as exc:
        return exc.code().name, (exc.details() or "")[:300]
    except Exception as exc:  # the client side broke (e.g. a stream that ended without a message)
        return f"CLIENT_{type(exc).__name__}", str(exc)[:300]


# ---- innocent traffic -------------------------------------------------------------------------
class Innocent:
    """The closed loop (disagg.bench.load_client) of greedy streams, each on a connection of its
    own (fuzz traffic cannot block it client-side), in a thread of its own until stopped; then
    every output checked, every gap between streamed messages measured (`tally`)."""

    def __init__(self, address: str, max_tokens: int, clients: int):
        self.stop, self.zero, self.run = threading.Event(), time.perf_counter(), None
        requests = [LoadRequest(innocent_request(p, max_tokens)) for p in PROMPTS]
        api = GrpcApi(address, connections=clients, timeout_s=300)
        loop = lambda: run_loop(api, closed_loop, requests, clients, self.stop.is_set, self.zero)  # noqa: E731
        self.thread = threading.Thread(target=lambda: setattr(self, "run", loop()), daemon=True)

    def tally(self, reference: list[list[int]]) -> None:
        """completed, wrong, failed (by code) and the first failures' details; the longest gap
        between two streamed messages (a stall) and how many messages came before it, the streams
        that stalled over STALL_S, the longest TTFT; (sent, first token) of each, perf_counter s."""
        self.completed = self.wrong = self.stalled = self.max_stall_after = 0
        self.failed, self.examples, self.max_stall, self.max_ttft, self.ttfts = Counter(), [], 0.0, 0.0, []
        for r in self.run.records if self.run else []:
            if not r.success:
                self.failed[r.error_code] += 1
                if len(self.examples) < 5:
                    self.examples.append(f"after {r.e2el:.1f} s: {r.error}")
                continue
            times = sorted(set(r.token_times))  # one per message that carried tokens
            gaps = [b - a for a, b in zip(times, times[1:])]
            self.completed += 1
            self.wrong += r.token_ids != reference[r.index % len(PROMPTS)]
            self.max_ttft = max(self.max_ttft, r.ttft)
            self.ttfts.append((self.zero + r.sent_at, self.zero + r.sent_at + r.ttft))
            if gaps and max(gaps) > self.max_stall:
                self.max_stall, self.max_stall_after = max(gaps), 1 + gaps.index(max(gaps))
            self.stalled += any(g > STALL_S for g in gaps)


def innocent_request(prompt: str, max_tokens: int):
    return generate_request(prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def probe_limits(client: DisaggClient) -> tuple[int, int]:
    """The vocabulary size and context length, read from the server's own refusals."""

    def message(request) -> str:
        try:
            drain(client.stream(request, timeout=30))
        except grpc.RpcError as exc:
            return exc.details()
        sys.exit("the probe request was not refused")

    vocab = re.search(r"\[0, (\d+)\)", message(req(prompt_token_ids=[2**31 - 1])))
    max_len = re.search(r"context \((\d+) tokens\)", message(req(prompt_token_ids=[1], max_tokens=2**31 - 1)))
    return int(vocab.group(1)), int(max_len.group(1))


def main(argv=None) -> int:
    args = parse_args(argv)
    print(host_line(), flush=True)
    with Deployment({}, base=args.config, name="fuzz") as dep:
        try:
            run(args, dep)
        finally:
            dep.stop()
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).with_suffix(".serve.log").write_bytes(dep.log.read_bytes())  # for the findings
    return 0


def run(args, dep: Deployment) -> None:
    c = Ctx(dep.address, *probe_limits(DisaggClient(dep.address)))
    reference = [c.client.generate(innocent_request(p, args.max_tokens), timeout=300)[0] for p in PROMPTS]
    workers_before = sorted(dep.workers())
    innocent = Innocent(dep.address, args.max_tokens, args.innocent_clients)
    threads = [innocent.thread]
    seen: dict[str, Counter] = defaultdict(Counter)
    lock, started = threading.Lock(), time.monotonic()
    deadline = started + args.max_minutes * 60
    plan = schedule(args.requests, random.Random(args.seed), args.cases, args.at_limit)
    examples: dict[str, list] = defaultdict(list)  # the first few unexpected answers of each case

    def fuzz(k: int) -> None:
        rng = random.Random(args.seed * 1000 + k)
        for case in plan[k :: args.fuzz_clients]:
            if time.monotonic() > deadline:
                return
            code, details = call(case, c, rng)
            with lock:
                seen[case.name][code] += 1
                if code not in case.expect and len(examples[case.name]) < 3:
                    examples[case.name].append(f"{code}: {details}")
                done = sum(sum(v.values()) for v in seen.values())
            if done % 1000 == 0:
                print(f"{done} fuzz requests, {time.monotonic() - started:.0f} s", flush=True)

    threads += [threading.Thread(target=fuzz, args=(k,), daemon=True) for k in range(args.fuzz_clients)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    fuzz_s = time.monotonic() - started
    innocent.stop.set()
    innocent.thread.join(timeout=320)
    innocent.tally(reference)
    try:
        answers = c.client.generate(innocent_request(PROMPTS[0], args.max_tokens), timeout=60)[0] == reference[0]
    except grpc.RpcError:
        answers = False
    # A decode instance may keep a cancelled request's blocks until its KV wait times out (30 s):
    # held now, and leaked (still held a minute on).
    held, alive = leaked_blocks(c.client, 0), dep.process.poll() is None and sorted(dep.workers()) == workers_before
    behind = ttfts_behind(innocent.ttfts, c.long_spans)
    report(args, seen, examples, innocent, answers, (held, leaked_blocks(c.client, 60)), alive, fuzz_s, behind)


def ttfts_behind(ttfts: list[tuple[float, float]], long_spans: list[tuple[float, float]]) -> dict[str, list[float]]:
    """The innocent TTFTs (s), split: "behind" a max-length prompt in flight at any time between
    the request's sending and its first token, or "without" one."""
    split: dict[str, list[float]] = {"behind": [], "without": []}
    for sent, first in ttfts:
        overlaps = any(start < first and sent < end for start, end in long_spans)
        split["behind" if overlaps else "without"].append(first - sent)
    return split


def p99(values: list[float]) -> float:
    """The 99th percentile (nearest rank); nan for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def report(
    args, seen, examples, innocent: Innocent, answers, blocks: tuple, alive: bool, fuzz_s: float, behind: dict
) -> None:
    cases, unexpected = {}, 0
    for case in CASES:
        codes = seen.get(case.name, Counter())
        bad = sum(n for code, n in codes.items() if code not in case.expect)
        unexpected += bad
        cases[case.name] = {
            "sent": sum(codes.values()), "codes": dict(codes), "expected": sorted(case.expect), "unexpected": bad,
            "unexpected_examples": examples.get(case.name, []),
        }  # fmt: skip
        print(f"{case.name:28s} {sum(codes.values()):6d}  {dict(codes)}  {bad}")
    sent = sum(v["sent"] for v in cases.values())
    result = {
        "args": vars(args), "fuzz_requests": sent, "fuzz_s": round(fuzz_s, 1), "unexpected_codes": unexpected,
        "cases": cases, "innocent_completed": innocent.completed, "innocent_failed": dict(innocent.failed),
        "innocent_failures": innocent.examples,
        "innocent_wrong": innocent.wrong, "innocent_streams_stalled": innocent.stalled,
        "innocent_max_stall_s": round(innocent.max_stall, 3),
        "innocent_max_stall_after_messages": innocent.max_stall_after, "innocent_max_ttft_s": round(innocent.max_ttft, 3),
        "innocent_ttft_s_behind_max_length": [round(t, 3) for t in behind["behind"]],
        "innocent_ttft_p99_s_behind_max_length": round(p99(behind["behind"]), 3),
        "innocent_ttft_p99_s_without": round(p99(behind["without"]), 3),
        "answers_after": answers, "blocks_held_after": blocks[0], "leaked_blocks": blocks[1], "serve_alive": alive,
    }  # fmt: skip
    write_results(args.out, result)
    print(f"fuzz took {fuzz_s:.0f} s; innocent: {innocent.completed} completed, {innocent.wrong} wrong,")
    print(
        f"  {innocent.stalled} streams stalled over {STALL_S} s (the longest after message {innocent.max_stall_after}),"
    )
    print(f"  max TTFT {innocent.max_ttft:.2f} s")
    print(
        f"KV blocks held after: {blocks[0]}, a minute on (leaked): {blocks[1]}; serve alive: {'yes' if alive else 'no'}"
    )
    print(f"fuzz requests: {sent}")
    print(f"unexpected codes: {unexpected}")
    print(f"innocent failed: {sum(innocent.failed.values())}")
    print(f"innocent max stall s: {innocent.max_stall:.3f}")
    print(f"innocent requests behind a max-length prompt / without: {len(behind['behind'])} / {len(behind['without'])}")
    print(
        f"innocent ttft p99 s behind a max-length prompt / without: {p99(behind['behind']):.3f} / "
        f"{p99(behind['without']):.3f}"
    )
    print(f"answers after: {'yes' if answers else 'no'}")


if __name__ == "__main__":
    sys.exit(main())
