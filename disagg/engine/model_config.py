"""The shape of a decoder-only model (dense or mixture-of-experts), independent of where its weights come from.

A family (disagg/engine/models/) maps its Hugging Face config.json onto these fields. Per layer,
attention is global or sliding-window: `layer_types` names each layer's kind as HF does
("full_attention", "sliding_attention"), `sliding_window` the window's length in tokens, its own
included (HF's `kv_idx > q_idx - sliding_window`). `attention_window(layer)` and `layer_groups`
are how the rest of the engine reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the MLP gate's activations the layers compute
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # the RoPE scalings layers/rotary.py computes


@dataclass(frozen=True)
class LayerGroup:
    """Layers that attend alike: the same window (None: global attention), so the same KV
    blocks of a request stay needed (what a block manager can free per group)."""

    window: int | None
    layers: tuple[int, ...]  # global layer indices


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the Hugging Face model_type ("llama", "qwen3", "gemma3_text", ...): names the family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)  # HF's dict, e.g. {"rope_type": "llama3", ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # QKV bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    sliding_window: int | None = None  # tokens a sliding-window layer attends to, its own included
    layer_types: tuple[str, ...] = ()  # each layer's LAYER_TYPES entry; () = every layer full_attention
    hidden_act: str = "silu"  # the MLP gate's activation (HIDDEN_ACTS)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before RoPE (Qwen3, Gemma 3)
    norms_per_layer: int = 2  # hidden-size norms a layer holds (Gemma 3: 4, before and after attention and MLP)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power, not head_dim's (Gemma)
    rope_local_theta: float | None = None  # sliding layers' RoPE base, unscaled, where not rope_theta (Gemma 3)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma)
    # Mixture of experts (num_experts 0: dense). A layer's MLP is `num_experts` experts of
    # `moe_intermediate_size`, each token routed to `num_experts_per_tok` of them, except in the
    # layers Qwen3-MoE keeps dense: those in `mlp_only_layers`, and all but every
    # `decoder_sparse_step`-th; a dense layer's MLP has `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the k routing weights renormalised to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling: rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (supported: {', '.join(HIDDEN_ACTS)})")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types: {len(self.layer_types)} entries for {self.num_hidden_layers} layers (num_hidden_layers)"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types: unsupported {unknown} (supported: {', '.join(LAYER_TYPES)})")
        windowed = SLIDING_ATTENTION in self.layer_types
        if windowed and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise ValueError(f"sliding_window: a positive number of tokens is needed, got {self.sliding_window!r}")

    @property
    def attention_scale(self) -> float:
        """What attention multiplies q.k by."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def uses_local_rope(self, layer: int) -> bool:
        """Whether (global) layer `layer` rotates by rope_local_theta (a sliding layer of Gemma 3)."""
        return self.rope_local_theta is not None and self.attention_window(layer) is not None

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of (global) layer `layer`, None where it attends to every position."""
        windowed = self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION
        return self.sliding_window if windowed else None

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """The layers by window, global attention first (one group for a model without windows)."""
        windows = sorted({self.attention_window(i) for i in range(self.num_hidden_layers)}, key=lambda w: w or 0)
        return tuple(
            LayerGroup(w, tuple(i for i in range(self.num_hidden_layers) if self.attention_window(i) == w))
            for w in windows
        )

    @property
    def shared_window(self) -> int | None:
        """The sliding window every layer has, after which a request's KV blocks may be released
        (disagg.engine.block_manager); None where some layer is global or the windows differ
        (releasing those would need a block table per layer group)."""
        groups = self.layer_groups
        return groups[0].window if len(groups) == 1 else None

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, in elements (multiply by dtype size)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    # ---- sizes: total (every weight, what memory holds) against active (what a token passes through)
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index`'s MLP is a mixture of experts (transformers' Qwen3-MoE rule)."""
        sparse = (index + 1) % self.decoder_sparse_step == 0 and index not in self.mlp_only_layers
        return self.is_moe and sparse

    @property
    def num_moe_layers(self) -> int:
        return sum(1 for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def expert_params(self) -> int:
        """One expert's gate, up and down matrices."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def linear_params(self, active: bool = False) -> int:
        """Weights of the decoder layers' matrices (attention, MLPs or experts and their
        routers), without biases, norms or embeddings; `active`: those one token passes through
        (its k experts of each MoE layer), else all of them."""
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = experts * self.expert_params + self.num_experts * self.hidden_size
        dense_layers = self.num_hidden_layers - self.num_moe_layers
        return (
            self.num_hidden_layers * self._attention_params
            + dense_layers * self._dense_mlp_params
            + self.num_moe_layers * moe
        )

    @property
    def _attention_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        return 2 * h * self.num_attention_heads * hd + 2 * h * self.num_key_value_heads * hd

    @property
    def _dense_mlp_params(self) -> int:
        mlp_matrices = 2 if self.architecture == "opt" else 3  # OPT: fc1, fc2; Llama: gate, up, down
        return mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def layer_linear_params(self) -> float:
        """Weights of one decoder layer's matrices that a token passes through (Q, K, V, O and
        the MLP, or its k experts and the router), without biases or norms; an average over the
        layers where some are dense and some not. What a token's FLOPs count."""
        return self.linear_params(active=True) / self.num_hidden_layers

    @property
    def total_params(self) -> int:
        """Every weight (embeddings, norms, LM head when untied): what the weights take in memory."""
        return self.linear_params() + self._other_params

    @property
    def active_params(self) -> int:
        """The weights one token's forward pass reads (as "30B-A3B" counts them): total_params
        with only k experts of each MoE layer."""
        return self.linear_params(active=True) + self._other_params

    @property
    def _other_params(self) -> int:
        h, layers = self.hidden_size, self.num_hidden_layers
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        qk_norms = 2 * layers * self.head_dim if self.qk_norm else 0
        return self.vocab_size * h + head + (self.norms_per_layer * layers + 1) * h + qk_norms

    @property
    def layer_small_params(self) -> int:
        """Norms and biases of one decoder layer: each family's hidden-size norms (Gemma 3 has four),
        q's and k's per-head norms where it has them, the QKV bias where it has one."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        qk_norms = 2 * self.head_dim if self.qk_norm else 0
        return self.norms_per_layer * self.hidden_size + qk_norms + ((q + 2 * kv) if self.attention_bias else 0)

    @property
    def attention_context_tokens(self) -> float:
        """The context at which a prompt token's attention costs as many FLOPs as its linear
        layers (2 per weight, against 4 per head dimension for each key it attends to): about
        3,000 for SmolLM2-135M (narrow and deep), 27,000 for Llama-3-8B."""
        return self.layer_linear_params / (2 * self.num_attention_heads * self.head_dim)

    @classmethod
    def from_hf_dict(cls, d: dict, name: str = "", **family_fields) -> "ModelConfig":
        """From a Hugging Face config.json dict: the fields every family shares, then
        `family_fields` (what a family's own mapping adds or reads differently)."""
        arch = (d.get("model_type") or "llama").lower()
        num_heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        fields = dict(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling_from_hf(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            hidden_act=d.get("hidden_act") or "silu",
        )
        return cls(**{**fields, **family_fields})

    def to_hf_dict(self) -> dict:
        """A config.json that transformers (and the family's own `config_from_hf`) read back as this config."""
        d = {
            "architectures": [_HF_CLASSES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "hidden_act": self.hidden_act,
        }
        if self.architecture in ("llama", "qwen3", "qwen3_moe"):
            d["attention_bias"] = self.attention_bias
        return {**d, **self._hf_window_fields(), **self._hf_gemma_fields(), **self._hf_moe_fields()}

    def _hf_moe_fields(self) -> dict:
        if self.architecture == "mixtral":  # its experts are intermediate_size wide
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok}
        if self.architecture != "qwen3_moe":
            return {}
        return {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
        }

    def _hf_window_fields(self) -> dict:
        if SLIDING_ATTENTION not in self.layer_types:
            return {}
        # Qwen2/3 read use_sliding_window (and layer_types); Mistral slides every layer by sliding_window.
        return {
            "sliding_window": self.sliding_window,
            "use_sliding_window": True,
            "layer_types": list(self.layer_types),
        }

    def _hf_gemma_fields(self) -> dict:
        if self.architecture != "gemma3_text":
            return {}
        return {
            "hidden_activation": self.hidden_act,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "rope_local_base_freq": self.rope_local_theta,
            "final_logit_softcapping": self.final_logit_softcapping,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
        }


_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def rope_scaling_from_hf(d: dict) -> dict | None:
    """HF's rope_scaling (or transformers 5's rope_parameters) with rope_type set; None when unscaled."""
    scaling = d.get("rope_scaling") or d.get("rope_parameters")
    if not scaling:
        return None
    rope_type = scaling.get("rope_type") or scaling.get("type")
    if rope_type in (None, "default"):
        return None
    scaling = {key: value for key, value in scaling.items() if key != "rope_theta"}  # (rope_parameters holds it)
    scaling["rope_type"] = rope_type
    if rope_type == "yarn":  # as transformers does when the config leaves it out
        scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 4096))
    return scaling
