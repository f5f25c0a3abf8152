"""Trace-driven simulation: serving model, traces, and the cluster simulator (`rose.sim.engine`)
with its settings (`rose.sim.sim_config`), models, rollout model, requests, ledger, runs and
report (docs/simulator.md). Broker-free: the simulated agent that publishes to Kafka is
`rose.node.simulated_agent`."""
