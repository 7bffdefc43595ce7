"""Operator tools: status and progress, the dashboard, inspect, replay, plots, checkpoint tools
(eval, sample, export), data preparation and the run planner's measurements. Each returns
data; `ops/cli/` prints it (or, for the dashboard, serves it)."""

from ops.tools import (
    checkpoint,
    dashboard,
    dashboard_web,
    inspect,
    plan,
    plots,
    prepare,
    replay,
    status,
)
from ops.tools.status import STATES, build_snapshot, natural_key, snapshot

__all__ = ["STATES", "build_snapshot", "checkpoint", "dashboard", "dashboard_web", "inspect",
           "natural_key", "plan", "plots", "prepare", "replay", "snapshot", "status"]
