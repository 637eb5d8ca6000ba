"""Ray actor: engine in the PREFILL role plus the KV sender."""
