"""GGUF files of the MoE families, written here as llama.cpp's converter writes them: Qwen3-MoE as
`qwen3moe`, Mixtral as `llama` with experts (its Q/K rows permuted), each layer's experts in one
3-D tensor per matrix (`ffn_{gate,up,down}_exps`) and the router as `ffn_gate_inp`. In F32 the
greedy output equals transformers' on the checkpoint itself; with the experts stored Q4_0 or Q8_0,
each expert matrix is kept quantized at the file's own values (weights: auto)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from support import describe_mismatches, hf_greedy, random_prompts

from disagg import LLM, SamplingParams
from disagg.engine.layers.quantized import Int4Weight, Int8Weight

PROMPT_LENGTHS = [1, 17, 60, 120]
MAX_TOKENS = 10
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}
ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}  # fmt: skip
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}  # fmt: skip


def gguf_tensors(hf_model, kind: str):
    """(GGUF name, float32 array) of every tensor, from transformers' in-memory (fused) layout."""
    config = hf_model.config
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy().copy()
        if name in TOP:
            yield TOP[name], array
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest.startswith("self_attn."):
            module = rest.split(".")[1]
            if kind == "mixtral" and module in ("q_proj", "k_proj"):
                heads = config.num_attention_heads if module == "q_proj" else config.num_key_value_heads
                array = permuted(array, heads)
            yield f"blk.{layer}.{ATTENTION[module]}.weight", array
        elif rest == "mlp.gate.weight":
            yield f"blk.{layer}.ffn_gate_inp.weight", array
        elif rest == "mlp.experts.gate_up_proj":
            half = array.shape[1] // 2
            yield f"blk.{layer}.ffn_gate_exps.weight", array[:, :half].copy()
            yield f"blk.{layer}.ffn_up_exps.weight", array[:, half:].copy()
        elif rest == "mlp.experts.down_proj":
            yield f"blk.{layer}.ffn_down_exps.weight", array
        else:
            norm = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm"}[rest]
            yield f"blk.{layer}.{norm}.weight", array


def permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(path, hf_model, kind: str, experts_as=None) -> str:
    """`experts_as`: a GGMLQuantizationType for the expert tensors (None: F32)."""
    config, arch = hf_model.config, GGUF_ARCH[kind]
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, config, kind)
    for name, array in gguf_tensors(hf_model, kind):
        if experts_as is not None and "_exps" in name:
            writer.add_tensor(name, gguf.quants.quantize(array, experts_as), raw_dtype=experts_as)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def write_metadata(writer, config, kind: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_expert_count(config.num_experts if kind == "qwen3_moe" else config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if kind == "qwen3_moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_weights_norm(config.norm_topk_prob)


@pytest.fixture(scope="module")
def hf_models(tiny_moe_checkpoint):
    """kind -> a tiny transformers model (Qwen3-MoE with every layer sparse, as a GGUF has it)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(kind: str):
        if kind not in cache:
            overrides = {"mlp_only_layers": []} if kind == "qwen3_moe" else {}
            path = tiny_moe_checkpoint(kind, seed=31, **overrides)
            cache[kind] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", sorted(GGUF_ARCH))
def test_a_moe_gguf_greedy_matches_transformers(tmp_path, hf_models, kind):
    hf = hf_models(kind)
    path = write_moe_gguf(tmp_path / f"{kind}.gguf", hf, kind)
    prompts = random_prompts(PROMPT_LENGTHS, hf.config.vocab_size, seed=4)
    refs = [hf_greedy(hf, p, MAX_TOKENS, with_margins=True) for p in prompts]
    expected, margins = [r[0] for r in refs], [r[1] for r in refs]
    llm = LLM(model=path, dtype="float32", max_num_batched_tokens=32, num_kv_blocks=64, cache_dir=str(tmp_path / "c"))
    assert llm.engine.model_config.architecture == kind
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == expected, f"{kind} from GGUF:\n" + describe_mismatches(prompts, expected, got, margins)


@pytest.mark.parametrize(
    "qtype,kept_as", [(gguf.GGMLQuantizationType.Q4_0, Int4Weight), (gguf.GGMLQuantizationType.Q8_0, Int8Weight)]
)
def test_quantized_experts_stay_quantized_at_the_files_values(tmp_path, hf_models, qtype, kept_as):
    hf = hf_models("qwen3_moe")
    path = write_moe_gguf(tmp_path / "q.gguf", hf, "qwen3_moe", experts_as=qtype)
    llm = LLM(model=path, dtype="float32", weights="auto", num_kv_blocks=64, cache_dir=str(tmp_path / "c"))
    experts = llm.engine.model.moe_layers()[0][1].experts
    assert experts.quantized and all(isinstance(g, kept_as) for pair in experts.gemms for g in pair)
    # Each expert matrix computes with the file's own values (dequantized by the gguf package).
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    gate = gguf.quants.dequantize(stored["blk.0.ffn_gate_exps.weight"].data, qtype)
    down = gguf.quants.dequantize(stored["blk.0.ffn_down_exps.weight"].data, qtype)
    inter = hf.config.moe_intermediate_size
    for e, (gate_up, down_gemm) in enumerate(experts.gemms):
        torch.testing.assert_close(gate_up.dequantized()[:inter], torch.from_numpy(gate[e]), rtol=0, atol=1e-3)
        torch.testing.assert_close(down_gemm.dequantized(), torch.from_numpy(down[e]), rtol=0, atol=1e-3)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in random_prompts([5, 40], 512, seed=2)], params)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
