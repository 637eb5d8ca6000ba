"""Load generators of others run against disagg: Locust (with its SLO figures) and GuideLLM."""
