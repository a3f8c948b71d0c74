"""The Python client and its CLI against the real gunicorn server; retries against a scripted stub server."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import skimage.data
from flask import Flask
from PIL import Image
from werkzeug.wrappers import Request, Response

from app import EXTENSION_KEY
from app.config import Settings
from app.engine.loaded.predictor import Predictor
from app.factory import create_app
from harness.servers import ROOT, Running, free_port
from tests.support.fakes import served_over_http, several_models_app
from tests.support.imaging import BLUE, RED, encode, image_bytes
from visionserve_client import Client, Embedding, Prediction, VisionServeError
from visionserve_client.__main__ import main as cli

PACKAGE = "visionserve_client"  # the import package pyproject.toml ships (not `client`: too common a name)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("photos")
    paths = {}
    for name in ("chelsea", "coffee"):
        paths[name] = folder / f"{name}.jpg"
        paths[name].write_bytes(encode(Image.fromarray(getattr(skimage.data, name)()), "JPEG"))
    return paths


def test_predict_paths_bytes_and_lists(live_server: Running, photos: dict[str, Path]) -> None:
    with Client(live_server.url) as client:
        one = client.predict(photos["chelsea"], top_k=3)
        assert isinstance(one, Prediction) and one.label == "tiger cat" and len(one.top_k) == 3
        assert one.top_k[0].score == one.score and one.top_k[0].score >= one.top_k[1].score
        many = client.predict([photos["coffee"].read_bytes(), str(photos["chelsea"])], top_k=1)
        assert [p.label for p in many] == ["espresso", "tiger cat"]
        assert client.health() and client.ready()
        info = client.model(labels=True)
        assert (info.name, info.num_classes, len(info.labels or [])) == ("efficientnet_lite0", 1000, 1000)


def test_embeddings_by_the_client_and_the_cli(live_server: Running, photos: dict[str, Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with Client(live_server.url) as client:
        one = client.embed(photos["chelsea"])
        cat, cup = client.embed([photos["chelsea"], photos["coffee"].read_bytes()])
    assert isinstance(one, Embedding) and (one.model, one.version) == ("efficientnet_lite0", "1")
    assert len(one.vector) == 1280 and abs(sum(v * v for v in one.vector) - 1) < 1e-4
    assert max(abs(a - b) for a, b in zip(one.vector, cat.vector)) < 1e-5  # the same photo, the same vector
    assert sum(a * b for a, b in zip(cat.vector, cup.vector)) < 0.9  # a cat is not a cup
    assert cli(["--url", live_server.url, "embed", str(photos["chelsea"]), "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["image"].endswith("chelsea.jpg") and max(abs(a - b) for a, b in zip(entry["vector"], cat.vector)) < 1e-5
    assert cli(["--url", live_server.url, "embed", str(photos["coffee"])]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "model efficientnet_lite0 version 1" and "coffee.jpg  1280 values  [" in lines[1]


def test_server_errors_carry_code_status_and_request_id(live_server: Running) -> None:
    with Client(live_server.url) as client, pytest.raises(VisionServeError) as caught:
        client.predict(b"this is not an image")
    error = caught.value
    assert (error.status, error.code) == (400, "invalid_image") and error.request_id
    assert error.request_id in str(error)


def test_cli_prints_a_table_and_json(live_server: Running, photos: dict[str, Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["--url", live_server.url, "predict", str(photos["chelsea"]), str(photos["coffee"]),
                "--top-k", "2"]) == 0
    table = capsys.readouterr().out
    assert "chelsea.jpg" in table and "1. tiger cat" in table and "1. espresso" in table
    assert table.splitlines()[0] == "model efficientnet_lite0 version 1"  # which model and version answered
    assert cli(["--url", live_server.url, "predict", str(photos["coffee"]), "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["image"].endswith("coffee.jpg") and entry["label"] == "espresso" and len(entry["top_k"]) == 5
    assert cli(["--url", live_server.url, "ready"]) == 0 and capsys.readouterr().out.strip() == "yes"


def test_cli_errors_have_exit_codes(live_server: Running, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "notes.jpg"
    text.write_text("hello")
    assert cli(["--url", live_server.url, "predict", str(text)]) == 1
    assert "invalid_image" in capsys.readouterr().err
    assert cli(["--url", live_server.url, "predict", str(tmp_path / "missing.jpg")]) == 2
    nowhere = f"http://127.0.0.1:{free_port()}"
    capsys.readouterr()
    for command in ("health", "ready"):  # no server at all: said so, not a bare "no" (as for a server not ready)
        assert cli(["--url", nowhere, "--retries", "0", command]) == 1
        said = capsys.readouterr()
        assert said.out == "no\n" and f"no server answers at {nowhere}: start one (make serve)" in said.err


def test_client_imports_without_torch_or_flask() -> None:
    code = "import sys, visionserve_client; sys.exit(bool({'torch', 'flask'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


class _Scripted:
    """A stub server answering a scripted list of (status, Retry-After) and recording each call."""

    def __init__(self, script: list[tuple[int, str | None]]) -> None:
        self.script, self.calls = list(script), 0

    def __call__(self, environ, start_response):  # noqa: ANN001, ANN204 - WSGI
        Request(environ).get_data()
        self.calls += 1
        status, retry_after = self.script.pop(0) if self.script else (200, None)
        if status == 200:
            body = {"model": {"name": "m", "version": "1"},
                    "predictions": [{"label": "a", "index": 0, "score": 1.0,
                                     "top_k": [{"label": "a", "index": 0, "score": 1.0}]}]}
        else:
            body = {"error": {"code": "overloaded" if status == 429 else "not_ready", "message": "busy",
                              "request_id": f"r{self.calls}"}}
        headers = {"X-Request-ID": f"r{self.calls}", **({"Retry-After": retry_after} if retry_after else {})}
        return Response(json.dumps(body), status=status, headers=headers, mimetype="application/json")(
            environ, start_response)


@pytest.fixture
def stub() -> Iterator[tuple[str, _Scripted]]:
    app = _Scripted([])
    with served_over_http(app) as url:
        yield url, app


def test_retries_honour_retry_after_then_give_up(stub: tuple[str, _Scripted]) -> None:
    url, app = stub
    sleeps: list[float] = []
    app.script = [(429, "2"), (503, "1")]
    client = Client(url, retries=3, sleep=sleeps.append)
    assert client.predict(b"x").label == "a"
    # What the server asked, and up to a fifth more (jitter: clients told the same do not all come back at once).
    assert len(sleeps) == 2 and 2.0 <= sleeps[0] <= 2.4 and 1.0 <= sleeps[1] <= 1.2 and app.calls == 3

    app.script, app.calls, sleeps[:] = [(429, "120")] * 5, 0, []
    with pytest.raises(VisionServeError) as caught:
        Client(url, retries=2, max_backoff_s=10, sleep=sleeps.append).predict(b"x")
    assert caught.value.code == "overloaded" and caught.value.request_id == "r3"
    assert len(sleeps) == 2 and all(10.0 <= s <= 12.0 for s in sleeps) and app.calls == 3  # max_backoff_s, jittered

    app.script, app.calls = [(400, None)], 0
    with pytest.raises(VisionServeError):
        Client(url, retries=3, sleep=sleeps.append).predict(b"x")
    assert app.calls == 1  # a client error is not retried


def test_connection_errors_back_off_exponentially() -> None:
    sleeps: list[float] = []
    client = Client(f"http://127.0.0.1:{free_port()}", retries=3, backoff_s=0.5, sleep=sleeps.append)
    with pytest.raises(VisionServeError) as caught:
        client.predict(b"x")
    assert caught.value.code == "connection_error" and caught.value.status is None
    assert len(sleeps) == 3 and all(0.25 * 2 ** i <= s <= 0.75 * 2 ** i for i, s in enumerate(sleeps))


def test_the_cli_says_what_to_do_when_no_server_answers(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert cli(["model", "--url", url, "--retries", "0"]) == 1
    said = capsys.readouterr().err
    assert "error: connection_error" in said and f"no server answers at {url}: start one (make serve)" in said


@pytest.fixture
def fake_server(app: Flask) -> Iterator[str]:
    """The app factory's app with the fake colour model (4 classes), served over real HTTP in this process."""
    with served_over_http(app) as url:
        yield url


