"""`workers.heap`: a jitted computation's scratch buffer is reused from one call to the next
instead of being faulted in again, page by page, on every call.

The count of minor page faults is exact (the kernel's, per process), not a timing: XLA's CPU
runtime allocates a computation's intermediates as one buffer per call, 64 MiB here; with
glibc's defaults that buffer is a fresh mapping each call (one fault per 4 KiB page touched),
with `keep_freed_memory` it comes back from the heap already mapped."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from workers import heap

SCRIPT = r"""
import json, resource, sys
from workers.heap import keep_freed_memory
result = keep_freed_memory()
import jax, jax.numpy as jnp
# x @ w is a [4096, 4096] fp32 intermediate (64 MiB) that the second product reads: XLA keeps
# it in the computation's scratch buffer, which is allocated when a call starts
f = jax.jit(lambda x, w, v: (x @ w) @ v)
x = jnp.ones((4096, 8), jnp.float32)
w = jnp.full((8, 4096), 0.5, jnp.float32)
v = jnp.ones((4096, 1), jnp.float32)
for _ in range(20):  # the heap grows to its working size over the first calls
    out = f(x, w, v).block_until_ready()
faults = []
for _ in range(9):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = f(x, w, v).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"result": result, "faults_per_call": sorted(faults)[4],  # the median
                  "value": float(out[0, 0])}))
"""
PAGES = 64 * 2**20 // 4096  # the intermediate's pages


def _run(env_value: str | None, script: str = SCRIPT) -> dict:
    """`script` in a fresh interpreter with `heap.ENV` set to `env_value` (None: unset); the
    JSON it prints last."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop(heap.ENV, None)
    if env_value is not None:
        env[heap.ENV] = env_value
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not heap._glibc(), reason="glibc's allocator only")
def test_a_jitted_call_reuses_its_scratch_memory_once_freed_memory_is_kept():
    returned = _run("0")
    kept = _run(None)
    assert returned["result"] == "off" and kept["result"] == "kept"
    assert returned["value"] == kept["value"] == 4096 * 8 * 0.5  # the same computation
    # with glibc's defaults, every call faults the 64 MiB intermediate in again ...
    assert returned["faults_per_call"] > 0.9 * PAGES
    # ... kept, it is already mapped once the heap has grown to its working size (the median
    # call: the heap may still grow once in a while, early on)
    assert kept["faults_per_call"] < 0.02 * PAGES


def test_it_is_applied_once_and_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(heap, "_state", {})
    monkeypatch.setenv(heap.ENV, "off")
    assert heap.keep_freed_memory() == "off"
    monkeypatch.setenv(heap.ENV, "1")
    assert heap.keep_freed_memory() == "off"  # once per process: the first answer stands


RETURN_SCRIPT = r"""
import json, sys
from workers.heap import return_freed_memory
import numpy as np
result = return_freed_memory()

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

big = np.ones(4 << 20, np.uint8)  # freed: glibc's default raises its mapping threshold past it
del big
arrays = [np.ones(2 << 20, np.uint8) for _ in range(200)]  # 400 MiB in 2 MiB arrays
before = rss()
del arrays[::2]  # every other one: holes a heap cannot give back
print(json.dumps({"result": result, "freed": before - rss()}))
"""


@pytest.mark.parametrize("env_value", [None, "1"])
def test_the_syncer_gives_freed_arrays_back_unless_told_to_keep_them(env_value):
    got = _run(env_value, RETURN_SCRIPT)
    if env_value is None:
        assert got["result"] == "returned" and got["freed"] > 150 * 2**20, got
    else:
        assert got["result"] == "kept" and got["freed"] < 50 * 2**20, got
