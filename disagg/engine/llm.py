"""The offline API, named as vLLM's so that users' scripts feel at home:

from disagg import LLM, SamplingParams
llm = LLM(model="...", dtype="float32")
outputs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from disagg.config import EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.engine.outputs import RequestOutput
from disagg.errors import InvalidRequestError
from disagg.request import SamplingParams, priority_value

PromptType = str | dict


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        config = EngineConfig(**({"model": model} if model else {}), **engine_args)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: int | str | Sequence[int | str] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; results in input order.
        `priority`: one per prompt, as vLLM's (lower runs first, 0 by default) or by our names
        (critical, standard, sheddable)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        priorities = self._priority_per_prompt(priority, len(prompts))
        ids = [self._add(prompt, p, rank) for prompt, p, rank in zip(prompts, params, priorities)]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.tokenizer is None:
            raise InvalidRequestError("messages", "this model has no tokenizer (and so no chat template)")
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(c)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add(self, prompt: PromptType, params: SamplingParams, priority: int) -> str:
        request_id = str(next(self._ids))
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                raise InvalidRequestError("prompt", "a dict prompt needs 'prompt_token_ids' or 'prompt'")
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        else:
            text, token_ids = prompt, None
        self.engine.add_request(request_id, text, token_ids, params, priority=priority)
        return request_id

    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise InvalidRequestError("sampling_params", f"got {len(params)} for {n} prompts")
        return params

    @staticmethod
    def _priority_per_prompt(priority, n: int) -> list[int]:
        """Checked before any prompt is added (a bad one must not leave the others half-added)."""
        if priority is None:
            return [0] * n
        if isinstance(priority, (int, str)):  # vLLM takes a list only; one for all is no surprise
            return [priority_value(priority)] * n
        priorities = list(priority)
        if len(priorities) != n:
            raise InvalidRequestError("priority", f"got {len(priorities)} for {n} prompts")
        return [priority_value(p) for p in priorities]
