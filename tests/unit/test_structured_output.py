"""Structured output: what requests may ask for (both APIs' parsing), the grammar compiler's
refusals, the engine-side grammar state (masks, jump-forward, catching up on tokens generated
elsewhere), and the engine's output under a grammar, with the default model's tokenizer."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
import torch

from disagg import LLM, SamplingParams
from disagg.engine.grammar import GrammarCompiler
from disagg.engine.guided_decoding import GrammarError, GuidedDecoding, generated_tokens
from disagg.engine.loader import default_gguf_path
from disagg.engine.scheduler import SampledToken
from disagg.errors import InvalidRequestError
from disagg.request import Request, StructuredOutput
from disagg.router.openai_structured import structured_output as http_structured
from disagg.router.validation import structured_output as grpc_structured
from disagg.v1 import serving_pb2

CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "population_in_millions": {"type": "number"},
        "is_capital_city": {"type": "boolean"},
    },
    "required": ["name", "population_in_millions", "is_capital_city"],
    "additionalProperties": False,
}
VOCAB = 49152


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def compiler(hf_tokenizer):
    return GrammarCompiler(hf_tokenizer, VOCAB, (hf_tokenizer.eos_token_id,))


def _request(structured: StructuredOutput, prompt=(1, 2, 3), **params) -> Request:
    return Request("r", list(prompt), SamplingParams(structured=structured, **params))


def _allowed(guided: GuidedDecoding, request: Request) -> torch.Tensor:
    logits = torch.zeros(1, VOCAB)
    guided.mask([request], logits)
    return torch.isfinite(logits[0])


# ---- what a request may ask for ------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, spec",
    [("yaml", "x"), ("regex", ""), ("json_schema", "  "), ("grammar", "x" * (64 * 1024 + 1))],
)
def test_a_structured_output_names_a_known_kind_and_a_bounded_spec(kind, spec):
    with pytest.raises(InvalidRequestError, match="structured"):
        StructuredOutput(kind, spec)


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, serving_pb2.StructuredOutput(json_object=True)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}},
            serving_pb2.StructuredOutput(json_schema=json.dumps(CITY)),
        ),
        ({"guided_json": CITY}, serving_pb2.StructuredOutput(json_schema=json.dumps(CITY))),
        ({"guided_regex": "[0-9]+"}, serving_pb2.StructuredOutput(regex="[0-9]+")),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, serving_pb2.StructuredOutput(grammar='root ::= "a"')),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            serving_pb2.StructuredOutput(choice=serving_pb2.ChoiceList(choices=["yes", "no"])),
        ),
    ],
)
def test_http_bodies_ask_for_structured_output_as_openai_and_vllm_do(body, expected):
    assert http_structured(body) == expected


@pytest.mark.parametrize(
    "body, field",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_regex": "a", "guided_json": {}}, "guided_regex"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ],
)
def test_http_bodies_that_ask_wrongly_are_refused_naming_the_field(body, field):
    with pytest.raises(InvalidRequestError) as caught:
        http_structured(body)
    assert caught.value.field == field


def test_grpc_structured_output_reads_each_kind():
    def read(**kind):
        return grpc_structured(serving_pb2.SamplingParams(structured=serving_pb2.StructuredOutput(**kind)))

    assert grpc_structured(serving_pb2.SamplingParams()) is None
    assert read(json_object=True) == StructuredOutput("json_object")
    assert read(regex="a+") == StructuredOutput("regex", "a+")
    assert read(choice=serving_pb2.ChoiceList(choices=["a", "b"])) == StructuredOutput("choice", '["a", "b"]')
    with pytest.raises(InvalidRequestError, match="set one of"):
        read()


# ---- the compiler --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "structured, message",
    [
        (StructuredOutput("json_schema", "{not json"), "not JSON"),
        (StructuredOutput("json_schema", "[1, 2]"), "must be a JSON object"),
        (StructuredOutput("json_schema", '{"type": "objectx"}'), "objectx"),
        (StructuredOutput("regex", "[a-"), "unclosed character class"),
        (StructuredOutput("grammar", "root ::= undefined_rule"), "undefined_rule"),
        (StructuredOutput("choice", '["a", 3]'), "list of non-empty strings"),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused_saying_why(compiler, structured, message):
    with pytest.raises(InvalidRequestError, match=message):
        compiler.check(structured)


# ---- the grammar state ---------------------------------------------------------------------------
def test_the_mask_allows_exactly_the_grammar_s_next_tokens(compiler, hf_tokenizer):
    guided = GuidedDecoding(lambda: compiler)
    request = _request(StructuredOutput("choice", '["yes", "no"]'))
    allowed = _allowed(guided, request)
    texts = {hf_tokenizer.decode([t]) for t in allowed.nonzero().flatten().tolist()}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    unconstrained = Request("free", [1, 2], SamplingParams())
    logits = torch.zeros(2, VOCAB)
    guided.mask([unconstrained, request], logits)
    assert torch.isfinite(logits[0]).all(), "a request without a grammar was masked"
    assert torch.equal(torch.isfinite(logits[1]), allowed)


def test_jump_forward_returns_the_forced_tokens_and_a_complete_grammar_ends(compiler, hf_tokenizer):
    key = "a_very_long_fixed_key_name"
    schema = {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}
    guided = GuidedDecoding(lambda: compiler)
    request = _request(StructuredOutput("json_schema", json.dumps(schema)))
    first = hf_tokenizer.encode("{", add_special_tokens=False)[0]
    forced, ends = guided.advance(request, first)
    assert key in hf_tokenizer.decode([first, *forced]) and not ends
    request.append_output_token(first)
    for t in forced:
        request.append_output_token(t)
    off = GuidedDecoding(lambda: compiler, jump_forward=False)
    assert off.advance(_request(StructuredOutput("json_schema", json.dumps(schema))), first) == ([], False)
    # Finish the object by hand: once complete, nothing may follow.
    rest = [t for t in hf_tokenizer.encode('":7}', add_special_tokens=False)]
    text = hf_tokenizer.decode(request.output_token_ids)
    assert text.endswith(key), text
    for t in rest[:-1]:
        _, ends = guided.advance(request, t)
        request.append_output_token(t)
    _, ends = guided.advance(request, rest[-1])
    assert ends


def test_a_request_resumed_elsewhere_catches_up_on_its_generated_tokens(compiler, hf_tokenizer):
    """The state after tokens generated on another instance (the tail of the prompt it resumes
    with) is the state of the instance that generated them."""
    structured = StructuredOutput("json_schema", json.dumps(CITY))
    done = hf_tokenizer.encode('{"name":"Pa', add_special_tokens=False)
    here = _request(structured)
    for t in done:
        here.append_output_token(t)
    resumed = _request(structured, prompt=[1, 2, 3, *done], resumed_tokens=len(done))
    assert generated_tokens(resumed) == done and generated_tokens(resumed, 2) == done[2:]
    assert torch.equal(
        _allowed(GuidedDecoding(lambda: compiler), here), _allowed(GuidedDecoding(lambda: compiler), resumed)
    )
    broken = _request(structured, prompt=[1, *hf_tokenizer.encode("nope", add_special_tokens=False)], resumed_tokens=1)
    with pytest.raises(GrammarError):
        _allowed(GuidedDecoding(lambda: compiler), broken)


def test_forced_tokens_are_appended_up_to_max_tokens_and_a_complete_grammar_stops():
    from disagg.engine.block_manager import BlockManager
    from disagg.engine.scheduler import Scheduler

    scheduler = Scheduler(BlockManager(64, 16, False))
    for rid, max_tokens in (("capped", 3), ("free", 10)):
        scheduler.add_request(Request(rid, [5, 6, 7], SamplingParams(max_tokens=max_tokens)))
    out = scheduler.schedule()
    scheduler.update_from_output(
        out, {"capped": SampledToken(8, forced=[9, 10, 11, 12]), "free": SampledToken(8, forced=[9], ends=True)}
    )
    capped, free = (scheduler_request(out, rid) for rid in ("capped", "free"))
    assert capped.output_token_ids == [8, 9, 10] and str(capped.finish_reason) == "length"
    assert free.output_token_ids == [8, 9] and str(free.finish_reason) == "stop"


def scheduler_request(out, rid: str) -> Request:
    return next(c.request for c in out.chunks if c.request.request_id == rid)


# ---- the engine under a grammar ------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    # The product's default weights (quantized): with float32 ones, jump-forward's chunks of
    # varying length each build new oneDNN kernels, and this module takes a minute longer.
    return LLM(num_kv_blocks=256, weights="auto")


def _city_prompt(llm, city: str) -> dict:
    question = f"Describe {city} as JSON with the keys name, population_in_millions and is_capital_city."
    return {"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])}


@pytest.mark.slow
def test_every_output_follows_its_schema_greedy_and_sampled(llm):
    structured = StructuredOutput("json_schema", json.dumps(CITY))
    params = [
        SamplingParams(temperature=0.0, max_tokens=64, structured=structured),
        SamplingParams(temperature=1.0, seed=7, max_tokens=64, structured=structured),
        SamplingParams(temperature=1.0, seed=8, max_tokens=64, structured=structured, logprobs=2),
    ]
    outs = llm.generate([_city_prompt(llm, c) for c in ("Paris", "Tokyo", "Lima")], params, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), CITY)
    logprobs = outs[2].outputs[0].logprobs
    assert len(logprobs) == len(outs[2].outputs[0].token_ids), "a token without its logprob"
    assert all(torch.isfinite(torch.tensor(list(lp.values()))).all() for lp in logprobs)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


@pytest.mark.slow
def test_jump_forward_gives_the_same_output_in_fewer_steps(llm):
    keys = ["the_name_of_the_city_in_english", "the_population_of_the_city_in_millions"]
    schema = {
        "type": "object",
        "properties": {keys[0]: {"type": "string", "maxLength": 16}, keys[1]: {"type": "integer"}},
        "required": keys,
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=0.0, max_tokens=80, structured=StructuredOutput("json_schema", json.dumps(schema))
    )
    runs = {}
    for jump in (True, False):
        llm.engine.guided.jump_forward = jump
        steps = llm.engine.num_steps
        out = llm.generate([_city_prompt(llm, "Rome")], params, use_tqdm=False)[0].outputs[0]
        runs[jump] = (out.token_ids, llm.engine.num_steps - steps)
    llm.engine.guided.jump_forward = True
    assert runs[True][0] == runs[False][0]
    assert keys[1] in llm.tokenizer.decode(runs[True][0])
    assert runs[True][1] < runs[False][1] - 10, f"steps with jump-forward {runs[True][1]}, without {runs[False][1]}"


def test_an_engine_refuses_a_grammar_it_cannot_compile(llm):
    with pytest.raises(InvalidRequestError, match="objectx"):
        llm.engine.add_request(
            "bad",
            prompt_token_ids=[1, 2],
            sampling_params=SamplingParams(structured=StructuredOutput("json_schema", '{"type": "objectx"}')),
        )
    assert not llm.engine.has_unfinished_requests()
