"""Turns a GenerateRequest into prompt token ids and SamplingParams, or an error naming the field.

Everything a worker would refuse is refused here first, so a bad request costs nothing
downstream and gets INVALID_ARGUMENT at once.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from disagg.engine.block_manager import max_blocks_held
from disagg.engine.tokenizer import Tokenizer
from disagg.errors import InvalidRequestError
from disagg.request import SamplingParams, StructuredOutput
from disagg.request import check_fits as check_prompt_fits
from disagg.v1 import serving_pb2

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Text longer than this many characters per token of context cannot fit (real tokens are far
# shorter): refused before the tokenizer spends seconds on it.
MAX_CHARS_PER_TOKEN = 32
MAX_REQUEST_ID_CHARS = 256
# The router names a migrated request's later attempts "<id>~N" on the workers (router.migration).
_ATTEMPT_SUFFIX = re.compile(r"~\d+$")


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    max_blocks_per_request: int  # the smallest KV cache among the instances, in blocks
    block_size: int
    # The window every attention layer shares (None: none, or layers of several): a request then
    # holds only its window's blocks and a step's chunk of `chunk_tokens` (the decoding pool's budget).
    sliding_window: int | None = None
    chunk_tokens: int = 1

    def blocks_held(self, num_tokens: int) -> int:
        """The most KV blocks a request of `num_tokens` holds at once on a decoding instance."""
        return max_blocks_held(num_tokens, self.block_size, self.sliding_window, self.chunk_tokens)


def sampling_params(proto: serving_pb2.SamplingParams, tokenizer: Tokenizer | None) -> SamplingParams:
    def opt(name, default):
        return getattr(proto, name) if proto.HasField(name) else default

    if proto.stop and tokenizer is None:
        raise InvalidRequestError("sampling.stop", "stop strings need a tokenizer; this model has none")
    try:
        return SamplingParams(
            temperature=float(opt("temperature", 1.0)),
            top_p=float(opt("top_p", 1.0)),
            top_k=int(opt("top_k", -1)),
            seed=opt("seed", None),
            max_tokens=int(opt("max_tokens", 16)),
            stop=list(proto.stop),
            stop_token_ids=list(proto.stop_token_ids),
            ignore_eos=proto.ignore_eos,
            logprobs=opt("logprobs", None),
            structured=structured_output(proto),
        )
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"sampling.{exc.field}", str(exc).split(": ", 1)[-1]) from None


def structured_output(proto: serving_pb2.SamplingParams) -> StructuredOutput | None:
    """The grammar a request's output follows, None for free text (its validity is checked by
    the grammar compiler, disagg.engine.grammar)."""
    if not proto.HasField("structured"):
        return None
    structured = proto.structured
    kind = structured.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured", "set one of json_object, json_schema, regex, grammar, choice")
    if kind == "json_object":
        if not structured.json_object:
            raise InvalidRequestError("structured", "json_object must be true when it is the kind set")
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(list(structured.choice.choices)))
    return StructuredOutput(kind, getattr(structured, kind))


def check_request_id(request_id: str) -> None:
    """An id a client chooses: short, printable, and never one the router uses for a later attempt."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")
    if not request_id.isprintable():
        raise InvalidRequestError("request_id", "must be printable")
    if _ATTEMPT_SUFFIX.search(request_id):
        raise InvalidRequestError("request_id", "must not end in '~' and digits (reserved for retries)")


def check_slo(slo: serving_pb2.Slo) -> None:
    """A request's own SLO targets (0: the server's default)."""
    for name in ("ttft_ms", "tpot_ms"):
        value = getattr(slo, name)
        if not (math.isfinite(value) and value >= 0):
            raise InvalidRequestError(f"slo.{name}", f"must be a finite number >= 0 (0: the server's), got {value}")


PRIORITY_NAMES = {
    serving_pb2.PRIORITY_STANDARD: "standard",
    serving_pb2.PRIORITY_CRITICAL: "critical",
    serving_pb2.PRIORITY_SHEDDABLE: "sheddable",
}


def check_priority(priority: int) -> None:
    if priority not in PRIORITY_NAMES:
        raise InvalidRequestError("priority", f"unknown value {priority}")


def check_model_bounds(params: SamplingParams, limits: ModelLimits) -> None:
    """What SamplingParams cannot check alone: the fields bounded by the model's vocabulary."""
    if params.top_k > limits.vocab_size:
        raise InvalidRequestError("sampling.top_k", f"must be at most the vocabulary size {limits.vocab_size}")
    if any(t >= limits.vocab_size for t in params.stop_token_ids):
        raise InvalidRequestError("sampling.stop_token_ids", f"must be in [0, {limits.vocab_size})")


def check_text_size(request: serving_pb2.GenerateRequest, limits: ModelLimits) -> None:
    """Before tokenizing: text that could not fit the context however it tokenized is refused."""
    kind = request.WhichOneof("input")
    texts = (
        [request.prompt] if kind == "prompt" else [m.content for m in request.chat.messages] if kind == "chat" else []
    )
    most = limits.max_model_len * MAX_CHARS_PER_TOKEN
    if sum(len(t) for t in texts) > most:
        raise InvalidRequestError(kind, f"longer than {most} characters: it cannot fit the model's context")


def prompt_token_ids(request: serving_pb2.GenerateRequest, tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("prompt", "give one of prompt, chat or prompt_token_ids")
    if kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
        if not ids:
            raise InvalidRequestError("prompt_token_ids", "must not be empty")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise InvalidRequestError("prompt_token_ids", f"must be in [0, {vocab_size})")
        return ids
    if tokenizer is None:
        raise InvalidRequestError(kind, "this model has no tokenizer; send prompt_token_ids")
    if kind == "prompt":
        if not request.prompt.strip():
            raise InvalidRequestError("prompt", "must not be empty")
        return tokenizer.encode(request.prompt)
    return tokenizer.apply_chat_template(_chat_messages(request.chat))


def _chat_messages(chat: serving_pb2.Chat) -> list[dict]:
    if not chat.messages:
        raise InvalidRequestError("chat.messages", "must not be empty")
    messages = []
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(f"chat.messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}")
        messages.append({"role": m.role, "content": m.content})
    return messages


def max_tokens_that_fit(num_prompt_tokens: int, limits: ModelLimits) -> int:
    """The most output tokens a prompt of this length leaves room for, in the model's context and
    in an instance's KV cache."""
    room = limits.max_model_len
    if limits.blocks_held(room) > limits.max_blocks_per_request:  # (under a window that fits, any length does)
        room = min(room, limits.max_blocks_per_request * limits.block_size)
    return room - num_prompt_tokens


def check_fits(num_prompt_tokens: int, params: SamplingParams, limits: ModelLimits) -> None:
    check_prompt_fits(
        num_prompt_tokens,
        params.max_tokens,
        limits.max_model_len,
        limits.block_size,
        limits.max_blocks_per_request,
        field_prefix="sampling.",
        max_blocks_held=limits.blocks_held(num_prompt_tokens + params.max_tokens),
    )
