"""Tokenizer wrapper and incremental detokenization, with the default model's tokenizer and two tiny
ones built here: byte-level BPE (GPT-2 style) and SentencePiece-like BPE with byte fallback (Llama 2 style)."""

from __future__ import annotations

import os
import string

import pytest

from disagg.engine.loader import default_gguf_path
from disagg.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from disagg.errors import InvalidRequestError

TEXTS = [
    "Hello world",
    "Café crème, naïve façade, Ångström, Straße",
    "Emoji: 🙂👍🏽 and a family 👨‍👩‍👧 at the end 🎉",
    "中文字符，日本語のテキスト、한국어",
    "mixed: a→b ≠ c ∑ x² — “quotes” …",
]


@pytest.fixture(scope="module")
def smollm():
    from transformers import AutoTokenizer

    path = default_gguf_path()
    return Tokenizer(AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)))


@pytest.fixture(scope="module")
def byte_level():
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(["hello world, the quick brown fox jumps"] * 20, trainer)
    return Tokenizer(
        PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    )


@pytest.fixture(scope="module")
def sentencepiece_like():
    """Like Llama 2's tokenizer.json: '▁' for spaces, <0xXX> byte fallback, BOS added, leading space stripped on decode."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for char in "▁" + string.ascii_letters + string.digits + ",.!?:'-":
        vocab.setdefault(char, len(vocab))
    merges = [
        ("▁", "w"),
        ("▁w", "o"),
        ("▁wo", "r"),
        ("H", "e"),
        ("He", "l"),
        ("Hel", "l"),
        ("Hell", "o"),
        ("▁", "Hello"),
    ]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return Tokenizer(
        PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    )


@pytest.fixture(params=["smollm", "byte_level", "sentencepiece_like"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def stream(tokenizer, prompt_ids, ids, step=1, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas = [detok.add_tokens(ids[i : i + step]) for i in range(0, len(ids), step)]
    return detok, deltas


# ---- Tokenizer -----------------------------------------------------------------------------------
def test_encode_decode_round_trip(tokenizer):
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_bos_only_where_the_tokenizer_adds_it(smollm, sentencepiece_like):
    assert smollm.encode("Hello")[0] != smollm.hf_tokenizer.bos_token_id  # SmolLM2 adds no BOS
    assert sentencepiece_like.encode("Hello")[0] == 1
    assert sentencepiece_like.encode("Hello")[1:] == sentencepiece_like.hf_tokenizer.encode(
        "Hello", add_special_tokens=False
    )


def test_eos_token_ids(smollm, byte_level):
    assert smollm.eos_token_ids == (2,) and byte_level.eos_token_ids == (2,)


def test_chat_template(smollm):
    ids = smollm.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}])
    assert (
        smollm.decode(ids, skip_special_tokens=False)
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> as one special token, not spelled out


def test_chat_template_missing_or_bad_messages(smollm, byte_level):
    with pytest.raises(ValueError, match="no chat template"):
        byte_level.apply_chat_template([{"role": "user", "content": "hi"}])
    for bad in ([], "hi", [{"role": "user"}], [{"content": "x"}], [{"role": "user", "content": 3}]):
        with pytest.raises(InvalidRequestError, match="messages"):
            smollm.apply_chat_template(bad)


# ---- IncrementalDetokenizer ----------------------------------------------------------------------
@pytest.mark.parametrize("step", [1, 3])
def test_deltas_join_to_the_full_decode(tokenizer, step):
    prompt_ids = tokenizer.encode("Tell me something:")
    for text in TEXTS:
        ids = tokenizer.hf_tokenizer.encode(" " + text, add_special_tokens=False)  # output ids carry no BOS
        detok, deltas = stream(tokenizer, prompt_ids, ids, step)
        assert "".join(deltas) == detok.text
        assert tokenizer.decode(prompt_ids + ids) == tokenizer.decode(prompt_ids) + detok.text
        assert not any("\ufffd" in d for d in deltas), deltas
        assert detok.text.strip() == text


def test_byte_level_deltas_equal_decode_of_all_ids(byte_level, smollm):
    for tokenizer in (byte_level, smollm):
        for text in TEXTS:
            ids = tokenizer.encode(text)
            detok, _ = stream(tokenizer, [], ids)
            assert detok.text == tokenizer.decode(ids) == text


def test_split_character_is_held_back_until_complete(byte_level):
    ids = byte_level.encode("a🙂")  # the emoji's 4 UTF-8 bytes are 4 tokens in this tiny vocab
    assert len(ids) == 5
    _, deltas = stream(byte_level, [], ids)
    assert deltas == ["a", "", "", "", "🙂"]


def test_flush_emits_an_unfinished_character(byte_level):
    ids = byte_level.encode("a🙂")[:3]
    detok, deltas = stream(byte_level, [], ids)
    assert deltas == ["a", "", ""]
    assert detok.flush() == "\ufffd" and detok.text == "a\ufffd"


def test_first_output_token_keeps_its_leading_space(sentencepiece_like):
    prompt = sentencepiece_like.encode("Hello")
    ids = sentencepiece_like.hf_tokenizer.encode(" world", add_special_tokens=False)[1:]  # drop the lone '▁'
    assert sentencepiece_like.decode(ids) == "world"  # decoded alone, SentencePiece strips the space
    detok, _ = stream(sentencepiece_like, prompt, ids)
    assert detok.text == " world"


def test_special_tokens_skipped_unless_asked(smollm):
    ids = smollm.encode("Done.") + [2]  # <|im_end|>
    assert stream(smollm, [], ids)[0].text == "Done."
    assert stream(smollm, [], ids, skip_special_tokens=False)[0].text == "Done.<|im_end|>"


def test_each_step_decodes_a_small_window(byte_level):
    calls = []

    class Spy(Tokenizer):
        def decode(self, token_ids, **kwargs):
            calls.append(len(token_ids))
            return super().decode(token_ids, **kwargs)

    spy = Spy(byte_level.hf_tokenizer)
    ids = byte_level.encode("hello world 🙂 " * 200)
    detok, _ = stream(spy, list(range(3, 50)), ids)
    assert detok.text == byte_level.decode(ids)
    assert max(calls) <= 8  # bounded by the longest split character plus context, not the output length


def test_truncate(smollm):
    detok, _ = stream(smollm, [], smollm.encode("Hello STOP world"))
    detok.truncate(len("Hello "))
    assert detok.text == "Hello "
