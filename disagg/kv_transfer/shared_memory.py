"""CPU tensors that another process on the same host can map: the prefill KV cache, so that a
decode worker beside it copies blocks straight out of it (one copy instead of pack, send,
receive and scatter).

The memory is an anonymous memfd: nothing in /dev/shm to leak, no size limit of a container's
/dev/shm, and the kernel frees it when the last process that maps it (or holds its descriptor)
is gone, however they end. A peer opens it through /proc/<pid>/fd/<fd> of the owner, which works
for processes of the same user in the same PID namespace on the same boot: what `host_key`
names. The memfd's name carries a random token that the peer checks, so a reused pid or
descriptor number is never mistaken for the cache.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from dataclasses import astuple, dataclass

import torch

from disagg.errors import KVTransferError


@dataclass(frozen=True)
class SharedHandle:
    """What a peer on the same host needs to map a shared tensor's memory."""

    pid: int
    fd: int
    token: int  # random, in the memfd's name

    def to_list(self) -> list[int]:
        return list(astuple(self))

    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"

    def name(self) -> str:
        return f"disagg-kv-{self.token:016x}"


def host_key() -> str:
    """Equal for two processes exactly when they can map each other's shared tensors."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""  # no /proc (not Linux): share nothing
    return f"{boot}/{pid_namespace}/{os.getuid()}"


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, SharedHandle]:
    """A zero-filled CPU tensor in shared memory, and the handle a peer maps it with."""
    token = secrets.randbits(63)
    nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    fd = os.memfd_create(f"disagg-kv-{token:016x}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        tensor = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=_numel(shape), dtype=dtype).view(shape)
        # Allocate every page now, as torch.zeros would: not one page fault at a time later,
        # in the middle of the prefills that first write them.
        tensor.zero_()
    except BaseException:
        os.close(fd)
        raise
    # The descriptor stays open while this tensor object lives (keep it, not only views of it):
    # it is how peers find the memory. Their mappings outlive it safely.
    weakref.finalize(tensor, os.close, fd)
    return tensor, SharedHandle(os.getpid(), fd, token)


def attach(handle: SharedHandle, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Map a peer's shared tensor; KVTransferError when it is not there or not what we expect."""
    expected_bytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    try:
        if os.readlink(handle.path()) != f"/memfd:{handle.name()} (deleted)":
            raise KVTransferError(f"shared KV cache {handle.name()} is gone (pid {handle.pid} fd {handle.fd} is something else)")
        actual_bytes = os.stat(handle.path()).st_size
        if actual_bytes != expected_bytes:
            raise KVTransferError(f"shared KV cache {handle.name()} holds {actual_bytes} bytes, expected {expected_bytes} for {list(shape)} {dtype}")
        tensor = torch.from_file(handle.path(), shared=True, size=_numel(shape), dtype=dtype).view(shape)
    except OSError as exc:
        raise KVTransferError(f"cannot map shared KV cache {handle.name()} of pid {handle.pid}: {exc}") from exc
    # Map every page, in the background: faulting them in one by one during copies doubles a
    # copy's time (measured: 256 MiB of blocks in 85 ms instead of 43), once per page for the
    # mapping's life; touching them all in one sweep costs about 70 ms per GiB, but a stall that
    # long on the first transfer from a peer is worse than the first copies running slower.
    threading.Thread(target=_touch_pages, args=(tensor,), name="kv-map-pages", daemon=True).start()
    return tensor


def _touch_pages(tensor: torch.Tensor) -> None:
    tensor.view(-1)[:: max(1, 4096 // tensor.element_size())].sum()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
