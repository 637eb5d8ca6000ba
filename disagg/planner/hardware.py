"""The hardware the planner knows by name: what a roofline needs of one device and its links.

GPU figures are vendors' datasheet figures, dense (not 2:4-sparse) BF16 tensor FLOP/s; link
bandwidths are per direction, since one all-reduce or KV transfer step sends one way at a time.
Real kernels reach a fraction of these: `roofline.Efficiency` holds that fraction, calibrated
against a published profile. The "cpu" entry is this development machine, measured.

Pure Python: the planner runs on any laptop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from disagg.placement.latency_model import TransferModel

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense BF16 FLOP/s of one device
    memory_bandwidth: float  # bytes/s of one device's memory
    memory_bytes: float  # one device's memory
    devices_per_node: int
    intra_node_bandwidth: float  # bytes/s per direction between two devices of a node (NVLink or PCIe)
    intra_node_latency_ms: float
    inter_node_bandwidth: float  # bytes/s per direction per device to another node (the NIC)
    inter_node_latency_ms: float

    def __post_init__(self) -> None:
        sizes = (self.peak_flops, self.memory_bandwidth, self.memory_bytes)
        links = (self.intra_node_bandwidth, self.inter_node_bandwidth)
        if min(sizes + links) <= 0 or self.devices_per_node < 1:
            raise ValueError(f"hardware {self.name}: every rate and size must be > 0")

    def link(self, inter_node: bool = False) -> tuple[float, float]:
        """(bytes/s, latency ms) between two devices, in one node or across nodes."""
        if inter_node:
            return self.inter_node_bandwidth, self.inter_node_latency_ms
        return self.intra_node_bandwidth, self.intra_node_latency_ms

    def kv_transfer(self, inter_node: bool = False) -> TransferModel:
        """A request's KV moving from a prefill to a decode device over that link."""
        bandwidth, latency = self.link(inter_node)
        where = "inter-node" if inter_node else "intra-node"
        return TransferModel(bandwidth, latency, notes=f"{self.name} {where} link, datasheet")


# NVLink: NVIDIA's figures are both directions added; we halve them.
# Inter-node: one InfiniBand NIC per GPU, as in NVIDIA's DGX/HGX reference designs
# (A100: HDR 200 Gb/s; H100/H200: NDR 400 Gb/s). Latencies are typical NCCL small-message figures.
_CATALOGUE = (
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense (624 sparse),
    # HBM2e 2,039 GB/s, 80 GB (80 GiB: the driver reports 81,920 MiB); NVLink 600 GB/s; HGX A100 8-GPU.
    Hardware("a100-80gb", 312e12, 2039 * GB, 80 * GIB, 8, 300 * GB, 0.01, 25 * GB, 0.005),
    # NVIDIA H100 datasheet (SXM5): BF16 989.4 TFLOPS dense (1,979 sparse), HBM3 3.35 TB/s, 80 GB;
    # NVLink 900 GB/s; HGX H100 8-GPU.
    Hardware("h100-sxm", 989.4e12, 3350 * GB, 80 * GB, 8, 450 * GB, 0.01, 50 * GB, 0.005),
    # NVIDIA H200 datasheet (SXM): BF16 989 TFLOPS dense (1,979 sparse), HBM3e 4.8 TB/s, 141 GB;
    # NVLink 900 GB/s; HGX H200 8-GPU.
    Hardware("h200", 989e12, 4800 * GB, 141 * GB, 8, 450 * GB, 0.01, 50 * GB, 0.005),
    # NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 sparse), GDDR6 864 GB/s, 48 GB;
    # no NVLink: PCIe Gen4 x16, 64 GB/s both directions; 8 per server (NVIDIA OVX); 200 Gb/s Ethernet.
    Hardware("l40s", 362.05e12, 864 * GB, 48 * GB, 8, 32 * GB, 0.02, 25 * GB, 0.01),
    # This development machine, one core per device (the engine runs one thread per worker).
    # Measured 2026-11-24, "AMD EPYC" (KVM, avx2 avx512f avx512_bf16), torch 2.13.0+cpu, three runs of
    #   .venv/bin/python -m loadtest.host.cpu
    # bf16 2048^3 matmul, best of 5: 483-505 GFLOP/s on 1 thread (median 492), 915-961 on 2;
    # fp32: 115-116 / 224-235. 1 GiB array copy (read + write bytes): 40-42 GB/s on 1 thread,
    # 46 GB/s on 2 (median; one run 77). Both cores stream at once when both workers run, so a
    # device gets half of the 2-thread figure.
    # Link: gloo send/recv on loopback, 3.33 GB/s (loadtest/RESULTS.md); its latency is assumed.
    # Memory: MemTotal 23.5 GiB, shared by the two devices.
    Hardware("cpu", 492e9, 23.0 * GB, 11.7 * GIB, 2, 3.33 * GB, 0.1, 3.33 * GB, 0.1),
)


def known_hardware() -> dict[str, Hardware]:
    return {hw.name: hw for hw in _CATALOGUE}


def hardware_spec(name: str) -> Hardware:
    """A catalogued kind, or a measured variant of one: `cpu-2t` is the CPU at 2 threads per rank
    (the name `disagg profile` gives its CPU profiles)."""
    key = name.strip().lower()
    catalogue = known_hardware()
    if key in catalogue:
        return catalogue[key]
    base, _, threads = key.rpartition("-")
    if base in catalogue and threads.endswith("t") and threads[:-1].isdigit() and int(threads[:-1]) >= 1:
        return replace(catalogue[base], name=key)
    raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted(catalogue))}")


def threads_per_rank(hardware_name: str) -> int | None:
    """The threads a measured CPU variant was profiled at (`cpu-2t` -> 2); None for the catalogue's kinds."""
    _, _, threads = hardware_name.rpartition("-")
    return int(threads[:-1]) if threads.endswith("t") and threads[:-1].isdigit() else None
