"""Trace-driven simulation: serving model, traces, and the cluster simulator (`rose.sim.engine`)
with its models, requests, ledger, runs and report (docs/simulator.md)."""
