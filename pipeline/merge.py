"""Merging contributions: token weights, anchored outer gradients, streaming averaging.

A contribution from learner m anchored at version b carries δ_m = Θ̃(b) − θ_m, where Θ̃(b) is the
value the learner actually received for that version (after down-link quantisation). Against the
current global value Θ(v) its outer gradient is Δ_m = Θ(v) − θ_m = (Θ(v) − Θ̃(b)) + δ_m.

Weights are "quantity × quality": w_m = tokens_m² / steps_m. Non-embedding tensors are merged by
radial-directional averaging, RDA = (Σ w‖Δ‖ / Σ w) · φ(Σ w φ(Δ) / Σ w) with φ(x) = x/‖x‖;
embeddings (sparse row updates) by the weighted mean. The accumulator keeps running sums only, so
memory stays O(fragment size) however many learners contribute.

For runs with learners that are not trusted, ``sync.merge = "trimmed"`` (`TrimmedMerge`) is a
robust variant of RDA: the directions are averaged by a coordinate-wise *weighted trimmed mean*
(the weight mass ``sync.trim`` at each end of every coordinate is left out) and so are the
norms; embeddings by the trimmed mean of Δ. ``sync.merge = "robust"`` first leaves out the
contributions that point away from the consensus of the others (a negative leave-one-out
cosine), then merges the rest the same way. Both hold every contribution of the round (memory
O(contributions × fragment size)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from pipeline import kernels, quant


def token_weight(tokens: int, steps: int) -> float:
    """w = tokens² / steps (tokens processed times tokens per step)."""
    if steps <= 0 or tokens <= 0:
        raise ValueError(f"a contribution needs steps > 0 and tokens > 0, got {steps}, {tokens}")
    return float(tokens) * float(tokens) / float(steps)


def anchored_delta(current: Mapping[str, np.ndarray], base_sent: Mapping[str, np.ndarray],
                   delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Δ = (Θ(v) − Θ̃(b)) + δ, tensor by tensor, fp32."""
    return {k: (current[k] - base_sent[k]) + delta[k] for k in current}


class NonFiniteContribution(ValueError):
    """A contribution whose values (or whose norm) are not finite; nothing was added."""


class NormExceeded(ValueError):
    """A contribution whose ‖δ‖ is above the bound it was offered with; nothing was added."""

    def __init__(self, norm: float, bound: float):
        super().__init__(f"‖δ‖ {norm:.4g} exceeds {bound:.4g}")
        self.norm, self.bound = norm, bound


def _check_add(shapes: Mapping[str, tuple[int, ...]], delta: Mapping[str, object],
               weight: float) -> None:
    if not weight > 0:
        raise ValueError(f"merge weight must be > 0, got {weight}")
    if set(delta) != set(shapes):
        raise ValueError("contribution tensors do not match the fragment's tensors")
    for k, d in delta.items():
        if tuple(d.shape) != shapes[k]:
            raise ValueError(f"{k}: shape {tuple(d.shape)}, the fragment's is {shapes[k]}")


def _clip_scale(dnorm: float, max_norm: float | None, clip: bool) -> float:
    """The factor s the contribution's δ is added with (1, or max_norm/‖δ‖ when clipped)."""
    if not math.isfinite(dnorm):
        raise NonFiniteContribution("non-finite values")
    if max_norm is not None and dnorm > max_norm:
        if not clip:
            raise NormExceeded(dnorm, max_norm)
        return max_norm / dnorm
    return 1.0


def trimmed_mean(x: np.ndarray, w: np.ndarray, trim: float) -> np.ndarray:
    """The weighted trimmed mean over axis 0 of `x` (n × …), weights `w` (n, all > 0).

    Per coordinate the n values are sorted and the weight mass ``trim × Σw`` at each end is
    left out (a value straddling a cut counts with the part of its weight inside), so with
    equal weights and n = 4, trim 0.25 drops the lowest and the highest value; with n = 2
    equal weights it is the plain mean; trim → 0.5 tends to the weighted median.
    """
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    w = np.asarray(w, np.float64)
    total = float(w.sum())
    lo_cut, hi_cut = trim * total, (1.0 - trim) * total
    order = np.argsort(x, axis=0, kind="stable")
    xs = np.take_along_axis(x, order, axis=0).astype(np.float64)
    ws = w[order]
    hi = np.cumsum(ws, axis=0)
    lo = hi - ws
    kept = np.clip(np.minimum(hi, hi_cut) - np.maximum(lo, lo_cut), 0.0, None)
    return (kept * xs).sum(axis=0) / (hi_cut - lo_cut)


