"""The fused merge kernels: the C build (workers/native.py) agrees bit for bit with the numpy
definition (pipeline/kernels.py), bad input never reaches C, and StreamingMerge built on them
computes the documented merge."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline import kernels, quant
from pipeline.merge import NonFiniteContribution, StreamingMerge
from pipeline.model import is_embedding
from workers import native

CASES = [(996, 64), (1001, 64), (777, 7), (5, 3), (1, 64), (70_000, 5000), (4097, 2)]


@pytest.fixture(params=["c", "numpy"])
def backend(request, monkeypatch):
    """Run a test on the compiled kernels and on the numpy twin."""
    if request.param == "numpy":
        monkeypatch.setattr(kernels, "_lib", None)
    elif native.install() != "c":
        pytest.skip("no C compiler on this machine")
    return request.param


def _reference(q, a):
    d = quant.dequantize(q).reshape(-1).astype(np.float64)
    return d, float(d @ d), float(a.astype(np.float64) @ d) if a is not None else 0.0


@pytest.mark.parametrize("codec", quant.CODECS)
def test_stats_and_axpy_match_the_definition(backend, codec):
    rng = np.random.default_rng(1)
    for n, block in CASES:
        x = (rng.standard_normal(n) * 1e-3).astype(np.float32)
        q = quant.quantize(x, codec, block)
        a = (rng.standard_normal(n) * 1e-6).astype(np.float32)
        (dd, ad), (dd0, ad0) = kernels.stats([(q, a), (q, None)])
        d, want_dd, want_ad = _reference(q, a)
        assert dd == pytest.approx(want_dd, rel=1e-12) and dd0 == dd and ad0 == 0.0
        assert ad == pytest.approx(want_ad, rel=1e-9, abs=1e-30)
        acc = rng.standard_normal(n)
        want = acc + d * 0.37  # numpy: the product rounded, then the sum rounded
        kernels.axpy([(acc, q, 0.37)])
        assert np.array_equal(acc, want), (codec, n, block)


@pytest.mark.parametrize("codec", quant.CODECS)
def test_c_and_numpy_agree_bit_for_bit(monkeypatch, codec):
    """Sums and dot products alike: a run's results do not depend on the backend."""
    if native.install() != "c":
        pytest.skip("no C compiler on this machine")
    rng = np.random.default_rng(2)
    for n, block in CASES:
        x = (rng.standard_normal(n) * 1e-2).astype(np.float32)
        a = (rng.standard_normal(n) * 1e-4).astype(np.float32)
        qs = [quant.quantize(x * (i + 1), codec, block) for i in range(3)]
        runs = []
        for lib in (kernels._lib, None):
            monkeypatch.setattr(kernels, "_lib", lib)
            acc = np.zeros(n)
            for i, q in enumerate(qs):
                kernels.axpy([(acc, q, 0.1 * (i + 1))])
            runs.append((acc, kernels.stats([(q, a) for q in qs] + [(q, None) for q in qs])))
        (acc_c, stats_c), (acc_np, stats_np) = runs
        assert np.array_equal(acc_c, acc_np), (codec, n, block)
        assert stats_c == stats_np, (codec, n, block)


def test_fp32_arrays_are_accepted_as_is(backend):
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    [(dd, ad)] = kernels.stats([(x, np.ones(10, np.float32))])
    assert dd == float(np.sum(np.arange(10.0) ** 2)) and ad == 45.0
    acc = np.zeros((2, 5))
    kernels.axpy([(acc, x, 2.0)])
    assert np.array_equal(acc, 2.0 * x)


def test_inconsistent_input_is_refused_before_any_c_call(backend):
    q = quant.quantize(np.ones(128, np.float32), "int4", 64)
    short = quant.QTensor("int4", (256,), q.data, q.scales, 64)  # data for 128 elements
    with pytest.raises(ValueError):
        kernels.stats([(short, None)])
    with pytest.raises(ValueError):
        kernels.axpy([(np.zeros(256), short, 1.0)])
    no_scales = quant.QTensor("int8", (4,), np.zeros(4, np.int8), None, 64)
    with pytest.raises(ValueError):
        kernels.stats([(no_scales, None)])
    with pytest.raises(ValueError, match="anchor"):
        kernels.stats([(q, np.ones(127, np.float32))])
    with pytest.raises(ValueError, match="accumulator"):
        kernels.axpy([(np.zeros(128, np.float32), q, 1.0)])
    with pytest.raises(ValueError, match="accumulator"):
        kernels.axpy([(np.zeros(129), q, 1.0)])


