"""How many CPU threads torch's intra-op pool uses (`--threads`, `NINFER_THREADS`).

A decode step on the CPU is a few thousand small ops; each parallel op ends at a barrier where
every thread waits for the slowest. More threads than free cores therefore stalls every op on
a descheduled thread: on a busy 2-core machine torch's default made SmolLM2 decode 4-10x slower
than one thread. The default here is the physical cores this process may use (its CPU affinity,
hyper-threads counted once, capped by a container's CPU quota); on a machine that is busy with
other work, fewer (`--threads 1`) is the user's call.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import NinferError

ENV = "NINFER_THREADS"
_CPU_SYSFS = Path("/sys/devices/system/cpu")
_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def usable_cpus() -> list[int]:
    """The logical CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int], sysfs: Path = _CPU_SYSFS) -> int:
    """Distinct (package, core) pairs among `cpus`: hyper-threads of one core count once.
    Without the topology files (not Linux), every logical CPU counts."""
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def cpu_quota(v2: Path = _CGROUP_V2, v1: tuple[Path, Path] = _CGROUP_V1) -> int | None:
    """A container's CPU limit in whole CPUs (cgroup v2 `cpu.max` or v1 CFS quota), None if unlimited."""
    try:
        quota, period = v2.read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota, period = v1[0].read_text().strip(), v1[1].read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def default_threads() -> int:
    """Physical cores of this process's CPUs, capped by the container's CPU quota."""
    cores = physical_cores(usable_cpus())
    quota = cpu_quota()
    return min(cores, quota) if quota is not None else cores


def resolve_threads(threads: int | None) -> int:
    """`--threads`, else NINFER_THREADS, else the default; at least 1."""
    if threads is None:
        env = os.environ.get(ENV, "").strip()
        if not env:
            return default_threads()
        if not env.isdigit():
            raise NinferError(f"{ENV} must be a number of threads, got '{env}'")
        threads = int(env)
    if threads < 1:
        raise NinferError(f"--threads must be at least 1, got {threads}")
    return threads


def busy_hint(threads: int, load: float | None = None, cpus: int | None = None) -> str | None:
    """A hint when more than one thread runs on a CPU that other work keeps busy (1-minute load
    average above the CPUs this process may use), where one thread is often several times faster."""
    if threads <= 1:
        return None
    if load is None:
        if not hasattr(os, "getloadavg"):
            return None
        load = os.getloadavg()[0]
    cpus = cpus or len(usable_cpus())
    if load <= cpus:
        return None
    return (f"hint: the CPU is busy (load {load:.1f} on {cpus} CPUs): with --threads 1 (or {ENV}=1) decoding is "
            f"often several times faster")


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (process-wide) and return the number in force."""
    import torch

    n = resolve_threads(threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def _loaded_libgomp() -> str | None:
    """The path of the GNU OpenMP runtime this process has loaded (torch's), from /proc/self/maps."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.rsplit(" ", 1)[-1]
        if "/libgomp" in path and ".so" in path:
            return path
    return None


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker pool, if it has one; True if the runtime did.

    Why: torch's CPU ops fork OpenMP teams, and each OS thread that runs one keeps its own pool of
    workers. When the engine thread runs every op while the thread that loaded the model still
    holds an idle pool, libgomp sees more threads than cores and stops spinning between parallel
    regions: every parallel op then waits for its workers to wake (on a 2-core machine an add of
    7 us took 83, the tiny fp32 model's 400-token prompt 3.5 -> 7.1 ms). OpenMP 5's
    `omp_pause_resource_all` frees the pool; torch has no API for it, hence ctypes. Elsewhere
    (another OpenMP runtime, not Linux) nothing happens."""
    import ctypes

    path = _loaded_libgomp()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(2) == 0  # omp_pause_hard: the threads end
