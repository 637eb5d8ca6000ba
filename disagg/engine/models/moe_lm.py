"""What every mixture-of-experts family shares: the decoder layer (attention, then a sparse MoE or,
in the layers the config keeps dense, a dense MLP), the experts' checkpoint names, and the
stack's extra duties (loading, packing and quantizing the experts; their per-expert load).

Checkpoints name experts one of three ways, and all load:
- one tensor per expert matrix (what transformers 5 writes with save_pretrained, and the hub's
  checkpoints): `<moe>.experts.<e>.<gate|up|down>.weight` under the family's names (`ExpertNames`:
  Qwen3-MoE `mlp` and gate_proj/up_proj/down_proj, Mixtral `block_sparse_moe` and w1/w3/w2);
- fused 3-D tensors, as transformers 5 holds them in memory: `mlp.experts.gate_up_proj`
  [experts, 2 * intermediate, hidden] (gate rows, then up rows) and `mlp.experts.down_proj`
  [experts, hidden, intermediate], with the router at `mlp.gate.weight`;
- GGUF's layout (a converted GGUF, disagg/engine/gguf_archs.py): one 3-D tensor per matrix,
  `mlp.experts.<gate_proj|up_proj|down_proj>.weight` [experts, out, in], router `mlp.gate.weight`.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from torch import nn

from disagg.engine.layers.cpu_kernels import cpu_ops
from disagg.engine.layers.moe import MoE
from disagg.engine.layers.moe_routing import RoutingRule
from disagg.engine.layers.parallel import TPGroup
from disagg.engine.model_config import ModelConfig
from disagg.engine.models.causal_lm import CausalLM
from disagg.engine.models.family import WeightShapes
from disagg.engine.models.llama import LlamaAttention, LlamaMLP
from disagg.engine.models.weights import decoder_weight_shapes

FUSED_GATE_UP, FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
# GGUF's layout: a 3-D tensor per matrix, by layer-relative name, and the part each one is.
STACKED = {
    "mlp.experts.gate_proj.weight": "gate",
    "mlp.experts.up_proj.weight": "up",
    "mlp.experts.down_proj.weight": "down",
}


@dataclass(frozen=True)
class ExpertNames:
    """How a family's per-expert checkpoint names its MoE block and each expert's matrices."""

    block: str  # "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    gate: str
    up: str
    down: str

    def expert(self, layer: int, expert: int) -> list[str]:
        """The checkpoint names of one expert's gate, up and down matrices."""
        p = f"model.layers.{layer}.{self.block}.experts.{expert}."
        return [p + part + ".weight" for part in (self.gate, self.up, self.down)]

    def pattern(self) -> re.Pattern:
        """A layer-relative expert matrix name -> (expert, part name)."""
        parts = "|".join(re.escape(p) for p in (self.gate, self.up, self.down))
        return re.compile(rf"{re.escape(self.block)}\.experts\.(\d+)\.({parts})\.weight")


class MoEDecoderLayer(nn.Module):
    """Llama's layer (its attention takes what the config adds: q/k norms, a sliding window) with
    a sparse MoE in place of the MLP where the config makes the layer sparse."""

    def __init__(
        self, model: "MoECausalLM", cfg: ModelConfig, layer_index: int, cache_index: int, tp: TPGroup, backends
    ):
        super().__init__()
        qk_norm = functools.partial(model.make_norm, cfg, backends)
        self.self_attn = LlamaAttention(cfg, layer_index, cache_index, tp, backends, qk_norm)
        if cfg.is_moe_layer(layer_index):
            rule = model.routing_rule(cfg)
            self.mlp = MoE(cfg.hidden_size, cfg.moe_intermediate_size, rule, tp, model.expert_parallel, backends.gemm)
        else:
            self.mlp = LlamaMLP(cfg, tp, backends)
        self.input_layernorm = model.make_norm(cfg, backends)
        self.post_attention_layernorm = model.make_norm(cfg, backends)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, meta.decode_rows), residual


