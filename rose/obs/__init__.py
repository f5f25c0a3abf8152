"""Observability: structured logs, OpenTelemetry traces, Prometheus metrics, percentiles of samples
(`stats`), PNG figures (`figures`)."""
