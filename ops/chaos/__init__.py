"""Chaos: runs under injected faults (the harness), their fault schedules, and the Jepsen-style
ledger that accounts for every push."""

from ops.chaos.harness import SPARE_AFTER_S, ChaosRun, run_chaos, spare_options_problem
from ops.chaos.ledger import account
from ops.chaos.schedule import KINDS, Fault, load_schedule, random_schedule

__all__ = ["KINDS", "SPARE_AFTER_S", "ChaosRun", "Fault", "account", "load_schedule",
           "random_schedule", "run_chaos", "spare_options_problem"]
