"""The OpenAI API's bodies read into the request path's message, its answers built from deltas,
and the one map from failures to HTTP statuses: pure functions, no server."""

from __future__ import annotations

import json

import pytest

from disagg.errors import (
    HTTP_STATUS,
    InvalidRequestError,
    OverloadedError,
    UnavailableError,
    grpc_code_name,
    http_status,
)
from disagg.request import SamplingParams
from disagg.router.openai_requests import (
    ModelNotFoundError,
    choice_params,
    parse_chat,
    parse_completion,
)
from disagg.router.openai_responses import Answer, error_body, invalid_request_body, openai_param
from disagg.router.stream_stats import Outcome
from disagg.router.validation import sampling_params
from disagg.rpc.messages import TokenDelta
from disagg.v1 import serving_pb2

MODEL = "smollm2-135m-instruct"


def completion(**body):
    return parse_completion({"model": MODEL, **body}, MODEL)


def chat(**body):
    return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}, MODEL)


def refusal(parse, **body) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as refused:
        parse(**body)
    return refused.value


# ---- requests ------------------------------------------------------------------------------------
def test_a_completion_becomes_the_generate_request_grpc_clients_send():
    api = completion(prompt="Hello", max_tokens=5, temperature=0.5, top_p=0.9, top_k=40, seed=3, stop="\n")
    generate = api.generate
    assert generate.WhichOneof("input") == "prompt" and generate.prompt == "Hello"
    params = sampling_params(generate.sampling, tokenizer=object())
    assert (params.max_tokens, params.temperature, params.top_k, params.seed, params.stop) == (5, 0.5, 40, 3, ["\n"])
    assert params.top_p == pytest.approx(0.9)
    assert params.logprobs is None and not api.chat and not api.stream and api.n == 1


def test_defaults_are_openais():
    params = sampling_params(completion(prompt="Hello").generate.sampling, tokenizer=None)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 1.0, 1.0, -1)
    api = chat()
    assert api.fill_context, "a chat with no max_tokens gets the context's room, as vLLM's"
    assert not chat(max_tokens=7).fill_context


def test_vllm_extensions_priority_and_slo():
    api = completion(prompt="x", ignore_eos=True, stop_token_ids=[5], priority="sheddable", slo={"ttft_ms": 200})
    assert api.generate.sampling.ignore_eos and list(api.generate.sampling.stop_token_ids) == [5]
    assert api.generate.priority == serving_pb2.PRIORITY_SHEDDABLE
    assert api.generate.slo.ttft_ms == 200 and api.generate.slo.tpot_ms == 0


def test_prompts_of_token_ids_and_a_batch_of_one():
    assert list(completion(prompt=[1, 2, 3]).generate.prompt_token_ids.ids) == [1, 2, 3]
    assert completion(prompt=["Hello"]).generate.prompt == "Hello"
    assert "one prompt per request" in str(refusal(completion, prompt=["a", "b"]))


def test_chat_messages_content_parts_and_the_developer_role():
    api = parse_chat(
        {
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_completion_tokens": 9,
            "max_tokens": 4,
        },
        MODEL,
    )
    messages = api.generate.chat.messages
    assert [(m.role, m.content) for m in messages] == [("system", "Be brief."), ("user", "a\nb")]
    assert api.generate.sampling.max_tokens == 9, "max_completion_tokens wins, as OpenAI's"
    assert api.chat and not api.fill_context


def test_streaming_usage_and_logprobs_flags():
    api = chat(stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=0, n=3)
    assert api.stream and api.include_usage and api.logprobs and api.n == 3
    assert api.generate.sampling.logprobs == 0, "the chosen token's logprob only"
    assert completion(prompt="x", logprobs=0).logprobs


