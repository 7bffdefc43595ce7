"""Fault schedules of a chaos run: scripted (a TOML file of faults at given times) or random
(Poisson per fault kind, seeded). What each kind does is the harness's (`ops/chaos/harness.py`).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import config as cfgmod

KINDS = ("kill-learner", "pause-learner", "kill-syncer", "kill-syncer-after-commit",
         "takeover", "kill-redis", "kill-redis-master", "partition-learner", "cut-zmq-learner")
# what a run on a Redis Cluster cannot do: its learners reach the nodes directly (no proxy to
# cut), and one server to kill is a master (kill-redis-master: target = the fragment whose
# slot's master dies, default 1)
NOT_ON_CLUSTER = ("kill-redis", "partition-learner")


@dataclass(frozen=True)
class Fault:
    """At `at_s` after the start, do `kind` to `target` (a learner id, or "" for a random one)
    for `down_s` seconds."""

    at_s: float
    kind: str
    target: str = ""
    down_s: float = 5.0


def load_schedule(path: str | Path) -> list[Fault]:
    """A TOML file of ``[[fault]]`` tables with at_s, kind, target, down_s."""
    data = tomllib.loads(Path(path).read_text())
    faults = []
    for i, f in enumerate(data.get("fault", [])):
        if f.get("kind") not in KINDS:
            raise cfgmod.ConfigError(f"fault[{i}].kind: {f.get('kind')!r} is not one of "
                                     f"{', '.join(KINDS)}")
        faults.append(Fault(float(f["at_s"]), f["kind"], str(f.get("target", "")),
                            float(f.get("down_s", 5.0))))
    return sorted(faults, key=lambda f: f.at_s)


def random_schedule(seed: int, duration_s: float, rates_s: dict[str, float], down_s: float,
                    quiet_tail_s: float) -> list[Fault]:
    """Poisson faults: kind k every `rates_s[k]` seconds on average (0 or less: never), none in
    the quiet tail."""
    rng = np.random.default_rng(seed)
    faults = []
    for kind, mean_s in sorted(rates_s.items()):
        if not mean_s > 0:  # a mean of 0 would put every fault at t = 0, for ever
            continue
        t = rng.exponential(mean_s)
        while t < duration_s - quiet_tail_s - down_s:
            faults.append(Fault(round(float(t), 3), kind, "", down_s))
            t += rng.exponential(mean_s)
    return sorted(faults, key=lambda f: f.at_s)
