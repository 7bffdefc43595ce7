"""Shared fixtures: a private redis-server per test (free port, temp folder), child reaping."""

from __future__ import annotations

import os
import shutil

import psutil
import pytest

from ops.cluster.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server on a free port, AOF in a temp folder; stopped after the test."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    server = RedisServer(workdir=tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


@pytest.fixture(autouse=True, scope="session")
def _reap_children():
    """Kill any child process a test left behind (a failed test must not leak workers)."""
    yield
    me = psutil.Process(os.getpid())
    for child in me.children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
