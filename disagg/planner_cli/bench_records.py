"""Simulated runs in the shape of `disagg bench` results, so that `disagg report` draws simulated
and measured runs side by side, with the same metric definitions (disagg.bench.metrics)."""

from __future__ import annotations

import math

from disagg.bench.metrics import RequestRecord, summarize
from disagg.planner.simulator import SimRecord
from disagg.planner.workload import SimRequest
from disagg.slo import SLO


def as_request_records(records: list[SimRecord]) -> list[RequestRecord]:
    """Per-token gaps are not simulated one by one: ITL is left empty (TPOT is exact)."""
    out = []
    for r in records:
        record = RequestRecord(r.index, r.prompt_len, r.output_len, str(r.index), r.arrival_s)
        if r.success:
            record.success, record.output_len = True, r.output_len
            record.ttft, record.e2el = r.ttft_s, r.e2el_s
        else:
            record.error_code, record.error = r.error_code or "INTERNAL", r.failed
        out.append(record)
    return out


def bench_result(
    label: str, requests: list[SimRequest], records: list[SimRecord], rate: float, slo: SLO, extra: dict
) -> dict:
    """A `disagg bench` result file's content, for a simulated run."""
    bench_records = as_request_records(records)
    end = max((r.sent_at + r.e2el for r in bench_records if r.success), default=0.0)
    summary = summarize(bench_records, end, slo)
    return {
        "label": label,
        "simulated": True,
        "load": {"request_rate": rate if math.isfinite(rate) else "inf", "num_requests": len(requests)},
        "summary": summary,
        "requests": [r.to_dict() for r in bench_records],
        **extra,
    }
