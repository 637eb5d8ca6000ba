"""A worker's model card gives a frontend the model's shape and the very tokenizer the worker
loaded, as plain data (disagg.engine.model_card): the frontend reads no model file."""

from __future__ import annotations

import pickle

from disagg.config import DEFAULT_MODEL, EngineConfig
from disagg.engine.loader import load_model_source
from disagg.engine.model_card import model_card

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_cards_tokenizer_is_the_workers():
    source = load_model_source(DEFAULT_MODEL, cache_dir=EngineConfig().cache_dir)
    card = pickle.loads(pickle.dumps(model_card(DEFAULT_MODEL, source.config, source.tokenizer)))  # as Ray carries it
    assert card.config == source.config and all(isinstance(v, bytes) for v in card.tokenizer_files.values())
    rebuilt, original = card.tokenizer(), source.tokenizer
    text = "Héllo wörld, 東京 <|im_end|>"
    assert rebuilt.encode(text) == original.encode(text) and len(rebuilt) == len(original)
    assert rebuilt.eos_token_id == original.eos_token_id
    chat = rebuilt.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat == original.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_a_model_without_a_tokenizer_has_a_card_without_one():
    source = load_model_source("random:tiny", cache_dir=EngineConfig().cache_dir)
    card = model_card("random:tiny", source.config, None)
    assert card.tokenizer_files == {} and card.tokenizer() is None and card.config.vocab_size == 512
