"""``weights/manifest.json``: what a weights directory holds and how its model wants its input."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Interpolation = Literal["nearest", "bilinear", "bicubic", "lanczos"]


class EvalPreset(BaseModel):
    """How a picture becomes the model's input: resize the short side, centre-crop, scale, normalise."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    resize_size: int = Field(gt=0)
    crop_size: int = Field(gt=0)
    interpolation: Interpolation = "bilinear"
    # On 0..1 pixels, as torchvision's Normalize expects.
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The (C, H, W) shape of one preprocessed image."""
        return (3, self.crop_size, self.crop_size)

    def given(self, resize_size: int | None = None, crop_size: int | None = None, interpolation: str | None = None,
              mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> "EvalPreset":
        """This preset with what is given in its place (None: this one's); a crop given alone resizes in this
        preset's proportion (224 of 256: ``round(crop / 0.875)``; the resize kept would evaluate a small crop's
        centre only, or pad a large one). ValueError (pydantic's, one a field) for values the server cannot serve."""
        if resize_size is None and crop_size is not None:
            resize_size = round(crop_size * self.resize_size / self.crop_size)
        given = {"resize_size": resize_size, "crop_size": crop_size, "interpolation": interpolation,
                 "mean": None if mean is None else tuple(mean), "std": None if std is None else tuple(std)}
        return EvalPreset(**{**self.model_dump(), **{key: value for key, value in given.items() if value is not None}})

    @model_validator(mode="after")
    def _servable(self) -> "EvalPreset":
        # Either was served before without a word (a user's own manifest): a division by zero, or pixels 255 times
        # too small for what the model learnt. (A crop larger than the resize is torchvision's CenterCrop's padding:
        # a pipeline some models were trained with, served as it pads.)
        if not all(0 < value <= 1 for value in self.std) or not all(0 <= value <= 1 for value in self.mean):
            scale = " (on 0..255: divide them by 255)" if max(*self.mean, *self.std) > 1 else ""
            raise ValueError(f"mean {list(self.mean)} and std {list(self.std)} are on the 0..1 scale of the pixels, "
                             f"each mean within 0..1 and each std above 0 and at most 1, as torchvision's Normalize "
                             f"takes them (ImageNet's: 0.485, 0.456, 0.406 and 0.229, 0.224, 0.225){scale}")
        return self


MANIFEST_NAME = "manifest.json"
TORCHSCRIPT_ARCH = "torchscript"  # the arch of a TorchScript file exported alone (no code to build)
WeightsFormat = Literal["torchscript", "state_dict"]


class WeightsFile(BaseModel):
    """One artifact in the weights directory, by bare file name, with its checksum."""

    model_config = ConfigDict(extra="forbid")

    path: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _bare_name(cls, value: str) -> str:
        # The manifest names files inside its own directory only: no traversal, no absolute paths.
        if Path(value).name != value or value in ("", ".", ".."):
            raise ValueError(f"file path must be a bare file name, got {value!r}")
        return value


MIN_TOP1_AGREEMENT = 0.99  # what a quantized package must reach against float32 before `auto` may serve it
MIN_EMBEDDING_COSINE = 0.99  # and its embeddings' lowest cosine similarity with float32's, when it answers them
# An ONNX file computes in float32 as the model does: its probabilities may differ by rounding only (measured under
# 1e-6 for the default model), where a quantized package's may differ by much more.
MAX_ONNX_PROBABILITY_DIFFERENCE = 1e-3


class Agreement(BaseModel):
    """A package's answers against the float32 model's on real photos (models/export/agreement.py), at export."""

    model_config = ConfigDict(extra="forbid")

    photos: int = Field(gt=0, description="images compared (views of photos int8 calibration never saw)")
    top1: float = Field(ge=0, le=1, description="share of images with the same top-1 class")
    max_probability_difference: float = Field(ge=0, description="largest difference of any class's probability")
    min_embedding_cosine: float | None = Field(default=None, ge=-1, le=1, description="lowest cosine similarity of "
                                               "an image's embedding with float32's (exports with an embedding)")


class CompiledPackage(WeightsFile):
    """An AOTInductor package (``torch.export`` + ``aoti_compile_and_package``): native code for one device type
    and dtype, built by one torch version, for batches of 1 to ``max_batch_size``. A quantized one
    (``quantization="int8"``: PT2E, models/export/quantize.py) takes and returns ``dtype`` tensors and computes in
    int8 inside; its ``agreement`` with the float32 model was measured at export. Manifests written before these
    two fields load with neither (a float package)."""

    device: Literal["cpu", "cuda"]
    dtype: Literal["float32", "float16", "bfloat16"]
    torch_version: str
    max_batch_size: int = Field(gt=0)
    compile_s: float = Field(ge=0, description="how long compiling took")
    quantization: Literal["int8"] | None = None
    agreement: Agreement | None = None


class OnnxFile(WeightsFile):
    """The model as ONNX (models/export/onnx.py), for ONNX Runtime on the CPU, with its answers' agreement with the
    float32 model measured at export. Manifests written before it load without it."""

    opset: int = Field(gt=0)
    max_batch_size: int = Field(gt=0, description="the batch dimension's upper bound at export")
    torch_version: str
    export_s: float = Field(ge=0, description="how long exporting took")
    agreement: Agreement


EMBEDDING_OUTPUT = "embedding"  # the output's name: V2's, ONNX's, the answers'


class EmbeddingOutput(BaseModel):
    """What an export's second output is: the input of its classification head (the pooled features), one
    ``dim``-vector per image, L2-normalised. Every artefact of such an export (TorchScript, ONNX, AOTInductor, int8;
    a state dict through models/architectures.WithEmbedding) answers it beside the logits from one forward pass,
    checked at export against the float32 model's: TorchScript within 1e-5, a float package within its probability
    tolerance (models/export/compile.py TOLERANCE), ONNX and int8 by their lowest cosine similarity
    (``Agreement.min_embedding_cosine``: an ONNX file below ``MIN_EMBEDDING_COSINE`` is not written, an int8 package
    below it is not served by ``auto``). Manifests written before it load without it: their models
    answer logits only."""

    model_config = ConfigDict(extra="forbid")

    layer: str = Field(min_length=1, description="the module whose input the embedding is (the classifier head)")
    dim: int = Field(gt=0)
    normalization: Literal["l2"] = "l2"


CONFIDENCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # upper edges, as Prometheus's `le`
LOW_CONFIDENCE_THRESHOLD = 0.5  # a prediction whose top-1 probability is below it counts as low-confidence


class PredictionReference(BaseModel):
    """What a version's predictions looked like on known images at export: the server's drift figure (PSI) compares
    the class mix of its recent predictions with ``class_counts`` (app/engine/loaded/monitor.py). Manifests written before
    it, and exports with no validation split (the packaged Lite0), have none: the server then takes its first
    predictions after the load as the reference."""

    model_config = ConfigDict(extra="forbid")

    source: Literal["validation"] = Field(description="validation: the validation split of the training run, through "
                                          "the exported weights' evaluation (evaluate() in models/train.py)")
    predictions: int = Field(gt=0, description="images the reference was measured on")
    class_counts: list[int] = Field(description="images whose top-1 class was each class, in label order")
    confidence_buckets: list[float] = Field(description="upper edges of the top-1 probability histogram")
    confidence_counts: list[int] = Field(description="images per bucket: above the previous edge, at most this "
                                         "one (the first from 0)")
    low_confidence_threshold: float = Field(gt=0, le=1)
    low_confidence_share: float = Field(ge=0, le=1, description="share of images whose top-1 probability is "
                                        "below low_confidence_threshold")

    @model_validator(mode="after")
    def _counts_add_up(self) -> "PredictionReference":
        if min(self.class_counts, default=-1) < 0 or min(self.confidence_counts, default=-1) < 0:
            raise ValueError("counts must be non-negative")
        if sum(self.class_counts) != self.predictions or sum(self.confidence_counts) != self.predictions:
            raise ValueError(f"class_counts and confidence_counts must each add up to predictions "
                             f"({self.predictions})")
        if (len(self.confidence_counts) != len(self.confidence_buckets)
                or list(self.confidence_buckets) != sorted(set(self.confidence_buckets))):
            raise ValueError("confidence_buckets must be increasing, one per confidence_counts entry")
        return self


class TrainedOn(BaseModel):
    """Which images trained the model, as its run named them on the machine that trained it: every image under
    ``folder`` but those ``held_out`` lists. ``models.predict`` counts an evaluation's images among them and warns
    (an accuracy on images the model learned from overstates it); where the folder is not there (another machine,
    moved), it cannot tell and says nothing. The server never reads it. Exports of no training run (the packaged
    Lite0) and manifests written before it have none."""

    model_config = ConfigDict(extra="forbid")

    folder: str = Field(min_length=1, description="the folder whose images trained it, absolute: the run's --data "
                        "split by --val-split, or its --data's train/")
    held_out: str | None = Field(default=None, description="the run's held_out.txt (absolute), listing the images "
                                 "under folder it validated on instead; None: none under folder was held out")


MIN_LABELS = 2  # a softmax over one class answers 1.0 for every image: no classifier
TOP5_MIN_CLASSES = 6  # with 5 classes or fewer, top-5 accuracy (and two versions' top-5 overlap) is 1.0 by
# construction: training, models.predict and the shadow's comparison leave it out there


def too_few_labels(labels: list[str]) -> str | None:
    """Why ``labels`` cannot be a classifier's (fewer than ``MIN_LABELS``), or None: the one message the manifest,
    the export and the server give."""
    if len(labels) >= MIN_LABELS:
        return None
    return (f"a classifier needs at least {MIN_LABELS} labels, got {len(labels)} ({labels}): over one class its "
            f"softmax answers 1.0 for every image; train and export it with every class it tells apart (a detector "
            f"of one thing is two classes: the thing and everything else)")


class Manifest(BaseModel):
    """Everything the server needs to load and serve a model, written by ``models.export``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    schema_version: Literal[1] = 1
    name: str = Field(min_length=1)
    version: str = Field(min_length=1)
    arch: str = Field(min_length=1)
    labels: list[str]
    preprocess: EvalPreset
    files: dict[WeightsFormat, WeightsFile] = Field(min_length=1)
    default_format: WeightsFormat
    packages: list[CompiledPackage] = Field(default_factory=list)
    onnx: OnnxFile | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    source: str = ""
    reference: PredictionReference | None = None  # optional: manifests written before it load without it
    embedding: EmbeddingOutput | None = None  # optional: exports written before it answer logits only
    trained_on: TrainedOn | None = None  # optional: exports of no run, and those written before it, have none

    @property
    def num_classes(self) -> int:
        """Number of output classes (one label per class)."""
        return len(self.labels)

    @property
    def torchscript_alone(self) -> bool:
        """A TorchScript file brought and exported alone (models.export --torchscript): no state dict to build ONNX,
        packages, gradients or an embedding from."""
        return self.arch == TORCHSCRIPT_ARCH and "state_dict" not in self.files

    @field_validator("labels")
    @classmethod
    def _classes_to_tell_apart(cls, labels: list[str]) -> list[str]:
        problem = too_few_labels(labels)
        if problem:
            raise ValueError(problem)
        blank = [i for i, label in enumerate(labels) if not label.strip()]
        if blank:  # (a label given twice is allowed: ImageNet's 'crane' is a bird and a machine; the index tells)
            raise ValueError(f"labels {blank} are empty: each class needs a name an answer can give")
        return labels

    @model_validator(mode="after")
    def _default_format_present(self) -> "Manifest":
        if self.default_format not in self.files:
            raise ValueError(f"default_format {self.default_format!r} has no entry in files")
        if self.reference is not None and len(self.reference.class_counts) != self.num_classes:
            raise ValueError(f"reference.class_counts has {len(self.reference.class_counts)} entries for "
                             f"{self.num_classes} labels")
        return self


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, streamed."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(weights_dir: Path) -> Manifest:
    """Parse and validate ``weights_dir/manifest.json`` (raises FileNotFoundError or pydantic.ValidationError)."""
    return Manifest.model_validate(json.loads((weights_dir / MANIFEST_NAME).read_text(encoding="utf-8")))


OMITTED_WHEN_NONE = ("trained_on",)  # (write_manifest)


def write_manifest(weights_dir: Path, manifest: Manifest) -> Path:
    """Write the manifest atomically, so a reader never sees half a file. A field newer than the servers that may
    read it, when it holds nothing (``trained_on`` of an export of no run), is left out: a server from before it
    refuses a manifest that names a field it does not know, even as null."""
    target = weights_dir / MANIFEST_NAME
    tmp = target.with_suffix(".json.tmp")
    left_out = {name for name in OMITTED_WHEN_NONE if getattr(manifest, name) is None}
    tmp.write_text(manifest.model_dump_json(indent=2, exclude=left_out) + "\n", encoding="utf-8")
    tmp.replace(target)
    return target
