"""Probing live deployments: the HTTP client and the Prometheus reader."""
