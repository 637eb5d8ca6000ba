"""Latency profiles, discrete-event simulator and the TP/PP placement search (pure)."""
