"""How an export reaches its folder: written beside it and moved in whole (a failed or forced export never leaves a
manifest over another export's files), a repository's version claimed by one export only, targets the server would
not read as meant refused, files that are no checkpoint refused in one line, and the docs' export commands naming
their folder."""
from __future__ import annotations

import fcntl
import logging
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from models.architectures import build_model
from models.export import __main__ as export_cli
from models.export import publish as publishing
from models.export import write
from models.export.load import load_model
from models.export.manifest import read_manifest, sha256_of
from models.export.repository import versions
from models.presets import EvalPreset
from tests.support.fakes import export_tiny

ROOT = Path(__file__).resolve().parents[2]
NO_PACKAGES = ["--packages", "none"]


def tiny_checkpoint(path: Path, seed: int = 0, arch: str = "mobilenet_v3_small") -> Path:
    """A models.train checkpoint of an untrained 3-class ``arch`` at 32 px (its weights made with ``seed``), as
    models.export reads one."""
    torch.manual_seed(seed)
    model = build_model(arch, 3)
    torch.save({"model": model.state_dict(), "args": {"output_dir": "runs/tiny"}, "arch": "mobilenet_v3_small",
                "classes": ["a", "b", "c"], "preset": EvalPreset(resize_size=40, crop_size=32).model_dump(),
                "metrics": {"val_acc1": 0.5}, "epoch": 0, "prediction_reference": None}, path)
    return path


def export(argv: list[str], caplog: pytest.LogCaptureFixture) -> tuple[int, list[str]]:
    """``python -m models.export argv`` in process: its exit code and its error lines."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.export"):
        code = export_cli.main(argv)
    return code, [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]


def folder_bytes(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by its path there, as its sha256."""
    return {str(path.relative_to(folder)): sha256_of(path) for path in sorted(folder.rglob("*")) if path.is_file()}


def weights_of(folder: Path) -> str:
    """The digest of the weights an export's state dict holds."""
    return write.weights_digest(torch.load(folder / write.STATE_DICT_NAME, map_location="cpu", weights_only=True))


def hidden(folder: Path) -> list[str]:
    return [path.name for path in folder.iterdir() if path.name.startswith(".")]


# -- 1. a forced export that fails half way, or succeeds: the old export whole until the new one is --------------------

@pytest.mark.slow  # real exports: seconds each
def test_a_forced_export_that_fails_half_way_leaves_the_old_export_as_it_was(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the new weights went straight over the old ones and the manifest last, so a compile that failed
    # (--packages cuda without a GPU: RuntimeError, a traceback) left the old manifest over new weights: the
    # served version failed its checksums.
    out = export_tiny(tmp_path / "export", seed=0)
    before = folder_bytes(out)

    def failing_compile(model: Any, preset: Any, out_dir: Path, *args: Any) -> None:
        (out_dir / "model.cpu-float32.pt2").write_bytes(b"half a package")
        raise RuntimeError("the compiled package differs from the eager model by 0.5\nand more lines")

    monkeypatch.setattr(write, "compile_package", failing_compile)
    monkeypatch.setattr(export_cli, "package_targets", lambda packages, dtype: [("cpu", "float32")])
    other = tiny_checkpoint(tmp_path / "other.pt", seed=1)
    code, errors = export(["--checkpoint", str(other), "--out", str(out), "--force"], caplog)
    assert code == 2 and errors == ["error: the compiled package differs from the eager model by 0.5 ..."]
    assert folder_bytes(out) == before and hidden(tmp_path) == []
    assert load_model(out, weights_format="torchscript", device="cpu").manifest.version == "1"
    assert load_model(out, weights_format="state_dict", device="cpu").manifest.version == "1"


@pytest.mark.slow  # real exports: seconds each
@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "renames"])
def test_a_forced_export_replaces_the_folder_whole_and_keeps_what_else_it_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool) -> None:
    # Before: a successful --force wrote file after file over the old export: until its manifest came, the folder
    # held new weights under the old manifest. Now nothing of the new export is there before it is whole.
    out = export_tiny(tmp_path / "weights", seed=0)
    (out / "README.md").write_text("what this folder is\n")  # weights/README.md is the project's own
    old_manifest, seen = sha256_of(out / "manifest.json"), []
    publish = publishing.publish

    def watched(staging: Path, out_dir: Path, *args: Any, **kwargs: Any) -> tuple[Path, Any]:
        seen.append(folder_bytes(out_dir))  # the moment before the new export goes in: still the old one, whole
        load_model(out_dir, weights_format="torchscript", device="cpu")
        return publish(staging, out_dir, *args, **kwargs)

    monkeypatch.setattr(publishing, "publish", watched)
    if not exchange:  # a system without renameat2: the old folder aside, then the new one in
        monkeypatch.setattr(publishing, "exchange", lambda first, second: False)
    export_tiny(out, version="2", seed=1, force=True)
    assert seen[0]["manifest.json"] == old_manifest
    assert load_model(out, weights_format="torchscript", device="cpu").manifest.version == "2"
    assert (out / "README.md").read_text() == "what this folder is\n" and hidden(tmp_path) == []
    assert sorted(folder_bytes(out)) == ["README.md", "manifest.json", "model.state_dict.pt", "model.torchscript.pt"]


