"""Discrete-event goodput simulator for a training job on N chips (pure code, seeded).

This module owns the simulation model behind `diloco goodput`: the assumptions (knobs), the
three failure-handling setups (data-parallel that restarts from a checkpoint, elastic
data-parallel, Decoupled DiLoCo with M learners), the event loop, the statistics over seeds,
the closed form for data-parallel without elasticity, and the published table it is checked
against. The table printing, the plot and the projection live in ``ops/sim/scenarios.py``, the
command line in ``ops/cli/goodput.py``.

Model in one paragraph: the job's chips are split into ``groups`` equal groups (1 for
data-parallel, M for DiLoCo). Chip interruptions form one Poisson process of rate
``chips / mtbi_s`` (the superposition of one exponential clock per chip); each lands on a
uniformly random chip, hence on a uniformly random group. A group either *restarts*
(pauses ``restart_s`` with a spare slice swapped in) or *re-forms elastically* (pauses
``downscale_s`` and runs without the failed slice; the slice returns ``repair_s`` later and
is re-admitted by the group's next re-form, or by an upscale pause of ``upscale_s`` once it
has waited ``upscale_wait_s``). On a failure the group loses its progress since its last sync
point (checkpoint, step or outer push: every ``sync_s`` of running time). Interruptions that
land on a group that is already paused are absorbed by the re-form or restart in progress.
DiLoCo rounds need ``quorum`` running learners; below it the running learners are blocked.
Synchronous groups wait for their slowest chip each step (per-chip step-time jitter).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np

YEAR_S = 365.0 * 86_400.0

#: Chip counts of the published table.
TABLE_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
#: Setup names of the published table, in row order.
TABLE_SETUPS = ("dp", "elastic-dp", "M=2", "M=4", "M=8", "M=16")
#: Published goodput per setup, one value per entry of TABLE_CHIPS.
PUBLISHED: dict[str, tuple[float, ...]] = {
    "dp": (0.72, 0.57, 0.38, 0.27, 0.18),
    "elastic-dp": (0.88, 0.80, 0.69, 0.58, 0.40),
    "M=2": (0.94, 0.88, 0.80, 0.70, 0.54),
    "M=4": (0.96, 0.93, 0.89, 0.82, 0.73),
    "M=8": (0.98, 0.96, 0.94, 0.88, 0.80),
    "M=16": (0.99, 0.98, 0.96, 0.93, 0.86),
}


@dataclass(frozen=True)
class Assumptions:
    """The simulator's knobs. Defaults are the one documented set that fits the table.

    Attributes:
        mtbi_s: Mean time between interruptions of one chip.
        slice_chips: Chips in the unit an elastic group drops on a failure and re-admits later.
        repair_s: Time for a dropped slice to return to service.
        downscale_s: Pause of an elastic group (whole job or one learner) to drop a failed
            slice and resume on the rest (detection, re-forming the mesh, resuming).
        upscale_s: Pause of an elastic group to re-admit returned slices.
        upscale_wait_s: How long the first returned slice waits before the group re-forms to
            admit it (and every slice returned meanwhile); a downscale in that window admits
            them at no extra cost. Batches upscales instead of pausing for every slice.
        restart_s: Pause of a non-elastic job on a failure (detect, swap a spare slice in,
            reschedule, reload the checkpoint) before it trains again.
        checkpoint_s: Training time between two checkpoints of the non-elastic job.
        step_s: Inner step time; an elastic group loses the step in flight on a failure.
        speed_cv: Coefficient of variation of one chip's step time (per step, independent);
            a synchronous group runs at the pace of its slowest chip.
        quorum: Running learners a DiLoCo round needs (K); below it, learners are blocked.
    """

    mtbi_s: float = YEAR_S
    slice_chips: int = 64
    repair_s: float = 1_800.0
    downscale_s: float = 18.0
    upscale_s: float = 12.0
    upscale_wait_s: float = 60.0
    restart_s: float = 74.0
    checkpoint_s: float = 1.0
    step_s: float = 1.0
    speed_cv: float = 0.0
    quorum: int = 1


@dataclass(frozen=True)
class Setup:
    """How a job is split into groups and how a group handles an interruption.

    Attributes:
        name: Label in tables ("dp", "elastic-dp", "M=8", ...).
        groups: Number of independent groups (1 for data-parallel, M for DiLoCo learners).
        elastic: True to drop the failed slice and re-form; False to restart with a spare.
        pause_s: Pause on a failure (downscale time if elastic, restart time otherwise).
        upscale_s: Pause to re-admit returned slices (elastic only).
        upscale_wait_s: Wait of the first returned slice before an upscale (elastic only).
        sync_s: Running time between sync points; a failure loses the progress since the last.
        quorum: Running groups needed for progress (DiLoCo K; 1 for data-parallel).
        fragments: Parameter fragments synced in turn (streaming DiLoCo): fragment k is
            pushed at (k + 1) / fragments * sync_s after a resume, then every sync_s.
    """

    name: str
    groups: int
    elastic: bool
    pause_s: float
    upscale_s: float
    upscale_wait_s: float
    sync_s: float
    quorum: int = 1
    fragments: int = 1


def make_setup(name: str, a: Assumptions) -> Setup:
    """Build a setup of the table ("dp", "elastic-dp" or "M=<learners>") from assumptions.

    Args:
        name: Setup name.
        a: Assumptions to take the pauses and sync intervals from.

    Returns:
        The setup.

    Raises:
        ValueError: If the name is not a known setup.
    """
    if name == "dp":
        return Setup(name, 1, False, a.restart_s, 0.0, 0.0, a.checkpoint_s)
    if name == "elastic-dp":
        return Setup(name, 1, True, a.downscale_s, a.upscale_s, a.upscale_wait_s,
                     a.step_s)
    if name.startswith("M="):
        m = int(name[2:])
        if m < 1:
            raise ValueError(f"need at least one learner, got {name!r}")
        return Setup(name, m, True, a.downscale_s, a.upscale_s, a.upscale_wait_s, a.step_s,
                     min(a.quorum, m))
    raise ValueError(f"unknown setup {name!r} (dp, elastic-dp or M=<learners>)")


def lost_work_s(running_s: float, sync_s: float, fragments: int = 1) -> float:
    """Work a group loses on a failure: its progress since the last sync point, per fragment.

    Args:
        running_s: Running time since the group last resumed (it resumed from a sync point).
        sync_s: Running time between two syncs of the same fragment (0: nothing is lost).
        fragments: Fragments synced in turn, evenly staggered over ``sync_s``.

    Returns:
        Lost seconds of whole-group work (the mean over fragments).
    """
    if sync_s <= 0:
        return 0.0
    if fragments <= 1:
        return running_s % sync_s
    total = 0.0
    for k in range(fragments):
        first = (k + 1) * sync_s / fragments
        total += running_s if running_s < first else (running_s - first) % sync_s
    return total / fragments


def expected_max_normal(n: float) -> float:
    """Expected maximum of ``n`` independent standard normals (Blom's approximation).

    Args:
        n: Number of samples (>= 1).

    Returns:
        E[max], 0 for a single sample.
    """
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def straggler_efficiency(group_chips: float, speed_cv: float) -> float:
    """Share of a synchronous group's time spent computing rather than waiting for stragglers.

    Args:
        group_chips: Chips that step in lockstep.
        speed_cv: Coefficient of variation of one chip's step time.

    Returns:
        1 / (1 + cv * E[max of group_chips normals]).
    """
    return 1.0 / (1.0 + speed_cv * expected_max_normal(group_chips))


def dp_goodput_closed_form(chips: float, a: Assumptions) -> float:
    """Goodput of data-parallel without elasticity, exactly, under this simulator's model.

    Up-times are exponential with rate lambda = chips / mtbi_s; each failure costs restart_s
    (failures during a restart are absorbed) and the work since the last checkpoint, so the
    useful work of an up-time U is C * floor(U / C). With q = exp(-lambda C):
    goodput = (C q / (1 - q)) / (1 / lambda + restart_s), times the straggler efficiency.
    For small C this is about 1 / (1 + lambda (restart_s + C / 2)).

    Args:
        chips: Chips in the job.
        a: Assumptions.

    Returns:
        The expected goodput.
    """
    lam = chips / a.mtbi_s
    c = a.checkpoint_s
    q = math.exp(-lam * c)
    useful = c * q / (1.0 - q) if c > 0 else 1.0 / lam
    return useful / (1.0 / lam + a.restart_s) * straggler_efficiency(chips, a.speed_cv)


@dataclass(frozen=True)
class RunResult:
    """One seeded run: goodput, uptime and how many interruptions hit the job."""

    goodput: float
    uptime: float
    failures: int


class _Draws:
    """Batched random draws (one numpy call per few thousand events, not per event)."""

    def __init__(self, rng: np.random.Generator, batch: int = 4096) -> None:
        self._rng, self._batch = rng, batch
        self._exp, self._uni, self._i, self._j = None, None, batch, batch

    def exponential(self) -> float:
        if self._i >= self._batch:
            self._exp, self._i = self._rng.standard_exponential(self._batch).tolist(), 0
        self._i += 1
        return self._exp[self._i - 1]

    def uniform(self) -> float:
        if self._j >= self._batch:
            self._uni, self._j = self._rng.random(self._batch).tolist(), 0
        self._j += 1
        return self._uni[self._j - 1]


def simulate_run(setup: Setup, chips: int, a: Assumptions, seed: int,
                 horizon_s: float, warmup_s: float = 0.0) -> RunResult:
    """Simulate one job for ``warmup_s + horizon_s`` seconds; measure over the horizon only.

    Args:
        setup: Failure handling and grouping.
        chips: Chips allocated to the job (goodput's denominator counts all of them).
        a: Assumptions (interruption rate, slice size, repair time, speed variance).
        seed: Seed of the numpy Generator; equal seeds give equal results.
        horizon_s: Measured wall time.
        warmup_s: Unmeasured wall time first, so that slices in repair reach steady state.

    Returns:
        Goodput (useful chip-seconds / allocated chip-seconds) and uptime (share of wall time
        with at least ``quorum`` groups training) over the horizon.
    """
    rng = np.random.default_rng(seed)
    draws = _Draws(rng)
    m, quorum = setup.groups, max(1, setup.quorum)
    size = chips / m
    slice_chips = min(float(a.slice_chips), size)
    mean_gap_s = a.mtbi_s / chips
    t_start, t_end = warmup_s, warmup_s + horizon_s

    out = [0.0] * m  # chips of each group out of service (in repair or waiting to rejoin)
    waiting = [0.0] * m  # of those, chips back from repair, waiting for the next re-form
    upscale_at = [math.inf] * m  # when the group will re-form to admit the waiting chips
    running = [True] * m
    resumed_at = [0.0] * m  # start of the current running stretch (for lost work)
    n_running, running_chips = m, float(chips)
    useful = uptime = 0.0
    failures = 0
    heap: list[tuple[float, int, int]] = []  # (time, kind, group)
    resume, returned, upscale = 0, 1, 2
    t_last = 0.0
    next_fail = mean_gap_s * draws.exponential() if math.isfinite(mean_gap_s) else math.inf

    def pause(g: int, t: float, pause_s: float) -> None:
        nonlocal n_running, running_chips
        running[g] = False
        n_running -= 1
        running_chips -= size - out[g]
        upscale_at[g] = math.inf  # this re-form admits whatever is waiting
        heapq.heappush(heap, (t + pause_s, resume, g))

    def admit(g: int) -> None:
        out[g] -= waiting[g]
        waiting[g] = 0.0

    while True:
        t_event = min(next_fail, heap[0][0] if heap else math.inf)
        t = min(t_event, t_end)
        lo = max(t_last, t_start)
        if t > lo and n_running >= quorum:
            useful += running_chips * (t - lo)
            uptime += t - lo
        t_last = t
        if t >= t_end:
            break
        if t_event == next_fail:
            next_fail = t + mean_gap_s * draws.exponential()  # finite: a failure happened
            g = min(int(draws.uniform() * m), m - 1)
            # A uniformly random chip; chips out of service cannot fail again.
            if out[g] > 0 and draws.uniform() * size < out[g]:
                continue
            if t >= t_start:
                failures += 1
            if not running[g]:
                # Absorbed by the restart or re-form under way (which also drops this slice).
                if setup.elastic:
                    out[g] += min(slice_chips, size - out[g])
                    heapq.heappush(heap, (t + a.repair_s, returned, g))
                continue
            lost_s = lost_work_s(t - resumed_at[g], setup.sync_s, setup.fragments)
            if t >= t_start and n_running >= quorum:
                useful -= (size - out[g]) * min(lost_s, t - t_start)
            if setup.elastic:
                gone = min(slice_chips, size - out[g])
                out[g] += gone
                running_chips -= gone
                heapq.heappush(heap, (t + a.repair_s, returned, g))
            if setup.pause_s > 0:
                pause(g, t, setup.pause_s)
            else:
                resumed_at[g] = t
                running_chips += waiting[g]
                admit(g)
                upscale_at[g] = math.inf
            continue
        t_ev, kind, g = heapq.heappop(heap)
        if kind == resume:
            running[g] = True
            n_running += 1
            admit(g)
            running_chips += size - out[g]
            resumed_at[g] = t
        elif kind == returned:
            back = min(slice_chips, out[g] - waiting[g])
            waiting[g] += back
            if running[g] and upscale_at[g] == math.inf:
                upscale_at[g] = t + setup.upscale_wait_s
                heapq.heappush(heap, (upscale_at[g], upscale, g))
        elif running[g] and upscale_at[g] == t_ev and waiting[g] > 0:
            if setup.upscale_s > 0:
                pause(g, t, setup.upscale_s)  # planned, at a step boundary: no work lost
            else:
                running_chips += waiting[g]
                admit(g)
                upscale_at[g] = math.inf

    eff = straggler_efficiency(size, a.speed_cv)
    return RunResult(max(0.0, useful) / (chips * horizon_s) * eff, uptime / horizon_s, failures)


_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of its 95% confidence interval (Student t over the values).

    Args:
        values: One value per seed.

    Returns:
        (mean, half-width); the half-width is 0 for a single value.
    """
    arr = np.asarray(values, dtype=float)
    if arr.size < 2:
        return float(arr.mean()), 0.0
    t = _T95[arr.size - 2] if arr.size - 2 < len(_T95) else 1.96
    return float(arr.mean()), float(t * arr.std(ddof=1) / math.sqrt(arr.size))


@dataclass(frozen=True)
class Cell:
    """Goodput and uptime of one setup at one chip count, with 95% CIs over seeds."""

    setup: str
    chips: int
    goodput: float
    goodput_ci: float
    uptime: float
    uptime_ci: float
    failures_per_hour: float
    seeds: int


def horizon_for(chips: int, a: Assumptions, target_failures: int) -> tuple[float, float]:
    """Measured horizon and warm-up that give about ``target_failures`` interruptions.

    Args:
        chips: Chips in the job.
        a: Assumptions.
        target_failures: Interruptions wanted per seed over the measured horizon.

    Returns:
        (horizon_s, warmup_s); the horizon spans at least two repair times and at most 30
        years (enough for any plan; no failures at all with ``mtbi_s = inf``).
    """
    horizon_s = min(max(target_failures * a.mtbi_s / chips, 2.0 * a.repair_s, 600.0),
                    30 * YEAR_S)
    return horizon_s, a.repair_s + a.upscale_wait_s + a.downscale_s + a.upscale_s


def simulate_cell(setup: Setup, chips: int, a: Assumptions, seeds: int = 8, seed: int = 0,
                  target_failures: int = 2000) -> Cell:
    """Simulate one setup at one chip count over several seeds.

    Args:
        setup: Failure handling and grouping.
        chips: Chips in the job.
        a: Assumptions.
        seeds: Independent runs to average.
        seed: Base seed; run i uses a stream spawned from (seed, chips, groups, i).
        target_failures: Interruptions per run over the measured horizon (sets its length).

    Returns:
        The cell, with mean and 95% CI half-width over the runs.
    """
    horizon_s, warmup_s = horizon_for(chips, a, target_failures)
    runs = []
    for i in range(seeds):
        ss = np.random.SeedSequence([seed, chips, setup.groups, int(setup.elastic), i])
        runs.append(simulate_run(setup, chips, a, int(ss.generate_state(1)[0]),
                                 horizon_s, warmup_s))
    g, g_ci = mean_ci95([r.goodput for r in runs])
    u, u_ci = mean_ci95([r.uptime for r in runs])
    per_hour = sum(r.failures for r in runs) / (seeds * horizon_s / 3600.0)
    return Cell(setup.name, chips, g, g_ci, u, u_ci, per_hour, seeds)


def simulate_table(a: Assumptions | None = None, chips: tuple[int, ...] = TABLE_CHIPS,
                   setups: tuple[str, ...] = TABLE_SETUPS, seeds: int = 8, seed: int = 0,
                   target_failures: int = 2000) -> list[Cell]:
    """Simulate every setup at every chip count.

    Args:
        a: Assumptions (defaults: the documented fit).
        chips: Chip counts.
        setups: Setup names ("dp", "elastic-dp", "M=<learners>").
        seeds: Runs per cell.
        seed: Base seed.
        target_failures: Interruptions per run.

    Returns:
        Cells in setup-major order.
    """
    a = a or Assumptions()
    return [simulate_cell(make_setup(s, a), n, a, seeds, seed, target_failures)
            for s in setups for n in chips]


def with_overrides(a: Assumptions, **overrides: float | int | None) -> Assumptions:
    """Copy of ``a`` with the overrides that are not None applied."""
    return replace(a, **{k: v for k, v in overrides.items() if v is not None})
