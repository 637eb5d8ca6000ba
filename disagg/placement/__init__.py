"""Pure policy shared by the router (online) and the planner's simulator (offline): the latency
model and its fit, profiles, and where a request goes. No torch, Ray, gRPC or Redis."""
