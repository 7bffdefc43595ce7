"""`diloco bench large`'s path at a size that runs in a minute, with every large value in
pieces of 4 KiB: two learners, two syncers sharing the fragments, the first killed for good
and taken over, then replay, export and eval of the result (BENCHMARKS.md runs the same path
at the largest model this host holds)."""

import pytest

from ops.bench.large import bench_large

pytestmark = pytest.mark.slow


def test_the_large_model_path_end_to_end_in_small_pieces():
    out = bench_large(quick=True, piece_bytes=4096)
    assert out["fragments"][1] * 4 > 64 * 4096  # the largest fragment's values: many pieces
    ledger = out["ledger"]
    assert ledger["lost"] == 0 and ledger["merged_twice"] == 0, ledger
    assert ledger["identical_final_values"] and ledger["versions_increase"], ledger
    assert ledger["exit_codes"] == {"syncer-0": -9, "syncer-1": 0, "L0": 0, "L1": 0}, ledger
    taken = out["takeover"]
    assert taken["rounds_by_syncer"].get("syncer-1", 0) > 0 and taken["first_round_after_s"]
    assert all(s is not None and s < 60 for s in taken["first_round_after_s"].values()), taken
    replay = out["replay"]["summary"]
    assert replay["status"] == "verified" and replay["rounds_checked"] == sum(
        taken["rounds_by_syncer"].values()), replay
    assert out["export"]["summary"]["params"] == out["params"]
    assert 0 < out["eval"]["summary"]["eval_loss"] < 6.0
    assert set(out["peak_bytes"]) == {"learner", "syncer", "redis"}
