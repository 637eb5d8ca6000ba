"""Model loading: HF dirs, GGUF files (tiny ones written here, and the real default model), random shapes."""

from __future__ import annotations

import dataclasses
import os
import time

import gguf
import numpy as np
import pytest
import torch
from support import tiny_tokenizer

from disagg.config import DEFAULT_MODEL
from disagg.engine import gguf_convert
from disagg.engine.gguf_convert import llama3_factors, llama3_scaling_from_factors, unpermute_rotary
from disagg.engine.loader import load_model_source
from disagg.engine.models import expected_weight_shapes
from disagg.errors import ModelLoadError

torch.set_num_threads(2)

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# ---- helpers -------------------------------------------------------------------------------------
def save_hf_model(directory, arch="llama", *, tie=False, shard_size=None, seed=0, **overrides):
    """A tiny HF checkpoint written by transformers itself; returns its state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    model = model_cls(config_cls(**{**TINY, "tie_word_embeddings": tie, "rope_theta": 5000.0, **overrides}))
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(directory, **kwargs)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tie:
        state.pop("lm_head.weight")
    return state


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, copied (the thing we must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{index}.{GGUF_LAYER_NAMES[module]}.{suffix}"


def write_gguf(
    path, state, *, arch="llama", qtype=gguf.GGMLQuantizationType.F32, heads=4, kv_heads=2, extra_tensors=()
):
    """A GGUF the way llama.cpp's converter writes one: Q/K permuted (llama), 2-D weights quantized."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(TINY["max_position_embeddings"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(5000.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in state.items():
        array = tensor.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            array = llama_cpp_permute(array, heads if ".q_proj." in name else kv_heads)
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), array)
    for name, array, *raw_dtype in extra_tensors:  # (name, array) or (name, raw bytes, their GGML type)
        writer.add_tensor(name, array, raw_dtype=raw_dtype[0] if raw_dtype else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def quant_roundtrip(tensor: torch.Tensor, qtype) -> torch.Tensor:
    """What a quantized GGUF holds for this tensor, dequantized (rows quantize independently,
    so the row permutation commutes with it)."""
    if tensor.ndim != 2 or qtype == gguf.GGMLQuantizationType.F32:
        return tensor.float()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(tensor.float().numpy(), qtype), qtype))


def weights(source) -> dict[str, torch.Tensor]:
    return dict(source.iter_weights())


# ---- Hugging Face directories --------------------------------------------------------------------
@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_hf_dir_loads_config_and_equal_tensors(tmp_path, arch, tie):
    state = save_hf_model(tmp_path / "m", arch, tie=tie)
    source = load_model_source(str(tmp_path / "m"), cache_dir=str(tmp_path / "cache"))
    cfg = source.config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (arch, 256, 64, 128)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.rope_theta) == (128, 1e-6, 5000.0)
    assert cfg.tie_word_embeddings is tie and cfg.attention_bias is (arch == "qwen2")
    assert source.tokenizer is None and source.path == str(tmp_path / "m")
    loaded = weights(source)
    assert sorted(loaded) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    assert [n for n, _ in source.iter_weights()] == [n for n, _ in expected_weight_shapes(cfg)]


def test_hf_dir_with_several_shards(tmp_path):
    state = save_hf_model(tmp_path / "m", shard_size="100KB")
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    loaded = weights(load_model_source(str(tmp_path / "m"), cache_dir=str(tmp_path)))
    assert sorted(loaded) == sorted(state)
    assert all(torch.equal(loaded[n], t) for n, t in state.items())


def test_iter_weights_yields_one_tensor_at_a_time(tmp_path):
    save_hf_model(tmp_path / "m")
    iterator = load_model_source(str(tmp_path / "m"), cache_dir=str(tmp_path)).iter_weights()
    name, tensor = next(iterator)
    assert name == "model.embed_tokens.weight" and tensor.shape == (256, 64) and tensor.device.type == "cpu"


def test_hf_dir_tokenizer_is_loaded_when_present(tmp_path):
    save_hf_model(tmp_path / "m", vocab_size=320)
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    source = load_model_source(str(tmp_path / "m"), cache_dir=str(tmp_path))
    assert source.tokenizer is not None
    assert source.tokenizer.decode(source.tokenizer.encode("hello world")) == "hello world"


