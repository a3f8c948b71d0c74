"""The settings, declared in groups (app/config.py): still one flat object read from ``VISIONSERVE_<FIELD>``, with
the variables, defaults and checks the committed docs/configuration.md lists."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from app import configdoc
from app.config import ENV_PREFIX, GROUPS, Settings, SettingsError, load_settings

ROW = re.compile(r"^\| `(?P<variable>VISIONSERVE_\w+)` \| (?P<default>.*?) \| ", re.MULTILINE)


def _documented() -> dict[str, str]:
    """variable -> default cell, from every table of the committed page."""
    rows = ROW.findall(configdoc.DOC.read_text(encoding="utf-8"))
    assert len(rows) == len(dict(rows)), "a variable is listed twice"
    return dict(rows)


def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [key for key in os.environ if key.upper().startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)


def test_the_variables_and_defaults_are_those_of_the_committed_page() -> None:
    settings = {f"{ENV_PREFIX}{name.upper()}": configdoc._default(field)
                for name, field in Settings.model_fields.items()}
    assert settings == _documented()


def test_every_setting_is_declared_in_exactly_one_group_in_the_order_of_the_page() -> None:
    declared = [name for group in GROUPS for name in group.model_fields]
    assert len(declared) == len(set(declared))
    assert declared == list(Settings.model_fields)
    assert list(_documented()) == [f"{ENV_PREFIX}{name.upper()}" for name in declared]
    assert Settings.__bases__ == (*reversed(GROUPS), BaseSettings)
    assert all(group.heading for group in GROUPS) and len({group.heading for group in GROUPS}) == len(GROUPS)
    assert not [name for name, field in Settings.model_fields.items() if field.alias or field.validation_alias]


@pytest.mark.parametrize("name", list(Settings.model_fields))
def test_each_setting_is_read_from_its_variable(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``VISIONSERVE_<NAME>=3`` either becomes the setting or is refused naming it: either way it was read."""
    _clean_environment(monkeypatch)
    monkeypatch.setenv(f"{ENV_PREFIX}{name.upper()}", "3")
    try:
        value = getattr(load_settings(), name)
    except SettingsError as exc:
        assert f"{ENV_PREFIX}{name.upper()}" in str(exc)  # alone, or in a rule across settings
    else:
        assert value != Settings.model_fields[name].default
        assert str(getattr(value, "get_secret_value", lambda: value)()) in ("3", "3.0")


