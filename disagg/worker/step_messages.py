"""What rank 0 and its followers say to each other once per step, as bytes for a step channel.

An order holds the step's chunks (plain copies: disagg.engine.step_chunks), every follower's KV
commands since the last step (each follower applies its own, before it computes) and how long an
idle follower may wait for a transfer. A reply holds a follower's finished transfers, the ids of
the transfers it was told to expect, the logits if it is the last stage's first TP rank, or the
error its step raised. Both carry the
step's number, so that a reply to another step is caught, not used. The logits travel as their
raw bytes after the pickled rest, so that they are neither pickled nor copied again on arrival.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass

import torch

from disagg.worker.shard_service import ShardCommand, ShardReply

_OFFSET = struct.Struct("<Q")  # where a reply's tensor bytes begin
_TENSOR_ALIGN = 16  # the bytes must start aligned for any dtype's view of them


@dataclass(frozen=True)
class StepOrder:
    number: int
    chunks: list | None  # None: no step to run, only commands to apply and transfers to report
    commands: list[list[ShardCommand]]  # by follower index
    wait_s: float = 0.0


@dataclass
class StepAnswer:
    number: int
    reply: ShardReply
    error: str | None = None  # the follower's step raised: the ranks are out of lockstep


def encode_order(order: StepOrder) -> bytes:
    return pickle.dumps(order, protocol=pickle.HIGHEST_PROTOCOL)


def decode_order(payload) -> StepOrder:
    order = pickle.loads(payload)
    if not isinstance(order, StepOrder):
        raise TypeError(f"a step channel carried {type(order).__name__}, not a StepOrder")
    return order


def encode_answer(answer: StepAnswer) -> bytes:
    logits = answer.reply.logits
    tensor = None if logits is None else logits.detach().to("cpu").contiguous()
    meta = None if tensor is None else (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
    reply = answer.reply
    head = pickle.dumps(
        (answer.number, reply.results, reply.transfer_ids, answer.error, meta), protocol=pickle.HIGHEST_PROTOCOL
    )
    offset = -(-(_OFFSET.size + len(head)) // _TENSOR_ALIGN) * _TENSOR_ALIGN
    parts = [_OFFSET.pack(offset), head, bytes(offset - _OFFSET.size - len(head))]
    if tensor is not None:
        parts.append(tensor.view(-1).view(torch.uint8).numpy())
    return b"".join(parts)


def decode_answer(payload: bytearray, device: torch.device | None = None) -> StepAnswer:
    """`payload` becomes the logits' memory (no copy); `device`: where rank 0 wants them."""
    (offset,) = _OFFSET.unpack_from(payload, 0)
    number, results, transfer_ids, error, meta = pickle.loads(memoryview(payload)[_OFFSET.size : offset])
    logits = None
    if meta is not None:
        dtype_name, shape = meta
        dtype = getattr(torch, dtype_name)
        if len(payload) == offset:  # torch.frombuffer refuses an empty buffer
            logits = torch.empty(shape, dtype=dtype)
        else:
            logits = torch.frombuffer(payload, dtype=torch.uint8, offset=offset).view(dtype).view(shape)
        if device is not None:
            logits = logits.to(device)
    return StepAnswer(number, ShardReply(logits, results, transfer_ids), error)
