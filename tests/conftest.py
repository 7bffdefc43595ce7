"""Shared fixtures: a private redis-server per test (free port, temp folder), child reaping, and
one JAX compilation cache for the session."""

from __future__ import annotations

import os
import shutil
import tempfile

# One persistent JAX compilation cache for this session, shared with every process a test starts
# (they inherit the environment): most tests run the same tiny models, and a fresh process would
# otherwise compile the same step again (test_e2e's three CLI runs: 30 s -> 20 s cold, 15 s
# warm). Set before anything imports JAX. A size limit makes JAX lock the folder (filelock), so
# concurrent processes can share it; learners keep it instead of their state folder's cache
# (workers.common.enable_compile_cache). Removed when the session ends.
_JAX_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _JAX_CACHE = tempfile.mkdtemp(prefix="diloco-test-jax-cache-")
    os.environ.update({"JAX_COMPILATION_CACHE_DIR": _JAX_CACHE,
                       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
                       "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30)})

import psutil  # noqa: E402
import pytest  # noqa: E402

from ops.cluster.redis_server import RedisServer  # noqa: E402


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
def _kernels_built():
    """The compiled kernels in the cache before any test starts processes that would each
    build them at once (what `ops/quickstart.sh` does after installing)."""
    from workers import native

    native.build()


@pytest.fixture(autouse=True)
def _unfused():
    """Every test starts tracing attention and layer norms as their JAX definitions: a test
    that runs a `diloco` command in this process installs the fused kernels (as the command
    does in production), and the next test must not inherit them (the golden numbers are the
    definitions')."""
    yield
    from pipeline import fused

    fused.uninstall()


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
    if _JAX_CACHE is not None:
        shutil.rmtree(_JAX_CACHE, ignore_errors=True)
