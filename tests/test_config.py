"""Configuration from the environment, without any broker: names map as documented."""

from rose.config import load_config


def test_environment_overrides_sections_and_passes_librdkafka_properties_through():
    cfg = load_config(
        env={
            "ROSE_KAFKA_BOOTSTRAP": "kafka-1:9092,kafka-2:9092",
            "ROSE_POLICY__TTL_S": "8",
            "ROSE_LIBRDKAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
            "ROSE_LIBRDKAFKA__LOG_LEVEL": "3",  # librdkafka spells this one with an underscore
        }
    )
    assert cfg.kafka.bootstrap == "kafka-1:9092,kafka-2:9092"
    assert cfg.policy.ttl_s == 8.0
    assert cfg.kafka.librdkafka["sasl.mechanism"] == "SCRAM-SHA-512"
    assert cfg.kafka.librdkafka["log_level"] == "3" and "log.level" not in cfg.kafka.librdkafka
