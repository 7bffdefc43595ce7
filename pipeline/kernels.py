"""Fused decode-and-accumulate kernels of the merge hot path: the definition, in numpy, and
the slot for a compiled implementation.

A syncer folds every contribution into fp64 running sums with two passes per tensor that never
materialise Δ: `stats` gives ‖δ‖² and ⟨a, δ⟩, `axpy` adds c·δ. The numpy code here is the
definition and the fallback. `workers/native.py` compiles `workers/kernels.c` (decoding in
registers, ~5× faster, called through ctypes with the GIL released) and `install`s it; that
module owns the compiler, the environment and the build cache, so this one stays pure.

Both implementations give the same bits: the decoded values are quant's, products and sums are
rounded the same way (the C is built with -ffp-contract=off), and the dot products use one
fixed summation order — element j goes to lane j % LANES, each lane sums in increasing j, and
the lanes are added 0..LANES-1 — so a run's results do not depend on which one ran.

With `set_threads(n)` the compiled kernels split a call's tensors into n groups of about equal
size and run them on a thread pool (ctypes releases the GIL): one syncer process merges a
fragment on the cores it is given. Each tensor's arithmetic is the same whatever the grouping,
so the results are identical bit for bit at any thread count.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pipeline import quant

LANES = 32  # must equal LANES in workers/kernels.c
_CODE = {"fp32": 0, "int4": 4, "int8": 8, "bf16": 16}
_lib: ctypes.CDLL | None = None
_pool: ThreadPoolExecutor | None = None
# a call over fewer values than this runs on the calling thread (a pool's hand-off costs more)
MIN_PARALLEL_VALUES = 1 << 17


def set_threads(n: int) -> None:
    """Run the compiled kernels of one call on up to `n` threads (1: the calling thread)."""
    global _pool
    if n < 1:
        raise ValueError(f"merge threads must be >= 1, got {n}")
    old, _pool = _pool, ThreadPoolExecutor(n, thread_name_prefix="merge") if n > 1 else None
    if old is not None:
        old.shutdown(wait=True)


def threads() -> int:
    return _pool._max_workers if _pool is not None else 1


def _groups(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of `sizes` in at most n groups of about equal total (largest first, each to the
    lightest group), each group in increasing index order."""
    loads = [0] * n
    groups: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        g = loads.index(min(loads))
        groups[g].append(i)
        loads[g] += sizes[i]
    return [sorted(g) for g in groups if g]


def _split(qs: list, accs: list[np.ndarray] | None = None) -> list[list[int]] | None:
    """How to split one call over the pool (None: run it on this thread). A call that adds
    into one accumulator twice (`accs`) is not split: its writes would race."""
    if _pool is None or len(qs) < 2:
        return None
    if accs is not None and len({a.ctypes.data for a in accs}) < len(accs):
        return None
    sizes = [size(q) for q in qs]
    if sum(sizes) < MIN_PARALLEL_VALUES:
        return None
    groups = _groups(sizes, threads())
    return groups if len(groups) > 1 else None


def install(lib: ctypes.CDLL | None) -> None:
    """Use a loaded `workers/kernels.c` library (None: back to numpy)."""
    global _lib
    _lib = lib


def backend() -> str:
    """"c" when a compiled library is installed, else "numpy"."""
    return "c" if _lib is not None else "numpy"


def _lane_dot(x: np.ndarray, y: np.ndarray) -> float:
    """Σ x·y in fp64 in the fixed lane order described in the module docstring (non-finite
    input gives a non-finite result, as in C, without a warning: the merge rejects it)."""
    with np.errstate(invalid="ignore", over="ignore"):
        prod = x * y
        pad = (-prod.size) % LANES
        if pad:
            prod = np.concatenate([prod, np.zeros(pad)])
        lanes = np.add.reduce(prod.reshape(-1, LANES), axis=0)  # row by row: increasing j
    total = 0.0
    for v in lanes.tolist():
        total += v
    return total


class Operand(quant.QTensor):
    """A QTensor already checked by `operand` (contiguous, consistent): safe to hand to C."""

    __slots__ = ()


def operand(x: quant.QTensor | np.ndarray) -> Operand:
    """A validated, contiguous view of a contribution tensor (fp32 arrays as the fp32 codec);
    `stats` and `axpy` call it on whatever they get, so validate once and pass the result when
    a tensor goes through both.

    Raises:
        ValueError: `x` is internally inconsistent (see `quant.check_layout`).
    """
    if isinstance(x, Operand):
        return x
    if isinstance(x, quant.QTensor):
        quant.check_layout(x)
        scales = None if x.scales is None else np.ascontiguousarray(x.scales)
        return Operand(x.codec, x.shape, np.ascontiguousarray(x.data), scales, x.block)
    arr = np.ascontiguousarray(x, dtype=np.float32)
    return Operand("fp32", arr.shape, arr.reshape(-1), None, 0)


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def size(x: quant.QTensor | np.ndarray) -> int:
    """Element count of a contribution tensor."""
    return int(np.prod(x.shape, dtype=np.int64)) if x.shape else 1


