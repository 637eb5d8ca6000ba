"""The decoder-only stack every family shares, over the paged KV cache.

`CausalLM` embeds, runs a stack of decoder layers, normalizes and projects to the vocabulary;
it loads Hugging Face-named weights and keeps GEMM weights quantized where asked. A family
subclasses it and names the decoder layer it stacks (`make_layer`); the hooks below
(`make_norm`, `embed`, `rope_tables`, `compute_logits`) are where a family's small differences go.

Written for tensor and pipeline parallelism: projections are column/row-parallel layers and a
pipeline stage builds only its range of layers (the first stage embeds, the last normalizes
and projects to the vocabulary). At TP=PP=1 it is the plain model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from disagg.engine.kv_cache import KVCache
from disagg.engine.layers.attention import AttentionMetadata
from disagg.engine.layers.cpu_gemm import PackedWeight
from disagg.engine.layers.cpu_kernels import cpu_ops
from disagg.engine.layers.fp8 import Fp8Weight, describe
from disagg.engine.layers.fused import FusedRMSNorm
from disagg.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from disagg.engine.layers.parallel import SINGLE, TPGroup
from disagg.engine.layers.quantized import Int8Weight, int8_blocks, quantize, weight_format
from disagg.engine.layers.rotary import RotaryEmbedding
from disagg.engine.model_config import ModelConfig
from disagg.engine.partition import layer_range
from disagg.errors import ModelLoadError


@dataclass(frozen=True)
class Backends:
    """Which CPU code paths the layers take (EngineConfig.attention_backend, .cpu_gemm)."""

    attention: str = "auto"  # cpu_kernels.BACKENDS: decode attention, norm and rotary
    gemm: str = "onednn"  # cpu_gemm.GEMMS
    fused_layer: bool = True  # decode-only CPU steps: a layer in one C++ call where it applies (decode_layer.py)


class CausalLM(nn.Module):
    captures_cuda_graphs = True  # decode steps may be replayed from CUDA graphs (cuda_graphs.py)

    def __init__(
        self,
        cfg: ModelConfig,
        max_model_len: int,
        tp: TPGroup = SINGLE,
        pp_rank: int = 0,
        pp_size: int = 1,
        backends: Backends = Backends(),
        expert_parallel: bool = False,
    ):
        """`expert_parallel`: a mixture of experts' experts split over `tp`'s ranks
        (ParallelConfig.enable_expert_parallel; a dense family ignores it)."""
        super().__init__()
        self.config = cfg
        self.backends = backends
        self.expert_parallel = expert_parallel
        self.start_layer, self.end_layer = layer_range(cfg.num_hidden_layers, pp_rank, pp_size)
        self.is_first_stage, self.is_last_stage = pp_rank == 0, pp_rank == pp_size - 1
        # The vocabulary projections are replicated across TP ranks (simple, and small next to the layers).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if self.is_first_stage else None
        self.layers = nn.ModuleList(
            self.make_layer(cfg, i, i - self.start_layer, tp, backends) for i in range(self.start_layer, self.end_layer)
        )
        self.norm = self.make_norm(cfg, backends) if self.is_last_stage else None
        self.lm_head = None
        if self.is_last_stage and not (cfg.tie_word_embeddings and self.is_first_stage):
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_model_len, cfg.rope_theta, cfg.rope_scaling)
        # Sliding layers of some families (Gemma 3) rotate by another base, unscaled.
        self.local_rotary = None
        if cfg.rope_local_theta is not None:
            self.local_rotary = RotaryEmbedding(cfg.head_dim, max_model_len, cfg.rope_local_theta)
        self.local_rope = [cfg.uses_local_rope(i) for i in range(self.start_layer, self.end_layer)]
        self.logits_weight = PackedWeight(backends.gemm)  # the vocabulary projection: the biggest GEMM of a decode step

    # ---- what a family chooses ---------------------------------------------------------------
    def make_layer(self, cfg: ModelConfig, layer_index: int, cache_index: int, tp: TPGroup, backends: Backends):
        """The decoder layer at global index `layer_index`; `cache_index`: its slot in the
        stage-local KV cache. Called with (h, residual, cos, sin, kv_cache, meta), it returns
        (h, residual)."""
        raise NotImplementedError

    def make_norm(self, cfg: ModelConfig, backends: Backends, size: int | None = None) -> nn.Module:
        """The final norm (and the layers' norms; `size`: other than hidden_size, e.g. a head's
        for q and k): RMSNorm with the residual add folded in."""
        return FusedRMSNorm(size or cfg.hidden_size, cfg.rms_norm_eps, backends.attention)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def local_attention_windows(self) -> list[int | None]:
        """Each of this stage's layers' sliding window (None: global), by local index (the
        KV cache's layer slots); ModelConfig.layer_groups has the whole model's."""
        return [self.config.attention_window(i) for i in range(self.start_layer, self.end_layer)]

    def expert_tokens(self) -> list[int]:
        """Tokens routed to each expert so far, over this stage's layers ([] for a dense model)."""
        return []

    def forward(
        self,
        input_ids,
        positions,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        hidden_states=None,
        residual=None,
        after_layer=None,
    ):
        """First stage takes input_ids; later stages take (hidden_states, residual) from the previous one.
        Returns final hidden states on the last stage, else (hidden_states, residual).
        `after_layer(local_index)` runs once each layer's KV is in the cache (KV streaming)."""
        h = self.embed(input_ids) if self.is_first_stage else hidden_states
        tables = {False: self.rotary.cos_sin(positions, h.dtype)}
        if self.local_rotary is not None:
            tables[True] = self.local_rotary.cos_sin(positions, h.dtype)
        for index, layer in enumerate(self.layers):
            h, residual = layer(h, residual, *tables[self.local_rope[index]], kv_cache, meta)
            if after_layer is not None:
                after_layer(index)
        if not self.is_last_stage:
            return h, residual
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        """The sampled rows' logits; `decode_rows`: how many of them (the first) a step's generated
        decodes are (AttentionMetadata.decode_rows; None: outside a step)."""
        if not isinstance(self.logits_weight, PackedWeight):  # quantized: it holds the weight itself
            return self.logits_weight.linear(hidden, decode_rows=decode_rows).float()
        return self.logits_weight.linear(hidden, self._vocab_weight(), None, decode_rows).float()

    def _vocab_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    # ---- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], pack: bool = True) -> None:
        """Load Hugging Face-named tensors, each rank/stage taking its own slice. `pack`: make
        the oneDNN copies now (not when the weights are about to be quantized: `pack_gemms`
        after that, so that the float32 copies never all exist at once)."""
        loaded: set[str] = set()
        for name, tensor in weights:
            loaded.update(self._load_one(name, tensor))
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ModelLoadError(f"weights: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        if pack:
            self.pack_gemms()

    def pack_gemms(self) -> None:
        # Loads write through .data, which moves no version counter: pack again, now.
        for holder, weight in self.packed_gemms():
            holder.pack(weight)

    def packed_gemms(self) -> list[tuple[PackedWeight, torch.Tensor]]:
        """Each GEMM that keeps a prepacked weight (layers/cpu_gemm.py), with that weight."""
        gemms = [(m.packed, m.weight) for m in self.modules() if isinstance(getattr(m, "packed", None), PackedWeight)]
        if self.is_last_stage and isinstance(self.logits_weight, PackedWeight):
            gemms.append((self.logits_weight, self._vocab_weight()))
        return gemms

    # ---- quantized weights (layers/quantized.py) ---------------------------------------------
    def quantize_weights(
        self, setting: str, gguf_types: dict[str, str], wide_dtype: torch.dtype = torch.float32
    ) -> None:
        """Keep each GEMM's weight quantized where `setting` (EngineConfig.weights) says so,
        freeing its dense copy. The vocabulary projection goes to int8 whenever anything is
        quantized, and a tied embedding to int8 blocks (QuantizedEmbedding)."""
        quantized = False
        kernels = cpu_ops(self._device(), self.backends.attention)  # ours where they build, else torch's
        for name, module in self.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                types = [gguf_types.get(n) for n in self._checkpoint_names(name)]
                fmt = weight_format(setting, types)
                if fmt is not None:
                    module.packed = quantize(module.weight.data, fmt, types, kernels, wide_dtype)
                    module.weight = _freed(module.weight)
                    quantized = True
        if not (quantized and self.is_last_stage):
            return
        dense = self._vocab_weight().data
        self.logits_weight = quantize(dense, "int8", kernels=kernels, wide_dtype=wide_dtype)
        if self.lm_head is not None:
            self.lm_head.weight = _freed(self.lm_head.weight)
        elif self.config.hidden_size % QuantizedEmbedding.BLOCK == 0:  # else the embedding stays dense
            self.embed_tokens = QuantizedEmbedding(dense)
            if kernels is not None:  # ours reads the embedding's own int8 blocks: one copy of the vocabulary
                self.logits_weight = Int8Weight.of_blocks(self.embed_tokens.q, self.embed_tokens.scales, kernels)
        self.logits_weight.without_wide_copy()

    def fp8_weights(self) -> str:
        """Keep each GEMM's weight as FP8 (layers/fp8.py: EngineConfig.weights = "fp8"), freeing
        its dense copy; the vocabulary projection, embedding and norms stay as they are. Returns
        a line for the log: which GEMMs take the FP8 tensor cores."""
        converted = []
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.packed = Fp8Weight(module.weight.data)
                module.weight = _freed(module.weight)
                converted.append(module.packed)
        return describe(converted)

    def every_row_quantized(self) -> None:
        """Every row, prompt or decode, through the quantized kernels (EngineConfig.batch_invariant)."""
        weights = [getattr(module, "packed", None) for module in self.modules()] + [self.logits_weight]
        for weight in weights:
            if hasattr(weight, "every_row_narrow"):
                weight.every_row_narrow = True

    def _device(self) -> torch.device:
        return next(p.device for p in self.parameters())

    def _checkpoint_names(self, module_name: str) -> list[str]:
        """The checkpoint tensors a (possibly fused) linear of this stage is loaded from."""
        prefix, _, local = module_name.partition(".")  # "layers", "3.self_attn.qkv_proj"
        index, _, rest = local.partition(".")
        layer = f"model.layers.{int(index) + self.start_layer}"
        parts = [src for src, (fused, _) in self._SHARDS.items() if fused == rest] or [rest]
        return [f"{layer}.{part}.weight" for part in parts]

    _LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
    # Checkpoint linears loaded as a shard of one fused linear of ours.
    _SHARDS = {
        "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
        "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
        "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
        "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
        "mlp.up_proj": ("mlp.gate_up_proj", "up"),
    }

    def _load_one(self, name: str, tensor: torch.Tensor) -> list[str]:
        if name == "model.embed_tokens.weight":
            targets = []
            if self.embed_tokens is not None:
                targets.append(self._copy("embed_tokens.weight", tensor))
            if self.lm_head is not None and self.config.tie_word_embeddings:
                targets.append(self._copy("lm_head.weight", tensor))
            return targets
        if name == "lm_head.weight":
            return [self._copy("lm_head.weight", tensor)] if self.lm_head is not None else []
        if name == "model.norm.weight":
            return [self._copy("norm.weight", tensor)] if self.norm is not None else []
        match = self._LAYER.fullmatch(name)
        if match is None:
            return []  # e.g. rotary inv_freq buffers some checkpoints carry
        index = int(match.group(1))
        if not self.start_layer <= index < self.end_layer:
            return []
        return [self._load_layer_tensor(f"layers.{index - self.start_layer}", match.group(2), tensor)]

    def _load_layer_tensor(self, prefix: str, rest: str, tensor: torch.Tensor) -> str:
        module_name, _, kind = rest.rpartition(".")
        if module_name in self._SHARDS:
            fused, shard = self._SHARDS[module_name]
            with torch.no_grad():
                self.get_submodule(f"{prefix}.{fused}").load(shard, tensor, is_bias=kind == "bias")
            return f"{prefix}.{fused}.{kind}"
        module = self.get_submodule(f"{prefix}.{module_name}")
        if isinstance(module, RowParallelLinear) and kind == "weight":
            with torch.no_grad():
                module.load(tensor)
            return f"{prefix}.{module_name}.weight"
        return self._copy(f"{prefix}.{module_name}.{kind}", tensor)

    def _copy(self, param_name: str, tensor: torch.Tensor) -> str:
        param = self.get_parameter(param_name)
        if param.shape != tensor.shape:
            raise ModelLoadError(
                f"weights: {param_name} has shape {tuple(tensor.shape)} in the checkpoint, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        return param_name


class QuantizedEmbedding(nn.Module):
    """A token embedding kept int8 in blocks of 32 with a scale each (GGUF's Q8_0, whose values
    it keeps exactly). Not the vocabulary projection's per-row int8: a lookup reads a few rows,
    so the finer scales cost nothing, and the coarser ones flip near-tied first tokens."""

    BLOCK = 32

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.q, self.scales = int8_blocks(weight, self.BLOCK)  # [vocab, hidden], [vocab, hidden / 32]
        self.dtype = weight.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        q = self.q[input_ids].view(*input_ids.shape, -1, self.BLOCK)
        rows = q.to(self.dtype) * self.scales[input_ids].to(self.dtype).unsqueeze(-1)
        return rows.flatten(-2)


def _freed(weight: nn.Parameter) -> nn.Parameter:
    """An empty stand-in for a weight now held quantized: its memory goes back."""
    return nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False)
