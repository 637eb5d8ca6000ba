"""Structured output as the OpenAI API asks for it (`response_format`: `json_object`,
`json_schema`) and as vLLM's extensions do (`structured_outputs: {json, regex, grammar,
choice}`, and the older `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice`), read
into the public API's `StructuredOutput`. One request asks for one grammar at most.

Pure: no aiohttp. Whether the grammar compiles is checked on the request path, for both APIs.
"""

from __future__ import annotations

import json

from disagg.errors import InvalidRequestError
from disagg.v1 import serving_pb2

VLLM_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}
STRUCTURED_FIELDS = {"response_format", "structured_outputs", *VLLM_GUIDED}


def structured_output(body: dict) -> serving_pb2.StructuredOutput | None:
    """The grammar a request body asks its output to follow, or None for free text."""
    asked = {name: body[name] for name in STRUCTURED_FIELDS if body.get(name) is not None}
    if _is_text(asked.get("response_format")):  # free text, said out loud
        del asked["response_format"]
    if len(asked) > 1:
        raise InvalidRequestError(sorted(asked)[1], f"ask for one structured output at most, not {sorted(asked)}")
    if not asked:
        return None
    ((name, value),) = asked.items()
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _vllm_structured(name, value)
    return _vllm_kind(name, VLLM_GUIDED[name], value)


def _is_text(response_format) -> bool:
    return isinstance(response_format, dict) and response_format.get("type") == "text"


def _response_format(value) -> serving_pb2.StructuredOutput:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError("response_format", "must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
    if value["type"] == "json_object":
        return serving_pb2.StructuredOutput(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidRequestError("response_format.json_schema", "must be {'name': ..., 'schema': {...}}")
    return serving_pb2.StructuredOutput(json_schema=json.dumps(spec["schema"]))


def _vllm_structured(name: str, value) -> serving_pb2.StructuredOutput:
    if not isinstance(value, dict):
        raise InvalidRequestError(name, "must be an object with one of json, regex, grammar, choice")
    kinds = {k: v for k, v in value.items() if v is not None}
    if set(kinds) == {"json_object"} and kinds["json_object"] is True:
        return serving_pb2.StructuredOutput(json_object=True)
    unknown = sorted(set(kinds) - {"json", "regex", "grammar", "choice"})
    if unknown or len(kinds) != 1:
        raise InvalidRequestError(name, "give exactly one of json, regex, grammar, choice")
    ((kind, spec),) = kinds.items()
    return _vllm_kind(f"{name}.{kind}", kind, spec)


def _vllm_kind(field: str, kind: str, spec) -> serving_pb2.StructuredOutput:
    if kind == "json":
        if isinstance(spec, str):
            return serving_pb2.StructuredOutput(json_schema=spec)
        if isinstance(spec, dict):
            return serving_pb2.StructuredOutput(json_schema=json.dumps(spec))
        raise InvalidRequestError(field, "must be a JSON schema (an object, or its JSON text)")
    if kind == "choice":
        if not isinstance(spec, list) or not all(isinstance(c, str) for c in spec):
            raise InvalidRequestError(field, "must be a list of strings")
        return serving_pb2.StructuredOutput(choice=serving_pb2.ChoiceList(choices=spec))
    if not isinstance(spec, str):
        raise InvalidRequestError(field, "must be a string")
    return serving_pb2.StructuredOutput(**{kind: spec})
