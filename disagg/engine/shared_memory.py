"""CPU tensors that another process on the same host can map: the prefill KV cache lives in one,
so that a decode worker beside it copies blocks straight out of it (disagg.kv_transfer.shared_memory
maps it).

The memory is an anonymous memfd: nothing in /dev/shm to leak, no size limit of a container's
/dev/shm, and the kernel frees it when the last process that maps it (or holds its descriptor)
is gone, however they end. A peer opens it through /proc/<pid>/fd/<fd> of the owner, which works
for processes of the same user in the same PID namespace on the same boot: what `host_key`
names. The memfd's name carries a random token that the peer checks, so a reused pid or
descriptor number is never mistaken for the cache.
"""

from __future__ import annotations

import math
import os
import secrets
import weakref
from dataclasses import astuple, dataclass

import torch


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
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    fd = os.memfd_create(f"disagg-kv-{token:016x}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        tensor = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=math.prod(shape), dtype=dtype).view(shape)
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
