"""Writes a trace of a workload that shifts: prefill-heavy (long prompts, short outputs), then
decode-heavy (short prompts, long outputs), then prefill-heavy again, each phase `--phase-s`
seconds of Poisson arrivals. `disagg simulate --trace` replays it; with `--replan` it says what
re-planning gains over every static split (disagg.planner.replan_sim).

    python -m loadtest.planner.shifting_trace -o /tmp/shift.json
    disagg simulate --trace /tmp/shift.json --config CONFIG --profile deploy/profiles/smollm2-135m-cpu-1t.json --replan
"""

from __future__ import annotations

import argparse
import json
import random
import sys


def shifting_rows(phase_s: float, prefill_rate: float, decode_rate: float, seed: int = 0) -> list[dict]:
    phases = [
        (prefill_rate, (700, 900), (4, 8)),
        (decode_rate, (20, 40), (150, 200)),
        (prefill_rate, (700, 900), (4, 8)),
    ]
    rng, rows, start = random.Random(seed), [], 0.0
    for rate, prompt, output in phases:
        t = start
        while t < start + phase_s:
            rows.append(
                {"arrival_s": round(t, 4), "prompt_len": rng.randint(*prompt), "output_len": rng.randint(*output)}
            )
            t += rng.expovariate(rate)
        start += phase_s
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase-s", type=float, default=90.0)
    p.add_argument("--prefill-rate", type=float, default=1.5, help="requests/s in the prefill-heavy phases")
    p.add_argument("--decode-rate", type=float, default=8.0, help="requests/s in the decode-heavy phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    rows = shifting_rows(args.phase_s, args.prefill_rate, args.decode_rate, args.seed)
    with open(args.output, "w") as f:
        json.dump({"requests": rows}, f)
    print(f"wrote {args.output}: {len(rows)} requests over {3 * args.phase_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
