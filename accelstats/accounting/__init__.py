"""GPU accounting per container: counters that integrate between scrapes (docs/accounting.md).

:class:`collectors.procsampler.ProcessSampler` reads every device once per ``accounting_interval``
and hands each round to :meth:`Ledger.add_rounds`, which integrates per (device, PID):

* SM-busy seconds: the seconds each NVML process-utilisation sample covers x its smUtil, every driver
  sample once (:class:`collectors.smsamples.SmSamples`);
* memory byte-seconds: ``usedGpuMemory`` held from one read to the next (a value read at *t* counts
  until the next read);
* energy: each delta of the GPU's total energy counter, split over the PIDs on that GPU by their SM-busy
  seconds in the same window: a PID gets ``delta x its SM-seconds / max(window, sum of SM-seconds)``;
  the rest is *idle* energy of the GPU (time no process was SM-busy). When the GPU gives no per-process
  utilisation (MIG mode, NOT_SUPPORTED) the whole delta is *unattributed*.

Each collection calls :meth:`Ledger.settle` with the containers the attribution found: every PID's
growth since the last settlement goes to the container whose cgroup holds the PID's cgroup (read when
the PID is first listed, so a PID that exits between two scrapes still counts where it ran); PIDs of
host cgroups add their energy to the GPU's unattributed energy. Allocated seconds run from the
collection that first sees a devices-cgroup grant (back-dated to the oldest process of the container,
not before accounting started) until the grant goes (seen by a collection) or the cgroup is removed
(checked every round); idle seconds are the allocated rounds in which none of the container's PIDs
was SM-busy. Scrapes only read: how often or how concurrently anyone scrapes changes nothing.

Series end as cAdvisor's do: once a container is gone and its last PID's last energy share is split,
the next collection publishes its final totals, then no more; so do those of a cgroup that stays but
is idle and empty (not listed by the attribution, no PID, no open allocation) for
:data:`~accelstats.accounting.ledger.IDLE_KEPT_S`. Counters restart at 0 when the exporter
restarts. Everything is in memory: the running PIDs, the accounts of containers that hold GPUs (at
most :data:`~accelstats.accounting.ledger.ACCOUNTS_KEPT`, the longest-idle ended first), and the sums
of ended containers until the next collection (at most 10 000).

Modules: :mod:`.records` (the data), :mod:`.ledger` (the integration), :mod:`.host` (what the ledger
asks of the host, answered from files).
"""

from accelstats.accounting.host import CgroupLookup, HostLookup, oldest_process_start
from accelstats.accounting.ledger import DISCARD_REASONS, Ledger
from accelstats.accounting.records import Account, AccountingView, Published

__all__ = ["DISCARD_REASONS", "Account", "AccountingView", "CgroupLookup", "HostLookup", "Ledger", "Published",
           "oldest_process_start"]
