"""The wire format of the KV transfer protocol: a fixed-size int64 header, then (for KV) a payload.

Every message to a peer is one header tensor; a KV header is followed by one packed tensor
[layers, 2, heads, blocks, block_size, head_dim] (consecutive layers) whose shape the receiver
derives from the header and its own cache geometry, so no shape metadata travels separately.
"""

from __future__ import annotations

import enum
from dataclasses import astuple, dataclass

import torch

HEADER_LEN = 9


class MsgType(enum.IntEnum):
    KV = 1  # some consecutive layers' blocks of one transfer (a chunk's worth), payload follows
    DONE = 2  # the sender has sent everything for the transfer; carries the first token
    ACK = 3  # the receiver has everything; the sender may free its blocks
    ABORT = 4  # the sender gives up on the transfer (request aborted or failed)


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
