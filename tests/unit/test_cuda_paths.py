"""Where the CUDA paths put a model, told by torch's answers simulated on the CPU: an AOTInductor package on the GPU
its model is placed on, each models.predict rank on its own GPU, an engine's DEVICE=auto on the CPU where the driver
lists GPUs this torch cannot use, and the memory check counting what this process's cache holds unused."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed

from app.config import Settings
from app.engine.versions import memory
from app.errors import InsufficientMemory
from app.hosting import host
from app.link import server
from models.export import load
from models.export.checks import ModelLoadError, resolve_device
from models.export.manifest import CompiledPackage, write_manifest
from models.predict import __main__ as predict
from tests.support.fakes import tiny_manifest

GIB = 1 << 30


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """A host whose torch can use ``count`` GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def _packaged_export(folder: Path) -> Path:
    """An export whose manifest lists a CUDA float32 package (its bytes are never run: the loader is faked)."""
    package = folder / "model.cuda-float32.pt2"
    package.write_bytes(b"a compiled package")
    manifest = tiny_manifest().model_copy(update={"packages": [CompiledPackage(
        path=package.name, sha256=hashlib.sha256(package.read_bytes()).hexdigest(), device="cuda", dtype="float32",
        torch_version=torch.__version__, max_batch_size=8, compile_s=1.0)]})
    write_manifest(folder, manifest)
    return folder


@pytest.mark.parametrize(("device", "index"), [("cuda:1", 1), ("cuda:0", 0), ("cuda", -1)])
def test_a_cuda_package_loads_onto_the_gpu_its_model_is_placed_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 device: str, index: int) -> None:
    # Before: aoti_load_package(path) with no index put the weights and kernels on the loading thread's current GPU
    # (GPU 0) for an engine or a models.predict rank placed on cuda:1, whose inputs are on cuda:1.
    _gpus(monkeypatch, 2)
    opened: list[int] = []

    def aoti_load_package(path: str, run_single_threaded: bool = False, device_index: int = -1) -> object:
        opened.append(device_index)
        return object()

    # (torch._inductor imported by the test that needs it: ~1.3 s of every test process's collection)
    monkeypatch.setattr("torch._inductor.aoti_load_package", aoti_load_package)
    checked: list[torch.device] = []
    monkeypatch.setattr(load, "check_output_shape", lambda model, manifest, target, *rest: checked.append(target))
    loaded = load.load_model(_packaged_export(tmp_path), weights_format="aoti", device=device, max_batch_size=8)
    assert loaded.weights_format == "aoti" and loaded.device == torch.device(device) == checked[0]
    assert opened == [index]  # no index: the current GPU, which is what "cuda" means


def _predict_folders(tmp_path: Path) -> list[str]:
    weights = tmp_path / "export"
    weights.mkdir()
    write_manifest(weights, tiny_manifest())
    data = tmp_path / "photos"
    data.mkdir()
    (data / "a.jpg").write_bytes(b"not read: the run stops at the load")
    return ["--weights", str(weights), "--data", str(data), "--out", str(tmp_path / "scores.jsonl"), "--workers", "0"]


def test_under_torchrun_device_cuda_puts_each_rank_on_its_gpu_before_the_model_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: --device cuda stayed "cuda" (no index): every rank loaded on GPU 0, then init_process_group's
    # torch.cuda.set_device(torch.device("cuda")) raised ValueError (a traceback, exit 1).
    _gpus(monkeypatch, 2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    steps: list[tuple[Any, ...]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: steps.append(("set_device", torch.device(device))))
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, device_id=None: steps.append(("group", backend, device_id)))

    def load_model(weights: Path, *, device: str, **options: object) -> None:
        steps.append(("load", device))
        raise ModelLoadError("stopped here: the test needs no model")

    monkeypatch.setattr(predict, "load_model", load_model)
    assert predict.main([*_predict_folders(tmp_path), "--device", "cuda"]) == 2
    rank_gpu = torch.device("cuda", 1)
    assert steps == [("set_device", rank_gpu), ("group", "nccl", rank_gpu), ("load", "cuda:1")]


def test_device_cuda_without_cuda_is_still_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    _gpus(monkeypatch, 0)
    with caplog.at_level(logging.ERROR, logger="models.predict"):
        assert predict.main([*_predict_folders(tmp_path), "--device", "cuda"]) == 2
    assert "CUDA is not available" in caplog.text


@pytest.mark.parametrize("usable", [False, True])
def test_an_engine_s_device_auto_is_the_cpu_where_torch_cannot_use_the_gpus_the_driver_lists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, usable: bool) -> None:
    # Before: with 2 GPUs listed (/proc/driver/nvidia/gpus) and a torch that cannot use CUDA (a CPU build, a driver
    # too old), engine 1 placed itself on cuda:1 and its load refused "CUDA is not available": the server stopped.
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (tmp_path / bus).mkdir()
    monkeypatch.setattr(host, "_NVIDIA_GPUS", tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _gpus(monkeypatch, 2 if usable else 0)
    settings = Settings(weights_dir=tmp_path, device="auto", log_level="warning")
    monkeypatch.setattr(server, "load_settings", lambda: settings)
    monkeypatch.setattr(server, "_exit_with_the_master", lambda: None)
    monkeypatch.setattr(server.signal, "signal", lambda *args: None)
    monkeypatch.setattr("app.logs.configure_logging", lambda *args: None)
    monkeypatch.setattr("models.data.malloc.keep_freed_memory", lambda *args: None)
    served: dict[int, Settings] = {}
    monkeypatch.setattr(server, "_serve_forever", lambda placed, slot: served.__setitem__(slot, placed))
    with caplog.at_level(logging.WARNING, logger=server.log.name):
        for slot in (0, 1):
            server.main([str(slot)])
    devices = [served[slot].device for slot in (0, 1)]
    if usable:
        assert devices == ["cuda:0", "cuda:1"] and "cannot use CUDA" not in caplog.text
        return
    assert [resolve_device(device) for device in devices] == [torch.device("cpu")] * 2
    assert caplog.text.count("DEVICE=auto: the driver lists 2 GPUs but torch") == 2
    assert "cannot use CUDA: engine 1 serves on the CPU" in caplog.text


def _cuda_memory(monkeypatch: pytest.MonkeyPatch, free: int, cached: int) -> list[bool]:
    """A 16 GiB GPU of which the driver says ``free`` is free, while this process's allocator holds ``cached`` of
    its own unused; emptying the cache hands it to the driver. The list records each empty_cache."""
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free + cached * bool(emptied), 16 * GIB))
    return emptied


def test_the_memory_check_counts_what_this_process_caches_unused_as_free(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the check read the driver's free memory alone (1 GiB), which leaves out the 6 GiB this process's cache
    # held unused: a version that fits was refused (507), and again at every retry.
    emptied = _cuda_memory(monkeypatch, free=1 * GIB, cached=6 * GIB)
    memory.check_fits("m version 1", 256 * 1024 * 1024, torch.device("cuda", 0), loaded_bytes=0, limit_mb=0,
                      reserve_mb=512)
    assert emptied == []  # what fits as it is leaves the cache alone
    memory.check_fits("m version 2", 1 * GIB, torch.device("cuda", 0), loaded_bytes=2 * GIB, limit_mb=0,
                      reserve_mb=512)
    assert emptied == [True]
    with pytest.raises(InsufficientMemory, match="which has 7168 MiB free"):  # what does not fit is still refused
        memory.check_fits("m version 3", 7 * GIB, torch.device("cuda", 0), loaded_bytes=2 * GIB, limit_mb=0,
                          reserve_mb=512)
