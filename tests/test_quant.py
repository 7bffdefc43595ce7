"""Tests of pipeline.quant: hand-worked cases, error bounds, sizes and edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline import quant
from pipeline.quant import (
    CODECS,
    DEFAULT_BLOCK,
    QTensor,
    dequantize,
    error_bound,
    payload_nbytes,
    quantize,
    roundtrip,
)

F32 = np.float32
SHAPES = [(), (0,), (1,), (3,), (63,), (64,), (65,), (7, 9), (2, 3, 5), (4, 0, 2), (1000,)]


def _random(shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = rng.choice([1e-30, 1e-6, 1.0, 1e6, 1e30])
    return np.asarray(rng.standard_normal(shape) * scale, dtype=F32)


def test_codecs_and_default_block() -> None:
    assert CODECS == ("fp32", "bf16", "int8", "int4")
    assert DEFAULT_BLOCK == 64


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_is_exact_and_does_not_alias(shape: tuple[int, ...]) -> None:
    x = _random(shape, 1)
    q = quantize(x, "fp32")
    assert q.codec == "fp32" and q.scales is None and q.block == 0 and q.shape == shape
    assert q.data.dtype == F32 and q.data.ndim == 1
    y = dequantize(q)
    assert y.dtype == F32 and y.shape == shape
    np.testing.assert_array_equal(y, x)
    if x.size:
        x.reshape(-1)[0] += 1.0
        assert not np.array_equal(dequantize(q), x)


def test_int8_hand_worked() -> None:
    q = quantize(np.array([1.0, -0.5, 0.25, 0.0], F32), "int8", block=4)
    assert q.data.dtype == np.int8
    # -0.5 * 127 = -63.5 rounds half to even -> -64; 0.25 * 127 = 31.75 -> 32.
    np.testing.assert_array_equal(q.data, [127, -64, 32, 0])
    np.testing.assert_array_equal(q.scales, np.array([1 / 127], F32))
    assert q.block == 4 and q.shape == (4,)
    np.testing.assert_allclose(dequantize(q), np.array([127, -64, 32, 0]) / 127, rtol=1e-6)


def test_int4_hand_worked_and_packing() -> None:
    q = quantize(np.array([7.0, -3.5, 1.0, 0.0], F32), "int4", block=4)
    np.testing.assert_array_equal(q.scales, np.array([1.0], F32))
    # -3.5 rounds half to even -> -4 (two's complement nibble 0xC); low nibble first.
    assert q.data.dtype == np.uint8
    np.testing.assert_array_equal(q.data, [0x07 | (0xC << 4), 0x01 | (0x0 << 4)])
    np.testing.assert_array_equal(dequantize(q), np.array([7.0, -4.0, 1.0, 0.0], F32))


def test_int4_odd_count_leaves_high_nibble_zero() -> None:
    q = quantize(np.array([-7.0, 7.0, -7.0], F32), "int4", block=64)
    np.testing.assert_array_equal(q.data, [0x9 | (0x7 << 4), 0x9])
    np.testing.assert_array_equal(dequantize(q), [-7.0, 7.0, -7.0])


def test_bf16_known_values() -> None:
    x = np.array(
        [1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-7, -2.0, 0.0, -0.0, 1 + 2**-8 + 2**-20], F32
    )
    q = quantize(x, "bf16")
    assert q.data.dtype == np.uint16 and q.scales is None and q.block == 0
    assert q.data[0] == 0x3F80
    # 1 + 2**-8 is a tie between 1 (even) and 1 + 2**-7 (odd): ties to even -> 1.0.
    # 1 + 3 * 2**-8 is a tie between 1 + 2**-7 (odd) and 1 + 2**-6 (even) -> 1 + 2**-6.
    # Just above the tie rounds up.
    expected = [1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -2.0, 0.0, -0.0, 1 + 2**-7]
    y = dequantize(q)
    np.testing.assert_array_equal(y, np.array(expected, F32))
    assert np.signbit(y[6])
    np.testing.assert_array_equal(q.data[4:7], [0xC000, 0x0000, 0x8000])


def test_bf16_saturates_instead_of_overflowing() -> None:
    big = np.finfo(F32).max
    y = roundtrip(np.array([big, -big], F32), "bf16")
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(np.abs(y), np.float32(3.3895313892515355e38))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [1, 5, 64, 4096])
def test_error_bound_holds(codec: str, shape: tuple[int, ...], block: int) -> None:
    for seed in range(3):
        x = _random(shape, seed * 1000 + block)
        y = roundtrip(x, codec, block)
        assert y.dtype == F32 and y.shape == shape
        assert np.isfinite(y).all()
        bound = error_bound(x, codec, block)
        assert bound.shape == shape
        err = np.abs(y.astype(np.float64) - x.astype(np.float64))
        assert (err <= bound).all(), (codec, shape, block, seed)


@pytest.mark.parametrize("codec", CODECS)
def test_error_bound_holds_on_extremes(codec: str) -> None:
    fi = np.finfo(F32)
    x = np.array(
        [fi.max, -fi.max, fi.tiny, -fi.tiny, 2.0**-149, 1e-40, 4e-36, -1e-37, 0.0, 1.0, 1e-3], F32
    )
    for block in (1, 2, 3, 10):
        y = roundtrip(x, codec, block)
        assert np.isfinite(y).all()
        err = np.abs(y.astype(np.float64) - x.astype(np.float64))
        assert (err <= error_bound(x, codec, block)).all(), (codec, block)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_error_bound_is_tight_for_integer_codecs(codec: str) -> None:
    qmax = {"int8": 127, "int4": 7}[codec]
    x = _random((4096,), 7)
    x[::64] = 0.0
    bound = error_bound(x, codec, 64)
    absmax = np.abs(x).reshape(-1, 64).max(axis=1)
    expected = absmax.astype(np.float64) * (1 / (2 * qmax) + 1e-6)
    np.testing.assert_allclose(bound.reshape(-1, 64)[:, 0], expected, rtol=1e-6)


def test_bf16_bound_formula() -> None:
    x = np.array([1.0, -2.0, 0.0], F32)
    np.testing.assert_allclose(error_bound(x, "bf16"), [2**-8, 2**-7, 2**-134], rtol=1e-6)
    np.testing.assert_array_equal(error_bound(x, "fp32"), 0.0)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_zero_blocks_decode_to_zero(codec: str) -> None:
    x = np.zeros(200, F32)
    x[70] = 3.0
    q = quantize(x, codec, block=64)
    np.testing.assert_array_equal(q.scales[[0, 2, 3]], 0.0)
    assert q.scales[1] > 0
    y = dequantize(q)
    assert np.count_nonzero(y) == 1 and y[70] == pytest.approx(3.0, rel=1e-6)


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 127, 129])
def test_sizes_and_padding(codec: str, n: int) -> None:
    x = _random((n,), n)
    q = quantize(x, codec, block=64)
    n_blocks = -(-n // 64)
    assert q.scales.shape == (n_blocks,) and q.scales.dtype == F32
    expected_data = (n + 1) // 2 if codec == "int4" else n
    assert q.data.shape == (expected_data,)
    assert payload_nbytes(q) == expected_data + 4 * n_blocks


def test_payload_nbytes() -> None:
    x = _random((64, 64), 3)
    assert payload_nbytes(quantize(x, "int4", 64)) == 2048 + 64 * 4
    assert payload_nbytes(quantize(x, "int8", 64)) == 4096 + 64 * 4
    assert payload_nbytes(quantize(x, "bf16")) == 4096 * 2
    assert payload_nbytes(quantize(x, "fp32")) == 4096 * 4


@pytest.mark.parametrize("codec", CODECS)
def test_scalar_and_empty(codec: str) -> None:
    y = roundtrip(np.float32(-2.5), codec)
    assert y.shape == () and float(y) == pytest.approx(-2.5, rel=2**-8)
    for shape in [(0,), (3, 0), (0, 0, 5)]:
        q = quantize(np.zeros(shape, F32), codec)
        assert q.shape == shape and q.data.size == 0
        assert dequantize(q).shape == shape


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rejected(codec: str, bad: float) -> None:
    x = np.ones(100, F32)
    x[77] = bad
    with pytest.raises(ValueError, match=codec):
        quantize(x, codec)
    with pytest.raises(ValueError):
        error_bound(x, codec)


def test_float64_overflow_is_non_finite() -> None:
    with pytest.raises(ValueError):
        quantize(np.array([1e300]), "int8")


def test_unknown_codec_and_bad_block() -> None:
    with pytest.raises(ValueError, match="int2"):
        quantize(np.ones(3, F32), "int2")
    with pytest.raises(ValueError, match="int2"):
        error_bound(np.ones(3, F32), "int2")
    for block in (0, -1, 2.5, True):
        with pytest.raises(ValueError):
            quantize(np.ones(3, F32), "int8", block)


def test_deterministic_and_non_contiguous_input() -> None:
    x = _random((50, 40), 11)
    for codec in CODECS:
        a, b = quantize(x[:, ::3], codec, 16), quantize(np.ascontiguousarray(x[:, ::3]), codec, 16)
        np.testing.assert_array_equal(a.data, b.data)
        np.testing.assert_array_equal(dequantize(a), dequantize(b))


def test_dequantize_rejects_inconsistent_qtensor() -> None:
    good = quantize(np.ones(10, F32), "int8", 4)
    bad_cases = [
        good._replace(codec="nope"),
        good._replace(scales=None),
        good._replace(scales=good.scales[:-1]),
        good._replace(data=good.data[:-1]),
        good._replace(data=good.data.astype(np.int16)),
        good._replace(block=0),
        QTensor("fp32", (2,), np.zeros(2, F32), np.zeros(1, F32), 0),
    ]
    for q in bad_cases:
        with pytest.raises(ValueError):
            dequantize(q)


def test_int4_crafted_minus_eight_decodes() -> None:
    q = QTensor("int4", (2,), np.array([0x88], np.uint8), np.array([0.5], F32), 2)
    np.testing.assert_array_equal(dequantize(q), [-4.0, -4.0])


def test_helpers() -> None:
    assert quant.data_nbytes("int4", 5) == 3
    assert quant.data_nbytes("bf16", 5) == 10
    assert quant.num_blocks(0, 64) == 0 and quant.num_blocks(65, 64) == 2
