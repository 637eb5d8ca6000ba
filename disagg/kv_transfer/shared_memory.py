"""Maps a peer's shared KV cache (disagg.engine.shared_memory allocates it on CPU,
disagg.engine.cuda_sharing exports it on a GPU) so that a decode worker on the same host copies
blocks straight out of it: one copy instead of pack, send, receive and scatter."""

from __future__ import annotations

import math
import os
import threading

import torch

from disagg.engine.cuda_sharing import ipc_name, open_cuda
from disagg.engine.shared_memory import SharedHandle
from disagg.errors import KVTransferError


def attach(handle: SharedHandle, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Map a peer's shared tensor; KVTransferError when it is not there or not what we expect."""
    expected_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    try:
        target = os.readlink(handle.path())
        if target == f"/memfd:{ipc_name(handle.token)} (deleted)":
            return _attach_cuda(handle, shape, dtype)
        if target != f"/memfd:{handle.name()} (deleted)":
            raise KVTransferError(
                f"shared KV cache {handle.name()} is gone (pid {handle.pid} fd {handle.fd} is something else)"
            )
        actual_bytes = os.stat(handle.path()).st_size
        if actual_bytes != expected_bytes:
            raise KVTransferError(
                f"shared KV cache {handle.name()} holds {actual_bytes} bytes, expected {expected_bytes} for {list(shape)} {dtype}"
            )
        tensor = torch.from_file(handle.path(), shared=True, size=math.prod(shape), dtype=dtype).view(shape)
    except OSError as exc:
        raise KVTransferError(f"cannot map shared KV cache {handle.name()} of pid {handle.pid}: {exc}") from exc
    # Map every page, in the background: faulting them in one by one during copies doubles a
    # copy's time, once per page for the mapping's life; one sweep over them all in the
    # foreground would stall the first transfer from a peer longer than slower first copies do.
    threading.Thread(target=_touch_pages, args=(tensor,), name="kv-map-pages", daemon=True).start()
    return tensor


def _attach_cuda(handle: SharedHandle, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A peer's cache on a GPU: its memfd holds the CUDA IPC descriptor, not the KV."""
    with open(handle.path(), "rb") as f:
        descriptor = f.read()
    try:
        return open_cuda(handle, descriptor, shape, dtype)
    except (ValueError, RuntimeError) as exc:
        raise KVTransferError(
            f"cannot map the CUDA KV cache {ipc_name(handle.token)} of pid {handle.pid}: {exc}"
        ) from exc


def _touch_pages(tensor: torch.Tensor) -> None:
    tensor.view(-1)[:: max(1, 4096 // tensor.element_size())].sum()
