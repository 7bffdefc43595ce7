"""Tests of pipeline.learner.LearnerCore driven by hand, and a hand-checked end-to-end of two
LearnerCores talking to FragmentSyncers (no engine, no I/O)."""

from __future__ import annotations

import dataclasses
import math
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

from broker.state import pack_state, unpack_state
from pipeline import quant
from pipeline.config import OuterConfig, SyncConfig
from pipeline.contribution import Drop, MergeRecord, PushHeader, Reason
from pipeline.fragments import partition
from pipeline.learner import DEFER, LearnerCore
from pipeline.model import is_embedding
from pipeline.syncer import Contribution, FragmentSyncer

F32 = np.float32
FC = "h0.mlp.fc"
SHAPES = {"wte": (2,), FC: (3,)}
FRAGS = partition(SHAPES, 2, is_embedding)  # [["wte"], ["h0.mlp.fc"]]
# P = 2, H = 4 -> Δh = 2: step 2 pushes fragment 1, step 4 fragment 0, step 6 fragment 1, ...
# The tests below read "overwrite" (a merged value replaces the fragment) unless they say
# "rebase" (which keeps the steps since the push).
CFG = dataclasses.replace(SyncConfig(), fragments=2, sync_every=4, overlap_steps=1,
                          codec_up="fp32", apply="overwrite")
BASE = {"wte": np.array([1.0, 2.0], F32), FC: np.array([1.0, 2.0, 3.0], F32)}
# a fake inner step subtracts G (exact binary fractions): after k steps θ = base − k·G
G = {"wte": np.array([0.25, -0.5], F32), FC: np.array([0.5, 0.25, -0.125], F32)}
V = {FC: np.array([10.0, 20.0, 30.0], F32)}  # a merged value for fragment 1
TOKENS = 8


def test_fragments_of_the_fake_model():
    assert FRAGS == [["wte"], [FC]]
    assert CFG.delta_h == 2


def make(cfg=CFG, base_versions=(0, 0)):
    core = LearnerCore("a", FRAGS, cfg, BASE, list(base_versions))
    params = {k: jnp.asarray(v) for k, v in BASE.items()}
    return core, params


def inner(params, g=G):
    return {k: params[k] - g[k] for k in params}


def run(core, params, steps, g=G, tokens=TOKENS):
    """Inner steps `steps`; returns params and {step: [pushes]} of the steps that pushed."""
    out = {}
    for t in steps:
        params = inner(params, g)
        params, pushes = after_step(core, t, tokens, params)
        if pushes:
            out[t] = pushes
    return params, out


_LOOKUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def answering(core, lookup):
    """Drive `core` as the in-process engine does: its questions (was the push in flight
    merged?) answered at once by `lookup(p, key)`: (version, value), None or DEFER."""
    core.questions.on = True
    _LOOKUPS[core] = lookup


def after_step(core, t, tokens, params, seconds=0.0):
    """`core.after_step`, then the questions it asked answered (`answering`) and the pushes
    that waited for them, in the same step."""
    params, pushes = core.after_step(t, tokens, params, seconds=seconds)
    lookup = _LOOKUPS.get(core)
    if lookup is not None and core.questions.asked:
        for p, key in core.questions.take().items():
            core.questions.answer(p, key, lookup(p, key))
        params, more = core.resume(t, params)
        pushes = pushes + more
    return params, pushes


def decoded(push):
    return {k: quant.dequantize(q) for k, q in push.payload.items()}


def np_(params, name):
    return np.asarray(params[name])


def test_push_schedule_and_deltas():
    core, params = make()
    params, pushes = run(core, params, range(1, 13))
    # step 2 -> fragment 1, 4 -> 0, 6 and 8: fragment still in flight (6 − 2 = 4 <= H = 4),
    # 10 -> fragment 1 again (10 − 2 = 8 > 4: superseded), 12 -> fragment 0 (12 − 4 = 8 > 4)
    assert {t: [p.fragment for p in ps] for t, ps in pushes.items()} == {
        2: [1], 4: [0], 10: [1], 12: [0]}
    p2, p4, p10, p12 = (pushes[t][0] for t in (2, 4, 10, 12))
    # δ = base − θ = k·G after k steps, counters since the last applied value
    np.testing.assert_array_equal(decoded(p2)[FC], 2 * G[FC])  # [1, 0.5, −0.25]
    assert (p2.base_version, p2.step, p2.steps, p2.tokens) == (0, 2, 2, 16)
    np.testing.assert_array_equal(decoded(p4)["wte"], 4 * G["wte"])  # [1, −2]
    assert (p4.base_version, p4.step, p4.steps, p4.tokens) == (0, 4, 4, 32)
    np.testing.assert_array_equal(decoded(p10)[FC], 10 * G[FC])  # [5, 2.5, −1.25]
    assert (p10.base_version, p10.step, p10.steps, p10.tokens) == (0, 10, 10, 80)
    np.testing.assert_array_equal(decoded(p12)["wte"], 12 * G["wte"])
    assert set(p2.payload) == {FC} and set(p4.payload) == {"wte"}
    assert p2.payload[FC].codec == "fp32"
    assert p2.nbytes == 3 * 4 and p4.nbytes == 2 * 4
    assert core.inflight[1].step == 10 and core.inflight[0].step == 12
    assert core.applied == 0


def test_on_global_not_newer_is_refused():
    core, params = make()
    params, _ = run(core, params, range(1, 3))
    assert core.on_global(1, 0, V) is False  # equal to the base version
    assert core.on_global(1, -1, V) is False
    assert core.on_global(1, 1, V) is True
    assert core.on_global(1, 1, V) is False  # equal to the pending version
    assert core.on_global(1, 0, V) is False
    assert core.pending[1].version == 1
    assert core.on_global(1, 2, V) is True  # a newer one replaces the pending one
    assert core.pending[1].version == 2


def test_overwrite_applied_tau_steps_after_push():
    core, params = make()
    params, pushes = run(core, params, range(1, 3))
    assert [p.fragment for p in pushes[2]] == [1]
    assert core.on_global(1, 1, V)
    assert core.apply_at(1) == 3  # push step 2 + τ 1
    assert core.apply_at(0) is None
    np.testing.assert_array_equal(np_(params, FC), BASE[FC] - 2 * G[FC])  # not yet applied
    params, _ = run(core, params, [3])
    np.testing.assert_array_equal(np_(params, FC), V[FC])  # overwritten
    np.testing.assert_array_equal(np_(params, "wte"), BASE["wte"] - 3 * G["wte"])  # untouched
    assert params[FC].dtype == jnp.float32
    assert core.base_version == [0, 1]
    np.testing.assert_array_equal(core.base[1][FC], V[FC])
    assert core.steps == [3, 0] and core.tokens == [24, 0]
    assert core.inflight[1] is None and core.pending[1] is None
    assert core.applied == 1
    # the next push of fragment 1 (step 6) is anchored on version 1: δ = V − (V − 3G) = 3G
    params, pushes = run(core, params, range(4, 7))
    p6 = pushes[6][0]
    assert (p6.fragment, p6.base_version, p6.steps, p6.tokens) == (1, 1, 3, 24)
    np.testing.assert_allclose(decoded(p6)[FC], 3 * G[FC], rtol=1e-6)


def test_apply_waits_exactly_tau_steps():
    cfg = dataclasses.replace(CFG, overlap_steps=3)
    core, params = make(cfg)
    params, _ = run(core, params, range(1, 3))  # push of fragment 1 at step 2
    core.on_global(1, 1, V)
    assert core.apply_at(1) == 5
    params, _ = run(core, params, [3, 4])
    np.testing.assert_array_equal(np_(params, FC), BASE[FC] - 4 * G[FC])
    assert core.pending[1] is not None
    params, _ = run(core, params, [5])
    np.testing.assert_array_equal(np_(params, FC), V[FC])


def test_late_value_applied_at_once():
    core, params = make()
    params, _ = run(core, params, range(1, 5))  # push at 2, due at 3, nothing arrived
    np.testing.assert_array_equal(np_(params, FC), BASE[FC] - 4 * G[FC])
    core.on_global(1, 1, V)
    params = core.apply_due(4, params)  # 4 >= 3: applied on arrival
    np.testing.assert_array_equal(np_(params, FC), V[FC])
    assert core.base_version == [0, 1]


