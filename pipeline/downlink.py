"""The down link's arithmetic, the one copy syncers (`pipeline.syncer`, `workers.recovery`) and
learners (`workers.learner_net`) share: a merged value quantised for the wire, and with the
delta down link (`sync.down_delta`) the reference R(v) every learner holds, computed the same
way on both sides so that it is bit for bit the same (its SHA-256 travels in the header).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline import quant


def encode_down(theta: Mapping[str, np.ndarray], codec: str, block: int,
                ref: Mapping[str, np.ndarray] | None = None
                ) -> tuple[dict[str, quant.QTensor], dict[str, np.ndarray]]:
    """Quantise a global value for the down link; also return what learners will decode.

    With `ref` (the delta down link, `sync.down_delta`) the payload is codec(Θ − ref) and what
    learners hold afterwards is ref + decode(payload), computed here exactly as they compute
    it (fp32, elementwise): the error one publish leaves is part of the next one's delta."""
    if ref is None:
        sent = {k: quant.quantize(v, codec, block) for k, v in theta.items()}
        return sent, {k: quant.dequantize(q) for k, q in sent.items()}
    sent = {k: quant.quantize(np.subtract(v, ref[k], dtype=np.float32), codec, block)
            for k, v in theta.items()}
    return sent, apply_delta(ref, sent)


def apply_delta(ref: Mapping[str, np.ndarray], delta: Mapping[str, quant.QTensor]
                ) -> dict[str, np.ndarray]:
    """R(v) = R(v−1) + decode(delta), the one way syncers and learners both compute it."""
    return {k: np.add(np.asarray(ref[k], np.float32), quant.dequantize(q), dtype=np.float32)
            for k, q in delta.items()}


def full_value(values: Mapping[str, np.ndarray]) -> dict[str, quant.QTensor]:
    """A decoded value as fp32 tensors: the delta down link's snapshots and key frames.

    The tensors are read-only views of `values` (no copy: a syncer keeps the value, and sends
    or stores it each round); the values must not change while the tensors are used.

    Raises:
        ValueError: A value holds NaN or infinity.
    """
    out = {}
    for k, v in values.items():
        a = np.asarray(v, np.float32)
        if not np.isfinite(a).all():
            raise ValueError(f"{k}: cannot send non-finite values")
        flat = a.reshape(-1).view()
        flat.flags.writeable = False
        out[k] = quant.QTensor("fp32", tuple(int(d) for d in a.shape), flat, None, 0)
    return out