class StreamingMerge:
    """Running weighted sums for one fragment; `result()` gives the merged outer gradient.

    Each contribution arrives as δ (quantised or fp32) plus the anchor a = Θ(v) − Θ̃(b) of its
    base version, shared by every contribution anchored at b; Δ = a + δ is never formed. Per
    tensor, one pass gives ‖δ‖² and ⟨a, δ⟩, so ‖Δ‖² = ‖a‖² + 2⟨a, δ⟩ + ‖δ‖² (‖a‖² once per
    anchor); a second pass adds c·δ to an fp64 sum (c = w/‖Δ‖ for RDA, w for the mean), and
    c is added to the anchor's coefficient. `result()` folds Σ_b C_b·a_b in once per anchor.
    Both passes are the fused kernels of `pipeline.kernels` (decode inside the loop).

    Args:
        shapes: name → shape of the fragment's tensors.
        method: "rda" (radial-directional averaging for non-embeddings) or "mean".
        is_embedding: which tensors are embeddings (the task's; merged by weighted mean).
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], method: str,
                 is_embedding: Callable[[str], bool]):
        if method not in ("rda", "mean"):
            raise ValueError(f"sync.merge: {method!r} is not one of rda, mean")
        self.method = method
        self.shapes = {k: tuple(s) for k, s in shapes.items()}
        self.total_weight = 0.0
        self.count = 0
        self._rda = {k: method == "rda" and not is_embedding(k) for k in shapes}
        # fp64 sums make the fp32 result (almost always) independent of arrival order. Each is
        # allocated at its tensor's first contribution: a syncer keeps a round open for every
        # fragment it owns, and an empty one holds no memory (8 bytes a value otherwise)
        self._sum: dict[str, np.ndarray] | None = {}  # None once `result` took it
        self._sum_norm = {k: 0.0 for k in shapes}
        # anchor id → (the anchor's tensors, ‖a‖² per tensor, Σ c per tensor)
        self._anchors: dict[object, tuple[Mapping[str, np.ndarray], dict[str, float],
                                          dict[str, float]]] = {}

    def add(self, delta: Mapping[str, quant.QTensor | np.ndarray], weight: float,
            anchor: Mapping[str, np.ndarray] | None = None, anchor_id: object = None, *,
            max_norm: float | None = None, clip: bool = False) -> float:
        """Fold one outer gradient Δ = anchor + δ with weight w into the running sums; return
        ‖δ‖ (over the fragment's tensors, before any clipping).

        Args:
            delta: name → δ, a :class:`~pipeline.quant.QTensor` or an fp32 array.
            weight: w > 0.
            anchor: name → fp32 a (None: Δ = δ); contributions passing the same `anchor_id`
                must pass the same anchor.
            anchor_id: identifies the anchor (the base version).
            max_norm: A bound on ‖δ‖ (the poison guard): above it the contribution is refused
                (`NormExceeded`), or with `clip` scaled down to the bound.

        Raises:
            NormExceeded: ‖δ‖ > `max_norm` and not `clip` (nothing is added).
            NonFiniteContribution: δ holds NaN or infinity (nothing is added; ‖Δ‖² is summed
                in fp64, which no finite fp32 tensor overflows).
            ValueError: bad weight, tensors that do not match the fragment's.
        """
        if self._sum is None:
            raise ValueError("the merge's result was taken already")
        _check_add(self.shapes, delta, weight)
        slot = None
        if anchor is not None:
            slot = self._anchors.get(anchor_id)
            if slot is None:
                slot = self._anchors[anchor_id] = (
                    anchor, dict(zip(anchor, (dd for dd, _ in kernels.stats(
                        [(a, None) for a in anchor.values()])), strict=True)),
                    {k: 0.0 for k in anchor})
        delta = {k: kernels.operand(d) for k, d in delta.items()}  # validated once, used twice
        names = list(delta)
        # pass 1 over every tensor before any sum changes
        stats = kernels.stats([(delta[k], slot[0][k] if slot else None) for k in names])
        dnorm = math.sqrt(math.fsum(dd for dd, _ in stats))
        s = _clip_scale(dnorm, max_norm, clip)  # δ is added as s·δ (s < 1: clipped)
        coefs = {}
        for k, (dd, ad) in zip(names, stats, strict=True):
            n2 = s * s * dd + 2.0 * s * ad + (slot[1][k] if slot else 0.0)
            if not math.isfinite(n2):
                raise NonFiniteContribution(f"{k}: non-finite values")
            if self._rda[k]:
                n = math.sqrt(max(n2, 0.0))
                coefs[k] = (weight / n, weight * n) if n > 0.0 else None  # φ(0) = 0
            else:
                coefs[k] = (weight, 0.0)
        live = [k for k in names if coefs[k] is not None]
        kernels.axpy([(self._sum_of(k), delta[k], coefs[k][0] * s) for k in live])
        for k in live:
            c, wn = coefs[k]
            self._sum_norm[k] += wn
            if slot:
                slot[2][k] += c
        self.total_weight += weight
        self.count += 1
        return dnorm

    def _sum_of(self, k: str) -> np.ndarray:
        s = self._sum.get(k)
        if s is None:
            s = self._sum[k] = np.zeros(self.shapes[k], np.float64)
        return s

    def result(self) -> dict[str, np.ndarray]:
        """The merged outer gradient (fp32), once: the fp64 sums become the mean in place (no
        second fp64 copy of the fragment) and are released tensor by tensor.

        Raises:
            ValueError: Nothing was added, or the result was taken already.
        """
        if self.count == 0:
            raise ValueError("no contributions to merge")
        if self._sum is None:
            raise ValueError("the merge's result was taken already")
        sums, self._sum = self._sum, None
        out = {}
        for k in self.shapes:
            mean = sums.pop(k, None)
            if mean is None:
                mean = np.zeros(self.shapes[k], np.float64)
            kernels.axpy([(mean, anchor[k], coef[k]) for anchor, _, coef in
                          self._anchors.values() if coef[k] != 0.0])
            np.divide(mean, self.total_weight, out=mean)  # in place: the same bits, no copies
            if self._rda[k]:
                norm = float(np.sqrt(np.sum(np.square(mean))))
                radius = self._sum_norm[k] / self.total_weight
                if norm > 0:
                    np.multiply(mean, radius / norm, out=mean)
                else:
                    mean[...] = 0.0
            out[k] = mean.astype(np.float32)
        return out


class TrimmedMerge:
    """The robust merge of one fragment's round (``sync.merge = "trimmed"``): RDA whose two
    averages — of the unit directions φ(Δ_m), coordinate by coordinate, and of the norms
    ‖Δ_m‖ — are weighted trimmed means (`trimmed_mean`); embeddings take the trimmed mean of
    Δ. A contribution far from the others in a coordinate (a sign-flipped or scaled δ that the
    norm guard lets through) is left out of that coordinate. Same interface as
    `StreamingMerge`; it keeps every Δ_m of the round (fp32).

    Args:
        shapes: name → shape of the fragment's tensors.
        is_embedding: which tensors are embeddings.
        trim: the weight fraction left out at each end (``sync.trim``).
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]],
                 is_embedding: Callable[[str], bool], trim: float, consistency: bool = False):
        if not 0.0 < trim < 0.5:
            raise ValueError(f"sync.trim must be in (0, 0.5), got {trim}")
        self.shapes = {k: tuple(s) for k, s in shapes.items()}
        self.trim = trim
        self.consistency = consistency
        self.excluded: list[int] = []  # contributions (in add order) the filter left out
        self._direction = {k: not is_embedding(k) for k in shapes}
        self.total_weight = 0.0
        self.count = 0
        self._weights: list[float] = []
        self._values: dict[str, list[np.ndarray]] = {k: [] for k in shapes}  # φ(Δ) or Δ
        self._norms: dict[str, list[float]] = {k: [] for k in shapes}

    def add(self, delta: Mapping[str, quant.QTensor | np.ndarray], weight: float,
            anchor: Mapping[str, np.ndarray] | None = None, anchor_id: object = None, *,
            max_norm: float | None = None, clip: bool = False) -> float:
        """Hold one outer gradient Δ = anchor + δ with weight w; return ‖δ‖ (before any
        clipping). Raises as `StreamingMerge.add` (nothing is held then)."""
        del anchor_id  # Δ is formed here: the anchor is used as given
        _check_add(self.shapes, delta, weight)
        d32 = {k: (quant.dequantize(kernels.operand(d)) if isinstance(d, quant.QTensor)
                   else np.asarray(d, np.float32)).reshape(self.shapes[k])
               for k, d in delta.items()}
        dnorm = math.sqrt(math.fsum(dd for dd, _ in kernels.stats(
            [(v, None) for v in d32.values()])))
        s = _clip_scale(dnorm, max_norm, clip)
        values, norms = {}, {}
        for k, d in d32.items():
            full = s * d.astype(np.float64)
            if anchor is not None:
                full = full + anchor[k]
            n = float(np.sqrt(np.sum(np.square(full))))
            if not math.isfinite(n):
                raise NonFiniteContribution(f"{k}: non-finite values")
            if self._direction[k]:
                values[k] = (full / n if n > 0.0 else np.zeros_like(full)).astype(np.float32)
            else:
                values[k] = full.astype(np.float32)
            norms[k] = n
        for k in self.shapes:
            self._values[k].append(values[k])
            self._norms[k].append(norms[k])
        self._weights.append(weight)
        self.total_weight += weight
        self.count += 1
        return dnorm

    def _inconsistent(self, w: np.ndarray) -> list[int]:
        """The contributions whose Δ points away from the weighted sum of the others' unit
        Δ (a negative leave-one-out cosine, over the whole fragment) — left out when the rest
        hold more than half of the round's weight. A sign-flipped δ opposes the honest
        consensus; an honest one agrees with it unless the noise swamps the signal."""
        n = self.count
        if n < 3:
            return []
        gram = np.zeros((n, n))
        for k, vals in self._values.items():
            x = np.stack(vals).reshape(n, -1).astype(np.float64)
            if self._direction[k]:
                x = x * np.asarray(self._norms[k])[:, None]  # back to Δ from φ(Δ)
            gram += x @ x.T
        d = np.sqrt(np.clip(np.diag(gram), 1e-300, None))
        cos = gram / d[:, None] / d[None, :]
        score = cos @ w - w  # Σ_{j≠i} w_j cos(Δ_i, Δ_j)
        out = [i for i in range(n) if score[i] < 0]
        if not out or w[[i for i in range(n) if i not in out]].sum() <= 0.5 * w.sum():
            return []
        return out

    def _sum_of(self, k: str) -> np.ndarray:
        s = self._sum.get(k)
        if s is None:
            s = self._sum[k] = np.zeros(self.shapes[k], np.float64)
        return s

    def result(self) -> dict[str, np.ndarray]:
        """The merged outer gradient (fp32). Raises ValueError if nothing was added."""
        if self.count == 0:
            raise ValueError("no contributions to merge")
        w = np.asarray(self._weights, np.float64)
        self.excluded = self._inconsistent(w) if self.consistency else []
        keep = [i for i in range(self.count) if i not in self.excluded]
        w = w[keep]
        out = {}
        for k, vals in self._values.items():
            mean = trimmed_mean(np.stack([vals[i] for i in keep]), w, self.trim)
            if self._direction[k]:
                norm = float(np.sqrt(np.sum(np.square(mean))))
                radius = float(trimmed_mean(np.asarray(self._norms[k])[keep][:, None], w,
                                            self.trim)[0])
                mean = mean * (radius / norm) if norm > 0 else np.zeros_like(mean)
            out[k] = mean.astype(np.float32)
        return out


def make_merge(shapes: Mapping[str, tuple[int, ...]], method: str,
               is_embedding: Callable[[str], bool], trim: float = 0.25
               ) -> StreamingMerge | TrimmedMerge:
    """The accumulator of one round for ``sync.merge`` (rda, mean, trimmed or robust)."""
    if method in ("trimmed", "robust"):
        return TrimmedMerge(shapes, is_embedding, trim, consistency=method == "robust")
    return StreamingMerge(shapes, method, is_embedding)
