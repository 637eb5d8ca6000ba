"""A thin wrapper over a Hugging Face tokenizer, and per-request incremental detokenization."""

from __future__ import annotations

from collections.abc import Iterable

from disagg.errors import InvalidRequestError

# Prompt tokens kept as context for the first output token: SentencePiece tokenizers drop the
# leading space of the first token they decode, so "world" needs "Hello" before it (vLLM uses 5).
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for the first bytes of an unfinished UTF-8 char


class Tokenizer:
    def __init__(self, hf_tokenizer):
        self.hf_tokenizer = hf_tokenizer
        eos = hf_tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (int(eos),) if eos is not None else ()

    def __len__(self) -> int:
        return len(self.hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        """Adds BOS (or other special tokens) only where the tokenizer does by default."""
        return list(self.hf_tokenizer.encode(text))

    def decode(self, token_ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        # Skipping special tokens by default, as vLLM does: users should not see "<|im_end|>".
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of the conversation followed by the assistant's generation prompt."""
        if not getattr(self.hf_tokenizer, "chat_template", None):
            raise InvalidRequestError("messages", "this model's tokenizer has no chat template")
        _check_messages(messages)
        try:
            text = self.hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # templates reject bad conversations with raise_exception(...)
            raise InvalidRequestError("messages", f"the chat template rejected them: {exc}") from exc
        # The template already wrote BOS where the model wants one; don't add a second.
        return list(self.hf_tokenizer.encode(text, add_special_tokens=False))


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {'role': ..., 'content': ...}")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise InvalidRequestError(f"messages[{i}]", "must be a dict with string 'role' and 'content'")


class IncrementalDetokenizer:
    """Per request: feed new token ids, get the new text delta.

    As vLLM's detokenize_incrementally: only a window of tokens is decoded each time, from
    `prefix_offset` (context already emitted) to the end; the text past the decoded
    `[prefix_offset, read_offset)` is the delta. A delta ending in U+FFFD is held back, because a
    multi-byte character split across tokens decodes to U+FFFD until its last byte arrives.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        prompt_token_ids = list(prompt_token_ids)
        self._window = prompt_token_ids[
            max(len(prompt_token_ids) - INITIAL_CONTEXT_TOKENS, 0) :
        ]  # tokens from prefix_offset on
        self._read_offset = len(self._window)  # relative to the window; the window starts at prefix_offset
        self._text = ""

    @property
    def text(self) -> str:
        """All output text so far."""
        return self._text

    def add_tokens(self, token_ids: list[int]) -> str:
        """The text the new tokens complete (may be "" while a character is unfinished)."""
        delta = "".join(self._add_token(int(t)) for t in token_ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: whatever is held back, even an unfinished character."""
        delta = self._delta(allow_incomplete=True)
        self._text += delta
        return delta

    def truncate(self, num_chars: int) -> None:
        """Cut the text (e.g. at a stop string); nothing more should be added afterwards."""
        self._text = self._text[:num_chars]

    def _add_token(self, token_id: int) -> str:
        self._window.append(token_id)
        return self._delta(allow_incomplete=False)

    def _delta(self, *, allow_incomplete: bool) -> str:
        prefix_text = self._decode(self._window[: self._read_offset])
        new_text = self._decode(self._window)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT_CHAR) and not allow_incomplete):
            return ""
        # The tokens just emitted become the next context; older ones are never decoded again.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return new_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
