"""`diloco plan`: what a run will cost before it starts (`pipeline.plan`), with the per-value
costs of this code measured on this host: the syncer's offer and close of a round (the real
`pipeline.syncer.FragmentSyncer`), the learner's push (delta and quantisation) and apply (the
published value decoded and the fragment moved onto it), each on a fragment of `--measure-values`
values, the best of a few repeats (the host's other work only makes a repeat slower)."""

from __future__ import annotations

import time
import timeit
from collections.abc import Callable

import numpy as np

from pipeline import quant
from pipeline.config import OuterConfig, RunConfig
from pipeline.contribution import Contribution
from pipeline.downlink import apply_delta, encode_down
from pipeline.plan import Costs
from pipeline.syncer import FragmentSyncer

MEASURE_VALUES = 1 << 21  # 8 MiB of fp32: far past the caches, a second or two in all


def _best(fn: Callable[[], object], repeats: int) -> float:
    return min(timeit.repeat(fn, number=1, repeat=repeats))


def measure(cfg: RunConfig, n: int = MEASURE_VALUES, repeats: int = 3,
            seed: int = 0) -> Costs:
    """Seconds per value of each data-path step of this code under `cfg`'s sync settings."""
    s = cfg.effective_sync()
    rng = np.random.default_rng(seed)
    theta = {"w": rng.standard_normal(n, dtype=np.float32)}
    moved = {"w": theta["w"] - 1e-3 * rng.standard_normal(n, dtype=np.float32)}

    def push() -> dict[str, quant.QTensor]:
        delta = {k: theta[k] - moved[k] for k in theta}
        return {k: quant.quantize(v, s.codec_up, s.quant_block) for k, v in delta.items()}

    payload = push()
    sent, _ = encode_down(moved, s.codec_down, s.quant_block, theta if s.down_delta else None)

    def apply() -> None:
        value = apply_delta(theta, sent) if s.down_delta else {
            k: quant.dequantize(q) for k, q in sent.items()}
        {k: value[k] + (moved[k] - theta[k]) for k in value}  # θ ← Θ + (θ − anchor)

    core = FragmentSyncer(0, theta, cfg.outer if isinstance(cfg.outer, OuterConfig) else
                          OuterConfig(), s, is_embedding=lambda _name: False)
    offer_s, close_s = float("inf"), float("inf")
    for i in range(repeats):
        c = Contribution(f"L{i}", 0, core.version, 1, s.sync_every, 1, delta=payload)
        t0 = time.perf_counter()
        accepted, why = core.offer(c, 0.0)
        t1 = time.perf_counter()
        if not accepted:
            raise RuntimeError(f"the measuring round refused its contribution: {why}")
        core.close(0.0, "quorum")
        _ = core.sent_hash  # each round's record carries the published value's hash
        t2 = time.perf_counter()
        offer_s, close_s = min(offer_s, t1 - t0), min(close_s, t2 - t1)
    return Costs(offer_s=offer_s / n, close_s=close_s / n, push_s=_best(push, repeats) / n,
                 apply_s=_best(apply, repeats) / n)
