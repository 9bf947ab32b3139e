"""How many CPU cores this process may really use: the default for every "one process per
core" setting (``RATCHET_API_WORKERS``, ``RATCHET_CURATION_PROCESSES``).

``os.cpu_count()`` is the machine's count, which in a container is the node's: a pod limited
to 2 CPUs on a 64-core node would start 64 processes that the CFS quota then throttles in
turn. The usable count is the affinity mask (``taskset``, cpusets) capped by the cgroup CPU
quota (what a Kubernetes CPU limit becomes), rounded up as the Downward API rounds
``limits.cpu``, and never below one.

The same count is the *thread budget* of the torch processes that one machine runs side by
side (:class:`ThreadBudget`): the model server, the job running beside it (train or eval),
and the one-thread processes (api, worker, curation), so that together they never ask for
more threads than there are cores.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def usable_cores(
    *, cgroup_root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP
) -> int:
    """Cores this process may use: affinity, capped by the cgroup quota, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root=cgroup_root, proc_self_cgroup=proc_self_cgroup)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def cgroup_cpu_quota(
    *, cgroup_root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP
) -> float | None:
    """The tightest CPU quota (in cores) on this process's cgroup and its ancestors.

    cgroup v2 (``cpu.max``: ``"<quota> <period>"`` or ``"max <period>"``) first, then v1
    (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, ``-1`` meaning none). None: no quota,
    or no cgroup filesystem to read.
    """
    quotas = [q for q in _v2_quotas(cgroup_root, proc_self_cgroup) if q is not None]
    if not quotas:
        quotas = [q for q in _v1_quotas(cgroup_root) if q is not None]
    return min(quotas) if quotas else None


def _own_v2_path(proc_self_cgroup: Path) -> str:
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return "/"
    for line in lines:
        if line.startswith("0::"):
            return line[3:] or "/"
    return "/"


def _v2_quotas(cgroup_root: Path, proc_self_cgroup: Path) -> list[float | None]:
    """``cpu.max`` of the own cgroup and every ancestor (inside a container's namespace the
    own cgroup is the root, which then holds the container's limit)."""
    relative = Path(_own_v2_path(proc_self_cgroup).lstrip("/"))
    directories = [cgroup_root / relative, *(cgroup_root / p for p in relative.parents)]
    return [_read_cpu_max(directory / "cpu.max") for directory in directories]


def _read_cpu_max(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        cores = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return cores if cores > 0 else None


def _v1_quotas(cgroup_root: Path) -> list[float | None]:
    found: list[float | None] = []
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        directory = cgroup_root / controller
        try:
            quota = int((directory / "cpu.cfs_quota_us").read_text())
            period = int((directory / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        found.append(quota / period if quota > 0 and period > 0 else None)
    return found


# What torch (OpenMP) and the BLAS libraries read for their thread pools at start-up.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class ThreadBudget:
    """How ``cores`` usable cores are divided between co-located torch processes.

    The rule: the model server gets ``max(1, cores // 2)`` threads, a job (train or eval,
    one at a time beside the server) the rest, ``max(1, cores - cores // 2)``; every other
    process (api and its workers, the Temporal worker, each curation process) runs one
    thread, as those are one process per core already. On 2 cores each torch process gets
    1 thread; on 8, the server 4 and the job 4. A single core cannot be divided: each
    process then gets 1.
    """

    cores: int

    def __post_init__(self) -> None:
        if self.cores < 1:
            raise ValueError(f"a thread budget needs at least 1 core, got {self.cores}")

    @property
    def server(self) -> int:
        """Threads of the model server."""
        return max(1, self.cores // 2)

    @property
    def job(self) -> int:
        """Threads of the one job (train or eval) running beside the model server."""
        return max(1, self.cores - self.cores // 2)

    @property
    def single(self) -> int:
        """Threads of every process that is one of a process-per-core set (api, curation)."""
        return 1


def thread_budget(cores: int | None = None) -> ThreadBudget:
    """The budget of ``cores`` (default: this process's :func:`usable_cores`)."""
    return ThreadBudget(usable_cores() if cores is None else cores)


def thread_env(threads: int) -> dict[str, str]:
    """The environment variables that start a child's torch/BLAS pools at ``threads``."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return dict.fromkeys(THREAD_VARIABLES, str(threads))


def job_threads(hyperparameters: Mapping[str, object]) -> int | None:
    """A job's own ``hyperparameters.threads`` when it is a positive integer (the job sets
    torch to it too), else None: the job takes its share, ``ThreadBudget.job``."""
    threads = hyperparameters.get("threads")
    if isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1:
        return threads
    return None