# ---- random weights ------------------------------------------------------------------------------
def test_random_llama3_8b_config_without_materializing():
    source = load_model_source("random:llama3-8b", cache_dir="/nonexistent")
    cfg = source.config
    assert (
        cfg.architecture,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    ) == ("llama", 32, 4096, 32, 8)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.max_position_embeddings, cfg.head_dim) == (
        14336,
        128256,
        500000.0,
        131072,
        128,
    )
    assert cfg.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert source.path is None and source.tokenizer is None and not cfg.tie_word_embeddings
    shapes = dict(expected_weight_shapes(cfg))
    assert len(shapes) == 2 + 32 * 9 + 1
    assert shapes["model.layers.31.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (4096, 14336)
    assert sum(np.prod(s) for s in shapes.values()) == 8_030_261_248  # Llama-3-8B's published parameter count


def test_random_named_shapes():
    q = load_model_source("random:qwen2-7b", cache_dir="/x").config
    assert (
        q.architecture == "qwen2"
        and q.attention_bias
        and (q.num_hidden_layers, q.hidden_size, q.num_key_value_heads) == (28, 3584, 4)
    )
    assert dict(expected_weight_shapes(q))["model.layers.0.self_attn.k_proj.bias"] == (512,)
    l13 = load_model_source("random:llama2-13b", cache_dir="/x").config
    assert (
        l13.num_hidden_layers,
        l13.hidden_size,
        l13.num_attention_heads,
        l13.num_key_value_heads,
        l13.vocab_size,
    ) == (40, 5120, 40, 40, 32000)
    l7 = load_model_source("random:llama2-7b", cache_dir="/x").config
    assert (l7.num_hidden_layers, l7.hidden_size, l7.intermediate_size) == (32, 4096, 11008)
    s = load_model_source("random:smollm2-135m", cache_dir="/x").config
    assert (
        s.num_hidden_layers,
        s.hidden_size,
        s.num_attention_heads,
        s.num_key_value_heads,
        s.vocab_size,
        s.tie_word_embeddings,
    ) == (30, 576, 9, 3, 49152, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_tiny_materializes_deterministically(dtype):
    source = load_model_source("random:tiny", cache_dir="/x", random_dtype=dtype)
    first, second = weights(source), weights(source)
    assert [(n, tuple(t.shape)) for n, t in first.items()] == expected_weight_shapes(source.config)
    for name, tensor in first.items():
        assert tensor.dtype == dtype and torch.equal(tensor, second[name])
        if name.endswith("norm.weight"):
            assert torch.all(tensor == 1)
        else:
            assert abs(tensor.float().std().item() - 0.02) < 0.004, name
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], first["model.layers.1.mlp.up_proj.weight"])


def test_random_with_tokenizer_from_another_model(tmp_path):
    save_hf_model(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    source = load_model_source("random:tiny", cache_dir=str(tmp_path), tokenizer=str(tmp_path / "m"))
    assert source.tokenizer is not None and source.path is None
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        save_hf_model(tmp_path / "bare")
        load_model_source("random:tiny", cache_dir=str(tmp_path), tokenizer=str(tmp_path / "bare"))


# ---- GGUF (tiny files written here) --------------------------------------------------------------
Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_matches_the_hf_weights_it_was_converted_from(tmp_path, qtype):
    state = save_hf_model(tmp_path / "hf")
    path = write_gguf(tmp_path / "tiny.gguf", state, qtype=qtype)
    source = load_model_source(path, cache_dir=str(tmp_path / "cache"))
    cfg = source.config
    assert (cfg.architecture, cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        "llama",
        256,
        4,
        2,
        16,
    )
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.bos_token_id, cfg.eos_token_ids, cfg.tie_word_embeddings) == (
        1e-6,
        5000.0,
        1,
        (2,),
        False,
    )
    assert source.tokenizer is None and source.path.startswith(str(tmp_path / "cache" / "gguf"))
    # what config.json in the cache says is what the GGUF metadata said
    assert source.config == dataclasses.replace(
        gguf_convert.gguf_model_config(gguf_convert.open_gguf(path), path), name="tiny"
    )
    loaded = weights(source)
    assert sorted(loaded) == sorted(state)
    for name, tensor in state.items():
        expected = quant_roundtrip(tensor, qtype)
        assert torch.equal(loaded[name].float(), expected.float()), name
        assert torch.allclose(loaded[name].float(), tensor, atol=0.02), name  # and it is the right tensor


def test_gguf_qwen2_with_bias_is_not_permuted(tmp_path):
    state = save_hf_model(tmp_path / "hf", "qwen2", tie=True)
    source = load_model_source(write_gguf(tmp_path / "q.gguf", state, arch="qwen2"), cache_dir=str(tmp_path / "c"))
    assert source.config.architecture == "qwen2" and source.config.attention_bias and source.config.tie_word_embeddings
    loaded = weights(source)
    assert sorted(loaded) == sorted(state) and "lm_head.weight" not in loaded
    assert all(torch.equal(loaded[n], t) for n, t in state.items())


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)  # 2 heads of head_dim 8
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 2))
    assert torch.equal(unpermute_rotary(permuted, 2), w)
    # llama.cpp pairs adjacent rows (0,1) where HF pairs rows j, j + head_dim/2 (0,4): rows 0 and 4 of head 0
    assert torch.equal(permuted[1], w[4]) and torch.equal(permuted[8 + 1], w[8 + 4])


