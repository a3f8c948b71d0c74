"""Device and dtype selection on a CPU machine, and the CUDA paths where a GPU exists."""
from __future__ import annotations

import time
from pathlib import Path

import pydantic
import pytest
import torch

from app.config import Settings
from app.engine.loaded.predictor import Predictor
from harness.photos import photo
from models.export.checks import ModelLoadError, resolve_device, resolve_dtype
from tests.support.fakes import ColourModel, tiny_manifest


def test_auto_picks_cuda_only_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_explicit_cuda_without_cuda_is_a_clear_boot_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # the setting named and what to set it to (before: "device 'cuda' was asked for but CUDA is not available"; a trial)
    with pytest.raises(ModelLoadError, match=r"'cuda:0' was asked for \(VISIONSERVE_DEVICE, or a command's --device\) "
                                             r"but CUDA is not available on this machine: set it to auto"):
        resolve_device("cuda:0")


def test_missing_cuda_index_is_a_clear_boot_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_device("cuda:3")


def test_dtypes() -> None:
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    with pytest.raises(ModelLoadError, match="float16 needs a CUDA device"):
        resolve_dtype("float16", torch.device("cpu"))


@pytest.mark.parametrize("env", [{"device": "gpu"}, {"device": "cuda:x"}, {"dtype": "int8"},
                                 {"max_batch_size": -1}, {"queue_size": -1}, {"device": "cpu", "dtype": "float16"}])
def test_bad_settings_are_refused_at_boot(env: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        Settings(**env)


def test_settings_come_from_prefixed_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VISIONSERVE_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.setenv("VISIONSERVE_MAX_BATCH_SIZE", "16")
    monkeypatch.setenv("VISIONSERVE_DEVICE", "CUDA:1")
    settings = Settings()
    assert settings.weights_dir == tmp_path and settings.max_batch_size == 16 and settings.device == "cuda:1"


def test_bfloat16_on_cpu_still_classifies() -> None:
    predictor = Predictor(ColourModel(), tiny_manifest(), device="cpu", dtype=torch.bfloat16)
    batch = torch.zeros(2, 3, 8, 8)
    batch[0, 0] = 1.0  # red
    batch[1, 2] = 1.0  # blue
    probs = predictor.predict_batch(batch)
    assert probs.dtype == torch.float32 and probs.argmax(1).tolist() == [0, 2]


@pytest.mark.gpu
# float32: cuDNN convolutions run in TF32 on Ampere and later (torch.backends.cudnn.allow_tf32, on by default), so
# the probabilities match the CPU's to about 1e-3, not 1e-6 (an H100 failed the 1e-4 this test had).
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 3e-3), (torch.float16, 2e-2), (torch.bfloat16, 5e-2)])
def test_cuda_matches_cpu(real_weights: Path, dtype: torch.dtype, atol: float) -> None:
    cpu = Predictor.load(real_weights, device="cpu")
    name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    gpu = Predictor.load(real_weights, device="cuda", dtype=name)
    batch = torch.stack([cpu.transform(photo(n)) for n in ("chelsea", "coffee")])
    expected, got = cpu.predict_batch(batch), gpu.predict_batch(batch)
    assert got.device.type == "cpu" and got.dtype == torch.float32
    assert got.argmax(1).tolist() == expected.argmax(1).tolist()
    assert torch.allclose(got, expected, atol=atol)



@pytest.mark.gpu
def test_on_cuda_the_forward_s_time_starts_where_the_work_queued_before_it_ends() -> None:
    # the batch's decoding and resizing are queued on the device and not waited for: the forward pass's time is the
    # device's from where they end, not the host's from when it queued the forward pass
    from app.engine.loaded.version import device_mark, device_seconds_since

    cuda = torch.device("cuda")
    started = time.perf_counter()
    torch.cuda._sleep(200_000_000)  # work queued before the mark: about a tenth of a second on the device
    mark = device_mark(cuda)
    assert mark is not None and device_mark(torch.device("cpu")) is None
    pixels = torch.ones(512, 512, device=cuda)
    (pixels @ pixels).cpu()  # the "forward pass", waited for
    seconds, whole = device_seconds_since(mark, cuda), time.perf_counter() - started
    assert 0 < seconds < whole / 4, (seconds, whole)


