"""The OpenAI-compatible HTTP API end to end, driven by the official `openai` SDK: real Ray actors,
a real redis-server, HTTP and gRPC side by side in one server (1 prefill + 1 decode instance),
with TLS and an API key, which every client here uses."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest
import ray

from disagg.bench.launcher import free_port
from disagg.client import DisaggClient, generate_request
from disagg.cluster.launcher import NAMESPACE
from disagg.config import ServingConfig
from disagg.server import Server
from disagg.v1 import serving_pb2
from tests.support import self_signed_certificate

API_KEY = "http-test-key"
MODEL = "smollm2-135m-instruct"
MAX_INFLIGHT = 4
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG_STORY = [{"role": "user", "content": "Tell me a very long story about dragons."}]
IGNORE_EOS = {"ignore_eos": True}  # vLLM's extension: the SDK sends it in extra_body


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(ray_session, tls):
    cert, key = tls
    config = ServingConfig.from_dict(
        {
            # The product's default weights (quantized), which the rest of the suite leaves out.
            "engine": {"num_kv_blocks": 400, "max_num_batched_tokens": 256, "weights": "auto"},
            "prefill": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "decode": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "port": 0,
            "http_port": free_port(),
            "max_inflight_requests": MAX_INFLIGHT,  # small, so that admission's 429 is quick to reach
            "api_key": API_KEY,
            "tls_cert_file": cert,
            "tls_key_file": key,
            "calibration_s": 0,  # not what these tests check
            "replan": False,
        }
    )
    with Server(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def trust(tls) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=tls[0])


def sdk(server, trust, api_key: str = API_KEY) -> openai.OpenAI:
    # No retries: a 429 or 503 must reach the test as it was answered.
    return openai.OpenAI(
        base_url=f"https://{server.http_address}/v1",
        api_key=api_key,
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=trust, timeout=120),
    )


@pytest.fixture(scope="module")
def client(server, trust):
    with sdk(server, trust) as c:
        yield c


class Reply:
    def __init__(self, status: int, headers, body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)


class Raw:
    """Plain HTTP requests, for what the SDK would not send (bad JSON) or hides (headers)."""

    def __init__(self, server, trust: ssl.SSLContext):
        self.base, self.trust = f"https://{server.http_address}", trust

    def open(self, method: str, path: str, body: bytes | dict | None = None, key: str | None = API_KEY):
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, context=self.trust, timeout=60)
        except urllib.error.HTTPError as refused:
            return refused  # a response too: status, headers, body

    def post(self, path: str, body: bytes | dict) -> Reply:
        with self.open("POST", path, body) as reply:
            return Reply(reply.status, reply.headers, reply.read())

    def get(self, path: str, key: str | None = API_KEY) -> Reply:
        with self.open("GET", path, key=key) as reply:
            return Reply(reply.status, reply.headers, reply.read())


@pytest.fixture(scope="module")
def raw(server, trust) -> Raw:
    return Raw(server, trust)


def wait_all_blocks_free(server, timeout_s: float) -> None:
    actors = [ray.get_actor(inst.actor_name, namespace=NAMESPACE) for inst in server.launcher.instances]
    deadline = time.monotonic() + timeout_s
    while True:
        loads = [ray.get(a.status.remote())["load"] for a in actors]
        if all(load.num_free_blocks == load.num_total_blocks for load in loads):
            return
        assert time.monotonic() < deadline, (
            f"blocks still held: {[(x.num_free_blocks, x.num_total_blocks) for x in loads]}"
        )
        time.sleep(0.05)


def test_models_and_health(client, raw):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert raw.get("/health", key=None).status == 401  # behind the key (health_without_key: false)
    health = raw.get("/health")
    assert health.status == 200 and health.json() == {"status": "ok"}


def test_greedy_chat_over_http_equals_grpc(server, client, tls):
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    with DisaggClient(server.address, api_key=API_KEY, tls_ca=tls[0]) as grpc_client:
        tokens, text, final = grpc_client.generate(
            generate_request(chat=QUESTION, temperature=0.0, max_tokens=20), timeout=60
        )
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text and text
    # The first token is a near-tie ("The" -1.88, "L'" -1.96 in float32) that 4-bit weights
    # answer as the reference does: a prompt is computed in float32 (layers/quantized.py).
    assert text.startswith("The capital of France is Paris"), text
    assert answer.object == "chat.completion" and answer.model == MODEL and answer.id.startswith("chatcmpl-")
    assert choice.finish_reason == final.finish_reason
    assert answer.usage.prompt_tokens == final.usage.prompt_tokens
    assert answer.usage.completion_tokens == len(tokens)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_streamed_chat_is_the_whole_answer_in_pieces_with_usage_last(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, usage = chunks
    assert len(content) >= 3, "tokens arrive over several chunks"
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    assert content[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in content][-1] == whole.choices[0].finish_reason
    assert all(c.usage is None for c in content) and all(c.object == "chat.completion.chunk" for c in content)
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens


def test_completions_whole_and_streamed_stop_at_max_tokens(client):
    prompt = "The three primary colors are"
    whole = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, extra_body=IGNORE_EOS)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stream=True, extra_body=IGNORE_EOS
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_a_prompt_of_token_ids_is_the_same_prompt(client, server):
    prompt = "Once upon a time"
    ids = server.request_path.tokenizer.encode(prompt)
    by_text = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6)
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_a_stop_string_ends_the_text_before_it(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    text = whole.choices[0].message.content
    stop = next(w for w in text.split()[1:] if w.isascii() and w.isalpha())  # a word after the first
    stopped = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20, stop=[stop])
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_n_choices_use_seed_plus_index(client):
    def sample(seed: int, n: int = 1):
        return client.completions.create(
            model=MODEL,
            prompt="My favourite animal is",
            temperature=1.0,
            max_tokens=12,
            seed=seed,
            n=n,
            extra_body=IGNORE_EOS,
        )

    two = sample(7, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text != two.choices[1].text, "the choices differ"
    assert [c.text for c in sample(7, n=2).choices] == [c.text for c in two.choices], "same seed, same output"
    # With 4-bit weights too (a decode's row takes one path while its step holds <= 4 decodes):
    assert sample(8).choices[0].text == two.choices[1].text, "choice i is seed + i"
    assert two.usage.completion_tokens == 24 and two.usage.prompt_tokens == sample(7).usage.prompt_tokens


def test_logprobs_of_the_chosen_tokens(client):
    completion = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=5, logprobs=0)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == completion.usage.completion_tokens
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, logprobs=True)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content).strip() == chat.choices[0].message.content.strip()
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, logprobs=True, top_logprobs=2)


BAD_BODIES = {
    "temperature < 0": ({"prompt": "hi", "temperature": -1}, "temperature"),
    "top_p = 0": ({"prompt": "hi", "top_p": 0}, "top_p"),
    "max_tokens < 1": ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "a string for a number": ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    "empty prompt": ({"prompt": ""}, "prompt"),
    "token id beyond the vocabulary": ({"prompt": [1, 10**7]}, "prompt"),
    "prompt too long": ({"prompt": [1] * 9000}, "prompt"),
    "prompt + max_tokens too long": ({"prompt": [1] * 8000, "max_tokens": 500}, "max_tokens"),
    "unknown field": ({"prompt": "hi", "temperatur": 1}, "temperatur"),
    "min_tokens": ({"prompt": "hi", "min_tokens": 3}, "min_tokens"),
    "logprobs > 0": ({"prompt": "hi", "logprobs": 3}, "logprobs"),
    "unknown priority": ({"prompt": "hi", "priority": "urgent"}, "priority"),
    "negative slo": ({"prompt": "hi", "slo": {"ttft_ms": -1}}, "slo.ttft_ms"),
    "stream_options without stream": ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_input_is_400_naming_the_field(raw, case):
    body, param = BAD_BODIES[case]
    reply = raw.post("/v1/completions", {"model": MODEL, **body})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]


def test_invalid_json_bad_chat_role_and_unknown_model(raw, client):
    assert raw.post("/v1/completions", b"{not json").status == 400
    reply = raw.post("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]})
    assert reply.status == 400 and reply.json()["error"]["param"] == "messages[0].role"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi")


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
CITY_QUESTION = [{"role": "user", "content": "Describe Paris as JSON: name, population_in_millions, is_capital_city."}]


def test_every_output_of_a_json_schema_request_parses_and_validates(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=CITY_QUESTION,
        temperature=1.0,
        seed=3,
        n=3,
        max_tokens=128,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), CITY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CITY_QUESTION,
            temperature=0,
            max_tokens=128,
            stream=True,
            response_format={"type": "json_object"},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict), text


def test_the_first_token_sampled_by_the_prefill_worker_follows_the_grammar(server, tls):
    """Unconstrained, this question's answer starts with a word ("The capital..."): a first
    token sampled without the mask would break the grammar on the decode worker."""
    structured = serving_pb2.StructuredOutput(regex="[0-9]{4}")
    with DisaggClient(server.address, api_key=API_KEY, tls_ca=tls[0]) as grpc_client:
        _, text, final = grpc_client.generate(
            generate_request(chat=QUESTION, temperature=0.0, max_tokens=16, structured=structured), timeout=60
        )
    assert len(text) == 4 and text.isdigit() and final.finish_reason == "stop", text


def test_an_invalid_grammar_is_400_over_http_and_invalid_argument_over_grpc(server, raw, tls):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    reply = raw.post("/v1/chat/completions", {"messages": QUESTION, "response_format": bad})
    assert reply.status == 400 and reply.json()["error"]["param"] == "response_format", reply.body
    assert "objectx" in reply.json()["error"]["message"]
    with DisaggClient(server.address, api_key=API_KEY, tls_ca=tls[0]) as grpc_client:
        with pytest.raises(grpc.RpcError) as refused:
            grpc_client.generate(
                generate_request(chat=QUESTION, structured=serving_pb2.StructuredOutput(regex="[a-")), timeout=60
            )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.structured" in refused.value.details()


def test_priority_and_slo_are_accepted(client):
    answer = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": "critical", "slo": {"ttft_ms": 60000}}
    )
    assert answer.usage.completion_tokens == 2


def test_a_wrong_or_missing_key_is_401(server, trust, raw):
    with sdk(server, trust, api_key="wrong-key") as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    missing = raw.get("/v1/models", key=None)  # (the SDK sends no request without a key)
    assert missing.status == 401 and missing.json()["error"]["code"] == "unauthenticated"


def test_over_the_inflight_bound_is_429_with_retry_after_then_serving_resumes(server, client, raw):
    busy = [
        client.chat.completions.create(
            model=MODEL, messages=LONG_STORY, max_tokens=300, stream=True, extra_body=IGNORE_EOS
        )
        for _ in range(MAX_INFLIGHT)
    ]
    try:
        with ThreadPoolExecutor(MAX_INFLIGHT) as pool:
            list(pool.map(next, busy))  # every one is decoding
        refused = raw.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert refused.status == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "resource_exhausted"
        assert "requests in flight" in refused.json()["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    finally:
        for stream in busy:
            stream.close()
    wait_all_blocks_free(server, 3.0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_a_draining_server_is_503(server, client):
    server.request_path.draining = True  # as on SIGTERM, without ending the module's server
    try:
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert refused.value.status_code == 503
    finally:
        server.request_path.draining = False


def test_a_client_that_disconnects_mid_stream_frees_every_block(server, client):
    stream = client.chat.completions.create(
        model=MODEL, messages=LONG_STORY, max_tokens=300, stream=True, extra_body=IGNORE_EOS
    )
    next(stream)
    next(stream)  # decoding is under way
    stream.close()
    wait_all_blocks_free(server, 1.5)
    deadline = time.monotonic() + 1.5
    while server.request_path._active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.request_path._active, "it no longer counts against admission"


def test_a_stream_is_server_sent_events_of_json_ending_with_done(raw):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with raw.open("POST", "/v1/completions", body) as reply:
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        events = [line.decode().strip().removeprefix("data: ") for line in reply if line.strip()]
    assert events[-1] == "[DONE]"
    assert all("choices" in json.loads(e) for e in events[:-1])
