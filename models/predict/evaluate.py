"""An evaluation of the merged records against the true classes: top-1/top-5, per-class precision and recall and
the confusion matrix (``models/run/confusion.py``, the training run's own), as JSON and a picture, and the most
confident mistakes as an HTML page of thumbnails.

Written into ``--report`` (by default beside ``OUT``, its name without the extension and ``-report``: for
``runs/mine/eval.jsonl``, ``runs/mine/eval-report/``): ``metrics.json``, ``confusion.json``, ``confusion.png``,
``mistakes.html``.
"""
from __future__ import annotations

import base64
import functools
import html
import io
import json
import os
import shlex
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from PIL import Image

from models.data.folder import in_another_form
from models.export.manifest import TOP5_MIN_CLASSES, Manifest, TrainedOn
from models.predict.inputs import folder_files, read_list
from models.predict.outputs import Record
from models.run.args import DataError
from models.run.confusion import confusion, write_confusion

METRICS_NAME = "metrics.json"
MISTAKES_NAME = "mistakes.html"
THUMBNAIL_SIDE = 160


def report_folder(out: Path, report: Path | None = None) -> Path:
    """``--report``, or beside ``out`` its name without the extension and ``-report`` (eval.jsonl: eval-report)."""
    return report or out.with_name(out.stem + "-report")


def check_labels(truths: dict[str, str], classes: Sequence[str], split: Path | None = None) -> None:
    """Every true class must be one the model knows, or its accuracy would be meaningless. ``split``: the held-out
    folder of a training layout given as ``--labels`` (DIR/train/, DIR/val/), named when its folders are what
    looked like classes."""
    unknown = sorted(set(truths.values()) - set(classes))
    if split is not None and {"train", split.name} & set(unknown):
        raise DataError(f"--labels {split.parent} holds the training splits train/ and val/, not <class>/ folders: "
                        f"evaluate on the split training held out, --data {split} --labels {split}")
    if forms := in_another_form(unknown, classes):  # the same text as one of the model's class names
        pairs = ", ".join(f"{name!r} (the model's {theirs!r})" for name, theirs in forms.items())
        raise DataError(f"--labels names class(es) {pairs} in another Unicode form than the model's (an accent "
                        "decomposed in one, composed in the other, as macOS's file names have it): rename the label "
                        "folders (or the CSV's labels) so both write them alike")
    if unknown:
        shown = ", ".join(unknown[:10]) + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
        raise DataError(f"--labels names classes the model does not have: {shown}")


def trained_count(trained_on: TrainedOn | None, files: Iterable[str]) -> int | None:
    """How many of ``files`` (as they are read: absolute, or from the current folder) are images the model trained
    on (its manifest's ``trained_on``: in its folder as training read it, not in its held-out list); None when that
    cannot be told (no record, its folder not on this machine, its held-out list unreadable). Files are compared
    where they really are: in a folder training read (the training folder's, or one a link there leads to: a
    class folder linked from elsewhere), or a file a link there leads to (before: the training folder's own real
    path only, so a linked class folder's images and linked files counted as unseen; earlier still, paths as
    written: a folder linked to the training folder held "0" of them; data scientists' trials). A copy of the
    folder is another folder."""
    if trained_on is None or not os.path.isdir(trained_on.folder):
        return None
    held: set[str] = set()
    if trained_on.held_out is not None:
        try:  # read as --data reads a file list
            held = {os.path.realpath(item.file) for item in read_list(Path(trained_on.held_out))}
        except (OSError, DataError):
            return None
    folders, linked = _read_in_training(trained_on.folder)
    return sum(1 for file in files if (path := os.path.realpath(file)) not in held
               and (os.path.dirname(path) in folders or path in linked))


