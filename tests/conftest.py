"""Shared fixtures: a private redis-server per test (free port, temp folder), child reaping, and
one JAX compilation cache for the session."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

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

# Under pytest-xdist (`ops/quickstart.sh test` runs the suite on every core, up to 4) a test
# marked `alone` (it measures CPU shares or delays) runs with no other test beside it: every
# test holds a shared lock while it runs and an `alone` one the exclusive lock; a gate taken
# first keeps new tests from starting while an `alone` one waits. Made here, in the process
# that starts the workers (they inherit the environment); removed when it ends.
_LOCKS = None
if "PYTEST_DILOCO_LOCKS" not in os.environ:
    _LOCKS = tempfile.mkdtemp(prefix="diloco-test-locks-")
    os.environ["PYTEST_DILOCO_LOCKS"] = _LOCKS

import psutil  # noqa: E402
import pytest  # noqa: E402

# the tiers: marks assigned from what each test reaches, and checked while it runs
from tiers import _tier_guard, pytest_collection_modifyitems, pytest_configure, pytest_sessionfinish  # noqa: E402,F401

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


_KERNELS: dict[str, bool] = {}


@pytest.fixture(autouse=True)
def _kernels_built(request):
    """The compiled kernels in the cache, once, before the first test that starts processes
    or builds them (the processes would each build them at once otherwise: what
    `ops/quickstart.sh` does after installing). Tests of the fast tier never run a compiler."""
    if not _KERNELS and request.node.get_closest_marker("process") is not None:
        from workers import native

        _KERNELS.update(native.build())


def _runtime(compiler: str | None, name: str) -> str | None:
    """The path of the compiler's runtime library `name`, or None where it has none."""
    import subprocess

    if compiler is None:
        return None
    done = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True,
                          text=True, timeout=60, check=False)
    path = done.stdout.strip()
    return path if done.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


class Sanitizer:
    """`env`: the environment of a child process that loads the compiled kernels built with
    the address and undefined-behaviour sanitizers (`workers.native.SANITIZE_ENV`), the
    sanitizer's runtime preloaded, and libstdc++ with it (its exception interceptors need it
    from the start)."""

    def __init__(self, env: dict[str, str]):
        self.env = env

    @staticmethod
    def reports(stderr: str) -> list[str]:
        """The lines of a child's stderr where a sanitizer reported something."""
        return [ln for ln in stderr.splitlines() if "Sanitizer" in ln or "runtime error" in ln]


@pytest.fixture
def sanitizer() -> Sanitizer:
    """A `Sanitizer`, both libraries built (by a process without the preload, so that the
    compilers do not run under it); skips where the compilers have no address-sanitizer
    runtime, or not the same one, or where a process does not start with it."""
    import subprocess
    import sys

    from workers import native

    cxx = native._cxx()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    asan, stdcxx = _runtime(cxx, "libasan.so"), _runtime(cxx, "libstdc++.so")
    if asan is None or stdcxx is None or _runtime(cc, "libasan.so") != asan:
        pytest.skip(f"no address-sanitizer runtime shared by {cc} and {cxx} here")
    base = {k: v for k, v in os.environ.items()
            if k not in (native.FUSED_ENV, "DILOCO_KERNELS", "LD_PRELOAD")}
    base.update({"JAX_PLATFORMS": "cpu", native.SANITIZE_ENV: "address,undefined"})
    build = subprocess.run([sys.executable, "-c", "from workers import native; native.build()"],
                           cwd=Path(__file__).resolve().parents[1], env=base,
                           capture_output=True, text=True, timeout=600, check=False)
    assert build.returncode == 0, build.stderr[-3000:]
    env = {**base, "LD_PRELOAD": f"{asan} {stdcxx}", "ASAN_OPTIONS": "detect_leaks=0",
           "UBSAN_OPTIONS": "print_stacktrace=1"}
    if subprocess.run([sys.executable, "-c", "pass"], env=env, capture_output=True,
                      timeout=120, check=False).returncode != 0:
        pytest.skip("a process with the address sanitizer's runtime preloaded fails here")
    return Sanitizer(env)


@pytest.fixture(autouse=True)
def _unfused():
    """Every test starts tracing attention and layer norms as their JAX definitions: a test
    that runs a `diloco` command in this process installs the fused kernels (as the command
    does in production), and the next test must not inherit them (the golden numbers are the
    definitions')."""
    yield
    from pipeline import fused

    fused.uninstall()


@pytest.fixture(autouse=True)
def _alone(request: pytest.FixtureRequest):
    """A test marked `alone` runs with no other beside it under pytest-xdist (see `_LOCKS`).
    Only in an xdist worker itself: a pytest a test starts (the sanitized kernels' run)
    inherits the worker's environment and must not wait for the locks its parent holds."""
    if not hasattr(request.config, "workerinput"):
        yield
        return
    import fcntl

    alone = request.node.get_closest_marker("alone") is not None
    folder = Path(os.environ["PYTEST_DILOCO_LOCKS"])
    with open(folder / "gate", "a") as gate, open(folder / "running", "a") as running:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's folders go with the process that made them (under pytest-xdist the
    process that starts the workers: it runs no fixture)."""
    for folder in (_JAX_CACHE, _LOCKS):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


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
