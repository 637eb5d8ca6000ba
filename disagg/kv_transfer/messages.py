"""The wire format of the KV transfer protocol: a fixed-size int64 header, then (for KV) a payload.

Every message to a peer is one header tensor; a KV header is followed by one packed tensor
[layers, 2, heads, blocks, block_size, head_dim] (consecutive layers) whose shape the receiver
derives from the header and its own cache geometry, so no shape metadata travels separately.

Between workers on one host whose prefill cache is in shared memory, KV_REF replaces KV: its
payload (`BlockRef`) names the sender's cache and its blocks, and the receiver copies them
itself, straight from the sender's cache into its own blocks. A reference costs the same
whatever it covers, so one goes per step for every layer of the target's range, and the one of a
prompt's last chunk travels with the DONE as KV_REF_DONE: a one-chunk prompt's KV moves in one
message and its ACK.

A request that moves between decode instances (disagg.decode_worker.migration) sends its
tokens in a TOKENS message before its DONE, so the target can decode on without another party.
"""

from __future__ import annotations

import enum
from dataclasses import astuple, dataclass, field, fields

import torch

HEADER_LEN = 9


class MsgType(enum.IntEnum):
    KV = 1  # some consecutive layers' blocks of one transfer (a chunk's worth), payload follows
    DONE = 2  # the sender has sent everything for the transfer; carries the first token
    ACK = 3  # the receiver has everything; the sender may free its blocks
    ABORT = 4  # either side gives up on the transfer (request aborted, cancelled or failed)
    KV_REF = 5  # as KV, but by reference to the sender's shared cache: a BlockRef payload follows
    TOKENS = 6  # a moving request's tokens (int64 payload of num_blocks tokens), before its DONE
    KV_REF_DONE = 7  # a KV_REF and then a DONE in one message (carries the first token)


REFERENCES = (MsgType.KV_REF, MsgType.KV_REF_DONE)  # the messages with a BlockRef payload


@dataclass(frozen=True)
class Header:
    type: MsgType
    transfer_id: int
    layer: int = 0  # global layer index
    first_block: int = 0  # index into the transfer's block list (not a block id)
    num_blocks: int = 0
    head_start: int = 0  # global KV head range
    head_end: int = 0
    token: int = -1  # DONE: the first output token (-1 when this rank has none, e.g. an early PP stage)
    num_layers: int = 1  # KV: layers [layer, layer + num_layers) are in the payload

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Header":
        values = t.tolist()
        return cls(MsgType(values[0]), *values[1:])

    @staticmethod
    def empty() -> torch.Tensor:
        return torch.empty(HEADER_LEN, dtype=torch.int64)

    def payload_shape(self, block_size: int, head_dim: int) -> tuple[int, ...]:
        return (self.num_layers, 2, self.head_end - self.head_start, self.num_blocks, block_size, head_dim)


@dataclass(frozen=True)
class BlockRef:
    """A KV_REF payload: where the sender's shared cache is, its geometry, which of its blocks
    hold the message's positions, and until when they are guaranteed to stay there."""

    pid: int
    fd: int
    token: int
    num_layers: int  # the sender's cache: [num_layers, 2, num_heads, num_blocks, block_size, head_dim]
    num_heads: int
    num_blocks: int
    layer_offset: int  # global index of the sender's layer 0
    head_offset: int  # global index of the sender's KV head 0
    # CLOCK_MONOTONIC (same host: one clock) nanoseconds until which the sender keeps the blocks,
    # whatever happens (it frees them earlier only on an ACK, which comes after the copy).
    valid_until_ns: int
    block_ids: list[int] = field(default_factory=list)  # the sender's block ids, in order
    # On a GPU, the IPC handle of an event recorded after the kernels that wrote the blocks, as
    # FENCE_LEN int64s: the receiver's copy waits for it on the device, and neither side waits on
    # the host. Zeros: nothing to wait for (a CPU cache is written before the reference is made).
    fence: tuple[int, ...] = (0,) * 8

    FIXED = 9  # int64 fields before the fence
    FENCE_LEN = 8  # 64 bytes: CUDA's IPC event handle
    NO_FENCE = (0,) * FENCE_LEN

    def to_tensor(self) -> torch.Tensor:
        fixed = [getattr(self, name) for name in _BLOCK_REF_FIXED]  # (astuple would deep-copy the ids)
        return torch.tensor([*fixed, *self.fence, *self.block_ids], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "BlockRef":
        values = t.tolist()
        ids_start = cls.FIXED + cls.FENCE_LEN
        return cls(*values[: cls.FIXED], block_ids=values[ids_start:], fence=tuple(values[cls.FIXED : ids_start]))

    @classmethod
    def empty(cls, num_blocks: int) -> torch.Tensor:
        return torch.empty(cls.FIXED + cls.FENCE_LEN + num_blocks, dtype=torch.int64)

    @property
    def has_fence(self) -> bool:
        return any(self.fence)


_BLOCK_REF_FIXED = tuple(f.name for f in fields(BlockRef))[: BlockRef.FIXED]
