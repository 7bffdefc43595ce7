"""Build, load and install the compiled kernels: the merge kernels (`workers/kernels.c`) and
the default model's fused operations (`workers/fused.cc`).

Each is compiled into a per-user cache (``$DILOCO_KERNEL_CACHE``, default
``~/.cache/diloco``) by `diloco build-kernels` or on first use in a process that merges or
trains, keyed by the source, the compiler and its version, the flags and the CPU (both are
built with ``-march=native``, or ``-march=$DILOCO_KERNEL_MARCH``: e.g. ``x86-64-v4`` for an
image that runs on many hosts), loaded from there afterwards and installed. Concurrent first
uses each build a complete file and rename it into place. A source that cannot be read, a
compiler that fails and a cached library that does not load are each a logged fallback.

* The merge kernels (`install`): `pipeline/kernels.py` defines the merge passes in numpy; the
  C twin is built with the system C compiler (``cc``, or ``$CC``). Without a compiler (or with
  ``DILOCO_KERNELS=numpy``) it logs why and the numpy definition runs: same results, ~5×
  slower. Every process that merges calls `install()` once at start (the syncer, `diloco`
  commands).
* The fused kernels (`install_fused`): `pipeline/fused.py` defines causal attention, the
  layer norm, GELU and the projections (whose weight gradient is a kernel) in JAX; the
  kernels are built with the system C++ compiler (``c++``/``g++``, or
  ``$CXX``) against the XLA FFI headers that jaxlib ships, and their targets are registered
  with JAX for the CPU platform. They run only where they are built for 512-bit vector
  registers (AVX-512): their blocks of scores and of weight gradients fill 16 such registers,
  and a narrower build spills them — an AVX2 build of the default model's step ran 3.6× slower
  than XLA's own operations (BENCHMARKS §8) — so elsewhere XLA's operations run
  (``DILOCO_FUSED=fused`` insists on the kernels). Without a compiler, on an accelerator (or
  with ``DILOCO_FUSED=xla``) it logs why and XLA runs the JAX definitions: the same values to
  float32 rounding (``DILOCO_FUSED=xla:gelu,dense`` runs only the kernels not named). Every
  process that trains on the CPU calls it once at start (learners, data-parallel workers, the
  `diloco` commands that run a model).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from pipeline import fused, kernels

log = logging.getLogger("diloco.native")

_SRC = Path(__file__).with_name("kernels.c")
# DILOCO_SANITIZE=address,undefined: both libraries built with those sanitizers, to debug them
# (separate libraries in the cache, "-sanitized" in their names). An address-sanitized library
# loads only into a process that has the sanitizer's runtime preloaded, and libstdc++ with it
# (LD_PRELOAD="$(c++ -print-file-name=libasan.so) $(c++ -print-file-name=libstdc++.so)"):
# without it the runtime would stop the process, so the library is built but not loaded, and
# the fallback runs, with the reason logged. The test suite runs every kernel so
# (tests/test_fused.py, tests/test_kernels.py).
SANITIZE_ENV = "DILOCO_SANITIZE"
# DILOCO_KERNEL_MARCH=TARGET: both libraries built for that -march (e.g. x86-64-v4 in an image
# that runs on many hosts of one kind) instead of the building host's CPU ("native")
MARCH_ENV = "DILOCO_KERNEL_MARCH"
_FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11"]
_done = False


# what this host's CPU must have to run code built for the x86-64 levels (its /proc/cpuinfo
# flags): a library built for a level this CPU lacks would stop the process (illegal
# instruction), so it is not loaded
_LEVEL_FLAGS = {"x86-64-v2": {"sse4_2", "popcnt", "ssse3"},
                "x86-64-v3": {"avx2", "fma", "bmi2", "movbe"},
                "x86-64-v4": {"avx2", "fma", "avx512f", "avx512bw", "avx512cd", "avx512dq",
                              "avx512vl"}}


def _host_runs(march: str) -> bool:
    """Whether this host can run code built with `march` (``-march=NAME``): always for native,
    by its CPU flags for the x86-64 levels, assumed for other names (the operator's word)."""
    name = march.removeprefix("-march=")
    need = _LEVEL_FLAGS.get(name)
    return need is None or need <= _cpu_flags()


def _cpu_flags() -> set[str]:
    """This CPU's feature flags (x86: /proc/cpuinfo's ``flags``; empty where none are known)."""
    for line in _cpu_key().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _march() -> str:
    """The ``-march`` flag both libraries are built with (``$DILOCO_KERNEL_MARCH``, default
    native; a value that is no target name is logged and ignored)."""
    value = os.environ.get(MARCH_ENV, "").strip()
    if value and not re.fullmatch(r"[a-z0-9][a-z0-9._+-]{0,63}", value):
        log.warning("%s=%r is not a -march target name: native used", MARCH_ENV, value[:80])
        value = ""
    return f"-march={value or 'native'}"


def install(build: bool = True) -> str:
    """Build (once per machine) and install the C kernels; returns the backend in use. Without
    `build`, only a library already in the cache is loaded (else numpy merges: the same bits),
    so that a tool that merges now and then never runs the compiler."""
    global _done
    if not _done:
        lib = _build(build)
        _done = lib is not None or build  # a later install() may still build it
        kernels.install(lib)
    return kernels.backend()


def _cpu_key() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        # x86: the model and its feature flags; ARM: the implementer, part and features
        keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")
        seen: dict[str, str] = {}
        for ln in text.splitlines():
            name = ln.split(":", 1)[0].strip()
            if name in keys and name not in seen:
                seen[name] = ln
        return "\n".join(seen[k] for k in keys if k in seen)
    except OSError:
        return platform.processor()


@functools.cache
def _compiler_key(compiler: str) -> str:
    """The compiler's path and what it says its version is: an upgraded compiler is a new
    build (its path alone would keep the old one's library)."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, timeout=60,
                              check=False)
        version = done.stdout.decode(errors="replace").split("\n", 1)[0]
    except (OSError, subprocess.SubprocessError):
        version = ""  # the build itself will say why the compiler does not run
    return f"{compiler}\n{version}"


def _compiled(name: str, src: Path, compiler: str, flags: list[str],
              what: str, build: bool = True) -> Path | None:
    """The cached shared library built from `src` (building it first if needed and `build`);
    None, with a warning naming `what` falls back, when the source cannot be read or the build
    fails (without `build`, None where the cache does not hold it yet)."""
    try:
        data = src.read_bytes()
    except OSError as err:
        log.warning("reading %s failed (%s): %s", src, err, what)
        return None
    # built for this CPU (-march=native): this CPU's model and flags are part of the key; for a
    # named target, the same library serves every host of this architecture (an image's)
    cpu = _cpu_key() if "-march=native" in flags else ""
    key = hashlib.sha256(b"\0".join([data, " ".join(flags).encode(),
                                     _compiler_key(compiler).encode(), cpu.encode(),
                                     platform.machine().encode()]))
    cache = Path(os.environ.get("DILOCO_KERNEL_CACHE") or Path.home() / ".cache" / "diloco")
    lib = cache / f"{name}-{key.hexdigest()[:16]}.so"
    if not lib.exists() and not build:
        log.info("%s is not built yet (diloco build-kernels): %s", src.name, what)
        return None
    if not lib.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            try:
                subprocess.run([compiler, *flags, "-o", tmp, str(src)], check=True,
                               capture_output=True, timeout=300)
                os.replace(tmp, lib)  # atomic: concurrent builders each install a complete file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, subprocess.SubprocessError) as err:
            detail = getattr(err, "stderr", b"") or b""
            log.warning("building %s failed (%s %s): %s", src.name, err,
                        detail.decode(errors="replace")[-500:], what)
            return None
    return lib


def _sanitize_flags() -> list[str]:
    """The compiler flags ``DILOCO_SANITIZE=NAME,…`` asks for (none where it is unset;
    a value that is not a list of names is logged and ignored)."""
    value = os.environ.get(SANITIZE_ENV, "").strip().lower()
    if not value:
        return []
    if not re.fullmatch(r"[a-z][a-z-]*(,[a-z][a-z-]*)*", value):
        log.warning("%s=%r is not a list of sanitizer names (e.g. address,undefined): "
                    "ignored", SANITIZE_ENV, value[:80])
        return []
    # -O1 (after the -O3 before it: the last one counts): the same loads and stores, the
    # vector code written out as it is, in half the build time
    return ["-O1", f"-fsanitize={value}", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer", "-g"]


def _loadable(lib: Path, what: str) -> bool:
    """Whether this process can load `lib`: not an address-sanitized build into a process
    without the sanitizer's runtime (its check would stop the process: logged instead)."""
    if "address" not in " ".join(_sanitize_flags()):
        return True
    try:
        loaded = "libasan" in Path("/proc/self/maps").read_text()
    except OSError:
        loaded = False
    if not loaded:
        log.warning("%s is built with the address sanitizer, whose runtime this process has "
                    "not preloaded (LD_PRELOAD: docs/DEPLOY.md, %s): %s", lib.name,
                    SANITIZE_ENV, what)
    return loaded


def _cxx() -> str | None:
    """The C++ compiler: ``$CXX``, else the system's."""
    return (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
            or shutil.which("clang++"))


def _build(build: bool = True) -> ctypes.CDLL | None:
    if os.environ.get("DILOCO_KERNELS", "").lower() == "numpy":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: the merge runs on numpy (slower; install gcc)")
        return None
    sanitize = _sanitize_flags()
    if not _host_runs(_march()):
        log.warning("%s=%s: this CPU cannot run code built for it: the merge runs on numpy",
                    MARCH_ENV, _march().removeprefix("-march="))
        return None
    lib = _compiled("kernels" + ("-sanitized" if sanitize else ""), _SRC, cc,
                    [*_FLAGS, _march(), *sanitize], "the merge runs on numpy", build)
    if lib is None or not _loadable(lib, "the merge runs on numpy"):
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


_FUSED_SRC = Path(__file__).with_name("fused.cc")
# -ffp-contract=fast: multiply-adds fused (no bit-for-bit twin to match, unlike the merge)
_FUSED_FLAGS = ["-O3", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c++20"]
FUSED_ENV = "DILOCO_FUSED"
# the kernels keep their blocks in 512-bit registers; narrower ones spill them, and the step
# is then slower than XLA's own (BENCHMARKS §8: 3.6x on an AVX2 build of the same host)
FUSED_MIN_VECTOR_BITS = 512
_registered: bool | None = None  # whether the library is built, loaded and registered
_vector_bits = 0  # the widest vector registers the library was built for
_said_narrow = False


def install_fused() -> str:
    """Build (once per machine), register and install the fused kernels of the model's step;
    returns the backend the step will use: "fused", or "xla" (the JAX definitions) with the
    reason logged. The kernels run where they are built for 512-bit vector registers
    (AVX-512); elsewhere XLA's operations are faster, and run, unless ``DILOCO_FUSED=fused``
    asks for the kernels anyway. ``DILOCO_FUSED=xla`` turns them all off,
    ``DILOCO_FUSED=xla:gelu,dense`` those named (of `pipeline.fused.KERNELS`: to compare, or
    to rule one out). Call it before the first step is traced (steps traced before keep
    what they traced) and after `jax.distributed.initialize` where there is one: it asks
    JAX for the default backend, which starts JAX's backends."""
    global _registered
    value = os.environ.get(FUSED_ENV, "").strip().lower()
    if value == "xla":
        backend = "xla"  # nothing built or registered: a later call may still ask for them
    elif value != "fused" and _known_narrow():
        backend = "xla"  # known before building: no compiler run for kernels left unused
    else:
        if _registered is None:
            _registered = _register_fused()
        backend = _fused_choice() if _registered else "xla"
    if backend == "fused":
        fused.install(_disabled_kernels())
    else:
        fused.uninstall()
    return backend


def _expected_vector_bits() -> int | None:
    """The vector width a build for `_march()` will have, where it is known without building:
    for this CPU from its flags (x86: AVX-512, AVX; 128 on other architectures), for the
    x86-64 levels from the level; None for other named targets (the library says)."""
    name = _march().removeprefix("-march=")
    if name != "native":
        return {"x86-64-v4": 512, "x86-64-v3": 256, "x86-64-v2": 128, "x86-64": 128}.get(name)
    if platform.machine() not in ("x86_64", "AMD64"):
        return 128
    flags = _cpu_flags()
    return 512 if "avx512f" in flags else 256 if "avx" in flags else 128


def _say_narrow(bits: int, built: bool) -> None:
    """Log once per process that the kernels' vectors are too narrow and XLA's operations run."""
    global _said_narrow
    if not _said_narrow:
        _said_narrow = True
        log.info("the fused kernels %s for %d-bit vectors (%s), where they are slower than XLA's "
                 "operations: the model's operations run as XLA's%s (%s=fused uses the kernels "
                 "anyway)", "are built" if built else "would be built", bits, _march(),
                 "" if built else ", nothing built", FUSED_ENV)


def _known_narrow() -> bool:
    """Whether the kernels would be built for vectors too narrow for them (logged once)."""
    bits = _expected_vector_bits()
    if bits is None or bits >= FUSED_MIN_VECTOR_BITS:
        return False
    _say_narrow(bits, built=False)
    return True


def _fused_choice() -> str:
    """"fused" where the registered kernels should run, "xla" (logged once) where the build's
    vectors are too narrow for them and ``DILOCO_FUSED=fused`` does not insist."""
    value = os.environ.get(FUSED_ENV, "").strip().lower()
    if _vector_bits >= FUSED_MIN_VECTOR_BITS or value == "fused":
        return "fused"
    _say_narrow(_vector_bits, built=True)
    return "xla"


def _disabled_kernels() -> list[str]:
    """The kernels ``DILOCO_FUSED=xla:NAME,…`` names; a name that is no kernel is logged and
    left out."""
    value = os.environ.get(FUSED_ENV, "").strip().lower()
    if not value.startswith("xla:"):
        return []
    names = [n.strip() for n in value[4:].split(",") if n.strip()]
    unknown = [n for n in names if n not in fused.KERNELS]
    if unknown:
        log.warning("%s: no kernel named %s (the kernels: %s); left out", FUSED_ENV,
                    ", ".join(unknown), ", ".join(fused.KERNELS))
    return [n for n in names if n in fused.KERNELS]


def _fused_library() -> Path | None:
    """The fused kernels' shared library, built first if needed; None (with the reason
    logged) where it cannot be."""
    if os.environ.get(FUSED_ENV, "").lower() == "xla":
        log.info("%s=xla: the fused kernels are not built", FUSED_ENV)
        return None
    import jax
    import jaxlib

    cxx = _cxx()
    if cxx is None:
        log.warning("no C++ compiler found: the model's fused operations run as XLA's "
                    "(attention, layer norms, GELU, weight gradients: slower; install g++)")
        return None
    if not _host_runs(_march()):
        log.warning("%s=%s: this CPU cannot run code built for it: the model's fused "
                    "operations run as XLA's", MARCH_ENV, _march().removeprefix("-march="))
        return None
    sanitize = _sanitize_flags()
    flags = [*_FUSED_FLAGS, _march(), f"-I{jax.ffi.include_dir()}", *sanitize]
    # the FFI headers come with jaxlib: a new jaxlib is a new build
    name = f"fused-jaxlib{jaxlib.__version__}" + ("-sanitized" if sanitize else "")
    return _compiled(name, _FUSED_SRC, cxx, flags, "the model's fused operations run as XLA's")


def _register_fused() -> bool:
    global _vector_bits
    import jax

    if jax.default_backend() != "cpu":
        # the step runs on an accelerator, where it is lowered with XLA's operations
        # (`pipeline.fused` chooses by the platform): nothing to build or register
        log.info("the model's step runs on %s: XLA's operations (the fused kernels are CPU "
                 "code, not built)", jax.default_backend())
        return False
    lib = _fused_library()
    if lib is None or not _loadable(lib, "the model's fused operations run as XLA's"):
        return False
    try:
        dll = ctypes.CDLL(str(lib))
        _vector_bits = int(dll.diloco_fused_vector_bits())
        for target, symbol in fused.SYMBOLS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(dll, symbol)),
                                        platform="cpu")
    except (OSError, AttributeError, ValueError) as err:
        log.warning("loading %s failed (%s): the model's fused operations run as XLA's",
                    lib, err)
        return False
    return True


def build() -> dict[str, bool]:
    """Build both libraries into the cache now (where they are not there yet) without
    installing either: what an installer runs, so that no process pays for the compilers at
    its first start (several learners starting at once would each run them)."""
    narrow = os.environ.get(FUSED_ENV, "").strip().lower() != "fused" and _known_narrow()
    return {"merge": _build() is not None,
            "fused": not narrow and _fused_library() is not None}
