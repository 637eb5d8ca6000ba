"""The running SLO tally (Locust's live figures) equals `summarize` of the same requests, adds up
across processes, and reads OpenAI chat streams as vLLM's `bench serve` does."""

from __future__ import annotations

import json

import pytest

from disagg.bench.metrics import RequestRecord, summarize
from disagg.bench.openai_stream import StreamTimer
from disagg.bench.slo_tally import FIGURE_FIELDS, SloBoard, SloTally
from disagg.slo import SLO

SLO_ = SLO(ttft_ms=200.0, tpot_ms=50.0)


def ok(ttft: float, e2el: float, output_len: int) -> RequestRecord:
    return RequestRecord(0, 10, output_len, success=True, output_len=output_len, ttft=ttft, e2el=e2el)


def failed() -> RequestRecord:
    return RequestRecord(0, 10, 5, error_code="RESOURCE_EXHAUSTED", e2el=0.01)


RECORDS = [
    ok(0.10, 0.50, 9),  # TPOT 50 ms: meets both
    ok(0.30, 0.60, 7),  # TTFT 300 ms: misses
    ok(0.05, 1.05, 11),  # TPOT 100 ms: misses
    ok(0.12, 0.12, 1),  # one token: no TPOT, meets
    failed(),  # a failure is a miss
    ok(0.15, 0.45, 16),  # TPOT 20 ms: meets
]


def test_figures_equal_summarize_of_the_same_requests():
    tally = SloTally(SLO_)
    for record in RECORDS:
        tally.add(record)
    figures = tally.figures(duration_s=4.0)
    summary = summarize(RECORDS, 4.0, SLO_)
    assert set(figures) == set(FIGURE_FIELDS)
    assert figures["requests"] == 6 and figures["succeeded"] == 5 and figures["good"] == 3
    assert figures["attainment_pct"] == pytest.approx(summary["slo_attainment_pct"]) == pytest.approx(50.0)
    assert figures["goodput_rps"] == pytest.approx(summary["goodput"]) == pytest.approx(0.75)
    assert figures["throughput_rps"] == pytest.approx(summary["request_throughput"])
    for metric in ("ttft", "tpot"):
        for p in ("p50", "p90", "p99"):
            assert figures[f"{metric}_{p}_ms"] == pytest.approx(summary[f"{metric}_ms"][p])
    assert figures["tpot_p50_ms"] == pytest.approx(50.0)  # of 4 requests (the one-token one has none)


def test_an_empty_tally_and_a_zero_duration_give_zeros():
    figures = SloTally(SLO_).figures(0.0)
    assert all(figures[key] == 0 for key in FIGURE_FIELDS)


def test_without_targets_only_failures_miss():
    tally = SloTally()
    for record in RECORDS:
        tally.add(record)
    assert tally.figures(1.0)["attainment_pct"] == pytest.approx(500 / 6)


def test_reports_taken_on_workers_add_up_to_one_tally_on_the_master():
    workers = [SloBoard(SLO_), SloBoard(SLO_)]
    for i, record in enumerate(RECORDS):
        workers[i % 2].add("grpc" if i < 4 else "http", record)
    master = SloBoard(SLO())
    for worker in workers:
        master.merge(json.loads(json.dumps(worker.take())))  # as Locust sends it: plain data
    assert all(not tally.requests for worker in workers for tally in worker.tallies.values())
    assert [worker.take() for worker in workers] == [{}, {}]  # nothing new: nothing sent
    rows = {row["name"]: row for row in master.rows(4.0)}
    assert master.slo == SLO_ and set(rows) == {"grpc", "http", "Aggregated"}
    assert rows["grpc"]["requests"] == 4 and rows["http"]["requests"] == 2
    expected = summarize(RECORDS, 4.0, SLO_)
    assert rows["Aggregated"]["attainment_pct"] == pytest.approx(expected["slo_attainment_pct"])
    assert rows["Aggregated"]["ttft_p90_ms"] == pytest.approx(expected["ttft_ms"]["p90"])


def test_one_api_has_one_row_and_a_reset_empties_the_board():
    board = SloBoard(SLO_)
    board.add("grpc", RECORDS[0])
    assert [row["name"] for row in board.rows(1.0)] == ["grpc"]
    board.reset()
    assert board.rows(1.0) == []


def test_tallies_judged_by_different_slos_do_not_merge():
    with pytest.raises(ValueError, match="cannot merge"):
        SloTally(SLO_).merge(SloTally(SLO(ttft_ms=1.0)))


# ---- a streamed chat completion ----------------------------------------------------------------
def chunk(content: str | None = None, finish: str | None = None, usage: dict | None = None) -> str:
    choices = [] if usage else [{"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}]
    return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": choices, "usage": usage})


def test_chat_stream_times_each_content_chunk_and_takes_counts_from_usage():
    timer = StreamTimer(started=10.0)
    lines = [
        (chunk(), 10.1),  # the role alone: no token yet
        ("", 10.1),
        (chunk("Hello"), 10.4),
        (chunk(" world"), 10.6),
        (chunk("!", finish="length"), 10.9),
        (chunk(usage={"prompt_tokens": 12, "completion_tokens": 3}), 10.95),
        ("data: [DONE]", 11.0),
    ]
    for line, at in lines:
        timer.on_line(line.encode(), at)
    record = timer.finish(RequestRecord(0, 5, 3), now=11.0)
    assert record.success and record.finish_reason == "length"
    assert record.ttft == pytest.approx(0.4) and record.e2el == pytest.approx(1.0)
    assert record.itl == pytest.approx([0.2, 0.3])
    assert record.output_len == 3 and record.prompt_len == 12  # the server's counts (chat template included)
    assert record.tpot == pytest.approx(0.3)


def test_usage_corrects_tokens_that_came_without_a_chunk_of_their_own():
    timer = StreamTimer(started=0.0)
    for line, at in [(chunk("ab"), 0.5), (chunk("c", "length"), 1.5), (chunk(usage={"completion_tokens": 5}), 1.5)]:
        timer.on_line(line, at)
    timer.on_line("data: [DONE]", 1.5)
    record = timer.finish(RequestRecord(0, 5, 5), now=1.5)
    assert record.output_len == 5 and record.tpot == pytest.approx(0.25)


def test_an_error_event_or_a_cut_stream_is_a_failure():
    timer = StreamTimer(started=0.0)
    timer.on_line(chunk("a"), 0.1)
    timer.on_line('data: {"error": {"message": "no decode instance", "code": "unavailable"}}', 0.2)
    timer.on_line("data: [DONE]", 0.2)
    record = timer.finish(RequestRecord(0, 5, 5), now=0.2)
    assert not record.success and record.error_code == "UNAVAILABLE" and "no decode" in record.error

    cut = StreamTimer(started=0.0)
    cut.on_line(chunk("a"), 0.1)
    record = cut.finish(RequestRecord(0, 5, 5), now=0.3)
    assert not record.success and record.error_code == "UNKNOWN"