def test_top_k_is_sent_only_when_asked(fake_server: str) -> None:
    # Before: the client always sent top_k=5, so a model with fewer classes answered 400 to every call.
    red = image_bytes(RED)
    with Client(fake_server) as client:
        assert len(client.predict(red).top_k) == 2  # the server's TOP_K (the test settings' 2)
        assert len(client.predict(red, top_k=4).top_k) == 4


def test_an_open_file_bytearray_or_memoryview_is_one_image_and_anything_else_is_refused_before_sending(
        fake_server: str, tmp_path: Path) -> None:
    # Before: an open file was iterated as a list (each line of the JPEG sent as an image: 413 "more than 16 files",
    # or 400 "not an image"), a bytearray's or memoryview's ints were taken for paths (TypeError "... not int")
    red, blue = tmp_path / "red.jpg", tmp_path / "notes.txt"
    red.write_bytes(image_bytes(RED))
    blue.write_bytes(b"hello")
    with Client(fake_server) as client, red.open("rb") as photo, blue.open("rb") as notes:
        answers = [client.predict(photo), client.predict(bytearray(image_bytes(RED))),
                   client.predict(memoryview(image_bytes(RED))), client.predict(io.BytesIO(image_bytes(RED))),
                   *client.predict([bytearray(image_bytes(BLUE)), red]), *client.predict_each(red)]
        assert [answer.label for answer in answers] == ["red", "red", "red", "red", "blue", "red", "red"]
        with pytest.raises(VisionServeError, match=r"image 0 \(notes.txt\): "):  # sent under its file's name
            client.predict(notes)
        notes.seek(0)
        (refused,) = client.predict_each([notes])
        assert isinstance(refused, VisionServeError) and "image 0 (notes.txt)" in str(refused)
        with red.open() as text, pytest.raises(TypeError, match=r"open it in binary mode: open\(path, 'rb'\)"):
            client.predict(text)
        with pytest.raises(TypeError, match=r"got JpegImageFile \(a PIL image: save it to an io.BytesIO"):
            client.predict(Image.open(red))
        with pytest.raises(TypeError, match=r"predict_each: image 1: an image is a path .* got int$"):
            client.predict_each([red, 3])
        with pytest.raises(TypeError, match=r"embed: an image is a path .* got dict$"):
            client.embed({"image": red})
        # any iterable of images, as before (a generator, Path.glob's); each checked before any is read or sent
        assert [p.label for p in client.predict(path for path in [red, red])] == ["red", "red"]
        with red.open("rb") as first, red.open() as text:
            with pytest.raises(TypeError, match=r"image 2 \(red.jpg\): a file opened in text mode"):
                client.predict_each([first, red, text])  # (before: the first requests' answers were lost)
            assert first.tell() == 0  # refused before the first image was read
        closed = red.open("rb")
        closed.close()
        with pytest.raises(ValueError, match=r"predict: image 0 \(red.jpg\): the file is closed"):
            client.predict(closed)
        with pytest.raises(TypeError, match=r"explain: an image is a path .* and explain takes one; got list$"):
            client.explain([red])


