"""Configuration from the environment, without any broker: names map as documented."""

import pytest

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


def test_rollout_engine_and_model_are_checked(tmp_path):
    from rose.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.engine: expected vllm, hf or reference, got 'sglang'"):
        load_config(env={"ROSE_ROLLOUT__ENGINE": "sglang"})
    with pytest.raises(ConfigError, match="rollout.model: engine 'vllm' needs"):
        load_config(env={"ROSE_ROLLOUT__ENGINE": "vllm"})
    with pytest.raises(ConfigError, match="not a Hugging Face checkpoint directory"):
        load_config(env={"ROSE_ROLLOUT__ENGINE": "hf", "ROSE_ROLLOUT__MODEL": str(tmp_path)})
    (tmp_path / "config.json").write_text("{}")
    c = load_config(env={"ROSE_ROLLOUT__ENGINE": "hf", "ROSE_ROLLOUT__MODEL": str(tmp_path)})
    assert (c.rollout.engine, c.rollout.model) == ("hf", str(tmp_path))
    with pytest.raises(ConfigError, match="rollout.step_tokens: expected 0 .* got -1"):
        load_config(env={"ROSE_ROLLOUT__STEP_TOKENS": "-1"})


def test_executor_clock_skew_bound_is_checked():
    from rose.config import ConfigError

    assert load_config(env={}).executor.max_clock_skew_s == 2.0
    assert load_config(env={"ROSE_EXECUTOR__MAX_CLOCK_SKEW_S": "0"}).executor.max_clock_skew_s == 0.0
    for bad in ("-1", "2.5", "nan"):
        with pytest.raises(ConfigError, match="executor.max_clock_skew_s: expected seconds >= 0 and below"):
            load_config(env={"ROSE_EXECUTOR__MAX_CLOCK_SKEW_S": bad})
    with pytest.raises(ConfigError, match=r"policy.renew_before_s \(1\)"):
        load_config(env={"ROSE_POLICY__RENEW_BEFORE_S": "1"})


def test_a_true_or_false_setting_reads_true_false_1_or_0_and_refuses_anything_else(tmp_path):
    from rose.config import ConfigError

    assert load_config(env={}).executor.worker_sched_idle is False
    for text, want in (("true", True), ("TRUE", True), ("1", True), ("false", False), ("0", False)):
        assert load_config(env={"ROSE_EXECUTOR__WORKER_SCHED_IDLE": text}).executor.worker_sched_idle is want
    path = tmp_path / "c.toml"
    path.write_text("[executor]\nworker_sched_idle = true\n")
    assert load_config(path, env={}).executor.worker_sched_idle is True
    for bad in ("yes", "2", ""):
        with pytest.raises(ConfigError, match="executor.worker_sched_idle: expected true or false"):
            load_config(env={"ROSE_EXECUTOR__WORKER_SCHED_IDLE": bad})


def test_router_kind_url_and_drain_timeout_are_checked():
    from rose.config import ConfigError

    c = load_config(env={})
    assert (c.router.kind, c.executor.drain_timeout_s) == ("vllm-router", 30.0)
    c = load_config(env={"ROSE_ROUTER__KIND": "readiness", "ROSE_ROUTER__URL": "http://0.0.0.0:8099"})
    assert (c.router.kind, c.router.url) == ("readiness", "http://0.0.0.0:8099")
    with pytest.raises(ConfigError, match="router.kind: expected vllm-router or readiness, got 'nginx'"):
        load_config(env={"ROSE_ROUTER__KIND": "nginx"})
    with pytest.raises(ConfigError, match="router.url: expected an http:// or https:// address, got '127.0.0.1:30000'"):
        load_config(env={"ROSE_ROUTER__URL": "127.0.0.1:30000"})
    for bad in ("0", "-5", "nan", "inf"):
        with pytest.raises(ConfigError, match="executor.drain_timeout_s: expected a number of seconds > 0"):
            load_config(env={"ROSE_EXECUTOR__DRAIN_TIMEOUT_S": bad})