def test_llama3_rope_scaling_is_recovered_from_rope_freqs():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    factors = llama3_factors(scaling, 500000.0, 128)
    assert factors[0] == 1.0 and factors[-1] == 8.0
    assert llama3_scaling_from_factors(factors, 500000.0, 128) == scaling
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        llama3_scaling_from_factors(factors.flip(0), 500000.0, 128)


def test_gguf_with_rope_freqs_gets_llama3_scaling(tmp_path):
    state = save_hf_model(tmp_path / "hf")
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    factors = llama3_factors(scaling, 5000.0, 16).numpy()
    path = write_gguf(tmp_path / "r.gguf", state, extra_tensors=[("rope_freqs.weight", factors)])
    source = load_model_source(path, cache_dir=str(tmp_path / "c"))
    assert source.config.rope_scaling == scaling
    assert "rope_freqs.weight" not in weights(source)


def test_gguf_cache_is_reused_and_invalidated_by_mtime(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "tiny.gguf", save_hf_model(tmp_path / "hf"))
    cache = str(tmp_path / "cache")
    first = load_model_source(path, cache_dir=cache)
    assert sorted(os.listdir(tmp_path / "cache" / "gguf")) == [os.path.basename(first.path)]  # no temp dir left
    assert {"config.json", "model.safetensors"} <= set(os.listdir(first.path))

    def no_conversion(*args):
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(gguf_convert, "convert_gguf", no_conversion)
    assert load_model_source(path, cache_dir=cache).path == first.path
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a replaced file must not reuse the old copy
    with pytest.raises(AssertionError, match="converted again"):
        load_model_source(path, cache_dir=cache)


def test_gguf_conversion_race_lost_to_another_process(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "tiny.gguf", save_hf_model(tmp_path / "hf"))
    cache = str(tmp_path / "cache")
    real_convert = gguf_convert.convert_gguf
    final = os.path.join(cache, "gguf", gguf_convert.cache_key(path))

    def convert_while_another_process_wins(gguf_path, out_dir):
        os.makedirs(final)
        real_convert(gguf_path, final)
        return real_convert(gguf_path, out_dir)

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert_while_another_process_wins)
    source = load_model_source(path, cache_dir=cache)
    assert source.path == final and len(weights(source)) == len(expected_weight_shapes(source.config))
    assert os.listdir(os.path.join(cache, "gguf")) == [os.path.basename(final)]


# ---- bad inputs ----------------------------------------------------------------------------------
def test_nonexistent_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model_source(str(tmp_path / "nope"), cache_dir=str(tmp_path))


def test_unknown_random_shape_lists_known_ones():
    with pytest.raises(ModelLoadError, match=r"unknown random shape 'nope'.*llama3-8b.*tiny"):
        load_model_source("random:nope", cache_dir="/x")


@pytest.mark.parametrize("keep_fraction", [0.02, 0.5, 0.99])
def test_truncated_gguf(tmp_path, keep_fraction):
    path = write_gguf(tmp_path / "tiny.gguf", save_hf_model(tmp_path / "hf"), qtype=Q.Q8_0)
    data = open(path, "rb").read()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        load_model_source(str(bad), cache_dir=str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache" / "gguf") == []  # no half-written cache entry


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="x.gguf: not a readable GGUF"):
        load_model_source(str(tmp_path / "x.gguf"), cache_dir=str(tmp_path))


def test_gguf_missing_a_tensor(tmp_path):
    state = save_hf_model(tmp_path / "hf")
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(
        ModelLoadError, match=r"m.gguf: lacks the tensor that becomes model.layers.1.mlp.up_proj.weight"
    ):
        load_model_source(write_gguf(tmp_path / "m.gguf", state), cache_dir=str(tmp_path / "c"))


