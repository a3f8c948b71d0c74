"""How many workers the server starts when WORKERS is 0 (auto), from the host read without torch (app/hosting/host.py),
and the cores and forward threads the server and models.predict take by one rule (models/serving.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.config import Settings
from app.engine.batching import tuning
from app.hosting import host
from models import serving


def test_a_cpu_host_gets_one_worker_per_core_up_to_the_bound() -> None:
    assert [host.auto_workers(cores, gpus=0) for cores in (1, 2, 4, 16, 64)] == [1, 2, 4, 8, 8]


def test_a_gpu_host_gets_one_worker_per_four_cores_at_least_one_and_at_most_four_per_gpu() -> None:
    assert host.auto_workers(16, gpus=1) == 4  # the H100 run: 4 workers on 16 cores served 1.5x one
    assert host.auto_workers(2, gpus=1) == 1 and host.auto_workers(4, gpus=2) == 2
    assert host.auto_workers(128, gpus=1) == 4 and host.auto_workers(128, gpus=8) == 32


def test_the_setting_wins_and_the_reason_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "usable_cores", lambda: 2)
    monkeypatch.setattr(host, "visible_gpus", lambda: 0)
    assert host.workers_for(3, "auto") == (3, "WORKERS")
    assert host.workers_for(0, "auto") == (2, "auto: 2 usable cores, no GPU")
    monkeypatch.setattr(host, "visible_gpus", lambda: 1)
    assert host.workers_for(0, "cpu") == (2, "auto: 2 usable cores, no GPU")  # DEVICE=cpu: the GPU is not used


def test_engine_auto_is_the_engine_process_on_a_gpu_and_inline_on_a_cpu_host(monkeypatch: pytest.MonkeyPatch
                                                                           ) -> None:
    monkeypatch.setattr(host, "visible_gpus", lambda: 0)
    assert host.engine_mode("auto", "auto") == "inline"
    assert host.engine_mode("process", "cpu") == "process"  # the setting as set
    monkeypatch.setattr(host, "visible_gpus", lambda: 1)
    assert [host.engine_mode("auto", device) for device in ("auto", "cuda", "cuda:0", "cpu")] == [
        "process", "process", "process", "inline"]  # DEVICE=cpu: the GPU is not used
    assert host.engine_mode("inline", "cuda") == "inline"


def test_a_container_quota_bounds_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(serving, "_CGROUP_CPU_MAX", cpu_max)
    monkeypatch.setattr(serving.os, "sched_getaffinity", lambda _: set(range(16)))
    cpu_max.write_text("250000 100000\n")  # a Kubernetes limit of 2.5 CPUs
    assert host.usable_cores() == 2
    cpu_max.write_text("max 100000\n")
    assert host.usable_cores() == 16


def test_visible_gpus_follow_the_driver_and_cuda_visible_devices(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "_NVIDIA_GPUS", tmp_path / "missing")
    assert host.visible_gpus() == 0
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (tmp_path / bus).mkdir()
    monkeypatch.setattr(host, "_NVIDIA_GPUS", tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert host.visible_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert host.visible_gpus() == 1
    # CUDA's rule: the entries before the first invalid one (a negative index, one the driver lacks, a typo)
    for visible, gpus in (("0,-1,1", 1), ("-1", 0), ("", 0), ("1,0", 2), ("0,2,1", 1), ("GPU-8f1c,1", 2),
                          ("0, 1", 2), ("0,x", 1), ("0,1,0,1", 2)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert host.visible_gpus() == gpus, visible


def test_each_workers_forward_pass_takes_half_its_share_of_the_cores() -> None:
    import torch

    cpu = torch.device("cpu")
    forward_threads = tuning.forward_threads  # the server's: its request threads decode in the same process
    assert forward_threads is serving.forward_threads
    assert forward_threads(0, cpu, cores=16, workers=1) == 8 and forward_threads(0, cpu, cores=16, workers=8) == 1
    assert forward_threads(0, cpu, cores=2, workers=2) == 1  # never 0
    assert forward_threads(0, torch.device("cuda", 1), cores=16) == 0 and forward_threads(3, cpu, cores=16) == 3


def test_beside_decoding_processes_the_forward_pass_takes_the_cores_they_leave() -> None:
    # models.predict: DataLoader worker processes decode, its one forward pass gets the rest.
    def apart(setting: int, device: str, cores: int, workers: int) -> int:
        return serving.forward_threads(setting, device, cores, workers, decoders_apart=True)

    assert apart(0, "cpu", 16, 4) == 12 and apart(0, "cpu", 16, 0) == 16
    assert apart(0, "cpu", 2, 2) == 1 and apart(0, "cpu", 2, 8) == 1  # never 0
    assert apart(0, "cuda:0", 16, 4) == 0 and apart(2, "cpu", 16, 4) == 2  # torch's default on CUDA; --threads wins


def test_the_host_and_models_predict_count_the_same_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert host.usable_cores is serving.usable_cores
    monkeypatch.setattr(serving, "usable_cores", lambda: 6)
    assert serving.forward_threads(0, "cpu", workers=2) == 1 and serving.forward_threads(0, "cpu") == 3
    assert serving.forward_threads(0, "cpu", workers=2, decoders_apart=True) == 4


def test_engines_per_device_places_k_engines_on_each_gpu_and_says_which_get_no_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "visible_gpus", lambda: 2)
    assert host.engine_count("auto") == 2 and host.engine_count("cuda", 2) == 4  # k per GPU auto/cuda spread over
    assert host.engine_count("cuda:1", 2) == 2 and host.engine_count("cpu", 3) == 3  # one device named: k on it
    assert [host.placed_device("auto", slot, 2, 2) for slot in range(4)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert host.placed_device("cpu", 1, 0, 2) == "cpu" and host.placed_device("cuda:1", 3, 2, 2) == "cuda:1"
    assert host.unserved_engines(workers=4, engines=4) == 0 and host.unserved_engines(workers=1, engines=2) == 1
    with pytest.raises(ValueError):
        Settings(engines_per_device=0)


def test_a_worker_takes_connections_once_it_serves_or_while_no_other_worker_does(tmp_path: Path) -> None:
    # A killed worker's replacement leaves new connections in the backlog for the workers that serve, instead of
    # answering them 503 while it loads; a server whose workers all load takes them (each answers 503 meanwhile).
    from app.hosting import control

    me, other, dead = os.getpid(), os.getppid(), 2 ** 22 + 1  # above pid_max's default: no such process
    assert control.takes_connections(tmp_path, me)  # nobody serves yet
    control.ready_mark(tmp_path, dead).touch()  # a killed worker's mark not yet removed
    assert control.takes_connections(tmp_path, me)
    control.ready_mark(tmp_path, other).touch()
    assert not control.takes_connections(tmp_path, me)  # another worker serves: it takes them
    control.ready_mark(tmp_path, me).touch()
    assert control.takes_connections(tmp_path, me)  # this one serves too


def test_inline_workers_past_the_usable_cores_are_warned_of_and_process_mode_s_are_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: "6 workers (WORKERS)" alone on 2 cores, 3.9 GB of worker memory (a misconfiguring operator's trial)
    monkeypatch.setattr(host, "usable_cores", lambda: 2)
    said = host.workers_past_cores(6, "inline")
    assert said is not None and said.startswith("6 inline workers on 2 usable cores: each holds a copy of every model")
    assert said.endswith("VISIONSERVE_WORKERS=0 (auto) picks 2 here")
    assert host.workers_past_cores(2, "inline") is None and host.workers_past_cores(6, "process") is None