@pytest.mark.slow  # real exports: seconds each
def test_an_export_into_a_folder_of_other_files_leaves_them_there(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    export_tiny(out)
    assert (out / "notes.txt").read_text() == "mine\n" and read_manifest(out).version == "1"
    assert hidden(tmp_path) == []


def test_packages_this_machine_cannot_compile_are_refused_before_anything_is_written(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: --packages cuda without a GPU was found at the compile, after TorchScript and the state dict were
    # written, and escaped main() as a traceback.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--packages cuda: a CUDA package is compiled on a machine with a GPU"):
        export_cli.package_targets("onnx,cuda", "float32")
    monkeypatch.setattr(export_cli.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match=r"--packages cpu: a cpu package is compiled with a C\+\+ compiler"):
        export_cli.package_targets("cpu", "float32")
    assert export_cli.package_targets("onnx", "float32") == [("onnx", "float32")]
    code, errors = export(["--checkpoint", str(tmp_path / "none.pt"), "--out", str(tmp_path / "out"),
                           "--packages", "cuda"], caplog)
    assert code == 2 and len(errors) == 1 and "a CUDA package is compiled on a machine with a GPU" in errors[0]
    assert list(tmp_path.iterdir()) == []


# -- 2. two exports into one repository at once ------------------------------------------------------------------------

@pytest.mark.slow  # real exports: seconds each
def test_two_exports_at_once_take_two_versions_each_whole(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: both took version 1 (a folder without a manifest did not count), wrote into one folder, and the
    # manifest's checksums, taken from the disk at the end, passed the mix. Here the first export is held after
    # writing its files, before it claims its version, while the second runs whole.
    repository, first, second = tmp_path / "repo", tiny_checkpoint(tmp_path / "a.pt", 0), tiny_checkpoint(
        tmp_path / "b.pt", 1)
    claim, held = publishing.claim, []

    def hold_the_first(staging: Path, out_dir: Path) -> bool:
        if not held:
            held.append(staging)
            assert read_manifest(staging).version == "1" and out_dir == repository / "m" / "1"
            assert versions(repository, "m") == []  # its hidden folder, manifest and all, is no version
            assert export_cli.main(["--checkpoint", str(second), "--repository", str(repository), "--name", "m",
                                    *NO_PACKAGES]) == 0
        return claim(staging, out_dir)

    monkeypatch.setattr(publishing, "claim", hold_the_first)
    code, errors = export(["--checkpoint", str(first), "--repository", str(repository), "--name", "m",
                           *NO_PACKAGES], caplog)
    assert code == 0 and errors == []
    assert f"wrote model m version 2 (3 classes, val top-1 0.5000) in {repository / 'm' / '2'}" in caplog.text
    assert versions(repository, "m") == ["1", "2"] and hidden(repository / "m") == []
    for version, checkpoint in (("1", second), ("2", first)):
        folder = repository / "m" / version
        assert load_model(folder, weights_format="torchscript", device="cpu").manifest.version == version
        assert load_model(folder, weights_format="state_dict", device="cpu").manifest.version == version
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
        assert weights_of(folder) == write.weights_digest(state)  # each version all one export's


def test_the_server_lists_no_hidden_folder_as_a_model_or_a_version(tmp_path: Path) -> None:
    from app.config import Settings
    from app.engine.versions.sources import DirectorySource
    from tests.support.fakes import tiny_manifest

    for folder in (tmp_path / "m" / "1", tmp_path / "m" / ".2.partial-1-ab", tmp_path / ".n.partial-1-ab" / "1"):
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(tiny_manifest().model_dump_json())
    source = DirectorySource(Settings(weights_dir=tmp_path, device="cpu"))
    assert source.models() == ["m"] and source.versions("m") == ["1"]


def test_an_export_removes_the_staging_folders_killed_exports_left_and_no_running_ones(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: an export killed with SIGKILL (or a power cut) left its hidden folder, weights and packages in it,
    # beside the versions for good: nothing ever removed it.
    def staging(name: str, age_s: float) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.state_dict.pt").write_bytes(b"weights")
        os.utime(folder, (time.time() - age_s,) * 2)
        return folder

    abandoned = staging(".1.partial-4242-aa", publishing.ABANDONED_AFTER_S + 5)
    running = staging(".2.partial-4343-bb", publishing.ABANDONED_AFTER_S + 5)
    just_made = staging(".3.partial-4444-cc", 1)  # made, not locked yet
    other = staging(".keep", publishing.ABANDONED_AFTER_S + 5)  # no export's
    held = os.open(running, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with caplog.at_level(logging.WARNING, logger="models.export"):
            with publishing.staging_beside(tmp_path / "4") as made:
                assert made.is_dir() and made.name.startswith(".4.partial-")
                probe = os.open(made, os.O_RDONLY | os.O_DIRECTORY)
                with pytest.raises(BlockingIOError):  # held while the export runs
                    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.close(probe)
    finally:
        os.close(held)
    assert not abandoned.exists() and running.is_dir() and just_made.is_dir() and other.is_dir()
    assert not made.exists()
    assert [record.getMessage() for record in caplog.records] == [
        f"removed {abandoned}: an export killed before it ended left it"]


# -- 3. a repository as a single export's folder, and the other way round ----------------------------------------------

@pytest.mark.slow  # real exports: seconds each
def test_out_into_a_repository_and_a_repository_in_a_single_export_are_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: --out <repository> wrote a manifest at its root, and the server then saw one export, not the
    # repository's models; --repository <weights/> wrote mine/1 inside a single export, which the server never saw.
    repository, single = tmp_path / "repo", export_tiny(tmp_path / "weights", name="tiny")
    export_tiny(repository / "alpha" / "1", name="alpha")
    checkpoint = str(tiny_checkpoint(tmp_path / "c.pt"))
    repository_before, single_before = folder_bytes(repository), folder_bytes(single)
    code, errors = export(["--checkpoint", checkpoint, "--out", str(repository), *NO_PACKAGES], caplog)
    assert code == 2 and errors == [f"error: {repository} is a model repository (it holds alpha): a single export "
                                    f"there would hide them from the server; write into it with --repository "
                                    f"{repository}"]
    code, errors = export(["--checkpoint", checkpoint, "--repository", str(single), "--name", "mine",
                           *NO_PACKAGES], caplog)
    assert code == 2 and len(errors) == 1 and "--out" in errors[0]
    assert errors[0].startswith(f"error: {single} holds a single export (tiny 1), which the server serves alone")
    assert folder_bytes(repository) == repository_before and folder_bytes(single) == single_before


# -- 4. files that are no checkpoint of the model they say -------------------------------------------------------------

@pytest.mark.slow  # real exports: seconds each
def test_a_file_that_is_no_checkpoint_of_its_model_is_refused_in_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: an export's model.state_dict.pt ended in KeyError 'args', weights of another architecture in a
    # RuntimeError listing every key: tracebacks, where the docs promise one line and exit code 2.
    weights = export_tiny(tmp_path / "export") / write.STATE_DICT_NAME
    resnet = tiny_checkpoint(tmp_path / "resnet.pt", arch="resnet18")  # says mobilenet_v3_small
    (tmp_path / "text.pt").write_text("not a checkpoint\n")
    out = tmp_path / "out"
    for path, expected in (
            (weights, f"error: {weights} is no models.train checkpoint (it lacks model, args, arch, classes, preset; "
                      f"an export's model.state_dict.pt holds weights only): --checkpoint takes a run's best.pt"),
            (resnet, f"error: {resnet} says mobilenet_v3_small with 3 classes, but its weights are not that model's: "
                     f"244 of its 244 keys missing, 122 unexpected, 0 of another shape"),
            (tmp_path / "text.pt", f"error: {tmp_path / 'text.pt'} is no checkpoint torch can read (")):
        code, errors = export(["--checkpoint", str(path), "--out", str(out), *NO_PACKAGES], caplog)
        assert code == 2 and len(errors) == 1 and errors[0].startswith(expected), errors
    assert not out.exists()


# -- 5. --force without --out, and the docs' export commands -----------------------------------------------------------

@pytest.mark.slow  # real exports: seconds each
def test_a_forced_checkpoint_export_never_replaces_weights_unasked(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: docs/training.md's `--checkpoint ... --packages onnx,cpu --force` had no --out, so it wrote ./weights
    # and --force replaced the bundled default model the server serves.
    monkeypatch.chdir(tmp_path)
    bundled = export_tiny(Path("weights"), name="efficientnet_lite0")
    before, checkpoint = folder_bytes(bundled), str(tiny_checkpoint(tmp_path / "best.pt"))
    # Now a checkpoint's export without --out goes into its run's export/ (before: refused, and without --force it
    # said "pass --force to replace it", which was then refused); one outside a run's folder names no default
    code, errors = export(["--checkpoint", checkpoint, *NO_PACKAGES], caplog)
    assert code == 2 and "is not in a models.train run's folder (no metrics.jsonl beside it)" in errors[0]
    from models.export.__main__ import RUN_METRICS
    from models.run.report import METRICS_NAME

    assert RUN_METRICS == METRICS_NAME
    (tmp_path / METRICS_NAME).write_text("")  # (a run's folder)
    assert export(["--checkpoint", checkpoint, *NO_PACKAGES], caplog)[0] == 0
    assert export(["--checkpoint", checkpoint, "--force", *NO_PACKAGES], caplog)[0] == 0
    assert read_manifest(tmp_path / "export").name == "tiny" and folder_bytes(bundled) == before
    code, errors = export(["--checkpoint", checkpoint, "--force", "--out", "weights", *NO_PACKAGES], caplog)
    assert code == 0 and read_manifest(bundled).name == "tiny"  # named: meant


def _export_commands(text: str) -> list[list[str]]:
    """The arguments of every ``models.export`` command in ``text``: in its bash blocks and its inline code."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    spans = re.findall(r"(?<!`)`([^`]+)`(?!`)", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    commands = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    commands += [span.replace("\n", " ") for span in spans]
    found = []
    for command in commands:
        words = shlex.split(command, comments=True) if "models.export " in command else []
        if "models.export" in words and words[words.index("models.export") + 1:]:
            found.append(words[words.index("models.export") + 1:])
    return found


def test_every_documented_checkpoint_export_names_its_folder() -> None:
    # Without --out or --repository a checkpoint's export goes to weights/, the bundled model's folder.
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [(page.name, argv) for page in pages for argv in _export_commands(page.read_text(encoding="utf-8"))
             if "--checkpoint" in argv]  # not a mention such as `models.export --repository`
    assert len(found) >= 4
    for page, argv in found:
        args = export_cli.get_args_parser().parse_args(argv)
        assert args.out or args.repository, f"{page}: models.export {' '.join(argv)}"


@pytest.mark.slow  # two real exports: seconds, the full suite's
def test_a_version_that_answers_other_classes_than_the_one_before_is_said_at_its_export(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before: a run of other classes exported into the model's folder as its next version in silence; the server
    # served it at once, index 1 now meaning "eight" where it meant "seven sevens" (a new user's trial).
    first = read_manifest(export_tiny(tmp_path / "repository" / "mine" / "1"))  # a, b, c
    with caplog.at_level(logging.WARNING, logger="models.export.write"):
        write.export_model(build_model("mobilenet_v3_small", 3), out_dir=tmp_path / "repository" / "mine" / "2",
                           name="mine", version="2", arch="mobilenet_v3_small", labels=["a", "b", "d"],
                           preset=EvalPreset(resize_size=40, crop_size=32), numbered=True)
    assert [r.getMessage() for r in caplog.records] == [
        "mine version 2 answers other classes than version 1 (1 new: d; 1 gone: c): a client that reads an answer's "
        "index gets another class from it; one that reads its label does not"]
    for labels, said in ((["c", "b", "a"], "(the same classes in another order)"), (["a", "b", "c"], None)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="models.export.write"):
            write._say_classes_changed(tmp_path / "repository" / "mine",
                                       first.model_copy(update={"version": "2", "labels": labels}))
        warned = [r.getMessage() for r in caplog.records]
        if said is None:
            assert warned == []
        else:
            assert warned == [f"mine version 2 answers other classes than version 1 {said}: a client that reads an "
                              f"answer's index gets another class from it; one that reads its label does not"]
