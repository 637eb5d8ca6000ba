"""Request bodies of the OpenAI API (`/v1/completions`, `/v1/chat/completions`, with vLLM's
extensions `top_k`, `ignore_eos`, `stop_token_ids`, `min_tokens`, structured output (see
openai_structured) and ours, `priority` and `slo`)
read into the request path's plain message, a `GenerateRequest`, beside what only the HTTP
answer needs (choices, streaming, usage and logprobs in it).

Pure: no aiohttp. What the engine cannot do is refused with InvalidRequestError naming the
field (400), never ignored: a client must not get an answer to a question it did not ask. The
values themselves are checked where gRPC's are (disagg.router.validation, SamplingParams), so
that both APIs accept and refuse the same requests.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from disagg.errors import InvalidRequestError
from disagg.request import SamplingParams
from disagg.router.openai_structured import STRUCTURED_FIELDS, structured_output
from disagg.v1 import serving_pb2

MAX_CHOICES = 128  # OpenAI's bound on n
INT32_MAX = 2**31 - 1
INT64 = (-(2**63), 2**63 - 1)
PRIORITIES = ("standard", "critical", "sheddable")
# OpenAI's newer name for the system role; chat templates know only "system".
ROLE_ALIASES = {"developer": "system"}

# Fields with no engine support: accepted at values that ask for nothing (or null), refused
# otherwise.
ONLY_DEFAULT = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "min_p": (0,),
    "min_tokens": (0,),
    "logit_bias": ({},),
    "echo": (False,),
    "suffix": ("",),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
}
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}  # change nothing in the answer
COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "stream",
    "stream_options", "ignore_eos", "priority", "slo", "logprobs", *ONLY_DEFAULT, *IGNORED, *STRUCTURED_FIELDS,
}  # fmt: skip
COMPLETION_FIELDS = COMMON | {"prompt", "best_of"}
CHAT_FIELDS = COMMON | {"messages", "top_logprobs", "max_completion_tokens"}


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve (404, as OpenAI and vLLM answer)."""

    grpc_code_name = "NOT_FOUND"


@dataclass(frozen=True)
class ApiRequest:
    """One completion or chat request: what the request path runs, and how to answer it."""

    chat: bool
    generate: serving_pb2.GenerateRequest  # the same message a gRPC client would send
    n: int = 1  # choices of the one prompt
    stream: bool = False
    include_usage: bool = False  # streamed: a last chunk with the usage (stream_options.include_usage)
    logprobs: bool = False  # each chosen token's logprob in the answer
    fill_context: bool = False  # no max_tokens given (chat): as many as the context holds, as vLLM


def parse_completion(body, served_model: str) -> ApiRequest:
    """A `/v1/completions` body."""
    _check_fields(body, COMPLETION_FIELDS, served_model)
    request = _generate_request(body)
    _set_prompt(request, body.get("prompt"))
    max_tokens = _optional_int(body, "max_tokens", 1, INT32_MAX)
    if max_tokens is not None:
        request.sampling.max_tokens = max_tokens
    logprobs = _optional_int(body, "logprobs", 0, INT32_MAX)
    _refuse_top_logprobs("logprobs", logprobs)
    n = _choices(body)
    best_of = _optional_int(body, "best_of", 1, MAX_CHOICES)
    if best_of is not None and best_of != n:
        raise InvalidRequestError("best_of", "must equal n: every sampled sequence is returned")
    return _api_request(body, request, chat=False, n=n, logprobs=logprobs is not None)


def parse_chat(body, served_model: str) -> ApiRequest:
    """A `/v1/chat/completions` body."""
    _check_fields(body, CHAT_FIELDS, served_model)
    request = _generate_request(body)
    request.chat.CopyFrom(serving_pb2.Chat(messages=_messages(body.get("messages"))))
    max_tokens = _optional_int(body, "max_completion_tokens", 1, INT32_MAX)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1, INT32_MAX)
    if max_tokens is not None:
        request.sampling.max_tokens = max_tokens
    logprobs = _optional_bool(body, "logprobs", False)
    _refuse_top_logprobs("top_logprobs", _optional_int(body, "top_logprobs", 0, 20))
    if max_tokens is None:  # the context's room, once the prompt's length is known; meanwhile 1 is checked
        request.sampling.max_tokens = 1
    chat = _api_request(body, request, chat=True, n=_choices(body), logprobs=logprobs)
    return dataclasses.replace(chat, fill_context=max_tokens is None)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of n: with a seed, seed + index, so that the choices differ and each is
    reproducible on its own."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


def check_model(name, served_model: str) -> None:
    """`model` names the served model: its configured name, or the last part of that name when
    it is a path (clients rarely know where the server keeps its files). Leaving it out means it."""
    if name is None:
        return
    if not isinstance(name, str):
        raise InvalidRequestError("model", "must be a string")
    if name not in (served_model, served_model.rstrip("/").rsplit("/", 1)[-1]):
        raise ModelNotFoundError("model", f"the model {name!r} does not exist; this server serves {served_model!r}")


