"""Structured output's cost, over gRPC against the default deployment (issue 37).

`disagg serve` (1 prefill + 1 decode instance of the default model, on 127.0.0.1) twice: with
jump-forward (the default) and without (`engine.jump_forward: false`). In each, `--streams`
closed-loop clients send chat requests in alternating rounds, so that drift on the machine
falls on every kind alike:

- free: the question unconstrained (EOS ignored, `--max-tokens` tokens);
- schema: the same question under a small JSON schema (a city: name, population, capital);
- long keys: under a schema whose keys are long and fixed (what jump-forward skips).

TPOT is each request's (last token - first token) / (tokens - 1), as the client sees it. Prints
`tpot ratio schema/free` without jump-forward (the mask's own cost, target <= 1.10) and with it,
and `e2e ratio jump-forward/without` for the long-key schema (greedy: the same output both ways,
checked).

    .venv/bin/python -m loadtest.service.structured [--streams 8] [--requests 24] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

from disagg.bench.launcher import Deployment, add_config_argument
from disagg.bench.load_client import GrpcApi, LoadRequest, closed_loop
from disagg.bench.metrics import RequestRecord
from disagg.bench.results import host_line, write_results
from disagg.client import generate_request
from disagg.v1 import serving_pb2

CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Quito", "Rome", "Seoul", "Accra", "Hanoi", "Bern"]
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "population_in_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        "is_capital_city": {"type": "boolean"},
    },
    "required": ["name", "population_in_millions", "is_capital_city"],
    "additionalProperties": False,
}
LONG_KEYS = [
    "the_official_name_of_the_city_in_the_english_language",
    "the_name_of_the_country_that_this_city_belongs_to_today",
    "whether_or_not_this_city_is_the_capital_of_its_country",
]
LONG_KEY_SCHEMA = {
    "type": "object",
    "properties": {
        LONG_KEYS[0]: {"type": "string", "maxLength": 20},
        LONG_KEYS[1]: {"type": "string", "maxLength": 20},
        LONG_KEYS[2]: {"type": "boolean"},
    },
    "required": LONG_KEYS,
    "additionalProperties": False,
}


def request_of(kind: str, city: str, max_tokens: int) -> LoadRequest:
    question = [{"role": "user", "content": f"Describe {city} as JSON."}]
    if kind == "free":
        return LoadRequest(generate_request(chat=question, temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    schema = CITY if kind == "schema" else LONG_KEY_SCHEMA
    structured = serving_pb2.StructuredOutput(json_schema=json.dumps(schema))
    return LoadRequest(
        generate_request(chat=question, temperature=0.0, max_tokens=4 * max_tokens, structured=structured)
    )


def outcome(record: RequestRecord) -> dict:
    """TPOT as the client sees it, (last token - first token) / (tokens - 1); e2e; what came back."""
    if not record.success:
        raise RuntimeError(f"a request failed: {record.error_code}: {record.error}")
    times, tokens = record.token_times, record.output_len
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None
    return {"tpot": tpot, "e2e": record.e2el, "tokens": tokens, "text": record.text}


async def measure(address: str, args) -> dict[str, list[dict]]:
    seen: dict[str, list[dict]] = {"free": [], "schema": [], "long keys": []}
    async with GrpcApi(address) as api:
        warm = [request_of("schema", "Paris", args.max_tokens), request_of("long keys", "Paris", args.max_tokens)]
        await closed_loop(api, warm, streams=1)  # compile the grammars once
        for _ in range(args.rounds):
            for kind in seen:
                cities = [CITIES[i % len(CITIES)] for i in range(args.requests)]
                run = await closed_loop(api, [request_of(kind, city, args.max_tokens) for city in cities], args.streams)
                seen[kind].extend(outcome(r) for r in run.records)
    return seen


def serve_and_measure(args, jump_forward: bool) -> dict[str, list[dict]]:
    settings = {
        "calibration_s": 0,
        "max_inflight_requests": 64,
        "replan": False,
        "engine": {"jump_forward": jump_forward},
    }
    with Deployment(settings, base=args.config) as dep:
        return asyncio.run(measure(dep.address, args))


def summary(results: list[dict]) -> dict:
    return {
        "tpot_ms": statistics.median(r["tpot"] for r in results if r["tpot"] is not None) * 1e3,
        "e2e_s": statistics.median(r["e2e"] for r in results),
        "tokens": statistics.mean(r["tokens"] for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--requests", type=int, default=24, help="per kind and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32, help="of a free request (a schema's: until it closes)")
    p.add_argument("--json", help="write the figures here too")
    add_config_argument(p)
    args = p.parse_args(argv)
    print(host_line(), flush=True)
    runs = {jump: serve_and_measure(args, jump) for jump in (False, True)}
    figures = {f"jump_forward={jump}": {k: summary(v) for k, v in seen.items()} for jump, seen in runs.items()}
    for label, kinds in figures.items():
        for kind, s in kinds.items():
            print(
                f"{label} {kind}: TPOT p50 {s['tpot_ms']:.1f} ms, e2e p50 {s['e2e_s']:.2f} s, {s['tokens']:.1f} tokens"
            )
    off, on = figures["jump_forward=False"], figures["jump_forward=True"]
    print(
        f"tpot ratio schema/free (mask only, jump-forward off): {off['schema']['tpot_ms'] / off['free']['tpot_ms']:.3f}"
    )
    print(f"tpot ratio schema/free (jump-forward on): {on['schema']['tpot_ms'] / on['free']['tpot_ms']:.3f}")
    same = [a["text"] for a in runs[True]["long keys"]] == [b["text"] for b in runs[False]["long keys"]]
    print(f"long-key outputs identical with and without jump-forward: {same}")
    print(f"e2e ratio jump-forward/without (long keys): {on['long keys']['e2e_s'] / off['long keys']['e2e_s']:.3f}")
    if args.json:
        write_results(args.json, {"figures": figures, "identical": same}, args)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
