"""The Func-IPC baseline's Redis is safe by default: protected mode, a generated password that is on
no command line, and files only its owner can read."""

from __future__ import annotations

import os
import stat

import pytest

from streambox.comm.baselines import RedisServer

pytestmark = pytest.mark.skipif(
    RedisServer.why_unavailable() is not None, reason=f"needs Redis: {RedisServer.why_unavailable()}"
)


def test_redis_wants_the_generated_password_and_keeps_it_off_command_lines():
    import redis

    with RedisServer() as server:
        assert len(server.password) >= 32
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port).set("k", b"v")
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port, password="guess").ping()
        client = server.client()
        client.set("k", b"v")
        assert client.get("k") == b"v"
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        pid = client.info("server")["process_id"]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert server.password.encode() not in f.read()
        for path in (server.password_file, server.password_file.parent / "redis.conf"):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(server.password_file.parent).st_mode) == 0o700
    assert not server.password_file.exists()