def test_rebase_keeps_progress_since_push():
    core, params = make(dataclasses.replace(CFG, apply="rebase"))
    params, _ = run(core, params, range(1, 3))  # θ_at_push = base − 2G
    np.testing.assert_array_equal(core.inflight[1].theta_at_push[FC], BASE[FC] - 2 * G[FC])
    core.on_global(1, 1, V)
    params, _ = run(core, params, [3])  # θ_now = base − 3G
    # Θ + (θ_now − θ_at_push) = V − G = [9.5, 19.75, 30.125]
    np.testing.assert_array_equal(np_(params, FC), V[FC] - G[FC])
    np.testing.assert_array_equal(np_(params, FC), [9.5, 19.75, 30.125])
    assert core.base_version == [0, 1]


REBASE = dataclasses.replace(CFG, apply="rebase")


def test_rebase_onto_a_round_that_did_not_hold_the_push_keeps_it_in_flight():
    """A value from a round that closed before the push arrived (the merge record names no
    push of this learner since the base): θ ← Θ_new + (θ − base), keeping every step, the
    push stays in flight with θ_at_push moved along, and its own round's value later keeps
    exactly the steps since the push."""
    core, params = make(REBASE)
    params, _ = run(core, params, range(1, 3))  # push of fragment 1 at step 2: θ = B − 2G
    assert core.on_global(1, 1, V, None)  # no push of this learner merged yet
    params, _ = run(core, params, [3])  # θ = B − 3G, then moved: V − 3G
    np.testing.assert_array_equal(np_(params, FC), V[FC] - 3 * G[FC])
    f = core.inflight[1]
    assert f is not None and f.key == (0, 2) and core.base_version == [0, 1]
    np.testing.assert_array_equal(f.theta_at_push[FC], V[FC] - 2 * G[FC])
    assert core.steps[1] == 3  # the push still carries its 2 steps; nothing dropped
    # the push's own round (v2, merged (0, 2)): keep the one step since the push
    V2 = {FC: np.array([100.0, 200.0, 300.0], F32)}
    assert core.on_global(1, 2, V2, MergeRecord(0, 2, 2))
    params = core.apply_due(3, params)
    np.testing.assert_array_equal(np_(params, FC), V2[FC] - G[FC])
    assert core.inflight[1] is None and core.steps[1] == 1 and core.base_version == [0, 2]


def test_rebase_onto_a_round_that_held_an_older_superseded_push():
    """The value holds a push that the one in flight superseded (its record names the older
    push, merged after the base): keep only the progress since the push in flight and wait
    on for that push's own value."""
    core, params = make(REBASE)
    params, pushes = run(core, params, range(1, 11))  # fragment 1: pushes at 2 and 10
    assert [p.step for p in pushes[2] + pushes[10] if p.fragment == 1] == [2, 10]
    assert core.inflight[1].key == (0, 10)
    assert core.on_global(1, 1, V, MergeRecord(0, 2, 1))  # v1 merged the push of step 2 only
    params, _ = run(core, params, [11])  # θ = B − 11G → V + (θ − θ_at_push) = V − G
    np.testing.assert_array_equal(np_(params, FC), V[FC] - G[FC])
    assert core.inflight[1].key == (0, 10) and core.base_version[1] == 1
    np.testing.assert_array_equal(core.inflight[1].theta_at_push[FC], V[FC])
    V2 = {FC: np.array([100.0, 200.0, 300.0], F32)}
    assert core.on_global(1, 2, V2, MergeRecord(0, 10, 2))
    params = core.apply_due(11, params)
    np.testing.assert_array_equal(np_(params, FC), V2[FC] - G[FC])
    assert core.inflight[1] is None and core.steps[1] == 1


def test_rebase_drops_a_value_older_than_the_round_that_merged_the_push():
    """The merge record names a round newer than the value: that round's value is on its
    way (the syncer records before it publishes), and only it holds the push."""
    core, params = make(REBASE)
    params, _ = run(core, params, range(1, 3))
    assert not core.on_global(1, 1, V, MergeRecord(0, 2, 2))
    assert core.pending[1] is None
    assert core.on_global(1, 2, V, MergeRecord(0, 2, 2))
    # "overwrite" does not ask: it takes any newer value
    core, params = make()
    params, _ = run(core, params, range(1, 3))
    assert core.on_global(1, 1, V, MergeRecord(0, 2, 2))


def test_overwrite_keeps_no_theta_at_push():
    core, params = make()
    run(core, params, range(1, 3))
    assert core.inflight[1].theta_at_push is None


def test_mix_alpha():
    core, params = make(dataclasses.replace(CFG, mix_alpha=0.25))
    params, _ = run(core, params, range(1, 3))
    core.on_global(1, 1, V)
    params, _ = run(core, params, [3])
    # 0.25·θ_now + 0.75·V, θ_now = [1, 2, 3] − 3·[0.5, 0.25, −0.125] = [−0.5, 1.25, 3.375]
    #   = [−0.125 + 7.5, 0.3125 + 15, 0.84375 + 22.5] = [7.375, 15.3125, 23.34375]
    np.testing.assert_allclose(np_(params, FC), [7.375, 15.3125, 23.34375], rtol=1e-7)


def test_value_without_push_in_flight_rebases_and_keeps_local_progress():
    """A round this learner had no part in: θ ← θ + (Θ_new − base), counters kept, so the
    next push carries the same δ, anchored at the new version (fresh, not stale)."""
    core, params = make()
    params, _ = run(core, params, [1])  # no push yet; θ = BASE − G
    assert core.on_global(1, 1, V)
    assert core.apply_at(1) == 0  # nothing in flight: applied at the next step boundary
    # step 2: θ = BASE − 2G, then rebased: θ = V − 2G; fragment 1 is pushed from version 1
    params, pushes = run(core, params, [2])
    np.testing.assert_allclose(np_(params, FC), V[FC] - 2 * G[FC], rtol=1e-6, atol=1e-6)
    p = pushes[2][0]
    assert (p.fragment, p.base_version, p.steps) == (1, 1, 2)
    np.testing.assert_allclose(decoded(p)[FC], 2 * G[FC], rtol=1e-5, atol=1e-6)
    assert core.base_version == [0, 1]


def test_a_learner_without_progress_rebases_exactly_onto_the_value():
    """θ = base (no step since): the new value is taken bit for bit, as an overwrite would,
    so learners that end a run this way hold identical values. The values are chosen so that
    θ + (Θ_new − base) rounds away from Θ_new in fp32."""
    base = {"wte": BASE["wte"], FC: np.array([0.1, 1e-3, 3.3], F32)}
    core = LearnerCore("a", FRAGS, CFG, base, [0, 0])
    params = {k: jnp.asarray(v) for k, v in base.items()}
    value = {FC: np.array([1e8, 7.7, -2.9e-3], F32)}
    assert not np.array_equal(base[FC] + (value[FC] - base[FC]), value[FC])  # the old rule
    assert core.on_global(1, 1, value)
    params = core.apply_due(0, params)
    np.testing.assert_array_equal(np.asarray(params[FC]), value[FC])
    assert core.base_version[1] == 1 and core.steps[1] == 0


def test_value_far_ahead_also_rebases():
    core, params = make()
    params, _ = run(core, params, [1])
    assert core.on_global(1, CFG.max_staleness + 3, V)
    params, pushes = run(core, params, [2])
    assert core.base_version == [0, CFG.max_staleness + 3]
    assert pushes[2][0].base_version == CFG.max_staleness + 3


def test_blocked_only_in_strict_mode():
    core, params = make()
    params, _ = run(core, params, range(1, 4))
    assert core.inflight[1] is not None
    assert not any(core.blocked(t) for t in range(0, 10))

    core, params = make(dataclasses.replace(CFG, strict=True))
    assert not core.blocked(0)
    params, _ = run(core, params, range(1, 3))  # push at 2, due at 3
    assert not core.blocked(2)
    params, _ = run(core, params, [3])
    assert core.blocked(3)  # step 3 done, merged value of the step-2 push missing
    np.testing.assert_array_equal(np_(params, FC), BASE[FC] - 3 * G[FC])
    core.on_global(1, 1, V)
    assert not core.blocked(3)
    params = core.apply_due(3, params)
    np.testing.assert_array_equal(np_(params, FC), V[FC])
    assert not core.blocked(3)