@functools.lru_cache(maxsize=2)  # read once a run: the count is said before scoring and again after
def _read_in_training(folder: str) -> tuple[frozenset[str], frozenset[str]]:
    """The real paths of the folders training read under ``folder`` (``folder_files``: a linked class folder
    followed) and of the files the links among their files lead to."""
    folders: set[str] = set()
    linked: set[str] = set()
    for _, real, files in folder_files(folder):
        folders.add(real)
        linked.update(os.path.realpath(entry.path) for entry in files if entry.is_symlink())
    return frozenset(folders), frozenset(linked)


def trained_warning(count: int, total: int, manifest: Manifest, labels: Path, read: bool = True) -> str:
    """What an evaluation of ``total`` images, ``count`` of them images the model trained on, says of them, and
    the command's options that evaluate on those the run held out instead; not yet ``read``: of files (one that is no
    image counts until scoring skips it, as training skipped it)."""
    trained = manifest.trained_on
    assert trained is not None
    if trained.held_out is not None:
        where = f"under {trained.folder} and not in {trained.held_out}"
        instead = f"--data {shlex.quote(str(trained.held_out))} --labels {shlex.quote(str(labels))}"
    else:
        where = f"under {trained.folder}"
        held = shlex.quote(str(Path(trained.folder).parent / "val"))
        instead = f"--data {held} --labels {held}"
    return (f"{count} of the {total} labelled {'images' if read else 'files (not yet read)'} are ones "
            f"{manifest.name} {manifest.version} trained on ({where}): "
            f"its accuracy on them overstates how it does on images it has not seen; evaluate on those its run held "
            f"out: {instead}")


def evaluation(records: Sequence[Record], truths: dict[str, str], classes: Sequence[str]) -> dict[str, Any]:
    """Top-1, top-5 (None below ``TOP5_MIN_CLASSES`` classes, where it is 1.0 by construction, as training says)
    and the confusion matrix over the labelled records that were scored; the matrix's classes are the model's that
    occur as a true or a predicted class, in the model's order."""
    scored = [r for r in records if r["path"] in truths and not r.get("error")]
    count = len(scored)
    top1 = sum(r["labels"][0] == truths[r["path"]] for r in scored)
    top5 = sum(truths[r["path"]] in r["labels"][:5] for r in scored)
    seen = {truths[r["path"]] for r in scored} | {r["labels"][0] for r in scored}
    shown = [name for name in classes if name in seen]
    position = {name: i for i, name in enumerate(shown)}
    matrix = torch.zeros(len(shown), len(shown), dtype=torch.int64)
    for r in scored:
        matrix[position[truths[r["path"]]], position[r["labels"][0]]] += 1
    # every record once: scored, unreadable (labelled or not: as the written file's count says), without a label,
    # or of a file gone since it was scored (a resumed run keeps its line; the labels are read from the files there)
    unreadable = sum(1 for r in records if r.get("error"))
    unmatched = [r["path"] for r in records if r["path"] not in truths and not r.get("error")]
    gone = sum(1 for path in unmatched if not os.path.lexists(path))
    return {"count": count, "wrong": count - top1, "acc1": top1 / count if count else 0.0,
            "acc5": (top5 / count if count else 0.0) if len(classes) >= TOP5_MIN_CLASSES else None,  # 1.0 below
            "top_k_written": max((len(r["labels"]) for r in scored), default=0), "unreadable": unreadable,
            "unlabelled": len(unmatched) - gone, "gone": gone, **confusion(matrix, shown)}


def mistakes(records: Sequence[Record], truths: dict[str, str], limit: int) -> list[Record]:
    """The wrong top-1 answers, most confident first."""
    wrong = [r for r in records if r["path"] in truths and not r.get("error") and r["labels"][0] != truths[r["path"]]]
    return sorted(wrong, key=lambda r: -r["scores"][0])[:limit]