def test_merge_of_quantised_anchored_contributions(backend):
    """RDA of Δ_i = a_b + δ_i, computed directly in fp64, vs the streaming merge."""
    rng = np.random.default_rng(3)
    shapes = {"wte": (50, 8), "h0.mlp.fc": (8, 33)}
    anchors = {b: {k: (rng.standard_normal(s) * 1e-5).astype(np.float32)
                   for k, s in shapes.items()} for b in (3, 4)}
    m = StreamingMerge(shapes, "rda", is_embedding)
    want_sum = {k: np.zeros(s) for k, s in shapes.items()}
    want_norm = {k: 0.0 for k in shapes}
    total = 0.0
    for i in range(5):
        base, w = (3, 4)[i % 2], float(i + 1)
        delta = {k: quant.quantize((rng.standard_normal(s) * 1e-3).astype(np.float32), "int4", 16)
                 for k, s in shapes.items()}
        m.add(delta, w, anchors[base], anchor_id=base)
        total += w
        for k in shapes:
            full = anchors[base][k].astype(np.float64) + quant.dequantize(delta[k])
            if k == "wte":  # embeddings: the weighted mean
                want_sum[k] += w * full
            else:
                n = float(np.linalg.norm(full))
                want_sum[k] += w * full / n
                want_norm[k] += w * n
    got = m.result()
    mean = want_sum["wte"] / total
    np.testing.assert_allclose(got["wte"], mean, rtol=1e-5, atol=1e-9)
    d = want_sum["h0.mlp.fc"] / total
    rda = d * (want_norm["h0.mlp.fc"] / total) / np.linalg.norm(d)
    np.testing.assert_allclose(got["h0.mlp.fc"], rda, rtol=1e-5, atol=1e-9)


def test_non_finite_contribution_adds_nothing(backend):
    m, alone = (StreamingMerge({"h0.mlp.fc": (4,)}, "rda", is_embedding) for _ in range(2))
    for merge in (m, alone):
        merge.add({"h0.mlp.fc": np.ones(4, np.float32)}, 1.0)
    for bad in (np.array([1, np.nan, 0, 0], np.float32), np.array([np.inf, 0, 0, 0], np.float32),
                quant.QTensor("bf16", (4,), np.array([0x7FC0, 0, 0, 0], np.uint16), None, 0)):
        with pytest.raises(NonFiniteContribution):
            m.add({"h0.mlp.fc": bad}, 5.0)
    assert m.count == 1 and np.array_equal(m.result()["h0.mlp.fc"], alone.result()["h0.mlp.fc"])


def test_a_zero_delta_adds_only_its_weight(backend):
    m = StreamingMerge({"h0.mlp.fc": (3,)}, "rda", is_embedding)
    m.add({"h0.mlp.fc": np.zeros(3, np.float32)}, 2.0)
    m.add({"h0.mlp.fc": np.array([3, 0, 4], np.float32)}, 2.0)
    # φ-average (0 + 2·(0.6, 0, 0.8)) / 4, radius (0 + 2·5) / 4 = 2.5
    np.testing.assert_allclose(m.result()["h0.mlp.fc"], [1.5, 0, 2.0], rtol=1e-6)
    assert math.isclose(m.total_weight, 4.0)


def _probe(env: dict) -> str:
    code = "from workers import native; print(native.install())"
    plain = {k: v for k, v in os.environ.items() if k != native.SANITIZE_ENV}
    out = subprocess.run([sys.executable, "-c", code], env={**plain, **env},
                         capture_output=True, text=True, timeout=180, check=True)
    return out.stdout.strip()


