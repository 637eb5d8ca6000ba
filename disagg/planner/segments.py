"""Instance segments: the node arithmetic of DistServe's Algorithm 2 (low node affinity).

The model is split into `pp` stages. A unit of the deployment is, for each stage, one node's
worth of instance segments holding that stage's layers: `num_prefill` prefill segments of
`prefill_tp` devices and `num_decode` decode segments of `decode_tp` devices. Because the prefill
and the decode segments of a stage share a node, a request's KV for those layers moves over the
node's own link (NVLink), never the network: that is what low node affinity buys, and why a
segment that does not fit one node is no candidate at all.

A unit is replicated whole. Its stages are packed onto nodes: a node holds as many stage slots as
its devices allow, so the nodes a plan needs are counted from slots, not from a total of devices.

Pure Python: the planner runs on any laptop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SegmentUnit:
    pp: int
    prefill_tp: int
    decode_tp: int
    num_prefill: int = 1  # prefill instances per unit (the P of the P:D ratio)
    num_decode: int = 1

    @property
    def devices_per_stage(self) -> int:
        """Devices one stage's segments take on their node."""
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def devices(self) -> int:
        return self.pp * self.devices_per_stage

    def fits_node(self, devices_per_node: int) -> bool:
        return self.devices_per_stage <= devices_per_node

    def stages_per_node(self, devices_per_node: int) -> int:
        return devices_per_node // self.devices_per_stage

    def nodes_needed(self, replicas: int, devices_per_node: int) -> int:
        """Nodes that `replicas` units take, their stage slots packed onto nodes."""
        if not self.fits_node(devices_per_node):
            raise ValueError(f"a stage of {self} needs more than the node's {devices_per_node} devices")
        return math.ceil(replicas * self.pp / self.stages_per_node(devices_per_node))

    def max_replicas(self, num_nodes: int, devices_per_node: int) -> int:
        """The most units `num_nodes` nodes can hold (0: not even one)."""
        if not self.fits_node(devices_per_node):
            return 0
        return num_nodes * self.stages_per_node(devices_per_node) // self.pp


def segments_fit_node(prefill_tp: int, decode_tp: int, devices_per_node: int) -> bool:
    """One prefill and one decode segment of a stage fit one node together."""
    return SegmentUnit(1, prefill_tp, decode_tp).fits_node(devices_per_node)


def node_ratios(prefill_tp: int, decode_tp: int, devices_per_node: int) -> list[tuple[int, int]]:
    """Every P:D ratio (coprime: 2:2 is 1:1 twice) whose segments fit one node."""
    return [
        (n_p, n_d)
        for n_p in range(1, devices_per_node // prefill_tp + 1)
        for n_d in range(1, devices_per_node // decode_tp + 1)
        if math.gcd(n_p, n_d) == 1 and n_p * prefill_tp + n_d * decode_tp <= devices_per_node
    ]
