"""ddiloco.lab: the tools around the services, never deployed.

``ddiloco run`` (the whole system on one machine: ``run``, ``cluster``), the chaos driver and
per-learner fault proxies (``chaos``, ``fault_proxy``), the accounting of goodput and invariants
from a run's event logs (``goodput``, ``invariants``), plots, the data-parallel reference
(``dp``) and the benchmark suite (``bench``).
"""
