"""Trace-driven simulation: serving model, traces, the cluster simulator and its report."""