def test_push_all():
    core, params = make()
    assert core.push_all(0, params) == []  # no progress anywhere
    params, _ = run(core, params, range(1, 4))  # fragment 1 in flight since step 2
    out = core.push_all(3, params)
    assert [p.fragment for p in out] == [0]
    p = out[0]
    assert (p.base_version, p.step, p.steps, p.tokens) == (0, 3, 3, 24)
    np.testing.assert_array_equal(decoded(p)["wte"], 3 * G["wte"])
    assert core.push_all(3, params) == []  # both in flight now


# -- end to end: two learners, one syncer per fragment, fp32 codecs ------------------------------

E2E_SYNC = dataclasses.replace(CFG, codec_down="fp32", down_delta=False, quorum=2, merge="rda")
GA = {"wte": np.array([0.25, 0.0], F32), FC: np.array([1.5, 2.0, 0.0], F32)}
GB = {"wte": np.array([0.0, 0.5], F32), FC: np.array([0.0, 0.0, 2.5], F32)}
TOK = {"a": 8, "b": 16}


def test_end_to_end_two_learners():
    syncers = [FragmentSyncer(p, {n: BASE[n] for n in f}, OuterConfig(momentum=0.9), E2E_SYNC,
                                  is_embedding=is_embedding)
               for p, f in enumerate(FRAGS)]
    start = {n: v for s in syncers for n, v in s.sent_values.items()}
    cores = {m: LearnerCore(m, FRAGS, E2E_SYNC, start, [0, 0]) for m in "ab"}
    params = {m: {k: jnp.asarray(v) for k, v in start.items()} for m in "ab"}
    grads = {"a": GA, "b": GB}
    live = frozenset("ab")
    clock = [0.0]

    def step(t):
        out = {}
        for m in "ab":
            params[m] = inner(params[m], grads[m])
            params[m], pushes = after_step(cores[m], t, TOK[m], params[m])
            out[m] = pushes
        return out

    def deliver(m, push):
        clock[0] += 0.1
        c = Contribution.of(push, decoded(push), entry_id=f"{m}{push.step}")
        return syncers[push.fragment].offer(c, clock[0])

    def close_and_publish(p):
        d = syncers[p].decide(clock[0], live, 1.0)
        assert d.close and "all 2 live learners contributed" in d.reason
        r = syncers[p].close(clock[0], d.reason)
        value = {k: quant.dequantize(q) for k, q in r.sent.items()}
        for m in "ab":
            assert cores[m].on_global(p, r.version, value)
        return r

    # -- round 1 of fragment 1 (steps 1, 2; pushes at step 2)
    # δ_a = 2·[1.5, 2, 0] = [3, 4, 0] (‖·‖ 5), tokens 16 over 2 steps -> w_a = 16²/2 = 128
    # δ_b = 2·[0, 0, 2.5] = [0, 0, 5] (‖·‖ 5), tokens 32 over 2 steps -> w_b = 32²/2 = 512
    # RDA: radius (128·5 + 512·5)/640 = 5; mean direction (1·[.6, .8, 0] + 4·[0, 0, 1])/5
    #   = [0.12, 0.16, 0.8], ‖·‖ = √0.68 -> Δ1 = 5·[0.12, 0.16, 0.8]/√0.68
    #   = [0.6, 0.8, 4]/√0.68 = [0.727607, 0.970143, 4.850713]
    # Nesterov first step: Θ(1) = Θ(0) − 0.7·1.9·Δ1 = [1, 2, 3] − 1.33·Δ1
    #   = [0.032283, 0.709710, −3.451448]
    step(1)
    pushes = step(2)
    for m in "ab":
        assert [p.fragment for p in pushes[m]] == [1]
    assert deliver("a", pushes["a"][0]) == (True, "accepted")
    assert not syncers[1].decide(clock[0], live, 1.0).close  # 1/2: waiting for quorum
    assert deliver("b", pushes["b"][0]) == (True, "accepted")
    r1 = close_and_publish(1)
    delta1 = np.array([0.6, 0.8, 4.0]) / math.sqrt(0.68)
    theta1_fc = BASE[FC] - 1.33 * delta1
    np.testing.assert_allclose(delta1, [0.727607, 0.970143, 4.850713], rtol=1e-6)
    np.testing.assert_allclose(r1.theta[FC], theta1_fc, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r1.theta[FC], [0.032283, 0.709710, -3.451448], atol=1e-5)
    assert [(e[1], e[2]) for e in r1.included] == [("a", 128.0), ("b", 512.0)]
    assert r1.version == 1 and r1.tokens == 48 and r1.steps == 4

    # step 3 = push + τ: both learners take Θ(1) (overwrite)
    step(3)
    for m in "ab":
        np.testing.assert_array_equal(np_(params[m], FC), r1.theta[FC])
        assert cores[m].base_version == [0, 1]

    # -- round 1 of fragment 0 (embeddings, weighted mean; pushes at step 4)
    # δ_a = 4·[0.25, 0] = [1, 0], tokens 32 over 4 -> w = 256;  δ_b = 4·[0, 0.5] = [0, 2],
    # tokens 64 over 4 -> w = 1024;  mean = (1·[1, 0] + 4·[0, 2])/5 = [0.2, 1.6]
    # Θ_wte(1) = [1, 2] − 1.33·[0.2, 1.6] = [0.734, −0.128]
    pushes = step(4)
    for m in "ab":
        assert [p.fragment for p in pushes[m]] == [0]
        deliver(m, pushes[m][0])
    r0 = close_and_publish(0)
    np.testing.assert_allclose(r0.theta["wte"], [0.734, -0.128], rtol=1e-5, atol=1e-6)
    step(5)
    for m in "ab":
        np.testing.assert_allclose(np_(params[m], "wte"), [0.734, -0.128], rtol=1e-5,
                                   atol=1e-6)

    # -- round 2 of fragment 1 (steps 4, 5, 6 since Θ(1); pushes at step 6, base version 1)
    # δ_a = 3·[1.5, 2, 0] = [4.5, 6, 0] (‖·‖ 7.5), tokens 24 over 3 -> w = 192
    # δ_b = 3·[0, 0, 2.5] = [0, 0, 7.5] (‖·‖ 7.5), tokens 48 over 3 -> w = 768  (1 : 4 again)
    # RDA: radius 7.5, same direction -> Δ2 = 1.5·Δ1
    # Nesterov: m1 = Δ1, m2 = Δ2 + 0.9·m1 = 2.4·Δ1, update = Δ2 + 0.9·m2 = 3.66·Δ1
    #   Θ(2) = Θ(1) − 0.7·3.66·Δ1 = Θ(0) − (1.33 + 2.562)·Δ1 = [1, 2, 3] − 3.892·Δ1
    pushes = step(6)
    for m in "ab":
        p = pushes[m][0]
        assert (p.fragment, p.base_version, p.steps) == (1, 1, 3)
        deliver(m, p)
    r2 = close_and_publish(1)
    assert r2.version == 2
    assert [(e[1], e[2], e[3]) for e in r2.included] == [("a", 192.0, 0), ("b", 768.0, 0)]
    np.testing.assert_allclose(r2.theta[FC], BASE[FC] - 3.892 * delta1, rtol=1e-5, atol=1e-5)
    step(7)
    for m in "ab":
        np.testing.assert_allclose(np_(params[m], FC), r2.theta[FC], rtol=0, atol=0)
        assert cores[m].base_version == [1, 2]
        assert cores[m].applied == 3


