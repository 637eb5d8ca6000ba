"""The benchmarks, by subject, each a thin `main` over disagg.bench: run one from the repository
root as `python -m loadtest.<group>.<name>` (`--help` says what it measures). Figures:
loadtest/RESULTS.md."""
