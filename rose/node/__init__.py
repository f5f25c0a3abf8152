"""What runs on a serving node to describe it: NVML, engine metrics, the telemetry agent."""
