"""Load testing: seeded workloads, an open-loop gRPC benchmark, vLLM-style metrics, SLO
attainment and goodput, reports with plots, and the disaggregated-vs-colocated experiment."""
