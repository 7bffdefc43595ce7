"""The lab: sites on one machine, each in its own network namespace behind a shaped link (rate
with ``tc``, round-trip time in user space, CPU share by cgroup quota), with every byte on the
links counted; decoupled, sync-diloco and data parallel (JAX over gloo) run in it."""

from ops.lab.netns import Lab, LabUnavailable, SiteSpec, check_capability, leftovers, sweep
from ops.lab.run import MODES, LabPlan, check_schedule, plot_traffic, run_lab, traffic

__all__ = ["MODES", "Lab", "LabPlan", "LabUnavailable", "SiteSpec", "check_capability",
           "check_schedule", "leftovers", "plot_traffic", "run_lab", "sweep", "traffic"]
