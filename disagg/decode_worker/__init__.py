"""Ray actor: engine in the DECODE role plus the KV receiver and the token stream."""
