"""Keep the memory a process frees for its next allocation instead of handing it back.

XLA's CPU runtime allocates one scratch buffer for all of a jitted computation's
intermediates with ``malloc`` when the computation starts and frees it when it ends: 168 MB
for the default model's training step. glibc serves an allocation that large with a fresh
``mmap`` and frees it with ``munmap``, so every step faults its whole scratch memory in again,
page by page, and the kernel zeroes each page: about 41,000 minor page faults per step, a third
of the step's time on the development VM (``diloco bench step`` measures both ways). PyTorch
keeps its freed CPU buffers for reuse; glibc can be told to do the same.

`keep_freed_memory` tells it, with ``mallopt``: no ``mmap`` for large allocations (they come
from the heap, which keeps what is freed), one arena for every thread (a thread's own arena
would ``mmap`` large allocations whatever the setting), and the heap trimmed back to the system
only above 1 GiB of free memory at its top. The process's resident memory then stays near its
peak instead of rising and falling every step — the trade of every caching allocator: the
default model's training process settles at 913 MB resident instead of 593 (its heap grows to
about twice the scratch buffer over the first steps, then stops growing), and its step takes no
page faults.

Call it first thing in a process that trains, before JAX runs anything (a thread that has
allocated already keeps its own arena): the ``diloco`` command (every subcommand but
``syncer``, whose merge threads allocate side by side and train nothing), the learner and
data-parallel worker processes do. ``DILOCO_KEEP_FREED_MEMORY=0`` turns it off. It does
nothing where the C library is not glibc.

The syncer makes the other trade (`return_freed_memory`): it trains nothing, its merge threads
allocate and free a fragment's arrays round after round, and glibc's default keeps what they
free in per-thread arenas whose holes it cannot give back, so its resident memory climbed to
twice what it held. Every allocation of 1 MiB or more is its own ``mmap``, unmapped when freed.
Measured (BENCHMARKS.md §2.1, `diloco bench roles`, 50.7M parameters): peak resident 3.9–4.3 GB
→ 3.0–3.1 GB; the cost is a page fault per page of a new array: `diloco bench pipeline`'s
syncer 0–12 % slower decoding and merging, up to 20 % with fp32 commits.
``DILOCO_KEEP_FREED_MEMORY=1`` in a syncer's environment keeps glibc's default.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

ENV = "DILOCO_KEEP_FREED_MEMORY"
TRIM_THRESHOLD = 1 << 30  # bytes free at the heap's top before it is given back
MMAP_THRESHOLD = 1 << 20  # the syncer: allocations this large are mapped, and unmapped when freed

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_state: dict[str, object] = {}


def keep_freed_memory() -> str:
    """Set glibc's allocator to keep freed memory (once per process); returns what was done:
    ``"kept"``, or why not (``"off"``: the environment turned it off; ``"not glibc"``;
    ``"mallopt failed"``)."""
    if "result" in _state:
        return str(_state["result"])
    result = _apply()
    _state["result"] = result
    if result not in ("kept", "off"):
        log.info("freed memory is returned to the system (%s): each jitted step faults its "
                 "scratch memory in again", result)
    return result


def return_freed_memory() -> str:
    """The syncer's setting (see the module's docstring): every allocation of
    `MMAP_THRESHOLD` bytes or more mapped on its own and given back when freed. Returns
    ``"returned"``, or why not (``"kept"``: ``DILOCO_KEEP_FREED_MEMORY=1``; ``"not glibc"``;
    ``"mallopt failed"``)."""
    if os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return "kept"
    mallopt = _mallopt()
    if mallopt is None:
        return "not glibc"
    return "returned" if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 else "mallopt failed"


def _mallopt():
    """glibc's ``mallopt`` (None where the C library is not glibc)."""
    if not _glibc():
        return None
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):
        return False


def _apply() -> str:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return "off"
    mallopt = _mallopt()
    if mallopt is None:
        return "not glibc"
    # the arena first: a thread that allocates after this shares the main arena
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    return "kept" if ok else "mallopt failed"
