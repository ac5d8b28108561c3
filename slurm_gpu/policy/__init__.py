"""Judging GPUs: the health checks (pure) and the one drain decision."""