def test_build_cache_and_fallbacks(tmp_path):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    cache = tmp_path / "cache"
    assert _probe({"DILOCO_KERNEL_CACHE": str(cache)}) == "c"
    built = list(cache.glob("kernels-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert _probe({"DILOCO_KERNEL_CACHE": str(cache)}) == "c"  # loaded, not rebuilt
    assert built[0].stat().st_mtime_ns == stamp
    assert _probe({"DILOCO_KERNEL_CACHE": str(cache), "DILOCO_KERNELS": "numpy"}) == "numpy"
    assert _probe({"DILOCO_KERNEL_CACHE": str(tmp_path / "other"),
                   "CC": str(tmp_path / "no-such-compiler")}) == "numpy"


def test_a_new_compiler_version_is_a_new_build(tmp_path):
    """The cache key holds what the compiler says its version is: the same path upgraded
    builds anew instead of loading the old compiler's library."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on this machine")
    wrapper = tmp_path / "cc"
    wrapper.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "cc $CC_VERSION"; exit 0; }\n'
                       f'exec {cc} "$@"\n')
    wrapper.chmod(0o755)
    cache = tmp_path / "cache"
    for version, libs in (("1.0", 1), ("1.0", 1), ("2.0", 2)):
        assert _probe({"DILOCO_KERNEL_CACHE": str(cache), "CC": str(wrapper),
                       "CC_VERSION": version}) == "c"
        assert len(list(cache.glob("kernels-*.so"))) == libs


def test_a_thread_pool_gives_the_same_bits(monkeypatch):
    """A fragment's tensors split over merge threads: identical sums and statistics, and a call
    that adds into one accumulator twice stays on one thread (no racing writes)."""
    if native.install() != "c":
        pytest.skip("no C compiler on this machine")
    monkeypatch.setattr(kernels, "MIN_PARALLEL_VALUES", 1)
    rng = np.random.default_rng(7)
    sizes = [70_000, 5, 4097, 996, 123_457, 64, 1001]
    qs = [quant.quantize(rng.normal(size=n).astype(np.float32), "int4") for n in sizes]
    anchors = [rng.normal(size=n).astype(np.float32) for n in sizes]
    runs = []
    try:
        for n in (1, 2, 3):
            kernels.set_threads(n)
            assert kernels.threads() == n
            accs = [np.zeros(s) for s in sizes]
            for i in range(3):
                kernels.axpy([(acc, q, 0.5 + i) for acc, q in zip(accs, qs, strict=True)])
            shared = np.zeros(sizes[0])  # one accumulator, two tensors: kept on one thread
            kernels.axpy([(shared, qs[0], 1.0), (shared, anchors[0], -2.0)])
            runs.append((accs, shared, kernels.stats(list(zip(qs, anchors, strict=True)))))
    finally:
        kernels.set_threads(1)
    for accs, shared, st in runs[1:]:
        for a, b in zip(accs, runs[0][0], strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(shared, runs[0][1])
        assert st == runs[0][2]
    # largest first, each to the lightest group: totals 8 and 7
    assert kernels._groups([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]


@pytest.mark.slow  # ~10 s of compiling: the full tier (CI)
@pytest.mark.timeout(900)  # the sanitized builds, on a machine whose cache is empty
def test_the_kernels_run_clean_under_the_address_and_undefined_behaviour_sanitizers(sanitizer):
    """This file's tests of the merge kernels (every codec, sizes with partial blocks and
    tails, the thread pool) in a process whose kernels are built with
    ``-fsanitize=address,undefined`` (``DILOCO_SANITIZE``): no read or write outside the
    arrays they are handed, no undefined behaviour, the numpy twin's bits. (A one-byte read
    past an int8 tensor, planted to try this test, is reported: "heap-buffer-overflow …
    kernels.c:54 in decode_block".)"""
    probe = ("from pipeline import kernels; from workers import native; "
             "print(native.install(), kernels._lib._name)")
    done = subprocess.run([sys.executable, "-c", probe], env=sanitizer.env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and not sanitizer.reports(done.stderr), done.stderr[-3000:]
    backend, lib = done.stdout.split()
    assert backend == "c" and "kernels-sanitized-" in lib
    here = Path(__file__).name
    # -s: a sanitizer's report goes to stderr as it stops the process (captured, it is lost)
    # the tests that build (or run this one) left out by name: `-k` would also match the tier
    # markers tests/tiers.py puts on every test here ("compiler")
    skip = ("test_build_cache_and_fallbacks", "test_a_new_compiler_version_is_a_new_build",
            "test_the_kernels_run_clean_under_the_address_and_undefined_behaviour_sanitizers")
    drop = [a for name in skip for a in ("--deselect", f"tests/{here}::{name}")]  # node ids
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           here, *drop],
                          cwd=Path(__file__).parent, env={**sanitizer.env, "DILOCO_FUSED": "xla"},
                          capture_output=True, text=True, timeout=600, check=False)
    report = sanitizer.reports(done.stdout + done.stderr)
    assert done.returncode == 0 and not report, (report or done.stderr.splitlines())[-40:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler on this machine")
def test_a_library_built_for_another_cpu_is_a_cache_miss_and_a_named_target_is_shared(
        monkeypatch, tmp_path):
    """A library built for one CPU (-march=native) is never loaded on another: the cache is
    keyed by the CPU, and the other CPU misses it (and would build its own). One built for a
    named target (an image's) is keyed without the CPU: every host of the architecture finds
    it."""
    monkeypatch.setenv("DILOCO_KERNEL_CACHE", str(tmp_path))
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    native_flags = [*native._FLAGS, "-march=native"]
    built = native._compiled("kernels", native._SRC, cc, native_flags, "test")
    assert built is not None and built.parent == tmp_path
    assert native._compiled("kernels", native._SRC, cc, native_flags, "test", build=False) == built
    here = native._cpu_key
    monkeypatch.setattr(native, "_cpu_key", lambda: "model name\t: another CPU\nflags\t\t: fpu")
    assert native._compiled("kernels", native._SRC, cc, native_flags, "test", build=False) is None
    portable = [*native._FLAGS, "-march=x86-64"] if native.platform.machine() == "x86_64" \
        else [*native._FLAGS, "-march=armv8-a"]
    shared = native._compiled("kernels", native._SRC, cc, portable, "test")  # on "another CPU"
    assert shared is not None and shared != built
    monkeypatch.setattr(native, "_cpu_key", here)
    assert native._compiled("kernels", native._SRC, cc, portable, "test", build=False) == shared
