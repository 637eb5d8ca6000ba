"""Qwen3-MoE and Mixtral (disagg/engine/models/qwen3_moe.py, mixtral.py) against transformers:
greedy output token for token in float32, prompts of mixed lengths in one batch, with and
without a chunking token budget; both checkpoint layouts load; quantized experts serve; each
expert's load is counted; EP2 and TP2 engines (real gloo groups) equal one rank."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import describe_mismatches, hf_greedy, random_prompts
from test_parallel_engine import sharded_engines

from disagg import LLM, SamplingParams
from disagg.config import EngineConfig
from disagg.engine.engine import LLMEngine

KINDS = ["qwen3_moe", "mixtral"]
PROMPT_LENGTHS = [1, 3, 16, 17, 40, 90, 150]
MAX_TOKENS = 12
BUDGETS = [512, 32]  # whole prompts, and chunks of at most 32 tokens


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(llm, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def cases(request):
    """kind -> (model dir, prompts, transformers' greedy tokens, its logit margins)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            from transformers import AutoModelForCausalLM

            model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            prompts = random_prompts(PROMPT_LENGTHS, 512, seed=5)
            refs = [hf_greedy(hf, p, MAX_TOKENS, with_margins=True) for p in prompts]
            cache[kind] = (model_dir, prompts, [r[0] for r in refs], [r[1] for r in refs])
        return cache[kind]

    return get


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(cases, kind, budget):
    model_dir, prompts, expected, margins = cases(kind)
    llm = LLM(model=model_dir, dtype="float32", max_num_batched_tokens=budget, num_kv_blocks=128)
    got = run(llm, prompts)
    assert got == expected, describe_mismatches(prompts, expected, got, margins)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    # Every token of every step went to k experts of each sparse layer (two in qwen3_moe's three).
    counts = llm.engine.expert_tokens()
    sparse_layers = 2 if kind == "qwen3_moe" else 2
    computed = sum(len(p) + MAX_TOKENS - 1 for p in prompts)
    assert len(counts) == 8 and sum(counts) == computed * 2 * sparse_layers


def test_fused_expert_layout_loads_the_same(cases, tmp_path):
    """transformers 5's in-memory layout (each layer's experts as two 3-D tensors, router under
    `mlp.`) gives the per-expert checkpoint's outputs."""
    model_dir, prompts, expected, _ = cases("mixtral")
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    fused = {k: v for k, v in tensors.items() if ".experts." not in k and ".gate." not in k}
    for layer in range(2):
        p = f"model.layers.{layer}.block_sparse_moe."
        experts = range(8)
        gate_up = [
            torch.cat([tensors[f"{p}experts.{e}.w1.weight"], tensors[f"{p}experts.{e}.w3.weight"]]) for e in experts
        ]
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [tensors[f"{p}experts.{e}.w2.weight"] for e in experts]
        )
        fused[f"model.layers.{layer}.mlp.gate.weight"] = tensors[f"{p}gate.weight"]
    save_file(fused, str(tmp_path / "model.safetensors"))
    with open(os.path.join(model_dir, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=128)
    assert run(llm, prompts) == expected


def test_quantized_experts_serve(cases):
    """weights int8: the experts kept quantized, one Int8Weight per expert matrix; the greedy
    outputs stay close to float32's (quantization changes near ties, not the model)."""
    model_dir, prompts, expected, _ = cases("qwen3_moe")
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=128, weights="int8")
    moe = llm.engine.model.moe_layers()[0][1]
    assert moe.experts.quantized and type(moe.experts.gemms[0][0]).__name__ == "Int8Weight"
    got = run(llm, prompts)
    agree = sum(g[:4] == e[:4] for g, e in zip(got, expected))
    assert agree >= len(prompts) - 1


def test_windowed_mixtral_matches_transformers(cases):
    """Mixtral with a sliding window of 32 on every layer, prompts up to 150 tokens (several
    windows) in chunks of 32: transformers' tokens."""
    model_dir, prompts, expected, margins = cases("mixtral_window")
    llm = LLM(model=model_dir, dtype="float32", max_num_batched_tokens=32, num_kv_blocks=128)
    assert llm.engine.model_config.attention_window(0) == 32
    got = run(llm, prompts)
    assert got == expected, describe_mismatches(prompts, expected, got, margins)


def greedy_steps(engine: LLMEngine, prompts) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, sampling_params=greedy(8))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "kind,tp,pp,expert_parallel",
    [
        ("qwen3_moe", 2, 1, True),
        ("qwen3_moe", 2, 1, False),
        ("mixtral", 2, 1, True),
        ("mixtral", 2, 1, False),
        ("qwen3_moe", 1, 2, False),  # a stage each side of the dense layer 1
        ("mixtral", 2, 2, True),
    ],
)
def test_sharded_engines_equal_one(tiny_qwen3_moe_dir, tiny_mixtral_dir, kind, tp, pp, expert_parallel):
    """EP (experts split over a stage's ranks, tokens by all-to-all), TP (each expert split) and
    PP over real gloo groups, a chunked budget: the single engine's tokens; an EP rank holds
    its share of the experts."""
    model_dir = tiny_qwen3_moe_dir if kind == "qwen3_moe" else tiny_mixtral_dir
    config = EngineConfig(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=24)
    prompts = random_prompts([5, 57, 1, 36], 512, seed=9)
    expected = greedy_steps(LLMEngine(config), prompts)
    engines = sharded_engines(config, tp, pp, enable_expert_parallel=expert_parallel)
    assert greedy_steps(engines[0], prompts) == expected
    experts = engines[-1].model.moe_layers()[0][1].experts
    assert experts.num_local_experts == (8 // tp if expert_parallel else 8)
    assert engines[0].num_free_blocks == engines[0].num_total_blocks


def test_expert_load_is_exposed_as_a_counter(tiny_mixtral_dir):
    """The engine's per-expert counts travel in the worker's load report and render as
    `disagg:moe_expert_tokens_total{instance, role, expert}`; a dense instance has none."""
    from disagg.metrics import ServingMetrics
    from disagg.worker.heartbeat import engine_load

    engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir, dtype="float32", device="cpu", num_kv_blocks=16))
    greedy_steps(engine, [[5, 6, 7, 8]])
    report = engine_load(engine)
    assert sum(report.expert_tokens) == (4 + 7) * 2 * 2  # 11 tokens computed, 2 experts, 2 layers
    metrics = ServingMetrics()
    metrics.set_expert_load("d0", "decode", report.expert_tokens)
    metrics.set_expert_load("p0", "prefill", [])
    text = metrics.render().decode()
    assert "# TYPE disagg:moe_expert_tokens_total counter" in text
    lines = [line for line in text.splitlines() if line.startswith("disagg:moe_expert_tokens_total{")]
    assert len(lines) == 8 and all('instance="d0"' in line and 'role="decode"' in line for line in lines)
    assert sum(float(line.rsplit(" ", 1)[1]) for line in lines) == sum(report.expert_tokens)
    metrics.remove_instance("d0", "decode")
    assert "disagg:moe_expert_tokens_total{" not in metrics.render().decode()
