"""What the tiers did: hits and bytes by tier (read from other threads for reports)."""

from __future__ import annotations

from dataclasses import dataclass, field

TIERS = ("pool", "host", "disk")


def _by_tier() -> dict[str, int]:
    return dict.fromkeys(TIERS, 0)


@dataclass
class TierStats:
    # Prefix blocks a request took instead of computing them: "pool" counts every block taken
    # from the pool's cache (those loaded back from below too), "host" / "disk" the loads back.
    hit_blocks: dict[str, int] = field(default_factory=_by_tier)
    loaded_bytes: dict[str, int] = field(default_factory=_by_tier)  # copied back into the pool
    stored_bytes: dict[str, int] = field(default_factory=_by_tier)  # written down into a tier
    dropped_blocks: int = 0  # evicted from the lowest tier: gone

    def to_dict(self, held_bytes: dict[str, int], held_blocks: dict[str, int]) -> dict:
        """Plain data for a load report: these counters and what each tier holds now."""
        return {
            "hit_blocks": dict(self.hit_blocks),
            "loaded_bytes": dict(self.loaded_bytes),
            "stored_bytes": dict(self.stored_bytes),
            "dropped_blocks": self.dropped_blocks,
            "held_bytes": held_bytes,
            "held_blocks": held_blocks,
        }