def test_unwritable_cache_dir(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", save_hf_model(tmp_path / "hf"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelLoadError, match="cache_dir"):
        load_model_source(path, cache_dir=str(tmp_path / "file"))


def test_gguf_with_a_quantization_it_cannot_read(tmp_path):
    """Q8_1 (llama.cpp's activation format) has no dequantizer: the load fails naming it, not later."""
    state = save_hf_model(tmp_path / "hf")
    name = "model.layers.1.mlp.up_proj.weight"
    rows, cols = state.pop(name).shape
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = np.zeros((rows, cols // block_elements * block_bytes), dtype=np.uint8)
    path = write_gguf(
        tmp_path / "m.gguf", state, extra_tensors=[(gguf_name(name), raw, gguf.GGMLQuantizationType.Q8_1)]
    )
    with pytest.raises(ModelLoadError, match=r"m.gguf: tensor blk.1.ffn_up.weight has unsupported type Q8_1"):
        load_model_source(path, cache_dir=str(tmp_path / "c"))


def test_gguf_of_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", save_hf_model(tmp_path / "hf"), arch="gpt2")
    with pytest.raises(ModelLoadError, match="general.architecture 'gpt2' is not supported"):
        load_model_source(path, cache_dir=str(tmp_path))


def test_garbage_safetensors(tmp_path):
    save_hf_model(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(os.urandom(1000))
    with pytest.raises(ModelLoadError, match="model.safetensors: not a readable safetensors"):
        load_model_source(str(tmp_path / "m"), cache_dir=str(tmp_path))


def test_truncated_safetensors(tmp_path):
    save_hf_model(tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model_source(str(tmp_path / "m"), cache_dir=str(tmp_path))


def test_dir_without_config_json(tmp_path):
    save_hf_model(tmp_path / "m")
    os.remove(tmp_path / "m" / "config.json")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model_source(str(tmp_path / "m"), cache_dir=str(tmp_path))


def test_dir_with_unsupported_model_type(tmp_path):
    save_hf_model(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        load_model_source(str(tmp_path / "m"), cache_dir=str(tmp_path))


def test_checkpoint_that_does_not_match_its_config(tmp_path):
    save_hf_model(tmp_path / "m")
    config = (tmp_path / "m" / "config.json").read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 3')
    (tmp_path / "m" / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match="lacks tensor model.layers.2"):
        load_model_source(str(tmp_path / "m"), cache_dir=str(tmp_path))


def test_tokenizer_larger_than_the_model_vocab(tmp_path):
    save_hf_model(tmp_path / "m", vocab_size=100)
    tiny_tokenizer().save_pretrained(tmp_path / "m")  # 259 tokens: 256 bytes + 3 special
    with pytest.raises(ModelLoadError, match="more than the model's vocab_size 100"):
        load_model_source(str(tmp_path / "m"), cache_dir=str(tmp_path))


# ---- the real default model (slow: converts a 98 MB GGUF) ----------------------------------------
@pytest.fixture(scope="module")
def default_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    started = time.perf_counter()
    source = load_model_source(DEFAULT_MODEL, cache_dir=str(cache))
    return str(cache), source, time.perf_counter() - started


@pytest.mark.slow
def test_default_model_config_cache_and_tokenizer(default_cache):
    cache, source, cold_seconds = default_cache
    cfg = source.config
    assert (
        cfg.architecture,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    ) == ("llama", 30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.tie_word_embeddings, cfg.max_position_embeddings) == (
        49152,
        1536,
        True,
        8192,
    )
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.bos_token_id, cfg.eos_token_ids, cfg.name) == (
        100000.0,
        1e-5,
        1,
        (2,),
        DEFAULT_MODEL,
    )
    assert os.path.dirname(source.path) == os.path.join(cache, "gguf")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(source.path))

    started = time.perf_counter()
    again = load_model_source(DEFAULT_MODEL, cache_dir=cache)
    warm_seconds = time.perf_counter() - started
    assert again.path == source.path and again.config == cfg
    assert warm_seconds < cold_seconds / 3, (warm_seconds, cold_seconds)
    loaded = weights(again)
    assert len(loaded) == 2 + 30 * 9 and loaded["model.embed_tokens.weight"].shape == (49152, 576)

    tokenizer = again.tokenizer
    text = "Hello, world! Ça va? 🙂 中文"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert "<|im_start|>" in tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_default_model_q_k_match_transformers_gguf_loader(default_cache, default_hf_reference):
    ref = default_hf_reference[1].state_dict()
    ours = weights(default_cache[1])
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ):
        assert torch.equal(ours[name].float(), ref[name].float()), name


@pytest.mark.slow
def test_random_smollm2_with_the_default_models_tokenizer(default_cache):
    source = load_model_source("random:smollm2-135m", cache_dir=default_cache[0], tokenizer=DEFAULT_MODEL)
    assert source.path is None and source.tokenizer is not None and source.tokenizer.chat_template
    with pytest.raises(ModelLoadError, match="vocab_size 512"):
        load_model_source("random:tiny", cache_dir=default_cache[0], tokenizer=DEFAULT_MODEL)
