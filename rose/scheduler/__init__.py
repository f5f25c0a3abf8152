"""The scheduler service: telemetry in, commands out, in Kafka transactions."""