def test_end_to_end_stale_learner_is_anchored():
    # Learner b misses round 1 of fragment 1 and pushes from base version 0 into round 2.
    sync = dataclasses.replace(E2E_SYNC, quorum=1)
    lr1 = OuterConfig(lr=1.0, momentum=0.0, nesterov=False)  # Θ(v+1) = Θ(v) − Δ
    s = FragmentSyncer(1, {FC: BASE[FC]}, lr1, sync, is_embedding=is_embedding)
    start = {"wte": BASE["wte"], FC: s.sent_values[FC]}
    cores = {m: LearnerCore(m, FRAGS, sync, start, [0, 0]) for m in "ab"}
    pa = {k: jnp.asarray(v) for k, v in start.items()}
    pb = dict(pa)
    pa = inner(pa, GA)
    pa, _ = cores["a"].after_step(1, 8, pa)
    pa = inner(pa, GA)
    pa, push_a = cores["a"].after_step(2, 8, pa)
    ca = push_a[0]
    s.offer(Contribution("a", 1, ca.base_version, 2, ca.steps, ca.tokens, delta=decoded(ca)), 1.0)
    r1 = s.close(1.1, "quorum 1")
    # Θ(1) = Θ(0) − δ_a = θ_a = [1, 2, 3] − [3, 4, 0] = [−2, −2, 3]
    np.testing.assert_allclose(r1.theta[FC], [-2, -2, 3], rtol=1e-6)
    pb = inner(pb, GB)
    pb, _ = cores["b"].after_step(1, 16, pb)
    pb = inner(pb, GB)
    pb, push_b = cores["b"].after_step(2, 16, pb)
    cb = push_b[0]
    assert cb.base_version == 0
    assert s.offer(Contribution("b", 1, cb.base_version, 2, cb.steps, cb.tokens,
                                delta=decoded(cb)), 2.0) == (True, "accepted")
    r2 = s.close(2.1, "quorum 1")
    # Δ = Θ(1) − Θ(0) + δ_b = [−3, −4, 0] + [0, 0, 5] = [−3, −4, 5];  Θ(2) = Θ(1) − Δ = θ_b
    #   = [1, 2, 3] − [0, 0, 5] = [1, 2, −2]
    np.testing.assert_allclose(r2.theta[FC], [1, 2, -2], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(r2.theta[FC], np_(pb, FC), rtol=1e-6, atol=1e-6)
    assert r2.included[0][3] == 1


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
def test_push_quantised_with_codec_up(codec):
    core, params = make(dataclasses.replace(CFG, codec_up=codec))
    _, pushes = run(core, params, range(1, 3))
    q = pushes[2][0].payload[FC]
    assert q.codec == codec
    err = np.abs(quant.dequantize(q) - 2 * G[FC])
    assert np.all(err <= quant.error_bound(2 * G[FC], codec, CFG.quant_block))


@pytest.mark.parametrize("apply", ["overwrite", "rebase"])
def test_checkpointed_core_continues_exactly_like_the_original(apply):
    """state_dict → load_state mid-run (a push in flight, a merged value pending): the
    restored core makes the same pushes and applies the same values as the original."""
    cfg = dataclasses.replace(CFG, apply=apply)
    core, params = make(cfg)
    params, _ = run(core, params, range(1, 3))      # step 2 pushed fragment 1
    assert core.inflight[1] is not None
    assert core.on_global(1, 1, V)                  # its merged value arrived, not applied yet
    meta, arrays = core.state_dict()
    twin = LearnerCore("a", FRAGS, cfg, {k: np.zeros_like(v) for k, v in BASE.items()}, [0, 0])
    twin.load_state(meta, {k: v.copy() for k, v in arrays.items()})
    a_params, a_out = run(core, dict(params), range(3, 9))
    b_params, b_out = run(twin, dict(params), range(3, 9))
    assert sorted(a_out) == sorted(b_out) and a_out
    for t in a_out:
        for pa, pb in zip(a_out[t], b_out[t], strict=True):
            assert (pa.fragment, pa.base_version, pa.steps, pa.tokens) == (
                pb.fragment, pb.base_version, pb.steps, pb.tokens)
            for k in pa.payload:
                np.testing.assert_array_equal(quant.dequantize(pa.payload[k]),
                                              quant.dequantize(pb.payload[k]))
    for k in a_params:
        np.testing.assert_array_equal(np.asarray(a_params[k]), np.asarray(b_params[k]))
    assert core.base_version == twin.base_version and core.applied == twin.applied


def test_forgotten_push_goes_out_again_with_its_progress():
    core, params = make()
    params, _ = run(core, params, range(1, 3))      # step 2 pushed fragment 1 (2 steps)
    core.forget_push(1)                             # Redis never acknowledged it
    _, out = run(core, params, range(3, 7))         # step 6: fragment 1 is due again
    [push] = out[6]
    assert push.fragment == 1 and push.steps == 6 and push.base_version == 0
    np.testing.assert_allclose(decoded(push)[FC], 6 * G[FC])


def test_load_state_refuses_a_checkpoint_of_other_fragments():
    core, _ = make()
    meta, arrays = core.state_dict()
    with pytest.raises(ValueError, match="fragments"):
        LearnerCore("a", [["wte", FC]], CFG, BASE, [0]).load_state(meta, arrays)
    del arrays[f"base1/{FC}"]
    with pytest.raises(ValueError, match="lacks"):
        make()[0].load_state(meta, arrays)


def test_a_superseding_push_over_a_merged_one_carries_only_the_unmerged_progress():
    core, params = make()
    asked = []

    def lookup(p, key):  # the syncer merged the step-2 push of fragment 1 into version 3
        asked.append((p, *key))
        return (3, V) if (p, key[1]) == (1, 2) else None

    answering(core, lookup)
    params, pushes = run(core, params, range(1, 11))  # step 10 supersedes the step-2 push
    assert (1, 0, 2) in asked and core.rebased_merged == 1
    [push] = pushes[10]
    # rebased onto v3 keeping the 8 steps since the push: θ = V + (θ − (base − δ₂)) = V − 8·G
    np.testing.assert_array_equal(np_(params, FC), V[FC] - 8 * G[FC])
    assert core.base_version[1] == 3 and push.base_version == 3
    assert (push.step, push.steps, push.tokens) == (10, 8, 8 * TOKENS)
    np.testing.assert_array_equal(decoded(push)[FC], 8 * G[FC])  # only the unmerged progress
    # fragment 0's step-4 push was not merged: it goes out again whole at step 12
    params, pushes = run(core, params, range(11, 13))
    [p12] = pushes[12]
    assert (p12.fragment, p12.base_version, p12.steps) == (0, 0, 12)


def test_the_pushed_delta_survives_a_checkpoint():
    core, params = make()
    params, _ = run(core, params, range(1, 3))
    meta, arrays = core.state_dict()
    back = LearnerCore("a", FRAGS, CFG, BASE, [0, 0])
    back.load_state(meta, arrays)
    np.testing.assert_array_equal(back.inflight[1].pushed_values()[FC], 2 * G[FC])
    del arrays[f"pushed1/{FC}"]  # an older checkpoint: no rebase, the push goes out whole
    back.load_state(meta, arrays)
    assert back.inflight[1].pushed is None


V2 = {FC: V[FC] + 1}  # a later merged value of fragment 1


@pytest.mark.parametrize("case", ["value comes, overwrite", "value comes, rebase",
                                  "merged, value never comes", "not merged"])
def test_a_push_sent_after_the_checkpoint_is_not_carried_again_by_the_restored_learner(case):
    """The learner checkpoints at step 4 (fragment 1's step-2 push already answered and
    applied: nothing of it in flight), pushes fragment 1 at step 6 — three steps since the
    apply, step 4 among them — and dies. Restored at step 4 with that push taken up from the
    push log (`resume_pushed`), the checkpoint's progress goes out again only if that push
    was not merged. Without it, the restored learner would rebase its step-4 progress onto
    the version that merged it and push it a second time."""
    cfg = dataclasses.replace(CFG, apply="rebase" if case == "value comes, rebase" else
                              "overwrite")
    core, params = make(cfg)
    params, _ = run(core, params, range(1, 3))       # step 2: fragment 1 pushed
    assert core.on_global(1, 1, V)
    params, _ = run(core, params, range(3, 5))       # applied at step 3; step 4: checkpoint
    since = 2 if cfg.apply == "rebase" else 1        # steps 3–4 kept, or step 4 after the apply
    assert core.inflight[1] is None and core.steps[1] == since
    meta, arrays = core.state_dict()
    at_ckpt = dict(params)
    _, out = run(core, dict(params), range(5, 7))
    [x1] = out[6]                                    # the push the checkpoint does not know
    assert (x1.fragment, x1.base_version, x1.steps) == (1, 1, since + 2)

    back = LearnerCore("a", FRAGS, cfg, BASE, [0, 0])
    back.load_state(meta, arrays)
    back.resume_pushed(1, x1.base_version, x1.step, 4, at_ckpt)
    assert back.inflight[1].key == (1, 6) and back.inflight[1].step == 4
    meta2, arrays2 = back.state_dict()               # and it survives the next checkpoint
    back = LearnerCore("a", FRAGS, cfg, BASE, [0, 0])
    back.load_state(meta2, arrays2)
    assert back.inflight[1].key == (1, 6)
    asked = []

    def lookup(p, key):
        asked.append((p, *key))
        return (2, V2) if case == "merged, value never comes" else None

    answering(back, lookup)
    params = at_ckpt
    if case.startswith("value comes"):
        assert back.on_global(1, 2, V2)              # applied at step 5 = 4 + τ
        params, out = run(back, params, range(5, 7))
        [push] = out[6]
        kept = 2 if case == "value comes, rebase" else 1  # rebase keeps step 5's progress
        assert (push.base_version, push.steps, push.tokens) == (2, kept, kept * TOKENS)
        np.testing.assert_array_equal(decoded(push)[FC], kept * G[FC])
        np.testing.assert_array_equal(np_(params, FC), V2[FC] - kept * G[FC])
        return
    params, out = run(back, params, range(5, 11))    # step 10 supersedes it (10 − 4 > H)
    assert 6 not in out and (1, 1, 6) in asked
    [push] = out[10]
    if case == "not merged":                         # all of it goes out: step 4 and 5…10
        assert (push.base_version, push.steps) == (1, 7)
        np.testing.assert_array_equal(decoded(push)[FC], 7 * G[FC])
    else:                                            # rebased past it: 5…10 only
        assert back.rebased_merged == 1
        assert (push.base_version, push.steps, push.tokens) == (2, 6, 6 * TOKENS)
        np.testing.assert_array_equal(decoded(push)[FC], 6 * G[FC])
        np.testing.assert_array_equal(np_(params, FC), V2[FC] - 6 * G[FC])


@pytest.mark.parametrize("merged", [True, False])
def test_a_push_taken_up_at_a_restore_and_error_feedback(merged):
    """Up-link error feedback over a push taken up at a restore: merged, the residual the
    checkpoint held went into a round with the real push and is not carried again; not
    merged, it goes back and out with the next push."""
    core, params = make(EF)
    params, _ = run(core, params, range(1, 5))       # step 2: fragment 1 pushed (int4)
    held = core.residual[1]                          # its quantisation error
    assert held is not None and np.abs(held[FC]).max() > 0
    core.resume_pushed(1, 0, 6, 4, params)           # the log: pushed again at step 6
    assert core.residual[1] is None and core.inflight[1].carried is held
    answering(core, lambda p, key: (2, V2) if merged else None)
    _, out = run(core, params, range(5, 11))         # step 10 supersedes it
    [push] = out[10]
    if merged:
        assert core.rebased_merged == 1 and push.steps == 6
        np.testing.assert_allclose(decoded(push)[FC] + core.residual[1][FC], 6 * G[FC],
                                   atol=1e-6)
    else:
        assert push.steps == 10
        np.testing.assert_allclose(decoded(push)[FC] + core.residual[1][FC],
                                   10 * G[FC] + held[FC], atol=1e-6)


def test_the_core_asks_and_the_push_waits_for_an_answer_given_later():
    """A distributed learner's driver answers on another thread: the due push waits (the
    training thread reads nothing), the question goes out once, and the push leaves at the
    first step after the answer. An answer about another push is not taken for it, and a
    question is asked once."""
    core, params = make()
    core.questions.on = True
    params, pushes = run(core, params, range(1, 11))  # step 10: fragment 1 due, asks
    assert 10 not in pushes and core.questions.take() == {1: (0, 2)}
    assert core.questions.waiting == {1} and core.inflight[1].step == 2
    params, pushes = run(core, params, range(11, 12))  # no answer yet: still waiting
    assert not pushes and core.questions.take() == {} and core.questions.waiting == {1}
    core.questions.answer(1, (0, 99), (3, V))  # about a push not in flight: not taken
    params, pushes = run(core, params, range(12, 13))
    # (fragment 0's turn: its step-4 push is late too, and is asked about)
    assert not pushes and core.questions.take() == {0: (0, 4)} and core.questions.waiting == {0, 1}
    core.questions.answer(1, (0, 2), (3, V))
    params, pushes = run(core, params, range(13, 14))
    [push] = pushes[13]
    assert core.rebased_merged == 1 and core.questions.waiting == {0}
    # the answer it applied, for the driver's own record of the fragment (taken once)
    [(p, version, value)] = core.questions.take_used()
    assert (p, version) == (1, 3) and core.questions.take_used() == []
    np.testing.assert_array_equal(value[FC], V[FC])
    # fragment 0's value comes while it waits: its turn needs no answer, a late one is dropped
    assert core.on_global(0, 2, {"wte": np.array([5.0, 6.0], F32)})
    params, pushes = run(core, params, range(14, 15))
    assert core.questions.waiting == set() and not core.questions.answers
    core.questions.answer(0, (0, 4), (5, BASE))
    assert not core.questions.answers
    assert (push.base_version, push.step, push.steps) == (3, 13, 11)
    np.testing.assert_array_equal(decoded(push)[FC], 11 * G[FC])  # only the unmerged part


def test_a_lookup_that_cannot_tell_defers_the_superseding_push():
    """Redis unreachable (a partition): the learner neither waits nor pushes the merged
    progress again; the fragment's push waits for its next turn, when the lookup answers."""
    core, params = make()
    answers = iter([DEFER, (3, V)])
    answering(core, lambda p, key: next(answers) if p == 1 else None)
    params, pushes = run(core, params, range(1, 11))  # step 10: fragment 1 due, lookup defers
    assert 10 not in pushes and core.inflight[1].step == 2 and core.rebased_merged == 0
    params, pushes = run(core, params, range(11, 15))  # step 14: its next turn
    [push] = pushes[14]
    assert core.rebased_merged == 1 and push.base_version == 3
    assert (push.step, push.steps) == (14, 12)  # the 12 steps since the merged step-2 push
    np.testing.assert_array_equal(decoded(push)[FC], 12 * G[FC])


# -- up-link error feedback (sync.up_feedback) -----------------------------------------------------

EF = dataclasses.replace(CFG, codec_up="int4", up_feedback=True)


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_error_feedback_keeps_what_the_rounds_saw_within_one_quantisation_step(codec):
    """A learner alone, every push merged at once (Θ ← Θ − decoded δ, rebase apply keeping the
    progress since the push): with error feedback, Θ lags the learner's pushed progress by
    exactly the residual it holds (one push's quantisation error); without, the errors of
    50 pushes add up."""
    shapes = {"w": (512,)}
    frags = [["w"]]
    rng = np.random.default_rng(0)
    steps = [{"w": (0.01 * rng.standard_normal(512)).astype(F32)} for _ in range(200)]
    errs = {}
    for feedback in (False, True):
        cfg = dataclasses.replace(SyncConfig(), fragments=1, sync_every=4, overlap_steps=0,
                                  apply="rebase", codec_up=codec, up_feedback=feedback)
        start = {"w": np.zeros(shapes["w"], F32)}
        core = LearnerCore("a", frags, cfg, start, [0])
        params, glob, version, progress = {"w": jnp.zeros(512)}, start["w"], 0, np.zeros(512)
        pushed_progress = np.zeros(512)
        for t, g in enumerate(steps, 1):
            params = {"w": params["w"] - g["w"]}
            progress = progress + g["w"]
            params, pushes = after_step(core, t, TOKENS, params)
            for push in pushes:
                version += 1
                glob = glob - quant.dequantize(push.payload["w"])
                pushed_progress = progress.copy()
                assert core.on_global(0, version, {"w": glob})
        assert version == 50
        lag = -glob - pushed_progress  # what the rounds have not seen of the pushed progress
        errs[feedback] = np.linalg.norm(lag)
        if feedback:
            np.testing.assert_allclose(lag, -core.residual[0]["w"], atol=1e-5)
            x = pushed_progress  # the residual is within one step of the last push's value
            assert np.all(np.abs(core.residual[0]["w"]) <= quant.error_bound(
                x.astype(F32), codec, cfg.quant_block) + 1e-6)
    assert errs[True] < errs[False] / 3, errs


@pytest.mark.parametrize("merged", [True, False])
def test_error_feedback_over_a_superseded_push_merged_or_not(merged):
    """The step-2 push is superseded at step 10: merged (the learner rebases onto its version)
    or not (the new push holds the old δ whole). Either way the pushes the rounds take plus
    the residual held add up to exactly the learner's progress: no error is lost or counted
    twice."""
    core, params = make(EF)
    first = {}

    def lookup(p, key):
        f = core.inflight[p]
        first["q"] = quant.dequantize(f.pushed[FC]) if isinstance(f.pushed[FC], quant.QTensor) \
            else f.pushed[FC]
        return (3, {FC: BASE[FC] - first["q"]}) if merged else None

    answering(core, lookup)
    params, pushes = run(core, params, range(1, 11))
    [p2] = pushes[2]
    q2 = decoded(p2)[FC]
    assert not np.array_equal(q2, 2 * G[FC])  # int4 loses something on these values
    [p10] = pushes[10]
    q10 = decoded(p10)[FC]
    taken = (q2 if merged else 0) + q10
    np.testing.assert_allclose(taken + core.residual[1][FC], 10 * G[FC], atol=1e-6)


def test_error_feedback_survives_a_checkpoint_and_forgotten_pushes_give_the_residual_back():
    core, params = make(EF)
    params, _ = run(core, params, range(1, 3))         # step 2 pushed fragment 1
    params, _ = run(core, params, range(3, 11))        # step 10 pushed it again (not merged)
    res, carried = core.residual[1][FC].copy(), core.inflight[1].carried[FC].copy()
    meta, arrays = core.state_dict()
    back = LearnerCore("a", FRAGS, EF, BASE, [0, 0])
    back.load_state(meta, arrays)
    np.testing.assert_array_equal(back.residual[1][FC], res)
    np.testing.assert_array_equal(back.inflight[1].carried[FC], carried)
    back.forget_push(1)  # never acknowledged: what it carried in is still unseen
    np.testing.assert_array_equal(back.residual[1][FC], carried)
    bad = dict(arrays, **{f"residual1/{FC}": np.zeros(7, F32)})
    with pytest.raises(ValueError, match="shape"):
        back.load_state(meta, bad)
    np.testing.assert_array_equal(back.residual[1][FC], carried)  # nothing replaced
    for bad_meta in (dict(meta, steps=None), dict(meta, steps=[float("inf"), 0]),
                     dict(meta, base_version=7)):
        with pytest.raises(ValueError, match="malformed"):
            back.load_state(bad_meta, arrays)
    longer = dict(meta, inflight=[*meta["inflight"], meta["inflight"][1]])
    with pytest.raises(ValueError, match="fragments"):
        back.load_state(longer, arrays)
    np.testing.assert_array_equal(back.residual[1][FC], carried)  # still nothing replaced


def _timed(core, params, steps, dt=0.5):
    """Inner steps of `dt` learner-seconds each; {step: [pushes]} as `run`."""
    out = {}
    for t in steps:
        params, pushes = after_step(core, t, TOKENS, inner(params), seconds=dt)
        if pushes:
            out[t] = pushes
    return params, out


@pytest.mark.parametrize("apply", ["overwrite", "rebase"])
def test_a_push_carries_the_seconds_of_exactly_the_progress_it_carries(apply):
    """Seconds are counted like steps and tokens: the step-6 push of fragment 1 carries the
    4 steps since its step-2 push was applied at step 3 under "rebase" (which keeps step 3's
    progress), the 3 steps after it under "overwrite" (which drops it) — never the step-2
    push's seconds again (goodput would count them twice)."""
    core, params = make(dataclasses.replace(CFG, apply=apply))
    params, pushes = _timed(core, params, range(1, 3))
    assert core.seconds[1] == pytest.approx(1.0) and pushes[2][0].steps == 2
    core.on_global(1, 1, V)
    params, pushes = _timed(core, params, range(3, 7))
    [p6] = pushes[6]
    kept = 4 if apply == "rebase" else 3
    assert p6.fragment == 1 and p6.steps == kept and p6.seconds == pytest.approx(0.5 * kept)
    assert core.inflight[1].seconds_at_push == pytest.approx(0.5 * kept)
    assert core.seconds[1] == pytest.approx(0.5 * kept)


def test_a_superseding_push_over_a_merged_one_carries_only_the_unmerged_seconds():
    core, params = make()
    answering(core, lambda p, key: (3, V) if (p, key[1]) == (1, 2) else None)
    params, pushes = _timed(core, params, range(1, 11))
    [push] = pushes[10]
    assert push.steps == 8 and core.seconds[1] == pytest.approx(4.0)
    # fragment 0's step-4 push was not merged: its 12 steps' seconds go out again whole
    params, pushes = _timed(core, params, range(11, 13))
    assert pushes[12][0].steps == 12 and core.seconds[0] == pytest.approx(6.0)


def test_seconds_survive_a_checkpoint_also_one_written_before_the_core_kept_them():
    core, params = make(dataclasses.replace(CFG, apply="rebase"))
    params, _ = _timed(core, params, range(1, 4))
    meta, arrays = core.state_dict()
    back = make(dataclasses.replace(CFG, apply="rebase"))[0]
    back.load_state(meta, arrays)
    assert back.seconds == core.seconds == [1.5, 1.5]
    assert back.inflight[1].seconds_at_push == 1.0
    # the island wrote these keys before: "secs" per fragment, "secs_at_push" by fragment
    old = {**meta, "inflight": [None if f is None else
                                {k: v for k, v in f.items() if k != "secs_at_push"}
                                for f in meta["inflight"]], "secs_at_push": {"1": 0.75}}
    back.load_state(old, arrays)
    assert back.inflight[1].seconds_at_push == 0.75
    del old["secs"], old["secs_at_push"]  # older still: no seconds at all
    back.load_state(old, arrays)
    assert back.seconds == [0.0, 0.0] and back.inflight[1].seconds_at_push == 0.0
    for bad in ([1.0, float("nan")], [1.0, -2.0], [1.0]):
        with pytest.raises(ValueError, match="seconds"):
            back.load_state({**meta, "secs": bad}, arrays)


def test_seconds_stay_with_progress_that_stays_and_go_with_progress_that_goes():
    """A push forgotten (never in Redis) leaves its seconds to the next push; a value merged
    while nothing is in flight keeps them (the progress is kept); adopting the final base
    drops them with the progress."""
    core, params = make()
    params, pushes = _timed(core, params, range(1, 3))
    core.forget_push(1)
    assert core.seconds[1] == pytest.approx(1.0)
    core.on_global(1, 1, V)  # nothing in flight now: rebased onto it, progress kept
    params, _ = _timed(core, params, [3])
    assert core.base_version[1] == 1 and core.seconds[1] == pytest.approx(1.5)
    params, pushes = _timed(core, params, range(4, 7))
    assert pushes[6][0].seconds == pytest.approx(3.0) and pushes[6][0].steps == 6
    core.adopt_base(1, params)
    assert core.seconds[1] == 0.0 and core.steps[1] == 0


# -- the syncer's side of superseding pushes: a push repeating a merged one counts only what it
# adds; an earlier push that comes after a later merged one is refused

def _fc_syncer() -> FragmentSyncer:
    return FragmentSyncer(1, {FC: BASE[FC]}, OuterConfig(), dataclasses.replace(CFG, quorum=1),
                          is_embedding=is_embedding)


def _fc_push(learner, step, steps, *, base=0, epoch=1, seconds=None, scale=1.0, chain=None):
    return Contribution(learner, 1, base, step, steps, steps * TOKENS,
                        delta={FC: (-G[FC] * steps * scale).astype(F32)},
                        entry_id=f"{learner}-{epoch}-{step}",
                        seconds=0.5 * steps if seconds is None else seconds, epoch=epoch,
                        chain=chain)


def _merge(s: FragmentSyncer, *cs: Contribution):
    for c in cs:
        ok, why = s.offer(c, 0.0)
        assert ok, why
    return s.close(0.0, "test")


def test_a_push_repeating_a_merged_push_counts_and_weighs_only_what_it_adds():
    s = _fc_syncer()
    _merge(s, _fc_push("a", 4, 4, chain=4))  # merged into v1
    # "a" superseded its step-4 push: the step-8 push (of its chain) holds its 4 steps too
    r = _merge(s, _fc_push("a", 8, 8, chain=4), _fc_push("b", 8, 8, epoch=3, chain=8))
    (_, _, w_a, _), (_, _, w_b, _) = r.included
    assert (r.steps, r.tokens) == (4 + 8, (4 + 8) * TOKENS)
    assert r.seconds == [pytest.approx(2.0), pytest.approx(4.0)]
    assert w_a == pytest.approx(w_b / 2)  # 4 new steps' tokens against b's 8
    # a chain goes on over a newer base (the learner took a value that did not hold its push)
    r = _merge(s, _fc_push("a", 12, 12, base=1, chain=4))
    assert (r.steps, r.seconds) == (4, [pytest.approx(2.0)])
    # a push of a chain of its own repeats nothing, on any base
    r = _merge(s, _fc_push("a", 16, 4, base=1, chain=16))
    assert (r.steps, r.seconds) == (4, [pytest.approx(2.0)])


def test_entries_without_chains_repeat_their_learners_pushes_on_the_same_base():
    """An entry of a version before chains: its learner's pushes on one base are its chain."""
    s = _fc_syncer()
    _merge(s, _fc_push("a", 4, 4))
    r = _merge(s, _fc_push("a", 8, 8))
    assert r.steps == 4
    r = _merge(s, _fc_push("a", 12, 4, base=2))  # a newer base: repeats nothing
    assert r.steps == 4
    ok, why = s.offer(_fc_push("a", 10, 2, base=2), 0.0)
    assert not ok and why.kind is Drop.SUPERSEDED


def test_an_earlier_push_after_a_later_merged_one_is_refused_as_superseded():
    s = _fc_syncer()
    _merge(s, _fc_push("a", 8, 8, chain=4))
    ok, why = s.offer(_fc_push("a", 4, 4, chain=4), 0.0)
    assert not ok and why.kind is Drop.SUPERSEDED and "step 8" in why
    assert Reason.of(str(why)).kind is Drop.SUPERSEDED  # as round records read it back


def test_another_process_or_a_learner_without_epochs_repeats_nothing():
    s = _fc_syncer()
    _merge(s, _fc_push("a", 4, 4, epoch=1), _fc_push("b", 4, 4, epoch=0))
    # "a" restarted (epoch 2) from a checkpoint on the same base: its steps are its own
    r = _merge(s, _fc_push("a", 6, 6, epoch=2), _fc_push("b", 6, 6, epoch=0))
    assert r.steps == 12 and r.seconds == [pytest.approx(3.0)] * 2


def test_a_push_adding_nothing_to_its_merged_push_is_refused_as_empty():
    s = _fc_syncer()
    _merge(s, _fc_push("a", 4, 4, chain=4))
    ok, why = s.offer(_fc_push("a", 6, 4, chain=4), 0.0)  # claims no steps beyond the merged 4
    assert not ok and why.kind is Drop.EMPTY and "merged push" in why


def test_the_last_merged_pushes_survive_the_syncer_state():
    s = _fc_syncer()
    _merge(s, _fc_push("a", 4, 4))
    doc = unpack_state(pack_state(s.state_dict()))
    back = FragmentSyncer.from_state_dict(doc, OuterConfig(), s.sync_cfg, is_embedding)
    assert _all_fields(back.last_merged) == _all_fields(s.last_merged)
    assert s.last_merged["a"] == PushHeader("a", 1, 0, 4, 4, 4 * TOKENS)  # its header
    r = _merge(back, _fc_push("a", 8, 8))
    assert (r.steps, r.seconds) == (4, [pytest.approx(2.0)])
    # a state written before the syncer kept them reads as none kept
    old = s.state_dict()
    del old["merged_pushes"]
    assert FragmentSyncer.from_state_dict(unpack_state(pack_state(old)), OuterConfig(),
                                          s.sync_cfg, is_embedding).last_merged == {}
    # one written before chains: rows without the chain, read as of no chain
    old["merged_last"] = [["a", 1, 0, 4, 4, 32, 2.0]]
    back = FragmentSyncer.from_state_dict(unpack_state(pack_state(old)), OuterConfig(),
                                          s.sync_cfg, is_embedding)
    assert _all_fields(back.last_merged) == {"a": ("a", 1, 0, 4, 4, 32, 2.0, None, False, 1)}


def _all_fields(merged: dict[str, PushHeader]) -> dict[str, tuple]:
    """Each header with the bookkeeping its equality leaves out."""
    return {k: dataclasses.astuple(v) for k, v in merged.items()}


def test_the_merged_pushes_kept_are_bounded_and_chains_survive_the_state(monkeypatch):
    import pipeline.syncer as syncer_mod
    monkeypatch.setattr(syncer_mod, "MAX_MERGED_KEPT", 2)
    s = _fc_syncer()
    _merge(s, _fc_push("a", 4, 4, chain=2), _fc_push("b", 4, 4), _fc_push("c", 4, 4))
    assert len(s.last_merged) == 2
    _merge(s, _fc_push("c", 8, 4, base=1))
    _merge(s, _fc_push("d", 8, 4, base=2))  # the least recently merged goes first
    assert list(s.last_merged) == ["c", "d"]
    _merge(s, _fc_push("c", 12, 4, base=3, chain=10))
    back = FragmentSyncer.from_state_dict(unpack_state(pack_state(s.state_dict())),
                                          OuterConfig(), s.sync_cfg, is_embedding)
    assert _all_fields(back.last_merged) == _all_fields(s.last_merged)
    assert list(back.last_merged) == ["d", "c"]
    assert back.last_merged["c"].chain == 10


@pytest.mark.parametrize("held", ["none", "older"])
def test_a_superseding_push_on_a_newer_base_counts_only_what_it_adds(held):
    """Under "rebase" a value that does not hold the push in flight moves the learner's base
    and leaves the push in flight: a push superseding it then goes out on the newer base
    carrying the older push's progress too. If a round merges the older push meanwhile, the
    syncer counts only what the newer one adds (its steps, tokens, seconds and weight), as it
    does for one on the same base: progress is counted once."""
    core, params = make(REBASE)
    s = _fc_syncer()
    answering(core, lambda p, key: None)  # the syncer has not merged the push yet
    params, pushes = run(core, params, range(1, 3))  # A: fragment 1 at step 2, 2 steps
    [a] = [p for p in pushes[2] if p.fragment == 1]
    if held == "older":  # A superseded an earlier push A0 (step 2), which round 1 merged
        params, pushes = run(core, params, range(3, 11))
        [a0, a] = a, next(p for p in pushes[10] if p.fragment == 1)
        assert (a.base_version, a.steps) == (0, 10)
        _merge(s, _as_contribution(a0))  # v1 holds A0
        record = MergeRecord(a0.base_version, a0.step, 1)
    else:
        _merge(s, _fc_push("b", 2, 2, epoch=3))  # v1 closed before A arrived
        record = None
    value = {FC: quant.dequantize(s.sent[FC])}
    assert core.on_global(1, 1, value, record)
    params, _ = run(core, params, [a.step + 1])  # applied: the base moves to v1, A stays
    assert core.base_version[1] == 1 and core.inflight[1].key == (0, a.step)
    params, pushes = run(core, params, range(a.step + 2, a.step + 9))  # B supersedes A
    [b] = [p for p in pushes[a.step + 8] if p.fragment == 1]
    assert b.base_version == 1 and b.steps == a.step + 8
    r_a = _merge(s, _as_contribution(a))  # A is merged after all (it waited in the stream)
    r_b = _merge(s, _as_contribution(b))
    merged_before = 2 if held == "older" else 0
    assert r_a.steps == a.steps - merged_before
    assert r_b.steps == 8  # B adds the 8 steps since A, not A's again
    assert merged_before + r_a.steps + r_b.steps == b.steps


def test_chains_through_forgotten_pushes_restores_and_checkpoints():
    """A push superseding one in flight continues its chain; a push going out after a
    forgotten one (refused: its progress goes out again) continues the forgotten one's; a
    push taken up at a restore chains from the restore's step (never after the pushes that
    continue it, even when the real push was sent later); a checkpoint keeps the chain and
    refuses one that is not an int in [0, the push's step]."""
    core, params = make()
    params, out = run(core, params, range(1, 11))
    assert [(p.step, p.chain) for p in out[2] + out[10] if p.fragment == 1] == [(2, 2), (10, 2)]
    meta, arrays = core.state_dict()
    back = make()[0]
    back.load_state(meta, arrays)
    assert back.inflight[1].chain_step == 2
    core.forget_push(1)  # the step-10 push was refused
    [again] = [p for p in core.push_all(11, params) if p.fragment == 1]
    assert (again.step, again.steps, again.chain) == (11, 10, 2)
    # a value that holds the progress ends the chain: the next push begins its own
    assert core.on_global(1, 1, V)
    params = core.apply_due(12, params)
    params, out = run(core, params, range(12, 15))
    assert [(p.step, p.chain) for p in out[14] if p.fragment == 1] == [(14, 14)]
    # taken up at a restore at step 4, sent at step 20 by the process that died
    core, params = make()
    params, _ = run(core, params, range(1, 5))
    core.resume_pushed(1, 0, 20, 4, params)
    params, out = run(core, params, range(5, 11))  # step 10 supersedes it
    [push] = [p for p in out[10] if p.fragment == 1]
    assert push.chain == 4  # the restore's step: an entry may not chain from after its step
    for bad in (-1, 11, "2", 2.0, True):
        m = {**meta, "inflight": [None, {**meta["inflight"][1], "chain": bad}]}
        with pytest.raises(ValueError, match="chain"):
            make()[0].load_state(m, arrays)


def _as_contribution(push, learner="a", epoch=1) -> Contribution:
    return Contribution.of(dataclasses.replace(push, learner=learner, epoch=epoch), decoded(push),
                           entry_id=f"{learner}-{push.step}")


def test_random_schedules_merge_no_step_of_a_learner_twice():
    """LearnerCores and FragmentSyncers under random schedules: learners of uneven speed,
    pushes arriving late (some refused as stale: the learner forgets them, and their
    progress goes out again), rounds closing whenever they hold one contribution, merged
    values late or lost (the learner then learns of a merge only from the records, at a
    superseding push). Whatever the order, the progress the rounds count of a learner on a
    fragment (its seconds, one per step) never exceeds the step of its last merged push: no
    step is merged twice. The schedules must include superseding pushes on a base newer than
    their chain's first push's, and forgotten pushes."""
    names = ("a", "b", "c")
    cfg = dataclasses.replace(REBASE, quorum=1, max_staleness=3, codec_down="fp32")
    moved_chains = forgotten = 0
    for seed in range(12):
        rng = np.random.default_rng(seed)
        syncers = [FragmentSyncer(p, {n: BASE[n] for n in f}, OuterConfig(), cfg,
                                  is_embedding=is_embedding) for p, f in enumerate(FRAGS)]
        values = [{0: {n: BASE[n] for n in f}} for f in FRAGS]  # p → version → value
        records: dict = {}  # (learner, p) → (base, step, version) of its last merged push
        cores, params, made, counted, upto = {}, {}, dict.fromkeys(names, 0), {}, {}
        for m in names:
            cores[m] = LearnerCore(m, FRAGS, cfg, BASE, [0, 0])
            params[m] = {k: jnp.asarray(v) for k, v in BASE.items()}
            counted.update({(m, p): 0.0 for p in range(2)})
            upto.update({(m, p): 0 for p in range(2)})  # the step of its last merged push

            def lookup(p, key, m=m, records=records, values=values):
                rec = records.get((m, p))
                if rec is None or (rec[0], rec[1]) != key:
                    return None
                return rec[2], values[p][rec[2]]
            answering(cores[m], lookup)
        streams = [[] for _ in FRAGS]  # p → [(arrival tick, contribution)]
        inbox = {m: [] for m in names}  # m → [(delivery tick, p, version)]
        keys, starts = {}, {}  # entry id → (learner, base, step); chain start → its base
        for tick in range(600):
            m = names[rng.choice(3, p=[0.5, 0.3, 0.2])]
            made[m] += 1
            g = {k: (rng.standard_normal(v.shape) * 0.01).astype(F32) for k, v in G.items()}
            params[m], pushes = after_step(cores[m], made[m], TOKENS, inner(params[m], g), 1.0)
            for push in pushes:
                starts.setdefault((m, push.fragment, push.chain), push.base_version)
                moved_chains += push.base_version != starts[(m, push.fragment, push.chain)]
                c = Contribution.of(dataclasses.replace(push, epoch=1), decoded(push),
                                    entry_id=f"{m}-{push.step}")
                keys[c.entry_id] = (m, push.base_version, push.step)
                streams[push.fragment].append((tick + int(rng.integers(0, 30)), c))
            for p, s in enumerate(syncers):
                while streams[p] and streams[p][0][0] <= tick:
                    c = streams[p][0][1]
                    ok, why = s.offer(c, float(tick))
                    if not ok and why.kind is Drop.DEFER:
                        break  # offered again after the round closes
                    streams[p].pop(0)
                    f = cores[c.learner].inflight[p]
                    if not ok and f is not None and f.key == (c.base_version, c.step):
                        cores[c.learner].forget_push(p)  # refused: its progress goes again
                        forgotten += 1
                if s._round.contributors and rng.random() < 0.15:
                    r = s.close(float(tick), "test")
                    values[p][r.version] = {k: quant.dequantize(q) for k, q in r.sent.items()}
                    for (entry_id, who, _, _), secs in zip(r.included, r.seconds, strict=True):
                        counted[(who, p)] += secs
                        records[(who, p)] = MergeRecord(*keys[entry_id][1:], r.version)
                        upto[(who, p)] = max(upto[(who, p)], keys[entry_id][2])
                    for n in names:
                        if rng.random() < 0.7:  # else lost: a missed message
                            last = max((d for d, q, _ in inbox[n] if q == p), default=0)
                            inbox[n].append((max(last, tick + int(rng.integers(0, 20))), p,
                                             r.version))
            for n in names:
                due = [x for x in inbox[n] if x[0] <= tick]
                inbox[n] = [x for x in inbox[n] if x[0] > tick]
                for _, p, v in due:  # the record is read as the value arrives
                    cores[n].on_global(p, v, values[p][v], records.get((n, p)))
            # merged progress of a learner lies before the step of its last merged push
            for (who, p), secs in counted.items():
                assert secs <= upto[(who, p)] + 1e-6, (seed, tick, who, p, secs, upto[(who, p)])
        # and little is lost: what the rounds have not counted yet is the last pushes' and
        # what refused (stale) pushes carried
        assert sum(counted.values()) >= 0.8 * len(FRAGS) * sum(made.values()), seed
    assert moved_chains > 0 and forgotten > 0


def test_a_checkpoint_holds_the_cores_arrays_unchanged_while_the_core_goes_on():
    """A learner checkpoint takes the core's arrays without copying them (its writer thread
    reads them while training goes on): the core replaces its arrays and never writes into
    one — through merged values applied, pushes with up-link error feedback, a rebase over a
    merged push, and the next pushes."""
    from workers.island_checkpoint import checkpoint_arrays

    cfg = dataclasses.replace(CFG, up_feedback=True, codec_up="int4")
    core = LearnerCore("L0", FRAGS, cfg, BASE, [0, 0])
    params = {n: jnp.asarray(v) for n, v in BASE.items()}
    step, pushed = 0, []

    def train(n):
        nonlocal params, step
        for _ in range(n):
            step += 1
            params = {k: v - 0.01 * step for k, v in params.items()}
            params, pushes = core.after_step(step, TOKENS, params)
            pushed.extend(pushes)

    train(4)
    assert all(f is not None for f in core.inflight) and any(core.residual)
    meta, arrays = core.state_dict()
    ckpt = checkpoint_arrays(step=step, tokens=0, run_hash="x", core_meta=meta,
                             core_arrays=arrays, params=params, opt_state=None)
    held = {k: np.array(v) for k, v in ckpt.items() if k.startswith("core/")}
    assert any(np.shares_memory(ckpt[f"core/base1/{FC}"], b) for b in core.base[1].values())
    core.on_global(1, 1, {FC: V[FC]})  # holds the push in flight
    params = core.rebase_merged(0, 1, {"wte": BASE["wte"] + 1}, params)
    train(12)
    assert len(pushed) > 2 and core.applied >= 2
    for k, v in held.items():
        np.testing.assert_array_equal(ckpt[k], v, err_msg=k)
