"""Grammars of structured output, compiled for one tokenizer with llguidance.

Why llguidance (over xgrammar, the other library vLLM and SGLang use): its wheel is 3 MB with no
dependencies (xgrammar pulls Triton and a TVM runtime onto every CPU host); on this project's
tokenizer it builds the token trie in 0.5 s once, compiles a JSON schema in ~4 ms and computes a
mask in 10-35 us; it takes JSON schemas, regexes, Lark and GBNF (llama.cpp's EBNF) grammars; and
it computes the tokens a grammar forces (jump-forward) on the token level, tokenized as the model
would, so appending them never leaves the model's own tokenization.

Pure: no torch. The router checks a request's grammar here before it runs; the engine compiles
it here and keeps its state per request (disagg.engine.guided_decoding).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from disagg.errors import InvalidRequestError
from disagg.request import StructuredOutput

# Compiled grammars kept per tokenizer: requests of one service mostly share a few schemas.
COMPILED_KEPT = 64
# JSON without optional whitespace: the densest output, and every key and bracket is then forced,
# so jump-forward appends them. A schema may allow whitespace with llguidance's "x-guidance" key.
JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_text(structured: StructuredOutput) -> str:
    """llguidance's grammar for a request's structured output; InvalidRequestError when its spec
    does not even parse (a schema that is not JSON, a choice that is not a list of strings)."""
    kind, spec = structured.kind, structured.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(_json_object(spec), defaults=JSON_DEFAULTS)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(_choices(spec)))
    try:
        return llguidance.grammar_from("regex" if kind == "regex" else "grammar", spec)
    except ValueError as exc:  # GBNF that does not convert
        raise InvalidRequestError("structured", f"invalid grammar: {exc}") from None


def _json_object(spec: str) -> dict:
    try:
        schema = json.loads(spec)
    except ValueError as exc:
        raise InvalidRequestError("structured", f"the JSON schema is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError("structured", "the JSON schema must be a JSON object")
    return schema


def _choices(spec: str) -> list[str]:
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError("structured", "choice must be a non-empty JSON list of non-empty strings")
    return choices


class GrammarCompiler:
    """Grammars compiled against one tokenizer: each distinct one once (the last COMPILED_KEPT),
    then copied per request, which costs microseconds."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] = ()):
        import llguidance.hf  # here: it imports transformers, which a router need not load otherwise

        eos = list(eos_token_ids) or None
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the router checks grammars from several threads

    def check(self, structured: StructuredOutput) -> None:
        """InvalidRequestError saying what is wrong with a grammar that cannot be compiled."""
        self.matcher(structured)

    def matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A matcher at the grammar's start, for one request."""
        with self._lock:
            compiled = self._compiled.get(structured)
            if compiled is not None:
                self._compiled.move_to_end(structured)
                return compiled.deep_copy()
        compiled = llguidance.LLMatcher(self._tokenizer, grammar_text(structured), log_level=0)
        if compiled.is_error():
            raise InvalidRequestError("structured", f"invalid {structured.kind}: {_brief(compiled.get_error())}")
        with self._lock:
            self._compiled[structured] = compiled
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()


def _brief(message: str, limit: int = 400) -> str:
    """The compiler's message on one line (it quotes the grammar over several)."""
    text = " ".join(message.split()) or "rejected by the grammar compiler"
    return text if len(text) <= limit else text[: limit - 3] + "..."