class MoECausalLM(CausalLM):
    """A family subclasses this: `routing_rule` and `EXPERT_NAMES`."""

    EXPERT_NAMES: ExpertNames
    # A step groups its tokens by expert on the host (counts read back each layer): no CUDA graph
    # can hold that, so decode steps run eagerly.
    captures_cuda_graphs = False

    def routing_rule(self, cfg: ModelConfig) -> RoutingRule:
        raise NotImplementedError

    def make_layer(self, cfg, layer_index, cache_index, tp, backends):
        return MoEDecoderLayer(self, cfg, layer_index, cache_index, tp, backends)

    def moe_layers(self) -> list[tuple[int, MoE]]:
        """(global layer index, its MoE) of this stage's sparse layers."""
        return [(self.start_layer + i, layer.mlp) for i, layer in enumerate(self.layers) if isinstance(layer.mlp, MoE)]

    def expert_tokens(self) -> list[int]:
        """Tokens routed to each expert so far, summed over this stage's MoE layers."""
        counts = [moe.expert_tokens for _, moe in self.moe_layers()]
        return torch.stack(counts).sum(0).tolist() if counts else []

    # ---- weights -----------------------------------------------------------------------------
    def _load_layer_tensor(self, prefix: str, rest: str, tensor: torch.Tensor) -> str:
        block = self.EXPERT_NAMES.block
        if rest in (f"{block}.gate.weight", "mlp.gate.weight"):
            return self._copy(f"{prefix}.mlp.gate.weight", tensor)
        if rest in (FUSED_GATE_UP, FUSED_DOWN):
            self._load_fused(self.get_submodule(f"{prefix}.mlp"), rest == FUSED_DOWN, tensor)
            return f"{prefix}.{rest}"
        if rest in STACKED:
            moe, part = self.get_submodule(f"{prefix}.mlp"), STACKED[rest]
            for expert in range(moe.first_local_expert, moe.first_local_expert + moe.experts.num_local_experts):
                self._load_expert(moe, expert, part, tensor[expert])
            return f"{prefix}.{FUSED_DOWN if part == 'down' else FUSED_GATE_UP}"
        match = self.EXPERT_NAMES.pattern().fullmatch(rest)
        if match is None:
            return super()._load_layer_tensor(prefix, rest, tensor)
        names = self.EXPERT_NAMES
        part = {names.gate: "gate", names.up: "up", names.down: "down"}[match.group(2)]
        self._load_expert(self.get_submodule(f"{prefix}.mlp"), int(match.group(1)), part, tensor)
        return f"{prefix}.{FUSED_DOWN if part == 'down' else FUSED_GATE_UP}"

    @staticmethod
    def _load_expert(moe: MoE, expert: int, part: str, tensor: torch.Tensor) -> None:
        local = expert - moe.first_local_expert
        if 0 <= local < moe.experts.num_local_experts:  # another rank's expert: not ours to hold
            with torch.no_grad():
                moe.experts.load(local, part, tensor)

    def _load_fused(self, moe: MoE, down: bool, tensor: torch.Tensor) -> None:
        intermediate = tensor.shape[1] // 2
        for expert in range(moe.first_local_expert, moe.first_local_expert + moe.experts.num_local_experts):
            if down:
                self._load_expert(moe, expert, "down", tensor[expert])
            else:
                self._load_expert(moe, expert, "gate", tensor[expert, :intermediate])
                self._load_expert(moe, expert, "up", tensor[expert, intermediate:])

    def pack_gemms(self) -> None:
        super().pack_gemms()
        for _, moe in self.moe_layers():
            moe.experts.prepare()

    def quantize_weights(self, setting: str, gguf_types: dict[str, str], wide_dtype: torch.dtype = torch.float32):
        """The dense layers as CausalLM quantizes them, and each expert's matrices where
        `setting` says so (a GGUF's types under auto, by the per-expert checkpoint names)."""
        super().quantize_weights(setting, gguf_types, wide_dtype)
        kernels = cpu_ops(self._device(), self.backends.attention)
        for layer, moe in self.moe_layers():
            first, count = moe.first_local_expert, moe.experts.num_local_experts
            types = [self._expert_types(gguf_types, layer, first + e) for e in range(count)]
            moe.experts.quantize(setting, types, kernels, wide_dtype)

    def _expert_types(self, gguf_types: dict[str, str], layer: int, expert: int) -> list[str | None]:
        """The GGUF types of one expert's gate, up and down matrices: its own tensors', or, in
        GGUF's layout, those of the 3-D tensors that hold them."""
        own = self.EXPERT_NAMES.expert(layer, expert)
        stacked = [f"model.layers.{layer}.{name}" for name in STACKED]
        return [gguf_types.get(name, gguf_types.get(stack)) for name, stack in zip(own, stacked)]

    def every_row_quantized(self) -> None:
        super().every_row_quantized()
        for _, moe in self.moe_layers():
            moe.experts.every_row_quantized()


def moe_weight_shapes(config: ModelConfig, names: ExpertNames) -> WeightShapes:
    """A dense decoder's tensors with each MoE layer's MLP replaced by its router and its
    experts, one tensor per expert matrix (the family's own checkpoint names)."""
    h, i = config.hidden_size, config.moe_intermediate_size
    shapes: WeightShapes = []
    for name, shape in decoder_weight_shapes(config):
        layer = _layer_of(name)
        if layer is None or not config.is_moe_layer(layer) or ".mlp." not in name:
            shapes.append((name, shape))
        elif name.endswith("mlp.gate_proj.weight"):  # where the dense MLP began
            shapes.append((f"model.layers.{layer}.{names.block}.gate.weight", (config.num_experts, h)))
            for e in range(config.num_experts):
                gate, up, down = names.expert(layer, e)
                shapes += [(gate, (i, h)), (up, (i, h)), (down, (h, i))]
    return shapes


def fused_moe_weight_shapes(config: ModelConfig) -> WeightShapes:
    """The same with transformers 5's in-memory names: each MoE layer's experts in two 3-D tensors."""
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    shapes: WeightShapes = []
    for name, shape in decoder_weight_shapes(config):
        layer = _layer_of(name)
        if layer is None or not config.is_moe_layer(layer) or ".mlp." not in name:
            shapes.append((name, shape))
        elif name.endswith("mlp.gate_proj.weight"):
            p = f"model.layers.{layer}."
            shapes += [(p + "mlp.gate.weight", (e, h)), (p + FUSED_GATE_UP, (e, 2 * i, h)), (p + FUSED_DOWN, (e, h, i))]
    return shapes


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    match = _LAYER_NAME.match(name)
    return int(match.group(1)) if match else None


def gguf_moe_weight_shapes(config: ModelConfig) -> WeightShapes:
    """The same in GGUF's layout (a converted GGUF): a 3-D tensor per expert matrix."""
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    shapes: WeightShapes = []
    for name, shape in decoder_weight_shapes(config):
        layer = _layer_of(name)
        if layer is None or not config.is_moe_layer(layer) or ".mlp." not in name:
            shapes.append((name, shape))
        elif name.endswith("mlp.gate_proj.weight"):
            p = f"model.layers.{layer}."
            shapes.append((p + "mlp.gate.weight", (e, h)))
            shapes += [(p + stacked, (e, h, i) if part == "down" else (e, i, h)) for stacked, part in STACKED.items()]
    return shapes
