"""What a frontend needs of the model its workers serve, as plain data a worker hands over: the
model's shape and its tokenizer's files (Dynamo's "model deployment card").

So a frontend reads no model files of its own: on a `ray up` cluster only the GPU nodes hold the
model (the head has neither its weights nor its tokenizer, nor the token that downloads them),
and the frontend tokenizes with exactly the tokenizer the workers loaded, a `tokenizer:` override
or a GGUF's converted one included.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from disagg.engine.loader import load_hf_tokenizer
from disagg.engine.model_config import ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ModelCard:
    model: str  # the spec the workers loaded (EngineConfig.model)
    config: ModelConfig
    tokenizer_files: dict[str, bytes] = field(default_factory=dict, hash=False)  # file name -> contents; {}: none
    # The bytes of one element of the workers' KV cache (4 for float32, CPU's `dtype: auto`); 0: not said.
    kv_element_bytes: int = 0

    def tokenizer(self) -> "PreTrainedTokenizerBase | None":
        """The workers' tokenizer, rebuilt from its files (None when the model has none)."""
        if not self.tokenizer_files:
            return None
        with tempfile.TemporaryDirectory(prefix="disagg-tokenizer-") as directory:
            for name, contents in self.tokenizer_files.items():
                with open(os.path.join(directory, name), "wb") as f:
                    f.write(contents)
            return load_hf_tokenizer(directory)


def model_card(
    model: str, config: ModelConfig, hf_tokenizer: "PreTrainedTokenizerBase | None", kv_element_bytes: int = 0
) -> ModelCard:
    """The card of a loaded model: its tokenizer as `save_pretrained` writes it."""
    if hf_tokenizer is None:
        return ModelCard(model, config, kv_element_bytes=kv_element_bytes)
    with tempfile.TemporaryDirectory(prefix="disagg-tokenizer-") as directory:
        hf_tokenizer.save_pretrained(directory)
        files = {}
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name), "rb") as f:
                files[name] = f.read()
    return ModelCard(model, config, files, kv_element_bytes)
