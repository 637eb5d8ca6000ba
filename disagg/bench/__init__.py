"""The benchmarks' library (loadtest/ holds thin mains over it): one deployment launcher
(launcher), one load client for closed and open loops over gRPC and HTTP (load_client), load
levels relative to a measured capacity (capacity), one SLO tally (slo_tally), one results writer
(results); seeded workloads, vLLM-style metrics, reports with plots, and `disagg bench |
report | experiment`."""