# ---- the parts -----------------------------------------------------------------------------------
def _check_fields(body, known: set[str], served_model: str) -> None:
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidRequestError(unknown[0], f"unknown field(s) {unknown}")
    check_model(body.get("model"), served_model)
    for name, accepted in ONLY_DEFAULT.items():
        value = body.get(name)
        if value is not None and value not in accepted:
            raise InvalidRequestError(
                name, f"{value!r} is not supported: this server has no {name}; leave it out or send {accepted[0]!r}"
            )


def _generate_request(body: dict) -> serving_pb2.GenerateRequest:
    """The fields both endpoints share, on a GenerateRequest."""
    sampling = serving_pb2.SamplingParams()
    for name in ("temperature", "top_p"):
        value = _optional_number(body, name)
        if value is not None:
            setattr(sampling, name, value)
    for name, low, high in (("top_k", -(2**31), INT32_MAX), ("seed", *INT64)):
        value = _optional_int(body, name, low, high)
        if value is not None:
            setattr(sampling, name, value)
    sampling.stop.extend(_stop(body.get("stop")))
    sampling.stop_token_ids.extend(_token_ids(body, "stop_token_ids", allow_empty=True))
    sampling.ignore_eos = _optional_bool(body, "ignore_eos", False)
    structured = structured_output(body)
    if structured is not None:
        sampling.structured.CopyFrom(structured)
    return serving_pb2.GenerateRequest(
        sampling=sampling, slo=_slo(body.get("slo")), priority=_priority(body.get("priority"))
    )


def _api_request(body: dict, request: serving_pb2.GenerateRequest, chat: bool, n: int, logprobs: bool) -> ApiRequest:
    if logprobs:
        request.sampling.logprobs = 0  # the chosen token's only (SamplingParams.logprobs)
    stream = _optional_bool(body, "stream", False)
    return ApiRequest(chat, request, n, stream, _include_usage(body.get("stream_options"), stream), logprobs)


def _set_prompt(request: serving_pb2.GenerateRequest, prompt) -> None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        request.prompt_token_ids.ids.extend(_token_ids({"prompt": prompt}, "prompt"))
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequestError("prompt", "one prompt per request (use n for several completions of it)")
    else:
        raise InvalidRequestError("prompt", "must be a string or a non-empty list of token ids")


def _messages(messages) -> list[serving_pb2.ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {'role': ..., 'content': ...}")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(index: int, message) -> serving_pb2.ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(where, "must be an object with 'role' and 'content'")
    unknown = sorted(set(message) - {"role", "content", "name"})
    if unknown:
        raise InvalidRequestError(f"{where}.{unknown[0]}", "not supported (tool calls are not)")
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidRequestError(f"{where}.role", "must be a string")
    return serving_pb2.ChatMessage(role=ROLE_ALIASES.get(role, role), content=_content(where, message.get("content")))


def _content(where: str, content) -> str:
    """A message's text: a string, or text parts (joined by newlines, as vLLM does)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        texts = [p.get("text") for p in content]
        if all(isinstance(t, str) for t in texts):
            return "\n".join(texts)
    raise InvalidRequestError(f"{where}.content", "must be a string or a list of text parts (this model reads text)")


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidRequestError("stop", "must be a string or a list of strings")


def _token_ids(body: dict, name: str, allow_empty: bool = False) -> list[int]:
    ids = body.get(name)
    if ids is None and allow_empty:
        return []
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
        raise InvalidRequestError(name, "must be a list of token ids (integers >= 0)")
    return ids


def _slo(slo) -> serving_pb2.Slo:
    if slo is None:
        return serving_pb2.Slo()
    if not isinstance(slo, dict) or set(slo) - {"ttft_ms", "tpot_ms"}:
        raise InvalidRequestError("slo", "must be an object with ttft_ms and/or tpot_ms")
    targets = {name: _optional_number(slo, name, where=f"slo.{name}") for name in slo}
    return serving_pb2.Slo(**{k: v for k, v in targets.items() if v is not None})


def _priority(priority) -> int:
    if priority is None:
        return serving_pb2.PRIORITY_STANDARD
    if priority not in PRIORITIES:
        raise InvalidRequestError("priority", f"must be one of {', '.join(PRIORITIES)}")
    return serving_pb2.Priority.Value(f"PRIORITY_{priority.upper()}")


def _choices(body: dict) -> int:
    n = _optional_int(body, "n", 1, MAX_CHOICES)
    return 1 if n is None else n


def _include_usage(options, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise InvalidRequestError("stream_options", "only with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise InvalidRequestError("stream_options", "must be an object with include_usage")
    if options.get("continuous_usage_stats"):
        raise InvalidRequestError("stream_options.continuous_usage_stats", "not supported; usage comes last")
    return _optional_bool(options, "include_usage", False, where="stream_options.include_usage")


def _refuse_top_logprobs(name: str, count: int | None) -> None:
    if count:
        raise InvalidRequestError(
            name,
            "only the chosen token's logprob comes back from the workers: top alternatives (> 0) are not supported",
        )


# ---- typed fields (JSON has no int/bool distinction Python would keep) ----------------------------
def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _optional_int(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise InvalidRequestError(name, f"must be an integer in [{low}, {high}], got {value!r}")
    return value


def _optional_number(body: dict, name: str, where: str | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(where or name, f"must be a finite number, got {value!r}")
    return float(value)


def _optional_bool(body: dict, name: str, default: bool, where: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(where or name, f"must be true or false, got {value!r}")
    return value
