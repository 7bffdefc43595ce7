"""Fused decode-and-accumulate kernels of the merge hot path, in C with a numpy twin.

A syncer folds every contribution into fp64 running sums. Done with numpy, one int4 entry of
a 1M-parameter fragment costs a table gather, a scale pass, an anchor add, a norm and a
multiply-add: six passes over 4–8 MB, ~4 ms. `kernels.c` does the same in two passes that
never write the decoded tensor out (`stats`: ‖δ‖² and ⟨a, δ⟩; `axpy`: acc += c·δ), called
through ctypes, which releases the GIL.

The C file is compiled on first use with the system C compiler (``cc``, or ``$CC``) into a
per-user cache (``$DILOCO_KERNEL_CACHE``, default ``~/.cache/diloco``), keyed by the source,
the flags and the CPU, and loaded from there afterwards. When no compiler is available, or
``DILOCO_KERNELS=numpy`` is set, the numpy twin runs instead: same decoded values, same
sums, bit for bit; dot products agree to the last bits (summation order), so a run is
reproducible on one machine whichever path it takes.

This is the one module of `pipeline` that touches the file system (the build cache).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from pipeline import quant

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("kernels.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11"]
_CODE = {"fp32": 0, "int4": 4, "int8": 8, "bf16": 16}

_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_key() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor()


def _build() -> ctypes.CDLL | None:
    if os.environ.get("DILOCO_KERNELS", "").lower() == "numpy":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: the merge runs on numpy (slower; install gcc)")
        return None
    src = _SRC.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(_FLAGS).encode(), cc.encode(),
                                     _cpu_key().encode(), platform.machine().encode()]))
    cache = Path(os.environ.get("DILOCO_KERNEL_CACHE") or Path.home() / ".cache" / "diloco")
    lib = cache / f"kernels-{key.hexdigest()[:16]}.so"
    if not lib.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SRC)], check=True,
                           capture_output=True, timeout=120)
            os.replace(tmp, lib)  # atomic: concurrent builders each install a complete file
        except (OSError, subprocess.SubprocessError) as err:
            detail = getattr(err, "stderr", b"") or b""
            log.warning("building the merge kernels failed (%s %s): the merge runs on numpy",
                        err, detail.decode(errors="replace")[-500:])
            return None
    try:
        dll = ctypes.CDLL(str(lib))
    except OSError as err:
        log.warning("loading %s failed (%s): the merge runs on numpy", lib, err)
        return None
    args = [ctypes.c_int] + [ctypes.c_void_p] * 7
    dll.diloco_stats.argtypes = args
    dll.diloco_stats.restype = None
    dll.diloco_axpy.argtypes = args
    dll.diloco_axpy.restype = None
    return dll


def _library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        _tried = True
        _lib = _build()
    return _lib


def backend() -> str:
    """"c" when the compiled kernels are in use, else "numpy"."""
    return "c" if _library() is not None else "numpy"


def _operand(x: quant.QTensor | np.ndarray) -> quant.QTensor:
    """A validated, contiguous QTensor view of a contribution tensor (fp32 arrays as fp32)."""
    if isinstance(x, quant.QTensor):
        quant.check_layout(x)
        data = np.ascontiguousarray(x.data)
        scales = None if x.scales is None else np.ascontiguousarray(x.scales)
        return quant.QTensor(x.codec, x.shape, data, scales, x.block)
    arr = np.ascontiguousarray(x, dtype=np.float32)
    return quant.QTensor("fp32", arr.shape, arr.reshape(-1), None, 0)


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
        q = _operand(x)
        if anchor is not None:
            anchor = np.ascontiguousarray(anchor, dtype=np.float32).reshape(-1)
            if anchor.size != size(q):
                raise ValueError(f"anchor has {anchor.size} elements, the tensor {size(q)}")
        qs.append(q)
        anchors.append(anchor)
    lib = _library()
    if lib is None:
        out = []
        for q, anchor in zip(qs, anchors, strict=True):
            d = quant.dequantize(q).reshape(-1).astype(np.float64)
            out.append((float(np.dot(d, d)), float(np.dot(anchor.astype(np.float64), d))
                        if anchor is not None else 0.0))
        return out
    res = np.zeros(2 * len(qs), np.float64)
    lib.diloco_stats(len(qs), *_layout(qs), _ptrs(anchors), res.ctypes.data)
    return [(float(res[2 * i]), float(res[2 * i + 1])) for i in range(len(qs))]


def axpy(items: list[tuple[np.ndarray, quant.QTensor | np.ndarray, float]]) -> None:
    """acc += c · δ, elementwise in fp64, for each (acc, δ, c); one C call for them all.

    Raises:
        ValueError: a tensor is internally inconsistent, or an `acc` is not a writeable
            C-contiguous fp64 array of its tensor's size.
    """
    qs, accs, cs = [], [], []
    for acc, x, c in items:
        q = _operand(x)
        _check_acc(acc, size(q))
        qs.append(q)
        accs.append(acc)
        cs.append(float(c))
    lib = _library()
    if lib is None:
        for acc, q, c in zip(accs, qs, cs, strict=True):
            d = quant.dequantize(q).reshape(-1).astype(np.float64)
            d *= c
            flat = acc.reshape(-1)
            flat += d
        return
    coef = np.asarray(cs, np.float64)
    lib.diloco_axpy(len(qs), *_layout(qs), coef.ctypes.data, _ptrs(accs))


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
