"""Plans a deployment: profiles, the simulator and the TP/PP search."""
