"""How KV moves from one worker to another, chosen once per pair from what each side's process
can see of the devices.

A KV cache on a GPU can be copied straight out of by a process on the same host only if that
process sees the GPU (Ray gives each actor its own CUDA_VISIBLE_DEVICES, so on a host of eight
GPUs two workers usually see none of each other's) and its own GPU can reach it (the same GPU, or
peer access between the two). Otherwise the KV goes over NCCL between the two GPUs, and over
gloo, packed, where either side is on CPU. GPUs are named by UUID, never by index: index 0 is a
different GPU in each process that Ray isolated.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass

import torch

from disagg.engine.cuda_sharing import gpu_uuid, peer_gpus, visible_gpus
from disagg.engine.shared_memory import host_key

CPU = "cpu"


class KVPath(enum.Enum):
    SHARED_MEMORY = "shared memory"  # CPU caches on one host: the receiver copies from the sender's memfd
    CUDA_IPC = "cuda ipc"  # the receiver maps the sender's GPU memory and copies from it
    NCCL = "nccl"  # packed messages between two GPUs
    GLOO = "gloo"  # packed messages through host memory

    @property
    def by_reference(self) -> bool:
        """The receiver copies the blocks itself: only references travel."""
        return self in (KVPath.SHARED_MEMORY, KVPath.CUDA_IPC)


@dataclass(frozen=True)
class DeviceView:
    """What one worker process knows of where its KV cache is and which GPUs it can reach."""

    host: str  # equal for two processes exactly when they can map each other's memory (host_key)
    cache_device: str = CPU  # "cpu", or the UUID of the GPU the cache is on
    visible: tuple[str, ...] = ()  # UUIDs of the GPUs this process sees, in its own index order
    peers: tuple[str, ...] = ()  # UUIDs of the GPUs the cache's GPU can access peer to peer

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "DeviceView":
        d = json.loads(text)
        return cls(d["host"], d["cache_device"], tuple(d["visible"]), tuple(d["peers"]))


def choose_path(sender: DeviceView, receiver: DeviceView) -> KVPath:
    """How KV goes from `sender`'s cache to `receiver`'s."""
    both_gpus = CPU not in (sender.cache_device, receiver.cache_device)
    if not sender.host or sender.host != receiver.host:
        return KVPath.NCCL if both_gpus else KVPath.GLOO
    if sender.cache_device == receiver.cache_device == CPU:
        return KVPath.SHARED_MEMORY
    if not both_gpus:
        return KVPath.GLOO  # one side on CPU: staged through host memory
    return KVPath.CUDA_IPC if _can_map(receiver, sender.cache_device) else KVPath.NCCL


def _can_map(receiver: DeviceView, gpu: str) -> bool:
    """The receiver's process sees `gpu` and its own GPU can read it."""
    return gpu in receiver.visible and (gpu == receiver.cache_device or gpu in receiver.peers)


def local_view(device: torch.device) -> DeviceView:
    """This process's view, for a KV cache on `device`."""
    if device.type != "cuda":
        return DeviceView(host_key(), CPU, visible_gpus())
    index = device.index if device.index is not None else torch.cuda.current_device()
    return DeviceView(host_key(), gpu_uuid(index), visible_gpus(), peer_gpus(index))
