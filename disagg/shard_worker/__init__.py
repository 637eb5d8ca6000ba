"""The other ranks of a TP x PP instance: actors that run their shard of each step rank 0 schedules."""
