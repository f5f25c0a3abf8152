"""Replica leases' router adapters: take a serving replica out of the router that spreads a pool's
requests over its replicas, and put it back (docs/router.md). `router.kind` picks the adapter:
`vllm-router` drives the real router's worker API (`rose.router.vllm_router`); `readiness` serves a
readiness endpoint per replica for routers ROSE cannot call (`rose.router.readiness`)."""