@pytest.mark.parametrize(
    "parse, body, field",
    [
        (completion, {"prompt": "x", "frobnicate": 1}, "frobnicate"),
        (completion, {"prompt": "x", "min_tokens": 2}, "min_tokens"),
        (completion, {"prompt": "x", "logprobs": 1}, "logprobs"),
        (chat, {"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
        (completion, {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        (completion, {"prompt": "x", "n": 0}, "n"),
        (completion, {"prompt": "x", "n": True}, "n"),
        (completion, {"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
        (completion, {"prompt": "x", "temperature": "warm"}, "temperature"),
        (completion, {"prompt": "x", "stream": "yes"}, "stream"),
        (completion, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        (completion, {"prompt": "x", "priority": 1}, "priority"),
        (completion, {"prompt": "x", "slo": {"ttft": 3}}, "slo"),
        (completion, {"prompt": "x", "stop": [1]}, "stop"),
        (completion, {"prompt": "x", "best_of": 2}, "best_of"),
        (completion, {"prompt": 3}, "prompt"),
        (chat, {"messages": []}, "messages"),
        (chat, {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (chat, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        (chat, {"tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_what_the_engine_cannot_do_is_refused_naming_the_field(parse, body, field):
    refused = refusal(parse, **body)
    assert refused.field == field and refused.grpc_code_name == "INVALID_ARGUMENT"


def test_min_tokens_says_it_is_not_supported():
    assert "not supported" in str(refusal(completion, prompt="x", min_tokens=1))
    assert completion(prompt="x", min_tokens=0).generate.prompt == "x"


def test_the_model_must_be_the_served_one_or_its_short_name():
    assert completion(prompt="x").generate.prompt == "x"
    parse_completion({"prompt": "x"}, MODEL)  # left out: the served one
    parse_completion({"model": "model.gguf", "prompt": "x"}, "/models/model.gguf")
    with pytest.raises(ModelNotFoundError) as refused:
        parse_completion({"model": "gpt-4o", "prompt": "x"}, MODEL)
    assert refused.value.grpc_code_name == "NOT_FOUND" and http_status(grpc_code_name(refused.value)) == 404


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(InvalidRequestError):
        parse_completion([1, 2], MODEL)


def test_choice_i_samples_with_seed_plus_i():
    params = SamplingParams(temperature=1.0, seed=10)
    assert [choice_params(params, i).seed for i in range(3)] == [10, 11, 12]
    unseeded = SamplingParams(temperature=1.0)
    assert choice_params(unseeded, 2).seed is None


# ---- errors --------------------------------------------------------------------------------------
def test_every_failure_maps_to_the_status_of_its_grpc_code():
    assert http_status(grpc_code_name(InvalidRequestError("prompt", "empty"))) == 400
    assert http_status(grpc_code_name(OverloadedError("full"))) == 429
    assert http_status(grpc_code_name(UnavailableError("draining"))) == 503
    assert http_status(grpc_code_name(RuntimeError("bug"))) == 500
    assert http_status("DEADLINE_EXCEEDED") == 504 and http_status("UNAUTHENTICATED") == 401
    assert http_status("SOMETHING_NEW") == 500
    assert set(HTTP_STATUS.values()) >= {400, 401, 404, 429, 500, 503}


def test_errors_have_openais_shape_with_the_field_as_openai_names_it():
    body = invalid_request_body(InvalidRequestError("sampling.temperature", "must be >= 0, got -1"))
    assert body == {
        "error": {
            "message": "temperature: must be >= 0, got -1",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_argument",
        }
    }
    assert openai_param("chat.messages[2].role") == "messages[2].role"
    assert openai_param("prompt_token_ids") == "prompt" and openai_param("chat") == "messages"
    refused = error_body("RESOURCE_EXHAUSTED", "best predicted TTFT 900 ms")
    assert refused["error"]["type"] == "rate_limit_error" and refused["error"]["param"] is None


def test_a_refusal_is_429_with_retry_after_and_its_message():
    pytest.importorskip("aiohttp")
    from disagg.router.http_frontend import RETRY_AFTER_S, _failure

    response = _failure("RESOURCE_EXHAUSTED", "no instance is predicted to meet the SLO: best predicted TTFT 9 ms")
    assert response.status == 429 and response.headers["Retry-After"] == str(RETRY_AFTER_S)
    assert "predicted TTFT" in json.loads(response.body)["error"]["message"]
    assert _failure("UNAVAILABLE", "server is shutting down").status == 503
    assert _failure("INTERNAL", "bug").status == 500


# ---- answers -------------------------------------------------------------------------------------
def outcome(completion_tokens: int, finish_reason: str = "stop") -> Outcome:
    return Outcome(
        finish_reason, 7, completion_tokens, 0, 0.0, 0.0, 0.0, 0, 0.0, 0.1, 0.2, (), "p0", "d0", 0.0, 0.0
    )  # fmt: skip


def test_a_chat_stream_names_the_role_first_and_ends_with_the_finish_reason():
    answer = Answer(chat(stream=True, stream_options={"include_usage": True}), MODEL, str)
    first = answer.chunk(0, TokenDelta("r", [1], text="Hel"), None)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"content": "Hel", "role": "assistant"}
    assert answer.chunk(0, TokenDelta("r", [2], text=""), None) is None, "half a character: nothing to say yet"
    last = answer.chunk(0, TokenDelta("r", [3], text="lo", finished=True), outcome(3))
    assert last["choices"][0]["delta"] == {"content": "lo"} and last["choices"][0]["finish_reason"] == "stop"
    usage = answer.usage_chunk()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3 and usage["usage"]["total_tokens"] == 10


def test_a_whole_answer_of_n_choices_counts_the_prompt_once():
    answer = Answer(completion(prompt="x", n=2), MODEL, str)
    answer.add(1, TokenDelta("b", [4, 5], text="yz", finished=True, finish_reason="length"), outcome(2, "length"))
    answer.add(0, TokenDelta("a", [6], text="w", finished=True), outcome(1))
    whole = answer.whole()
    assert whole["object"] == "text_completion" and whole["id"].startswith("cmpl-")
    assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "w", "stop"),
        (1, "yz", "length"),
    ]
    assert whole["usage"]["prompt_tokens"] == 7 and whole["usage"]["completion_tokens"] == 3


def test_logprobs_in_completion_and_chat_shapes():
    names = {1: "He", 2: "llo"}.get
    answer = Answer(completion(prompt="x", logprobs=0), MODEL, names)
    answer.add(0, TokenDelta("a", [1, 2], text="Hello", logprobs=[-0.5, -0.25], finished=True), outcome(2))
    logprobs = answer.whole()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["He", "llo"] and logprobs["token_logprobs"] == [-0.5, -0.25]
    assert logprobs["text_offset"] == [0, 2] and logprobs["top_logprobs"] == [{"He": -0.5}, {"llo": -0.25}]
    answer = Answer(chat(logprobs=True), MODEL, names)
    answer.add(0, TokenDelta("a", [1], text="He", logprobs=[-0.5], finished=True), outcome(1))
    content = answer.whole()["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "He", "logprob": -0.5, "bytes": [72, 101], "top_logprobs": []}]
    assert Answer(chat(), MODEL, names).whole()["choices"][0]["logprobs"] is None
