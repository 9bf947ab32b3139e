"""Usable cores: the affinity mask capped by the cgroup CPU quota (v2 and v1), at least 1."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.cores import (
    ThreadBudget,
    cgroup_cpu_quota,
    job_threads,
    thread_budget,
    thread_env,
    usable_cores,
)
from services.settings import Settings

AFFINITY = len(os.sched_getaffinity(0))


def cgroup_v2(root: Path, own: str, limits: dict[str, str]) -> Path:
    """A cgroup v2 tree with ``cpu.max`` files at the given paths; returns /proc/self/cgroup."""
    for path, value in limits.items():
        directory = root / path.lstrip("/")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cpu.max").write_text(value + "\n")
    proc = root / "proc-self-cgroup"
    proc.write_text(f"0::{own}\n")
    return proc


@pytest.mark.parametrize(
    ("limits", "quota"),
    [
        ({"/": "max 100000"}, None),
        ({"/": "200000 100000"}, 2.0),
        ({"/": "150000 100000"}, 1.5),
        ({"/": "max 100000", "/kubepods/pod1": "50000 100000"}, 0.5),
        ({"/kubepods": "300000 100000", "/kubepods/pod1": "max 100000"}, 3.0),
    ],
)
def test_the_tightest_v2_quota_on_the_way_up_counts(
    tmp_path: Path, limits: dict[str, str], quota: float | None
) -> None:
    proc = cgroup_v2(tmp_path, "/kubepods/pod1", limits)
    assert cgroup_cpu_quota(cgroup_root=tmp_path, proc_self_cgroup=proc) == quota


def test_a_v1_quota_counts_when_there_is_no_v2(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu,cpuacct"
    cpu.mkdir()
    (cpu / "cpu.cfs_quota_us").write_text("250000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc"
    proc.write_text("4:cpu,cpuacct:/\n")
    assert cgroup_cpu_quota(cgroup_root=tmp_path, proc_self_cgroup=proc) == 2.5
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(cgroup_root=tmp_path, proc_self_cgroup=proc) is None


def test_usable_cores_rounds_a_quota_up_and_never_exceeds_the_affinity(tmp_path: Path) -> None:
    proc = cgroup_v2(tmp_path, "/", {"/": "50000 100000"})
    assert usable_cores(cgroup_root=tmp_path, proc_self_cgroup=proc) == 1
    (tmp_path / "cpu.max").write_text(f"{(AFFINITY + 8) * 100000} 100000\n")
    assert usable_cores(cgroup_root=tmp_path, proc_self_cgroup=proc) == AFFINITY
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(cgroup_root=tmp_path, proc_self_cgroup=proc) == AFFINITY


def test_no_cgroup_filesystem_means_the_affinity(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    assert usable_cores(cgroup_root=missing, proc_self_cgroup=missing) == AFFINITY


def test_garbage_in_cgroup_files_is_no_quota(tmp_path: Path) -> None:
    proc = cgroup_v2(tmp_path, "/", {"/": "lots 0"})
    assert cgroup_cpu_quota(cgroup_root=tmp_path, proc_self_cgroup=proc) is None


def test_process_settings_default_to_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RATCHET_API_WORKERS", raising=False)
    monkeypatch.delenv("RATCHET_CURATION_PROCESSES", raising=False)
    settings = Settings()
    assert settings.api_workers == settings.curation_processes == min(usable_cores(), 64)
    monkeypatch.setenv("RATCHET_CURATION_PROCESSES", "1")
    assert Settings().curation_processes == 1


@pytest.mark.parametrize(
    ("cores", "server", "job"), [(1, 1, 1), (2, 1, 1), (3, 1, 2), (4, 2, 2), (8, 4, 4), (9, 4, 5)]
)
def test_the_thread_budget_gives_the_server_half_and_the_job_the_rest(
    cores: int, server: int, job: int
) -> None:
    budget = ThreadBudget(cores)
    assert (budget.server, budget.job, budget.single) == (server, job, 1)
    assert budget.server + budget.job <= max(cores, 2)  # one core cannot be divided


def test_the_default_budget_is_the_usable_cores() -> None:
    assert thread_budget().cores == usable_cores()
    assert thread_budget(3) == ThreadBudget(3)


def test_thread_variables_and_bad_counts() -> None:
    assert thread_env(3) == {
        "OMP_NUM_THREADS": "3",
        "MKL_NUM_THREADS": "3",
        "OPENBLAS_NUM_THREADS": "3",
    }
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        thread_env(0)
    with pytest.raises(ValueError, match="at least 1 core, got 0"):
        ThreadBudget(0)


@pytest.mark.parametrize(
    ("hyperparameters", "threads"),
    [
        ({"threads": 2}, 2),
        ({}, None),
        ({"threads": True}, None),
        ({"threads": 0}, None),
        ({"threads": "2"}, None),
    ],
)
def test_a_jobs_own_threads_setting(
    hyperparameters: dict[str, object], threads: int | None
) -> None:
    assert job_threads(hyperparameters) == threads
