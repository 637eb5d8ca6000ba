"""Measures profiles: runs the real engine over a grid of steps and fits the latency model to them."""
