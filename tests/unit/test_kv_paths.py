"""How KV moves between two workers, chosen from what each process sees of the devices
(kv_transfer.paths), with stand-in device maps for the hosts we cannot build here."""

from __future__ import annotations

import pytest

from disagg.kv_transfer.paths import DeviceView, KVPath, choose_path

HOST, OTHER_HOST = "boot-1/ns/0", "boot-2/ns/0"
A, B = "GPU-aaaa", "GPU-bbbb"


def gpu(cache: str, visible: tuple[str, ...], peers: tuple[str, ...] = (), host: str = HOST) -> DeviceView:
    return DeviceView(host, cache, visible, peers)


@pytest.mark.parametrize(
    "sender, receiver, path",
    [
        # One GPU shared by both processes (a prefill and a decode instance on one H200).
        (gpu(A, (A,)), gpu(A, (A,)), KVPath.CUDA_IPC),
        # Two GPUs both processes see, with peer access: the receiver maps the sender's GPU.
        (gpu(A, (A, B), (B,)), gpu(B, (A, B), (A,)), KVPath.CUDA_IPC),
        # Two GPUs both see, without peer access between them (e.g. across PCIe root complexes).
        (gpu(A, (A, B)), gpu(B, (A, B)), KVPath.NCCL),
        # Ray gave each its own CUDA_VISIBLE_DEVICES: neither sees the other's GPU.
        (gpu(A, (A,)), gpu(B, (B,)), KVPath.NCCL),
        # The same GPUs, numbered differently in each process: names, not indices, decide.
        (gpu(B, (B, A), (A,)), gpu(A, (A, B), (B,)), KVPath.CUDA_IPC),
        # GPUs on two hosts.
        (gpu(A, (A,)), gpu(A, (A,), host=OTHER_HOST), KVPath.NCCL),
        # CPU caches: one host, two hosts.
        (DeviceView(HOST), DeviceView(HOST), KVPath.SHARED_MEMORY),
        (DeviceView(HOST), DeviceView(OTHER_HOST), KVPath.GLOO),
        # A CPU cache beside a GPU one: staged through host memory.
        (DeviceView(HOST, visible=(A,)), gpu(A, (A,)), KVPath.GLOO),
        (gpu(A, (A,)), DeviceView(HOST), KVPath.GLOO),
        # No /proc (host unknown): never by reference.
        (DeviceView(""), DeviceView(""), KVPath.GLOO),
    ],
    ids=[
        "one-gpu",
        "two-gpus-peer-access",
        "two-gpus-no-peer-access",
        "ray-isolated",
        "renumbered",
        "two-hosts-gpu",
        "one-host-cpu",
        "two-hosts-cpu",
        "cpu-to-gpu",
        "gpu-to-cpu",
        "unknown-host",
    ],
)
def test_the_path_follows_what_the_receiver_can_map(sender, receiver, path):
    assert choose_path(sender, receiver) is path


def test_the_choice_is_per_direction():
    """The receiver maps the sender's cache: a process that sees both GPUs can pull from one that
    sees only its own, not the other way round."""
    sees_both, sees_own = gpu(B, (A, B), (A,)), gpu(A, (A,))
    assert choose_path(sees_own, sees_both) is KVPath.CUDA_IPC
    assert choose_path(sees_both, sees_own) is KVPath.NCCL


def test_a_view_travels_as_json_unchanged():
    view = gpu(A, (B, A), (B,))
    assert DeviceView.from_json(view.to_json()) == view


@pytest.mark.parametrize("path, by_reference", [(p, p in (KVPath.SHARED_MEMORY, KVPath.CUDA_IPC)) for p in KVPath])
def test_only_paths_on_mapped_memory_go_by_reference(path, by_reference):
    assert path.by_reference is by_reference
