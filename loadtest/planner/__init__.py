"""The planner and the simulator against measured runs (ours and DistServe's), and re-planning."""

from pathlib import Path

# DistServe's measured A100 runs and published profiles, beside the repository (as CI has them).
DISTSERVE_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "distserve"