@pytest.mark.parametrize("order", ["before", "after"])
def test_cli_options_work_before_or_after_the_command(fake_server: str, tmp_path: Path, order: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # Before: `predict cat.jpg --url ...` gave "unrecognized arguments: --url".
    photo = tmp_path / "red.jpg"
    photo.write_bytes(image_bytes(RED))
    options = ["--url", fake_server, "--retries", "0"]
    argv = [*options, "predict", str(photo)] if order == "before" else ["predict", str(photo), *options]
    assert cli(argv) == 0
    assert "1. red" in capsys.readouterr().out


def test_one_bad_file_among_several_is_reported_and_the_others_answered(
        fake_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: one 400 for the whole request, and the CLI printed nothing for the good files.
    files = []
    for name, data in (("red.jpg", image_bytes(RED)), ("notes.txt", b"hello"), ("blue.jpg", image_bytes(BLUE))):
        files.append(tmp_path / name)
        files[-1].write_bytes(data)
    with Client(fake_server) as client:
        red, bad, blue = client.predict_each(files)
    assert red.label == "red" and blue.label == "blue"
    assert isinstance(bad, VisionServeError) and bad.code == "invalid_image" and bad.image_index == 1
    assert cli(["predict", *map(str, files), "--url", fake_server]) == 1
    captured = capsys.readouterr()
    assert "red.jpg" in captured.out and "blue.jpg" in captured.out and "1. blue" in captured.out
    assert "notes.txt" in captured.err and "invalid_image" in captured.err and "image 1 (notes.txt)" in captured.err
    assert cli(["predict", str(files[0]), str(tmp_path / "missing.jpg"), "--url", fake_server]) == 2
    captured = capsys.readouterr()
    assert "1. red" in captured.out and "missing.jpg" in captured.err


@pytest.mark.slow
def test_the_cli_stops_quietly_when_what_reads_its_output_stops(fake_server: str, tmp_path: Path) -> None:
    # Before: `visionserve embed cat.jpg --json | head` ended in a BrokenPipeError traceback (a new user's trial).
    photos = []
    for index in range(200):  # output past the pipe's buffer, so a write meets the closed pipe
        photos.append(tmp_path / f"red{index}.jpg")
        photos[-1].write_bytes(image_bytes(RED))
    command = [sys.executable, "-m", PACKAGE, "--url", fake_server, "embed", "--json", *map(str, photos)]
    cli_process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert cli_process.stdout is not None and cli_process.stdout.read(10)
    cli_process.stdout.close()  # as `head` does once it has its lines
    _, stderr = cli_process.communicate(timeout=120)
    assert cli_process.returncode == 1 and b"Traceback" not in stderr, stderr.decode()[-2000:]


@pytest.mark.slow  # a fresh virtualenv and a pip install: seconds, the full suite's
def test_the_client_installs_with_pip_into_a_fresh_virtualenv(fake_server: str, tmp_path: Path) -> None:
    # From a copy of what pyproject.toml packages, so the build leaves nothing in the repository.
    import shutil

    source = tmp_path / "source"
    shutil.copytree(ROOT / PACKAGE, source / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "docs/api.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    installed = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", str(source)], capture_output=True,
                               text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-2000:]
    photo = tmp_path / "red.jpg"
    photo.write_bytes(image_bytes(RED))
    done = subprocess.run([str(venv / "bin" / "visionserve"), "predict", str(photo), "--url", fake_server],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and "1. red" in done.stdout, done.stderr
    assert subprocess.run([str(venv / "bin" / "visionserve"), "--help"], capture_output=True,
                          text=True).stdout.startswith("usage: visionserve")
    # Before: the import package was `client`, a name a user's own module or another distribution takes too.
    (tmp_path / "client.py").write_text("MINE = True\n")
    code = f"import sys, client, {PACKAGE}; assert client.MINE; print(sorted(sys.modules))"
    modules = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                             cwd=tmp_path)
    assert modules.returncode == 0, modules.stderr
    assert "'requests'" in modules.stdout and "'torch'" not in modules.stdout and "'flask'" not in modules.stdout
    # PEP 561: the installed package says it is typed, so a caller's mypy checks its calls against the annotations.
    typed = subprocess.run([str(venv / "bin" / "python"), "-c", f"import pathlib, {PACKAGE} as p; "
                            "print(pathlib.Path(p.__file__).with_name('py.typed').is_file())"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert typed.stdout.strip() == "True", typed.stderr


@pytest.fixture
def two_models(settings: Settings) -> Iterator[str]:
    """colour versions 1 and 2 (2 the default) and shade 1, through the app factory, over real HTTP."""
    with several_models_app(settings) as app, served_over_http(app) as url:
        yield url


def test_without_a_model_the_client_meets_the_default_model(settings: Settings) -> None:
    # Before: a second model turned every request naming none into a 400, and model() read the first entry.
    red = image_bytes(RED)
    with several_models_app(settings.model_copy(update={"default_model": "shade"})) as app, \
            served_over_http(app) as url, Client(url) as client:
        assert client.predict(red).model == "shade" and client.model().name == "shade"
        assert client.model(model="colour").version == "2"  # its default version
        with pytest.raises(VisionServeError) as caught:
            client.model(model="nope")
        assert caught.value.status == 404


def test_predict_asks_the_model_and_version_given(two_models: str) -> None:
    # Before: predict had no model or version, so with several models served a request could not choose.
    red = image_bytes(RED)
    with Client(two_models) as client:
        one = client.predict(red, model="colour", version="1")
        assert (one.label, one.model, one.version) == ("red", "colour", "1")
        assert [(p.model, p.version) for p in client.predict([red, red], model="colour")] == [("colour", "2")] * 2
        assert client.predict(red, model="shade").model == "shade"
        (each,) = client.predict_each([red], model="colour", version="1")
        assert isinstance(each, Prediction) and each.version == "1"
        with pytest.raises(VisionServeError) as caught:
            client.predict(red, model="colour", version="7")
        assert caught.value.status == 404


def test_cli_predict_takes_model_and_version(two_models: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    photo = tmp_path / "red.jpg"
    photo.write_bytes(image_bytes(RED))
    assert cli(["predict", str(photo), "--url", two_models, "--model", "colour", "--version", "1", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert (entry["label"], entry["model"], entry["version"]) == ("red", "colour", "1")
    assert cli(["predict", str(photo), "--url", two_models, "--model", "nope", "--retries", "0"]) == 1
    assert "not_found" in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["predict"], ["model"]])
def test_cli_help_shows_the_defaults(command: list[str], capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: --timeout, --retries and --url said nothing of the value used when they are left out.
    monkeypatch.delenv("VISIONSERVE_URL", raising=False)
    monkeypatch.setenv("VISIONSERVE_API_KEY", "s3cret-key")
    with pytest.raises(SystemExit) as done:
        cli([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert done.value.code == 0
    for shown in ("(default: http://127.0.0.1:8000, or set VISIONSERVE_URL)", "(default: 30)", "(default: 3)",
                  "(default: $VISIONSERVE_API_KEY, set; else none)"):
        assert shown in text
    assert "s3cret-key" not in text  # the key's value never
    if command == ["predict"]:
        assert "--model NAME the served model to ask (default: the server's default model" in text
        assert "--version V the model's version to ask (default: that model's default version)" in text


def test_cli_table_names_the_model_and_version_that_answered(two_models: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # Before (#46): the table never said which model and version answered, so during a canary nobody could tell.
    photo = tmp_path / "red.jpg"
    photo.write_bytes(image_bytes(RED))
    assert cli(["predict", str(photo), str(photo), "--url", two_models, "--model", "colour", "--version", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "model colour version 1" and lines[1] == str(photo) and lines.count(str(photo)) == 2
    assert cli(["predict", str(photo), "--url", two_models, "--model", "colour"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "model colour version 2"  # its default version


def test_cli_table_names_each_images_version_when_they_differ() -> None:
    from visionserve_client.__main__ import _tables

    def answer(version: str | None) -> Prediction:
        return Prediction.from_json({"label": "red", "index": 0, "score": 0.9,
                                     "top_k": [{"label": "red", "index": 0, "score": 0.9}]},
                                    model=None if version is None else "colour", version=version)

    lines = _tables([("a.jpg", answer("1")), ("b.jpg", answer("2"))])  # a canary met by one request, not the next
    assert [line for line in lines if not line.startswith(" ")] == ["a.jpg  (model colour version 1)",
                                                                    "b.jpg  (model colour version 2)"]
    assert _tables([("a.jpg", answer(None))])[0] == "a.jpg"  # a server that does not say: no header


def test_with_no_default_model_the_client_never_guesses(two_models: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # Before (#46): with several models and no default, model() described the first one listed while predict()
    # got a 400. Both are that 400 now, in the server's words; the CLI says --model NAME where they say ?model=NAME.
    red = image_bytes(RED)
    with Client(two_models, retries=0) as client:
        with pytest.raises(VisionServeError) as predicted:
            client.predict(red)
        with pytest.raises(VisionServeError) as described:
            client.model()
        assert client.model(model="shade").name == "shade"
    server, own = predicted.value, described.value
    assert (own.status, own.code, own.message, own.details) == (server.status, server.code, server.message,
                                                                server.details)
    assert server.status == 400 and "?model=NAME" in server.message
    assert server.details == {"models": ["colour", "shade"]}
    photo = tmp_path / "red.jpg"
    photo.write_bytes(red)
    for argv in (["predict", str(photo)], ["model"]):
        assert cli([*argv, "--url", two_models, "--retries", "0"]) == 1
        error = capsys.readouterr().err
        assert "serves 2 models (colour, shade)" in error and "name one (--model NAME)" in error, error
        assert "?model=" not in error and "/v2/models" not in error


def test_a_file_that_cannot_be_read_is_named(fake_server: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # Before (#46): predict_each([..., "notes.txt"]) gave FileNotFoundError(2, 'No such file or directory'), no name.
    red = tmp_path / "red.jpg"
    red.write_bytes(image_bytes(RED))
    missing = tmp_path / "notes.txt"
    with Client(fake_server) as client:
        good, absent, folder = client.predict_each([red, str(missing), tmp_path])
        assert isinstance(good, Prediction) and good.label == "red"
        assert isinstance(absent, FileNotFoundError) and absent.filename == str(missing)
        assert str(missing) in repr(absent) and str(missing) in str(absent) and absent.errno == 2
        assert isinstance(folder, IsADirectoryError) and str(tmp_path) in repr(folder)
        assert str(missing) in repr(client.predict_each([missing]))  # no request needed: nothing to send
        with pytest.raises(FileNotFoundError) as caught:
            client.predict([red, missing])
        assert str(missing) in repr(caught.value) and str(missing) in str(caught.value)
    assert cli(["predict", str(red), str(missing), "--url", fake_server]) == 2
    captured = capsys.readouterr()
    assert "1. red" in captured.out
    assert f"error: {missing}: cannot read it: No such file or directory" in captured.err


def test_predict_each_and_the_cli_split_the_files_to_fit_the_servers_limits(
        fake_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: every file in one request, so more than MAX_IMAGES files (4 here), or more than MAX_BODY_BYTES (256 KiB
    # here), was one 413 for every file, and the CLI printed no answer at all.
    files = []
    for i in range(9):
        files.append(tmp_path / f"{i}.jpg")
        files[-1].write_bytes(image_bytes(RED if i % 2 else BLUE))
    huge = tmp_path / "huge.jpg"
    huge.write_bytes(os.urandom(300 * 1024))  # alone over the body limit
    files.insert(5, huge)
    with Client(fake_server) as client:
        results = client.predict_each(files)
    assert [r.label for r in results if isinstance(r, Prediction)] == ["blue", "red"] * 4 + ["blue"]
    too_large = results[5]
    assert isinstance(too_large, VisionServeError) and too_large.code == "request_entity_too_large"
    assert too_large.image_index == 5 and "huge.jpg" in str(too_large)
    assert cli(["predict", *map(str, files), "--url", fake_server, "--top-k", "1"]) == 1
    captured = capsys.readouterr()
    assert captured.out.count("1. red") == 4 and captured.out.count("1. blue") == 5
    assert captured.err.count("error:") == 1 and "huge.jpg" in captured.err
    assert "request_entity_too_large" in captured.err


def test_predict_each_names_each_refused_image_by_its_own_position(fake_server: str, tmp_path: Path) -> None:
    # Before: after the first refused image was taken out, the server counted the rest from 0 again, and the
    # client passed that on: notes2.txt, the caller's image 2, came back as "image 1 (notes2.txt)", image_index 1.
    names = ["notes.txt", "red.jpg", "notes2.txt"]
    for name in names:
        (tmp_path / name).write_bytes(b"hello" if name.endswith(".txt") else image_bytes(RED))
    with Client(fake_server) as client:
        results = client.predict_each([*(tmp_path / name for name in names), b"junk"])
    for position, name in ((0, "notes.txt"), (2, "notes2.txt"), (3, "image3")):
        error = results[position]
        assert isinstance(error, VisionServeError) and error.code == "invalid_image"
        assert error.image_index == position and error.message.startswith(f"image {position} ({name}): ")
        assert error.details["filename"] == name  # type: ignore[index]
    assert isinstance(results[1], Prediction) and results[1].label == "red"


@pytest.mark.parametrize("key", ["ключ", "café", "plain"])
def test_an_api_key_in_any_script_is_accepted(settings: Settings, predictor: Predictor, key: str) -> None:
    # Before: a key with a character past U+00FF raised UnicodeEncodeError ('latin-1' codec) before any request.
    app = create_app(Settings.model_validate({**settings.model_dump(), "api_key": key}), predictor)
    try:
        with served_over_http(app) as url:
            with Client(url, api_key=key) as client:
                assert client.predict(image_bytes(RED)).label == "red"
            with Client(url, api_key=key + "x", retries=0) as client, pytest.raises(VisionServeError) as caught:
                client.predict(image_bytes(RED))
            assert caught.value.status == 401
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)