# A rule across settings names each as its variable (before: "the settings: Value error, queue_size (8) must be at
# least max_images (16)", the fields' names, where every other bad setting is said by its variable)
@pytest.mark.parametrize("environment, message", [
    ({"DTYPE": "float16", "DEVICE": "cpu"}, "VISIONSERVE_DTYPE float16 needs a CUDA device; use bfloat16 or float32"),
    ({"DEVICE": "gpu"}, "VISIONSERVE_DEVICE: Value error, device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    # Before: latest:0 was taken, and the start stopped at the workers' boot without naming the setting
    ({"VERSION_POLICY": "latest:0"}, "VISIONSERVE_VERSION_POLICY: Value error, latest:N keeps the N newest versions: "
                                     "N must be 1 or more, got 'latest:0'"),
    # Before: taken, though a header of that name can never arrive (no client kept on one side of a canary)
    ({"CLIENT_KEY_HEADER": "bad header"}, "VISIONSERVE_CLIENT_KEY_HEADER: String should match pattern"),
    ({"VERSION_POLICY": "newest"}, "VISIONSERVE_VERSION_POLICY: Value error, must be latest:N, all or "
                                   "specific:V[,V...], got 'newest'"),
    ({"SHUTDOWN_DRAIN_S": "35"}, "VISIONSERVE_SHUTDOWN_DRAIN_S (35) must be shorter than "
                                 "VISIONSERVE_GRACEFUL_TIMEOUT_S (35)"),
    # Before: taken, and a request accepted just before SIGTERM was cut off 20 s before its deadline
    ({"GRACEFUL_TIMEOUT_S": "10"}, "VISIONSERVE_GRACEFUL_TIMEOUT_S (10) must be at least "
                                   "VISIONSERVE_REQUEST_TIMEOUT_S (30): a request accepted just before SIGTERM"),
    ({"MONITOR_MIN_PREDICTIONS": "2000"}, "VISIONSERVE_MONITOR_MIN_PREDICTIONS (2000) must be at most "
                                          "VISIONSERVE_MONITOR_WINDOW (1000)"),
    ({"API_KEY_FILE": "/nonexistent/key"}, "VISIONSERVE_API_KEY_FILE /nonexistent/key does not exist"),
    ({"QUEUE_SIZE": "8", "MAX_IMAGES": "16"}, "VISIONSERVE_QUEUE_SIZE (8) must be at least VISIONSERVE_MAX_IMAGES "
                                              "(16)"),
    # Before: an empty address started a server listening nowhere ("Listening at:  ", then ready); a URL, or two
    # addresses, stopped it with gunicorn's own "Error: '//127.0.0.1' is not a valid port number." (a trial)
    ({"BIND": ""}, "VISIONSERVE_BIND: Value error, it is empty; give HOST:PORT"),
    ({"BIND": "http://127.0.0.1:8001"}, "VISIONSERVE_BIND: Value error, http:// is a URL's scheme: the address "
                                        "alone, '127.0.0.1:8001'"),
    ({"BIND": "127.0.0.1:8001,127.0.0.1:8002"}, "VISIONSERVE_BIND: Value error, it holds several addresses"),
    # Before: taken; warm-up's batch of 100,000 images took the machine's memory, and a graceful timeout past what a
    # thread's join takes crashed each worker's exit (OverflowError), a trial
    ({"MAX_BATCH_SIZE": "100000"}, "VISIONSERVE_MAX_BATCH_SIZE: Input should be less than or equal to 1024"),
    ({"GRACEFUL_TIMEOUT_S": "99999999999"}, "VISIONSERVE_GRACEFUL_TIMEOUT_S: Input should be less than or equal to "
                                            "86400"),
    ({"THREADS": "30000"}, "VISIONSERVE_THREADS: Input should be less than or equal to 1024"),
    # an origin without its scheme can never match a browser's Origin header (before: taken, CORS silently off)
    ({"CORS_ORIGINS": "https://a.example, app.example.com"}, "VISIONSERVE_CORS_ORIGINS: Value error, each origin is "
                                                             "scheme://host[:port]"),
])
def test_the_groups_checks_still_stop_the_start(environment: dict[str, str], message: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_environment(monkeypatch)
    for name, value in environment.items():
        monkeypatch.setenv(f"{ENV_PREFIX}{name}", value)
    with pytest.raises(SettingsError) as raised:
        load_settings()
    assert str(raised.value).startswith(message)


def test_a_setting_of_a_few_words_takes_them_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: VISIONSERVE_LOG_LEVEL=INFO, as Python's logging names its levels, stopped the start (a trial)
    _clean_environment(monkeypatch)
    for name, value in {"LOG_LEVEL": "INFO", "ENGINE": " Process ", "DTYPE": "BFloat16", "ACCESS_LOG": "Errors",
                        "CONTROL_API": "OFF", "WEIGHTS_FORMAT": "ONNX"}.items():
        monkeypatch.setenv(f"{ENV_PREFIX}{name}", value)
    settings = load_settings()
    assert (settings.log_level, settings.engine, settings.dtype, settings.access_log, settings.control_api,
            settings.weights_format) == ("info", "process", "bfloat16", "errors", "off", "onnx")
    monkeypatch.setenv(f"{ENV_PREFIX}LOG_LEVEL", "INFOO")  # still one of the words, whatever its case
    with pytest.raises(SettingsError, match="VISIONSERVE_LOG_LEVEL: Input should be 'debug', 'info', 'warning' or "
                                            "'error' \\(got 'INFOO'\\)"):
        load_settings()


def test_the_methods_of_the_groups_and_of_the_whole(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(" s3cret\n", encoding="utf-8")
    settings = Settings(models=" a, ,b", api_key_file=key_file, device=" CUDA:1 ", max_images=4, max_batch_size=16)
    assert settings.model_names() == ["a", "b"]
    assert settings.resolved_api_key() == "s3cret"
    # the setting's key stripped as the file's is: a header's value is, so " s3cret" could never be presented
    assert Settings(api_key=" s3cret\n").resolved_api_key() == "s3cret"
    # Before: an empty API_KEY (a compose file's ${API_KEY:-}) beside a key file turned auth off (a security review)
    assert Settings(api_key="", api_key_file=key_file).resolved_api_key() == "s3cret"
    with pytest.raises(ValueError, match="api_key and api_key_file are both set"):
        Settings(api_key="other", api_key_file=key_file)
    assert settings.device == "cuda:1"
    assert settings.resolved_queue_size("cuda") == settings.threads * 4 == 128
    assert settings.resolved_weights_dir().is_absolute()


def test_cors_origins_are_taken_as_browsers_send_them() -> None:
    # Before: `null` and every scheme but http(s) (chrome-extension://, capacitor://) were refused as "can never
    # match", where browsers send them; App.Example.com, a default port and a trailing slash were taken as written
    # and could never match the Origin header, which is compared as it is
    taken = Settings(cors_origins="null, chrome-extension://abcdef, capacitor://localhost, "
                                  "https://App.Example.com:443/, http://[::1]:8080, http://a.example:80, "
                                  "http://localhost:3000").cors_origins
    assert taken.split(",") == ["null", "chrome-extension://abcdef", "capacitor://localhost", "https://app.example.com",
                                "http://[::1]:8080", "http://a.example", "http://localhost:3000"]
    assert Settings(cors_origins="*").cors_origins == "*" and Settings().cors_origins == ""
    for never in ("app.example.com", "https://a.example/app", "https://", "https://a b"):
        with pytest.raises(ValueError, match="can never match one"):
            Settings(cors_origins=never)
    # a wildcard host, user@host, a query or fragment, a port out of range, an IPv6 address that is none: refused
    # (were taken, and matched nothing); an IPv6 host in the shortest form a browser writes
    for never in ("https://*.example.com", "https://user@a.example", "https://a.example?x", "https://a.example#x",
                  "http://a.example:0", "http://a.example:65536", "http://[::g]"):
        with pytest.raises(ValueError, match="can never match one"):
            Settings(cors_origins=never)
    assert Settings(cors_origins="http://[0:0:0:0:0:0:0:1]:8080").cors_origins == "http://[::1]:8080"
    with pytest.raises(ValueError, match=r"\* allows every origin: give it alone"):  # the others would say nothing
        Settings(cors_origins="*, https://a.example")


@pytest.mark.parametrize("workers, engines, threads", [(1, 0, 1), (4, 1, 2), (8, 2, 32)])
def test_a_queue_always_holds_a_whole_request(workers: int, engines: int, threads: int) -> None:
    # Before: QUEUE_SIZE below MAX_IMAGES was taken, and a request of more images than the queue held was refused
    # 429 with Retry-After 1 however long it waited. The automatic size holds MAX_IMAGES for every request thread.
    with pytest.raises(ValueError, match=r"queue_size \(2\) must be at least max_images \(16\)"):
        Settings(queue_size=2, max_images=16)
    assert Settings(queue_size=16, max_images=16).resolved_queue_size("cpu") == 16
    auto = Settings(queue_size=0, max_images=16, max_batch_size=1, workers=workers, engines=engines, threads=threads)
    assert auto.resolved_queue_size("cpu") >= auto.max_images


def test_a_relative_key_file_that_is_not_there_is_said_with_the_path_tried(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: "api_key_file keyfile does not exist", the folder it was looked for in unsaid (bin/serve runs in the
    # checkout's folder, not the caller's: a misconfiguring operator's trial)
    _clean_environment(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(f"{ENV_PREFIX}API_KEY_FILE", "keyfile")
    with pytest.raises(SettingsError, match=re.escape(f"{tmp_path / 'keyfile'} does not exist (a relative path is "
                                                      "taken from the working directory")):
        load_settings()
