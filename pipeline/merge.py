"""Merging contributions: token weights, anchored outer gradients, streaming averaging.

A contribution from learner m anchored at version b carries δ_m = Θ̃(b) − θ_m, where Θ̃(b) is the
value the learner actually received for that version (after down-link quantisation). Against the
current global value Θ(v) its outer gradient is Δ_m = Θ(v) − θ_m = (Θ(v) − Θ̃(b)) + δ_m.

Weights are "quantity × quality": w_m = tokens_m² / steps_m. Non-embedding tensors are merged by
radial-directional averaging, RDA = (Σ w‖Δ‖ / Σ w) · φ(Σ w φ(Δ) / Σ w) with φ(x) = x/‖x‖;
embeddings (sparse row updates) by the weighted mean. The accumulator keeps running sums only, so
memory stays O(fragment size) however many learners contribute.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline.model import is_embedding


def token_weight(tokens: int, steps: int) -> float:
    """w = tokens² / steps (tokens processed times tokens per step)."""
    if steps <= 0 or tokens <= 0:
        raise ValueError(f"a contribution needs steps > 0 and tokens > 0, got {steps}, {tokens}")
    return float(tokens) * float(tokens) / float(steps)


def anchored_delta(current: Mapping[str, np.ndarray], base_sent: Mapping[str, np.ndarray],
                   delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Δ = (Θ(v) − Θ̃(b)) + δ, tensor by tensor, fp32."""
    return {k: (current[k] - base_sent[k]) + delta[k] for k in current}


def norm(x: np.ndarray) -> float:
    """‖x‖₂ (a BLAS dot product over the flattened tensor)."""
    flat = x.ravel()
    return float(np.sqrt(np.dot(flat, flat)))


class StreamingMerge:
    """Running weighted sums for one fragment; `result()` gives the merged outer gradient.

    Args:
        shapes: name → shape of the fragment's tensors.
        method: "rda" (radial-directional averaging for non-embeddings) or "mean".
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], method: str = "rda"):
        if method not in ("rda", "mean"):
            raise ValueError(f"sync.merge: {method!r} is not one of rda, mean")
        self.method = method
        self.total_weight = 0.0
        self.count = 0
        self._rda = {k: method == "rda" and not is_embedding(k) for k in shapes}
        # fp64 sums make the fp32 result (almost always) independent of arrival order.
        self._sum = {k: np.zeros(s, np.float64) for k, s in shapes.items()}
        self._sum_norm = {k: 0.0 for k in shapes}
        self._scratch: dict[str, np.ndarray] = {}

    def add(self, delta: Mapping[str, np.ndarray], weight: float,
            norms: Mapping[str, float] | None = None) -> None:
        """Fold one outer gradient Δ with weight w into the running sums (pass `norms` when
        ‖Δ‖ per tensor is already known, to spare a pass over each tensor)."""
        if not weight > 0:
            raise ValueError(f"merge weight must be > 0, got {weight}")
        if set(delta) != set(self._sum):
            raise ValueError("contribution tensors do not match the fragment's tensors")
        for k, d in delta.items():
            scratch = self._scratch.get(k)
            if scratch is None:
                scratch = self._scratch[k] = np.empty(d.shape, np.float32)
            if self._rda[k]:
                n = norms[k] if norms is not None else norm(d)
                if n == 0.0:
                    continue  # φ(0) = 0 and ‖0‖ = 0: adds nothing but its weight
                np.multiply(d, np.float32(weight / n), out=scratch)
                self._sum_norm[k] += weight * n
            else:
                np.multiply(d, np.float32(weight), out=scratch)
            np.add(self._sum[k], scratch, out=self._sum[k])
        self.total_weight += weight
        self.count += 1

    def result(self) -> dict[str, np.ndarray]:
        """The merged outer gradient (fp32). Raises ValueError if nothing was added."""
        if self.count == 0:
            raise ValueError("no contributions to merge")
        out = {}
        for k, s in self._sum.items():
            mean = s / self.total_weight
            if self._rda[k]:
                norm = float(np.sqrt(np.sum(np.square(mean))))
                radius = self._sum_norm[k] / self.total_weight
                mean = mean * (radius / norm) if norm > 0 else np.zeros_like(mean)
            out[k] = mean.astype(np.float32)
        return out
