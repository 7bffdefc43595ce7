"""Operator tools: status and progress, inspect, replay, plots, and checkpoint tools (eval,
sample, export). Each returns data; `ops/cli/` prints it."""

from ops.tools import checkpoint, inspect, plots, replay, status
from ops.tools.status import STATES, build_snapshot, natural_key, snapshot

__all__ = ["STATES", "build_snapshot", "checkpoint", "inspect", "natural_key", "plots",
           "replay", "snapshot", "status"]
