"""The shape of a decoder (Llama-like, dense or mixture-of-experts), independent of where its weights come from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "mistral" or "qwen2"
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
        return self.vocab_size * h + head + (2 * layers + 1) * h

    @property
    def attention_context_tokens(self) -> float:
        """The context at which a prompt token's attention costs as many FLOPs as its linear
        layers (2 per weight, against 4 per head dimension for each key it attends to): about
        3,000 for SmolLM2-135M (narrow and deep), 27,000 for Llama-3-8B."""
        return self.layer_linear_params / (2 * self.num_attention_heads * self.head_dim)

    @classmethod
    def from_hf_dict(cls, d: dict, name: str = "") -> "ModelConfig":
        """From a Hugging Face config.json dict (Llama, Mistral, Qwen2)."""
        arch = (d.get("model_type") or "llama").lower()
        num_heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
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
            rope_scaling=_rope_scaling(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    def to_hf_dict(self) -> dict:
        """A config.json that transformers' LlamaForCausalLM (or Qwen2) accepts."""
        d = {
            "architectures": [
                {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[
                    self.architecture
                ]
            ],
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
            "hidden_act": "silu",
        }
        if self.architecture == "llama":
            d["attention_bias"] = self.attention_bias
        return d


def _rope_scaling(d: dict) -> dict | None:
    scaling = d.get("rope_scaling") or d.get("rope_parameters")
    if not scaling:
        return None
    rope_type = scaling.get("rope_type") or scaling.get("type")
    if rope_type in (None, "default"):
        return None
    return dict(scaling, rope_type=rope_type)
