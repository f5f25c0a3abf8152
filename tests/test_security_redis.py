"""Redis AUTH/ACL users through the configured URL, on the real Redis: an ACL user limited
to ROSE's key prefix works, a wrong password is refused, and the password never appears in
the redacted config."""

from __future__ import annotations

import uuid

import pytest
import redis

from rose.config import load_config

pytestmark = pytest.mark.stack


def test_acl_user_via_url_and_redaction(cfg, redis_client, tmp_path):
    user, password = f"rose-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    prefix = cfg.redis.key_prefix
    redis_client.execute_command("ACL", "SETUSER", user, "on", f">{password}", f"~{prefix}*", "+@all")
    try:
        secret = tmp_path / "redis-url"
        secret.write_text(f"redis://{user}:{password}@127.0.0.1:{cfg.stack.redis_port}/0\n")
        loaded = load_config(env={"ROSE_REDIS__URL_FILE": str(secret)})
        assert password not in str(loaded.redacted())
        assert f"{user}:***@" in loaded.redacted()["redis"]["url"]
        r = redis.Redis.from_url(loaded.redis.url)
        r.set(cfg.redis.key("acl-probe"), b"ok")
        assert r.get(cfg.redis.key("acl-probe")) == b"ok"
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.set("outside-the-prefix", b"x")
        bad = redis.Redis.from_url(f"redis://{user}:wrong@127.0.0.1:{cfg.stack.redis_port}/0")
        with pytest.raises(redis.exceptions.AuthenticationError):
            bad.ping()
    finally:
        redis_client.execute_command("ACL", "DELUSER", user)