def readable(text: str) -> str:
    """``text`` as a page or a picture can show it: a file name that is not UTF-8 (os.walk's surrogate escapes,
    which UTF-8 cannot encode) with U+FFFD for its bytes that are not."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _thumbnail(file: str) -> str:
    """A small JPEG of the file as a data: URL (the page stands alone), or "" when it cannot be read."""
    try:
        with Image.open(file) as image:
            image.draft("RGB", (THUMBNAIL_SIDE, THUMBNAIL_SIDE))
            image = image.convert("RGB")
            image.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=80)
    except Exception:  # noqa: BLE001 - a thumbnail is a courtesy: the row stays without it
        return ""
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _mistakes_intro(shown: int, total: int | None, scored: int | None) -> str:
    """The page's first line: how many mistakes it shows of how many, or that there were none."""
    total = shown if total is None else total
    if not total:
        of = f" on all {scored} labelled images scored" if scored is not None else ""
        return f"No mistakes: the model's top-1 answer was right{of}."
    which = (f"The {shown} most confident of {total} mistakes" if shown < total else
             f"All {total} mistake{'s' if total != 1 else ''}, most confident first")
    return f"{which}: the model's answer and score in bold, the true class under it, then the next two answers."


def mistakes_page(wrong: Sequence[Record], truths: dict[str, str], files: dict[str, str], title: str,
                  total: int | None = None, scored: int | None = None) -> str:
    """An HTML page: one card per mistake with its thumbnail, true class, answer and score, and the runner-up;
    ``total`` mistakes of ``scored`` images (when known: the page says how many it leaves out, or that there were
    none)."""
    cards = []
    for r in wrong:
        source = _thumbnail(files.get(r["path"], r["path"]))
        picture = f'<img src="{source}" alt="">' if source else "<div class=none>no preview</div>"
        others = ", ".join(f"{html.escape(label)} {score:.3f}" for label, score in zip(r["labels"][1:3], r["scores"][1:3]))
        path = readable(r["path"])
        cards.append(f'<figure>{picture}<figcaption><b>{html.escape(r["labels"][0])}</b> {r["scores"][0]:.3f}'
                     f'<br>true: {html.escape(truths[r["path"]])}<br><small>{others}</small>'
                     f'<br><small title="{html.escape(path)}">{html.escape(Path(path).name)}</small>'
                     "</figcaption></figure>")
    style = ("body{font-family:sans-serif;margin:1em}figure{display:inline-block;width:170px;margin:6px;"
             "vertical-align:top}img{max-width:160px;max-height:160px}figcaption{font-size:13px}"
             "small{color:#555;word-break:break-all}")
    intro = html.escape(_mistakes_intro(len(wrong), total, scored), quote=False)
    return (f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title><style>{style}</style>"
            f"<h1>{html.escape(title)}</h1><p>{intro}</p>" + "\n".join(cards) + "\n")


def write_report(report: dict[str, Any], wrong: Sequence[Record], truths: dict[str, str], files: dict[str, str],
                 folder: Path, title: str) -> list[str]:
    """metrics.json, confusion.json, confusion.png and mistakes.html in ``folder``; returns the lines to print."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    from models.plot import plot_confusion

    folder.mkdir(parents=True, exist_ok=True)
    title = readable(title)  # it names --data, whose name may not be UTF-8
    metrics = {key: report.get(key) for key in ("count", "acc1", "acc5", "unreadable", "unlabelled", "gone",
                                                "trained_on")}
    (folder / METRICS_NAME).write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    confusion_path, table = write_confusion({k: report[k] for k in ("classes", "matrix", "per_class")}, folder)
    plot_confusion(confusion_path, folder / "confusion.png", title=title)
    page = mistakes_page(wrong, truths, files, title, total=report["wrong"], scored=report["count"])
    (folder / MISTAKES_NAME).write_text(page, encoding="utf-8")
    top5 = "" if report["acc5"] is None else f", top-5 {report['acc5']:.4f}"  # none below 6 classes, as training
    summary = (f"evaluated {report['count']} images: top-1 {report['acc1']:.4f}{top5}"
               f" ({report['unreadable']} unreadable, {report['unlabelled']} without a label"
               + (f", {report['gone']} of files gone since they were scored" if report.get("gone") else "")
               + f"); report in {folder}")
    return [summary, *table]
