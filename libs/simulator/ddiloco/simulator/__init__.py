"""ddiloco.simulator: fleet-scale goodput of data-parallel, elastic and Decoupled DiLoCo training.

Chips live only in numpy aggregates (``trace``: the failure trace; ``spmd``: one synchronous job's
books); learners and fragment rounds are simulated one event at a time (``merges``), with every
merge decided by the synchronizer's own policy functions. ``strategies`` compares the three on one
trace, ``shards`` models a sharded synchronizer's failures (each shard stalls only its own fragments'
merges), ``report`` renders tables, JSON and plots, ``cli`` is ``ddiloco simulate``.
"""

from ddiloco.simulator.config import YEAR_S, SimConfig
from ddiloco.simulator.merges import MergeStats, simulate_merges
from ddiloco.simulator.shards import SyncOutages, sample_outages
from ddiloco.simulator.spmd import JobResult, run_job, slowest_chip_factor
from ddiloco.simulator.strategies import (
    STRATEGIES,
    StrategyResult,
    simulate,
    simulate_decoupled,
    simulate_dp,
    simulate_elastic,
)
from ddiloco.simulator.trace import FailureTrace, sample_trace

__all__ = [
    "STRATEGIES", "YEAR_S", "FailureTrace", "JobResult", "MergeStats", "SimConfig", "StrategyResult",
    "SyncOutages", "run_job", "sample_outages", "sample_trace", "simulate", "simulate_decoupled", "simulate_dp",
    "simulate_elastic", "simulate_merges", "slowest_chip_factor",
]