def stats(items: list[tuple[quant.QTensor | np.ndarray, np.ndarray | None]]
          ) -> list[tuple[float, float]]:
    """(‖δ‖², ⟨a, δ⟩) in fp64 for each (δ, a) pair: δ a contribution tensor (quantised or
    fp32), a its fp32 anchor of the same size or None (⟨a, δ⟩ = 0). One C call for them all.

    Raises:
        ValueError: a tensor is internally inconsistent or an anchor has another size.
    """
    qs, anchors = [], []
    for x, anchor in items:
        q = operand(x)
        if anchor is not None:
            anchor = np.ascontiguousarray(anchor, dtype=np.float32).reshape(-1)
            if anchor.size != size(q):
                raise ValueError(f"anchor has {anchor.size} elements, the tensor {size(q)}")
        qs.append(q)
        anchors.append(anchor)
    lib = _lib
    if lib is None:
        out = []
        for q, anchor in zip(qs, anchors, strict=True):
            d = quant.dequantize(q).reshape(-1).astype(np.float64)
            out.append((_lane_dot(d, d), _lane_dot(anchor.astype(np.float64), d)
                        if anchor is not None else 0.0))
        return out
    res = np.zeros(2 * len(qs), np.float64)
    groups = _split(qs)
    if groups is None:
        lib.diloco_stats(len(qs), *_layout(qs), _ptrs(anchors), res.ctypes.data)
    else:
        def run(g: list[int]) -> np.ndarray:
            part = np.zeros(2 * len(g), np.float64)
            lib.diloco_stats(len(g), *_layout([qs[i] for i in g]),
                             _ptrs([anchors[i] for i in g]), part.ctypes.data)
            return part

        for g, part in zip(groups, _pool.map(run, groups), strict=True):
            for j, i in enumerate(g):
                res[2 * i:2 * i + 2] = part[2 * j:2 * j + 2]
    return [(float(res[2 * i]), float(res[2 * i + 1])) for i in range(len(qs))]


def axpy(items: list[tuple[np.ndarray, quant.QTensor | np.ndarray, float]]) -> None:
    """acc += c · δ, elementwise in fp64, for each (acc, δ, c); one C call for them all.

    Raises:
        ValueError: a tensor is internally inconsistent, or an `acc` is not a writeable
            C-contiguous fp64 array of its tensor's size.
    """
    qs, accs, cs = [], [], []
    for acc, x, c in items:
        q = operand(x)
        _check_acc(acc, size(q))
        qs.append(q)
        accs.append(acc)
        cs.append(float(c))
    lib = _lib
    if lib is None:
        for acc, q, c in zip(accs, qs, cs, strict=True):
            d = quant.dequantize(q).reshape(-1).astype(np.float64)
            d *= c
            flat = acc.reshape(-1)
            flat += d
        return
    groups = _split(qs, accs)
    if groups is None:
        coef = np.asarray(cs, np.float64)
        lib.diloco_axpy(len(qs), *_layout(qs), coef.ctypes.data, _ptrs(accs))
        return

    def run(g: list[int]) -> None:  # every accumulator is its tensor's own: no shared writes
        coef = np.asarray([cs[i] for i in g], np.float64)
        lib.diloco_axpy(len(g), *_layout([qs[i] for i in g]), coef.ctypes.data,
                        _ptrs([accs[i] for i in g]))

    list(_pool.map(run, groups))


def _ptrs(arrays: list[np.ndarray | None]):
    return (ctypes.c_void_p * len(arrays))(*[_ptr(a) for a in arrays])


def _layout(qs: list[quant.QTensor]):
    """(codec codes, data pointers, scale pointers, sizes, blocks) as ctypes arrays."""
    k = len(qs)
    return ((ctypes.c_int * k)(*[_CODE[q.codec] for q in qs]), _ptrs([q.data for q in qs]),
            _ptrs([q.scales for q in qs]), (ctypes.c_int64 * k)(*[size(q) for q in qs]),
            (ctypes.c_int64 * k)(*[q.block for q in qs]))


def _check_acc(acc: np.ndarray, n: int) -> None:
    if acc.dtype != np.float64 or not acc.flags.c_contiguous or not acc.flags.writeable:
        raise ValueError("the accumulator must be a writeable C-contiguous float64 array")
    if acc.size != n:
        raise ValueError(f"the accumulator has {acc.size} elements, the tensor {n}")
