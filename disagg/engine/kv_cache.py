"""The physical KV-cache tensors, and export/import of a request's blocks.

One tensor for all layers: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim].
Token-major blocks make writing new tokens a single index_copy_ per layer, and a request's KV
for one layer is `cache[layer, :, block_ids]`, which is what the transfer sends.
"""

from __future__ import annotations

import torch

from disagg.engine.model_config import ModelConfig


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, num_layers: int, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_layers(self) -> int:
        return self.tensor.shape[0]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block of one layer's K (or V)."""
        return tuple(self.tensor.shape[3:])

    def layer(self, layer_idx: int) -> torch.Tensor:
        """[2, num_blocks, block_size, num_kv_heads, head_dim] view of one layer."""
        return self.tensor[layer_idx]

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K and V ([T, kv_heads, head_dim]) at flat slots block*block_size+offset."""
        kv = self.tensor[layer_idx].view(2, -1, *self.tensor.shape[4:])
        kv[0].index_copy_(0, slot_mapping, k)
        kv[1].index_copy_(0, slot_mapping, v)

    def export_blocks(self, block_ids: list[int], layer_idx: int | None = None) -> torch.Tensor:
        """A copy of the blocks: [num_layers, 2, n, ...] or, for one layer, [2, n, ...]."""
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        if layer_idx is None:
            return self.tensor.index_select(2, index)
        return self.tensor[layer_idx].index_select(1, index)

    def import_blocks(self, block_ids: list[int], data: torch.Tensor, layer_idx: int | None = None) -> None:
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        expected = (len(block_ids), *self.tensor.shape[3:])
        got = tuple(data.shape[-len(expected) :])
        if got != expected or data.shape[-len(expected) - 1] != 2:
            raise ValueError(f"kv: expected [..., 2, {expected}] blocks, got {tuple(data.shape)}")
        data = data.to(device=self.tensor.device, dtype=self.tensor.dtype)
        if layer_idx is None:
            self.tensor.index_copy_(2, index, data)
        else:
            self.tensor[layer_idx].index_copy_(1, index, data)
