"""`rose gateway`: an OpenAI-compatible front door over the rollout pool (docs/gateway.md)."""
