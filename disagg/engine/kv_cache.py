"""The physical KV-cache tensors, and export/import of a request's blocks.

One tensor for all layers, head-major:
    [num_layers, 2 (K, V), num_kv_heads, num_blocks, block_size, head_dim].
Head-major means a gather of blocks along the block dimension yields, for every (request,
head), one contiguous [tokens, head_dim] matrix, which attention reads at full speed without a
permuting copy (token-major was several times slower on CPU). It also makes a tensor-parallel
split of KV heads a plain slice, which the transfer's resharding uses.

A prefill worker's cache is shared (`shared=True`): on CPU it lives in shared memory, on a GPU it
is exported through CUDA IPC; a decode worker on the same host then copies its blocks straight
out of it (disagg.kv_transfer.shared_memory).
"""

from __future__ import annotations

import torch

from disagg.engine.cuda_sharing import export_cuda
from disagg.engine.shared_memory import SharedHandle, shared_zeros


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        shared: bool = False,
        layer_offset: int = 0,
        head_offset: int = 0,
    ):
        """`shared`: in memory that peers on this host can map (shared memory on CPU, CUDA IPC on a
        GPU; other devices ignore it).
        `layer_offset`, `head_offset`: the global index of this rank's local layer 0 and KV
        head 0 (a pipeline stage holds some layers, a tensor-parallel rank some heads)."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_offset = layer_offset
        self.head_offset = head_offset
        shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)
        self.shared_handle: SharedHandle | None = None
        if shared and torch.device(device).type == "cpu":
            self.tensor, self.shared_handle = shared_zeros(shape, dtype)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
            if shared and self.tensor.device.type == "cuda":
                self.shared_handle = export_cuda(self.tensor)
        # Each layer's views, made once: a decode step writes and reads every layer, and making
        # them per step is 4 calls into torch a layer.
        self._layers = list(self.tensor.unbind(0))  # [2, KVH, blocks, bs, D] each
        self._slots = [layer.view(2, num_kv_heads, -1, head_dim).unbind(0) for layer in self._layers]

    @property
    def num_layers(self) -> int:
        return self.tensor.shape[0]

    def layer(self, layer_idx: int) -> torch.Tensor:
        """[2, num_kv_heads, num_blocks, block_size, head_dim] view of one layer."""
        return self._layers[layer_idx]

    # ---- a block view for the KV transfer: slices addressed by global layer and head indices --------
    def slice_bytes(self, num_layers: int, heads: tuple[int, int], num_blocks: int) -> int:
        """Bytes of `num_layers` layers' K and V of heads [h0, h1) in `num_blocks` blocks."""
        return (
            num_layers
            * 2
            * (heads[1] - heads[0])
            * num_blocks
            * self.block_size
            * self.head_dim
            * self.tensor.element_size()
        )

    def packing_buffer(self, num_layers: int, heads: tuple[int, int], num_blocks: int) -> torch.Tensor:
        """Room for that slice, packed: [num_layers, 2, h1 - h0, num_blocks, block_size, head_dim]."""
        return torch.empty(
            num_layers,
            2,
            heads[1] - heads[0],
            num_blocks,
            self.block_size,
            self.head_dim,
            dtype=self.tensor.dtype,
            device=self.tensor.device,
        )

    def pack_layer(self, layer: int, heads: tuple[int, int], block_ids: list[int], out: torch.Tensor) -> None:
        """Copy (global) layer `layer`'s heads [h0, h1) of scattered blocks into `out` [2, h, n, bs, D]."""
        src = torch.as_tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        torch.index_select(
            self.layer(layer - self.layer_offset)[:, heads[0] - self.head_offset : heads[1] - self.head_offset],
            2,
            src,
            out=out,
        )

    def blocks_view(self, first_layer: int, num_layers: int, heads: tuple[int, int]) -> torch.Tensor:
        """A view of (global) layers [first, first + n) and heads [h0, h1): [n, 2, h, num_blocks, bs, D]."""
        local = first_layer - self.layer_offset
        return self.tensor[local : local + num_layers, :, heads[0] - self.head_offset : heads[1] - self.head_offset]

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K and V ([T, kv_heads, head_dim]) at flat slots block*block_size+offset."""
        keys, values = self._slots[layer_idx]  # [KVH, blocks*bs, D] each
        keys.index_copy_(1, slot_mapping, k.transpose(0, 1))
        values.index_copy_(1, slot_mapping, v.transpose(0, 1))

    def export_blocks(self, block_ids: list[int], layer_idx: int | None = None) -> torch.Tensor:
        """A packed copy of the blocks: [num_layers, 2, KVH, n, bs, D], or [2, KVH, n, bs, D] for one layer."""
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        if layer_idx is None:
            return self.tensor.index_select(3, index)
        return self.tensor[layer_idx].index_select(2, index)

    def import_blocks(self, block_ids: list[int], data: torch.Tensor, layer_idx: int | None = None) -> None:
        """Scatter packed blocks (as export_blocks makes them) into this cache's blocks."""
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        target = self.tensor if layer_idx is None else self.tensor[layer_idx]
        expected = list(target.shape)
        expected[-3] = len(block_ids)
        if list(data.shape) != expected:
            raise ValueError(f"kv: expected blocks shaped {expected}, got {list(data.shape)}")
        target.index_copy_(target.dim() - 3, index, data.to(device=self.tensor.device, dtype=self.tensor.dtype))
