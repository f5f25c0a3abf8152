"""Kafka SASL/SCRAM through the librdkafka pass-through config, on the real broker's SCRAM
listener: the right credentials produce and consume, wrong ones are refused, and the
password never appears in the redacted config that services log."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from rose.config import load_config
from rose.kafka.admin import (
    KafkaException,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
    make_admin,
)
from rose.kafka.producer import make_producer, produce
from tests.kafka_checks import consume_one
from tests.test_rollout_tasks import wait_for

pytestmark = pytest.mark.stack


def refused_errors(kcfg) -> list:
    """The client errors of a connection the broker must refuse (metadata fails; the
    reasons arrive through the error callback, served on poll)."""
    errors: list = []
    admin = make_admin(kcfg, error_cb=errors.append)
    with pytest.raises(KafkaException):
        admin.list_topics(timeout=5)
    for _ in range(10):
        if errors:
            break
        admin.poll(0.5)
    return errors


def _authenticates(kcfg) -> bool:
    """Whether a client with these credentials gets the cluster's metadata."""
    try:
        make_admin(kcfg).list_topics(timeout=3)
        return True
    except KafkaException:
        return False


def _scram_user(cfg, user: str, password: str) -> None:
    admin = make_admin(cfg.kafka)
    up = UserScramCredentialUpsertion(user, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), password.encode())
    for fut in admin.alter_user_scram_credentials([up]).values():
        fut.result(timeout=20)


def _secured(cfg, stack, user, password, env_extra=None):
    env = {
        "ROSE_KAFKA_BOOTSTRAP": f"127.0.0.1:{stack.scfg.sasl_port}",
        "ROSE_LIBRDKAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "ROSE_LIBRDKAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
        "ROSE_LIBRDKAFKA__SASL_USERNAME": user,
        "ROSE_LIBRDKAFKA__SASL_PASSWORD": password,
        **(env_extra or {}),
    }
    loaded = load_config(env=env)
    return dataclasses.replace(
        cfg, kafka=dataclasses.replace(cfg.kafka, bootstrap=loaded.kafka.bootstrap, librdkafka=loaded.kafka.librdkafka)
    ), loaded


def test_scram_client_produces_and_consumes(cfg, stack):
    user, password = f"rose-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    _scram_user(cfg, user, password)
    secured, loaded = _secured(cfg, stack, user, password)
    assert loaded.kafka.librdkafka["sasl.username"] == user
    assert password not in str(loaded.redacted())
    # the credentials propagate through the metadata log: a SASL client is let in once they have
    wait_for(lambda: _authenticates(secured.kafka), 30, "the SCRAM credentials were never accepted")
    p = make_producer(secured.kafka)
    produce(p, secured.kafka.telemetry_topic, b'{"probe": 1}', "g")
    assert p.flush(20) == 0
    m = consume_one(secured.kafka, secured.kafka.telemetry_topic, "scram-test")
    assert m is not None and m.value() == b'{"probe": 1}'


def test_wrong_scram_password_is_refused(cfg, stack):
    user = f"rose-{uuid.uuid4().hex[:6]}"
    _scram_user(cfg, user, "right-password")
    secured, _ = _secured(cfg, stack, user, "wrong-password")
    errors = refused_errors(secured.kafka)
    assert any("SASL" in str(e) or "uthentication" in str(e) for e in errors), errors


def _tls(cfg, stack, env_extra):
    loaded = load_config(
        env={
            "ROSE_KAFKA_BOOTSTRAP": f"127.0.0.1:{stack.scfg.tls_port}",
            "ROSE_LIBRDKAFKA__SECURITY_PROTOCOL": "SSL",
            **env_extra,
        }
    )
    return dataclasses.replace(
        cfg, kafka=dataclasses.replace(cfg.kafka, bootstrap=loaded.kafka.bootstrap, librdkafka=loaded.kafka.librdkafka)
    )


def test_tls_client_verifies_the_broker_and_round_trips(cfg, stack):
    secured = _tls(cfg, stack, {"ROSE_LIBRDKAFKA__SSL_CA_LOCATION": str(stack.tls_dir / "ca.pem")})
    assert secured.kafka.librdkafka["ssl.ca.location"].endswith("ca.pem")
    p = make_producer(secured.kafka)
    produce(p, secured.kafka.commands_topic, b'{"tls": true}', "g")
    assert p.flush(20) == 0
    m = consume_one(secured.kafka, secured.kafka.commands_topic, "tls-test")
    assert m is not None and m.value() == b'{"tls": true}'


def test_tls_client_refuses_a_broker_it_cannot_verify(cfg, stack, tmp_path):
    import subprocess

    other = tmp_path / "other-ca.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=other",
            "-keyout",
            str(tmp_path / "k"),
            "-out",
            str(other),
        ],
        check=True,
        capture_output=True,
    )
    secured = _tls(cfg, stack, {"ROSE_LIBRDKAFKA__SSL_CA_LOCATION": str(other)})
    errors = refused_errors(secured.kafka)
    assert any("SSL" in str(e) or "certificate" in str(e) for e in errors), errors
