"""The request path between the router and the workers' rank 0: a direct socket per
(router, instance), carrying the calls that sit on a request's latency (prefill, handshake,
abort) and the token streams back. Ray stays in charge of placement and lifecycle; its actor
calls cost milliseconds each on a busy host, which is TTFT the client sees.
"""
