"""Operator tools: status and progress, inspect, replay, plots, checkpoint tools (eval,
sample, export), data preparation and the run planner's measurements. Each returns data;
`ops/cli/` prints it."""

from ops.tools import checkpoint, inspect, plan, plots, prepare, replay, status
from ops.tools.status import STATES, build_snapshot, natural_key, snapshot

__all__ = ["STATES", "build_snapshot", "checkpoint", "inspect", "natural_key", "plan", "plots",
           "prepare", "replay", "snapshot", "status"]
