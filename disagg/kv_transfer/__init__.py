"""How KV-cache blocks move between workers (interface, torch.distributed backend, protocol)."""
