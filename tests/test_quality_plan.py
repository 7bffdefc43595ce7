"""The default-model quality table's run plan (ops/bench/quality_default.py): which runs it
wants next given the finished ones — the same learning-rate sweep rule for data parallel and
the candidate, extended until each one's best rate is bracketed."""
from __future__ import annotations

import math

from ops.bench.quality_default import CAND, DDP, H100, SHIPPED, losses, name, plan, sweep


def _done(rows: dict[tuple[str, float, int], float]) -> dict[str, float]:
    return {name(r): loss for r, loss in rows.items()}


def test_an_empty_table_starts_with_the_sweep_interleaved():
    assert plan({}) == [(DDP, 1e-3, 0), (CAND, 1e-3, 0), (DDP, 4e-4, 0), (CAND, 4e-4, 0),
                        (DDP, 2e-3, 0), (CAND, 2e-3, 0)]


def test_a_best_rate_at_the_top_of_the_sweep_extends_it_before_any_seed():
    done = _done({(DDP, 1e-3, 0): 1.077, (DDP, 4e-4, 0): 1.331, (DDP, 2e-3, 0): 0.997,
                  (CAND, 1e-3, 0): 1.124, (CAND, 4e-4, 0): 1.297})
    assert sweep(done, DDP) == ([4e-3], None)
    assert plan(done) == [(DDP, 4e-3, 0), (CAND, 2e-3, 0)]
    # the extension is worse: 2e-3 is bracketed, data parallel's seeds go ahead at it
    done[name((DDP, 4e-3, 0))] = 1.02
    assert sweep(done, DDP) == ([], 2e-3)
    assert plan(done) == [(CAND, 2e-3, 0), (DDP, 2e-3, 1), (DDP, 2e-3, 2)]


def test_the_sweep_extends_downwards_and_stops_at_the_grid_ends():
    done = _done({(CAND, 1e-3, 0): 1.2, (CAND, 4e-4, 0): 1.1, (CAND, 2e-3, 0): 1.3})
    assert sweep(done, CAND) == ([2e-4], None)
    done[name((CAND, 2e-4, 0))] = 1.0
    assert sweep(done, CAND) == ([], 2e-4)  # the grid's lowest rate
    up = _done({(DDP, lr, 0): 2.0 - lr * 100 for lr in (4e-4, 1e-3, 2e-3, 4e-3, 8e-3)})
    assert sweep(up, DDP) == ([], 8e-3)


def test_a_diverged_run_counts_as_worst_and_malformed_rows_are_ignored():
    results = {name((DDP, 1e-3, 0)): {"final_eval_loss": 1.1},
               name((DDP, 4e-4, 0)): {"final_eval_loss": 1.3},
               name((DDP, 2e-3, 0)): {"final_eval_loss": float("nan")},
               "junk": [1, 2], "bool": {"final_eval_loss": True}, "none": {}}
    done = losses(results)
    assert set(done) == {name((DDP, lr, 0)) for lr in (1e-3, 4e-4, 2e-3)}
    assert math.isinf(done[name((DDP, 2e-3, 0))])
    assert sweep(done, DDP) == ([], 1e-3)


def test_the_shipped_and_h100_rows_run_at_the_candidates_rate_after_its_seeds():
    done = _done({(v, lr, 0): loss for v in (DDP, CAND)
                  for lr, loss in ((4e-4, 1.3), (1e-3, 1.0), (2e-3, 1.2))})
    want = plan(done)
    assert want[:4] == [(DDP, 1e-3, 1), (CAND, 1e-3, 1), (DDP, 1e-3, 2), (CAND, 1e-3, 2)]
    assert want[4:] == [(v, 1e-3, s) for v in (SHIPPED, H100) for s in (0, 1, 2)]
    done.update({name(r): 1.0 for r in want})
    assert plan(done) == []
