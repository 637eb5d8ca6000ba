"""KV tiers under an instance's pool: host memory, then disk (see tiered_store.py)."""
