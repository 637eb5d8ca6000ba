"""KV transfer: raw against the protocol, between processes on one device, sliding windows, live migration."""
