"""Build, load and install the compiled merge kernels (`workers/kernels.c`).

`pipeline/kernels.py` defines the merge passes in numpy; this module compiles the C twin on
first use with the system C compiler (``cc``, or ``$CC``) into a per-user cache
(``$DILOCO_KERNEL_CACHE``, default ``~/.cache/diloco``), keyed by the source, the flags and the
CPU, loads it from there afterwards and installs it. Without a compiler (or with
``DILOCO_KERNELS=numpy``) it logs why and the numpy definition runs: same results, ~5× slower.
Every process that merges calls `install()` once at start (the syncer, `diloco` commands).
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

from pipeline import kernels

log = logging.getLogger("diloco.native")

_SRC = Path(__file__).with_name("kernels.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11"]
_done = False


def install() -> str:
    """Build (once per machine) and install the C kernels; returns the backend in use."""
    global _done
    if not _done:
        _done = True
        kernels.install(_build())
    return kernels.backend()


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
    for fn in (dll.diloco_stats, dll.diloco_axpy):
        fn.argtypes = args
        fn.restype = None
    return dll
