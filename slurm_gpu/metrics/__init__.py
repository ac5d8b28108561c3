"""Prometheus metrics: the catalog, the textfile writer, what the hooks write, the exporter (docs/prometheus.md)."""
