"""The goodput simulator: a discrete-event model of training on N chips with failures, and its
scenarios (the published table, projections of this implementation)."""

from ops.sim.scenarios import (
    cell_dict,
    format_table,
    pct,
    plot_table,
    project_setups,
    table_rows,
)
from ops.sim.simulator import (
    PUBLISHED,
    TABLE_CHIPS,
    TABLE_SETUPS,
    YEAR_S,
    Assumptions,
    Cell,
    Setup,
    make_setup,
    simulate_cell,
    simulate_run,
    simulate_table,
    with_overrides,
)

__all__ = [
    "PUBLISHED", "TABLE_CHIPS", "TABLE_SETUPS", "YEAR_S", "Assumptions", "Cell", "Setup",
    "cell_dict", "format_table", "make_setup", "pct", "plot_table", "project_setups",
    "simulate_cell", "simulate_run", "simulate_table", "table_rows", "with_overrides",
]
