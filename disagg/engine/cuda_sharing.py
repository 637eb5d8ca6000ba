"""CUDA tensors that another process on the same host can map (CUDA IPC): the GPU counterpart of
shared_memory.py, so that a decode worker beside a prefill worker copies KV blocks straight out
of the prefill cache, GPU to GPU, with no packing and no NCCL (which refuses two ranks on one
device anyway).

The peer learns where the memory is the same way as for a CPU cache: through a SharedHandle
(pid, fd, token) naming a memfd of the owner. Here the memfd holds no KV, only the IPC
descriptor of the cache's allocation (JSON, bytes in hex), and its name says so (`disagg-kvipc-…`), which
is how `disagg.kv_transfer.shared_memory.attach` tells the two apart. A peer in the owner's own
process (tests, in-process pairs) gets the tensor itself: CUDA refuses to open an IPC handle in
the process that made it.
"""

from __future__ import annotations

import json
import os
import secrets
import weakref

import torch

from disagg.engine.shared_memory import SharedHandle

IPC_NAME_PREFIX = "disagg-kvipc-"
_OWN: weakref.WeakValueDictionary[int, torch.Tensor] = (
    weakref.WeakValueDictionary()
)  # token -> this process's exported tensors


def ipc_name(token: int) -> str:
    return f"{IPC_NAME_PREFIX}{token:016x}"


def export_cuda(tensor: torch.Tensor) -> SharedHandle:
    """Make a contiguous CUDA tensor mappable by peers on this host; returns its handle."""
    if tensor.device.type != "cuda" or not tensor.is_contiguous() or tensor.storage_offset() != 0:
        raise ValueError("export_cuda: a contiguous CUDA tensor at the start of its storage is required")
    fields = tensor.untyped_storage()._share_cuda_()
    descriptor = json.dumps(
        {
            # device, handle, size, offset, ref counter handle and offset, event handle, sync required
            "ipc": [{"hex": f.hex()} if isinstance(f, bytes) else f for f in fields],
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
        }
    ).encode()
    token = secrets.randbits(63)
    fd = os.memfd_create(ipc_name(token), os.MFD_CLOEXEC)
    try:
        os.write(fd, descriptor)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(tensor, os.close, fd)  # peers find the descriptor while the tensor lives
    _OWN[token] = tensor
    return SharedHandle(os.getpid(), fd, token)


def open_cuda(handle: SharedHandle, descriptor: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The peer's tensor, mapped into this process (ValueError when it is not what we expect)."""
    if handle.pid == os.getpid():
        own = _OWN.get(handle.token)
        if own is None:
            raise ValueError(f"CUDA tensor {ipc_name(handle.token)} of this process is gone")
        return _checked(own, shape, dtype)
    d = json.loads(descriptor)
    if list(d["shape"]) != list(shape) or d["dtype"] != str(dtype).removeprefix("torch."):
        raise ValueError(f"holds {d['shape']} {d['dtype']}, expected {list(shape)} {dtype}")
    torch.cuda._lazy_init()
    fields = [bytes.fromhex(f["hex"]) if isinstance(f, dict) else f for f in d["ipc"]]
    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, shape)


def _checked(tensor: torch.Tensor, shape, dtype) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise ValueError(f"holds {list(tensor.shape)} {tensor.dtype}, expected {list(shape)} {dtype}")
    return tensor
