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
_OWN_FENCES: weakref.WeakValueDictionary[tuple[int, ...], torch.cuda.Event] = (
    weakref.WeakValueDictionary()
)  # fence -> this process's fence events (CUDA opens no IPC handle in the process that made it)


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
            "gpu": gpu_uuid(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()),
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
    # The first field is the owner's index of its GPU; this process may number it otherwise.
    fields[0] = local_index(d["gpu"])
    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, shape)


def _checked(tensor: torch.Tensor, shape, dtype) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise ValueError(f"holds {list(tensor.shape)} {tensor.dtype}, expected {list(shape)} {dtype}")
    return tensor


class WriteFence:
    """An event that a peer process can wait for on its own stream: recorded after the kernels
    that wrote some KV blocks, so the peer's copy of them starts when they are written, without a
    host wait on either side. One event serves every reference: re-recorded, it marks later work
    than before, so a peer that waits on it late waits for more, never for less."""

    def __init__(self, device: torch.device):
        self.device = device
        self.event = torch.cuda.Event(interprocess=True)
        self.fence = tuple(torch.frombuffer(bytearray(self.event.ipc_handle()), dtype=torch.int64).tolist())
        _OWN_FENCES[self.fence] = self.event

    def record(self) -> tuple[int, ...]:
        """After the kernels queued so far on the current stream; returns the fence to send."""
        self.event.record(torch.cuda.current_stream(self.device))
        return self.fence


def open_fence(fence: tuple[int, ...], device: torch.device) -> torch.cuda.Event:
    """A peer's WriteFence event, opened in this process (wait for it with `stream.wait_event`)."""
    own = _OWN_FENCES.get(tuple(fence))
    if own is not None:
        return own
    handle = torch.tensor(fence, dtype=torch.int64).numpy().tobytes()
    return torch.cuda.Event.from_ipc_handle(device, handle)


def gpu_uuid(index: int) -> str:
    """A GPU's name that is the same in every process (its index is not: Ray isolates GPUs)."""
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


def visible_gpus() -> tuple[str, ...]:
    """UUIDs of the GPUs this process sees, in its own index order."""
    if not torch.cuda.is_available():
        return ()
    return tuple(gpu_uuid(i) for i in range(torch.cuda.device_count()))


def peer_gpus(index: int) -> tuple[str, ...]:
    """UUIDs of the visible GPUs that GPU `index` can read peer to peer."""
    visible = visible_gpus()
    return tuple(u for j, u in enumerate(visible) if j != index and torch.cuda.can_device_access_peer(index, j))


def local_index(uuid: str) -> int:
    """This process's index of the GPU named `uuid` (ValueError when it does not see it)."""
    visible = visible_gpus()
    if uuid not in visible:
        raise ValueError(f"GPU {uuid} is not visible to this process (it sees {list(visible) or 'none'})")
    return visible.index(uuid)