@pytest.mark.gpu
def test_cuda_pads_batches_to_the_warmed_shapes(real_weights: Path) -> None:
    cpu = Predictor.load(real_weights, device="cpu")
    gpu = Predictor.load(real_weights, device="cuda", dtype="float16")
    gpu.warmup(8, repeats=1)
    assert gpu.pad_batches and gpu.warmed_batch_sizes == [1, 2, 4, 8]
    batch = torch.stack([cpu.transform(photo(n)) for n in ("chelsea", "coffee", "astronaut")])
    expected, got = cpu.predict_batch(batch), gpu.predict_batch(batch)  # 3 rows run as a batch of 4
    assert got.shape == expected.shape and got.argmax(1).tolist() == expected.argmax(1).tolist()
    assert torch.allclose(got, expected, atol=2e-2)


def test_workers_spread_over_the_gpus_and_a_restarted_worker_takes_the_free_slot() -> None:
    import os
    import runpy
    import shutil
    from types import SimpleNamespace

    from app.hosting.host import gpu_for, placed_device

    assert [gpu_for(slot, 4, 0) for slot in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]  # round robin
    assert [gpu_for(slot, 2, 2) for slot in range(6)] == [0, 0, 1, 1, 0, 0]  # two per GPU in turn
    assert placed_device("auto", 3, 2, 0) == "cuda:1" and placed_device("cuda", 2, 4, 0) == "cuda:2"
    assert placed_device("cuda:0", 3, 2, 0) == "cuda:0"  # an explicit GPU wins
    assert placed_device("auto", 3, 1, 0) == "auto" and placed_device("auto", None, 8, 0) == "auto"
    before = dict(os.environ)
    try:
        config = runpy.run_path("gunicorn.conf.py")  # as the master loads it: it hands out the slots
        server = SimpleNamespace(WORKERS={})
        workers = [SimpleNamespace() for _ in range(3)]
        for pid, worker in enumerate(workers):
            config["pre_fork"](server, worker)
            server.WORKERS[pid] = worker
        assert [w.slot for w in workers] == [0, 1, 2]
        del server.WORKERS[1]  # worker 1 died: its replacement takes slot 1, and so GPU 1 again
        replacement = SimpleNamespace()
        config["pre_fork"](server, replacement)
        assert replacement.slot == 1
    finally:
        shutil.rmtree(os.environ.get("VISIONSERVE_CONTROL_DIR", "/nonexistent"), ignore_errors=True)
        os.environ.clear()
        os.environ.update(before)


def test_an_address_is_in_use_only_while_a_socket_listens_there() -> None:
    import socket

    from app.hosting.host import address_in_use

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        port = other.getsockname()[1]
        other.listen()
        assert address_in_use(f"127.0.0.1:{port}") and address_in_use(f":{port}")
    assert not address_in_use(f"127.0.0.1:{port}")
    assert not address_in_use("unix:/tmp/visionserve.sock") and not address_in_use("fd://3")
    assert not address_in_use("no-such-host.invalid:80")  # fails otherwise: gunicorn says why


def test_a_port_shared_under_reuse_port_is_not_in_use_and_tcp_binds_are_checked() -> None:
    # Before: a server started with gunicorn's --reuse-port beside one that shares its port (a hand-over) stopped at
    # once, "in use", where gunicorn would have bound it; tcp://HOST:PORT was never checked
    import socket

    from app.hosting.host import address_in_use

    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        port = other.getsockname()[1]
        other.listen()
        assert address_in_use(f"127.0.0.1:{port}") and address_in_use(f"tcp://127.0.0.1:{port}")
        assert not address_in_use(f"127.0.0.1:{port}", reuse_port=True)


def test_an_address_gunicorn_cannot_listen_on_is_told_why() -> None:
    from app.hosting.host import bind_problem

    for bind in ("0.0.0.0:8000", ":8000", "127.0.0.1", "[::1]:8080", "[::1]", "tcp://127.0.0.1:9999", "unix:/tmp/s",
                 "fd://3", "localhost:0", "192.0.2.1:8000"):  # (TEST-NET-1: an address that may yet come up)
        assert bind_problem(bind) is None, bind
    # Before: a port alone was read as a host (an IPv4 number): gunicorn then retried for 5 s and said "Can't connect
    # to ('18440', 8000)".
    assert bind_problem("18440") == bind_problem("tcp://18440") == (
        "'18440' is read as a host with port 8000: a port alone is written :18440 (every address)")
    assert bind_problem("localhost:99999") == "its port '99999' is not a port number (0-65535)"
    assert bind_problem("localhost:http") == "its port 'http' is not a port number (0-65535)"
    assert bind_problem("no-such-host.invalid:8000").startswith("its host 'no-such-host.invalid' is no address")
