"""The engine as the HTTP side knows it, torch-free, so the protocols and the web layer can run in processes that
never import torch (under ENGINE=process, reaching an engine process through app/link/client.py) and the same types
serve when the engine runs inside the worker:

- the data that crosses: ``Signature`` (what a protocol parses a request with), ``Served`` and ``Ranked`` (a
  request's answer, its stage times: ``stage_ms``), ``VersionInfo`` (one loaded version's facts, its prediction
  monitor's ``MonitorSnapshot`` among them), ``VersionState`` (a row of the repository index);
- the faces: ``ServiceFace`` (what protocols and the web layer use of a service: ``admit`` -> a ``CallFace``, the
  ``catalog``, readiness, draining), ``CatalogFace`` (every catalog call, the one list the remote catalog is made
  from: ``CATALOG_CALLS``), implemented by the engine's ``Service`` and the link's ``RemoteService`` (both a
  ``app/engine/lifecycle.py`` ``Lifecycle``: what they do alike).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, NamedTuple, Protocol, Sequence

import numpy as np

from app.config import Settings
from app.engine.batching.arrivals import InFlight
from app.engine.batching.types import BatchRun
from app.engine.ranking import top_indices
from app.errors import NoEmbedding
from models.export.manifest import Manifest

CLIENT_CHECK_S = 0.05  # how often a waiting request looks whether its client is still connected


@dataclass(frozen=True)
class Signature:
    """What a protocol parses a request and shapes its answer with: the version that answers, its classes in output
    order, and the input a client may send preprocessed."""

    name: str
    version: str
    labels: list[str]
    input_shape: tuple[int, ...]  # (C, H, W) of one preprocessed image
    embedding_dim: int = 0  # the length of the embedding it answers when asked (0: its export has none)

    def check_embedding(self) -> None:
        """NoEmbedding (400) unless this version answers embeddings."""
        if not self.embedding_dim:
            raise NoEmbedding(f"{self.name} version {self.version} was exported without an embedding: an export "
                              f"of a release before embeddings (export it again: every export since records one), or "
                              f"a model whose head is no Linear layer at the end of its forward pass (the export's "
                              f"log said so), or a TorchScript file exported alone")

    @property
    def num_classes(self) -> int:
        """How many classes the model tells apart (the width of its output)."""
        return len(self.labels)


class Ranked(NamedTuple):
    """One class of an image's top k: its index in the output, its label, its probability."""

    index: int
    label: str
    score: float


@dataclass(slots=True)
class Served:
    """A request's answer: its ``rows``, one per input in order (float32 probabilities, followed by the image's
    embedding when it was asked for: ``embedding_dim`` columns), the batches they ran in (a run of consecutive
    inputs per batch, in input order: ``Group.runs``), which version gave it, and how long decoding took. Never
    changed once made, but not frozen: made on both sides of every request (app/link/wire.py ``_Message``)."""

    rows: np.ndarray
    batches: tuple[BatchRun, ...]
    model: str
    version: str
    labels: list[str]  # class names in output order
    decode_s: float
    started_ns: int = 0  # wall clock (time.time_ns) when decoding began: traces place the stages from it
    embedding_dim: int = 0  # the rows' last columns that are the embedding (0: none asked)

    def labelled(self, labels: list[str]) -> "Served":
        """This answer with ``labels`` (an answer crosses the link without them): made directly, where
        ``dataclasses.replace`` looks the fields up again each time (about 10 us a request)."""
        return Served(self.rows, self.batches, self.model, self.version, labels, self.decode_s, self.started_ns,
                      self.embedding_dim)

    def between(self, start: int, stop: int) -> "Served":
        """The answer of rows ``start`` to ``stop`` alone (a bundle's requests on one connection: theirs of its
        rows): those rows (a view) and the runs they ran in, cut to them."""
        if start == 0 and stop == len(self.rows):
            return self
        runs, at = [], 0
        for run in self.batches:
            first, last = max(at, start), min(at + run.rows, stop)
            if first < last:
                runs.append(run if last - first == run.rows else run._replace(rows=last - first))
            at += run.rows
        return Served(self.rows[start:stop], tuple(runs), self.model, self.version, self.labels, self.decode_s,
                      self.started_ns, self.embedding_dim)

    def batch_sizes(self) -> list[int]:
        """The size of the batch each input ran in, in input order."""
        return [size for run in self.batches for size in (run.batch_size,) * run.rows]

    def probabilities(self) -> np.ndarray:
        """(N, classes) float32 softmax probabilities, one row per input."""
        rows = self.rows
        return rows[:, :rows.shape[1] - self.embedding_dim] if self.embedding_dim else rows

    def embeddings(self) -> np.ndarray:
        """(N, embedding_dim) float32 L2-normalised embeddings, one row per input (asked for: ``embedding_dim``)."""
        assert self.embedding_dim, "no embedding was asked for"
        return np.ascontiguousarray(self.rows[:, -self.embedding_dim:])

    def top_k(self, k: int) -> list[list[Ranked]]:
        """Each image's ``k`` most probable classes (at most every class), most probable first (ties: the lower
        index first)."""
        probabilities = self.probabilities()
        order = top_indices(probabilities, min(k, probabilities.shape[1]))
        labels = self.labels
        return [[Ranked(i, labels[i], score) for i, score in zip(indices, row[indices].tolist())]
                for row, indices in zip(probabilities, order.tolist())]


def stage_ms(runs: Sequence[BatchRun]) -> tuple[float, float]:
    """(queue, inference) milliseconds of one request's images: the one definition the Server-Timing header and
    the access log both report.

    inference: the wall time the request's images spent in forward passes, the sum of its batch runs' ``run_s`` (one
    run per batch: images of one batch share its forward pass). A request's images are queued together and a
    batcher runs one batch at a time, so its batches never overlap and their durations add up; the largest alone
    would leave out every batch but one, and a sum over images would count a batch once per image.
    queue: from the images' queueing to the end of the request's last batch, less that inference: the time they
    waited behind other work (and for company) while none of the request's batches ran: decode + queue + inference
    then add up to the request's time from its first decode to the end of its last forward pass.
    """
    inference_s = sum(run.run_s for run in runs)
    done_s = max(run.queued_s + run.run_s for run in runs)
    return max(0.0, done_s - inference_s) * 1000, inference_s * 1000


@dataclass(frozen=True)
class Explanation:
    """Why a version chose a class for one image: its Grad-CAM map (``grid``: rows of 0..1 values over ``crop``, the
    region (left, top, right, bottom) of the photo the model saw), from the feature map of ``layer``, computed on its
    ``weights`` (the format that gave the gradients), and the overlay PNG when asked for."""

    model: str
    version: str
    index: int
    label: str
    score: float
    method: str
    layer: str
    weights: str
    grid: list[list[float]]
    crop: tuple[int, int, int, int]
    explain_ms: float
    png: bytes | None = None


@dataclass(frozen=True)
class ClassCount:
    """A class the window's predictions name, how often, and its share of the window."""

    label: str
    index: int
    count: int
    share: float


@dataclass(frozen=True)
class ReferenceSummary:
    """Where the reference comes from and what it holds."""

    source: str  # validation (the manifest's), or first_predictions (this worker's first window after the load)
    predictions: int  # while first_predictions collects: collected so far
    complete: bool
    low_confidence_threshold: float
    low_confidence_share: float | None


@dataclass(frozen=True)
class MonitorSnapshot:
    """A version's prediction monitor's state for /v1/models (app/engine/loaded/monitor.py)."""

    window_size: int
    predictions: int
    predictions_total: int
    psi: float | None
    psi_bins: int
    low_confidence_threshold: float
    low_confidence_ratio: float | None
    top_classes: list[ClassCount]
    reference: ReferenceSummary


@dataclass(frozen=True)
class VersionInfo:
    """One loaded version's facts, as /v1/models and the V2 metadata show them."""

    manifest: Manifest
    weights_format: str
    device: str
    dtype: str
    memory_format: str  # contiguous or channels_last: the layout its forward passes run in
    warmed_batch_sizes: list[int]
    alive: bool  # its batcher's thread runs
    default: bool  # requests naming no version get it
    role: str | None  # live, canary, shadow or previous while a rollout is set
    memory_bytes: int
    device_memory_bytes: int | None
    monitoring: MonitorSnapshot
    batch_cap: int  # the batch size cap measured at warm-up
    current_max_batch_size: int  # lower for a while after a CUDA out-of-memory split
    queue_depth: int
    profile: dict[int, float]  # forward images/s per batch size, at warm-up

    @property
    def name(self) -> str:
        """The model's name."""
        return self.manifest.name

    @property
    def version(self) -> str:
        """The version."""
        return self.manifest.version


@dataclass(frozen=True)
class ModelsOverview:
    """What /v1/models shows, read in one catalog call (one exchange with an engine process, not four): every loaded
    version, what each worker serves, the default model, the rollouts."""

    versions: list[VersionInfo]
    workers: list[dict[str, Any]]
    default_model: str | None
    rollouts: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class VersionState:
    """One row of the repository index: a version and what this process does with it."""

    name: str
    version: str
    state: str  # READY, LOADING, UNLOADING, UNAVAILABLE (Triton's words)
    reason: str = ""


@dataclass(frozen=True)
class RepositoryOverview:
    """What the V2 repository index shows, read in one catalog call (one exchange with an engine process, not
    several): every version's state, each version's role (its model's default is "live") and the rollouts."""

    index: list[VersionState]
    roles: dict[tuple[str, str], str]
    rollouts: dict[str, dict[str, Any]]


class CatalogFace(Protocol):
    """What protocols read about the served models and the calls that change them (app/engine/catalog.py):
    plain data out. Every public method here is a catalog call; an engine process answers the same ones."""

    def versions(self) -> list[VersionInfo]: ...
    def overview(self) -> ModelsOverview: ...
    def repository_overview(self) -> RepositoryOverview: ...
    def version(self, name: str | None, version: str | None = None) -> VersionInfo: ...
    def signature(self, name: str | None, version: str | None = None) -> Signature: ...
    def routes_generation(self) -> int: ...
    def default_model(self) -> str | None: ...
    def serving(self) -> dict[str, Any]: ...
    def workers(self) -> list[dict[str, Any]]: ...
    def index(self) -> list[VersionState]: ...
    def in_repository(self, name: str, version: str | None = None) -> bool: ...
    def roles(self) -> dict[tuple[str, str], str]: ...
    def rollouts(self) -> dict[str, dict[str, Any]]: ...
    def settle_figures(self) -> None: ...
    def load(self, name: str, config: Any = None) -> dict[str, Any]: ...
    def unload(self, name: str) -> dict[str, Any]: ...
    def promote(self, name: str, version: str | None = None) -> dict[str, Any]: ...
    def rollback(self, name: str, version: str | None = None) -> dict[str, Any]: ...


# The catalog's calls, from the face itself: a new call is one method on CatalogFace and its implementation.
CATALOG_CALLS = tuple(name for name, _ in inspect.getmembers(CatalogFace, inspect.isfunction)
                      if not name.startswith("_"))
# Those that change what is served (each waits for every engine to apply it); every other one reads.
CATALOG_CHANGES = frozenset({"load", "unload", "promote", "rollback"})


class PixelsForTheDefault(Exception):
    """Raised in an admission (``ServiceFace.admit``) whose call cannot take the request's pixels (``takes_pixels``
    False: a canary whose input differs from the default's, for which a request naming no version shapes them): the
    admission ends uncounted, and the request is admitted again with ``pixels=True``, which routes it to the
    default."""


class CallFace(Protocol):
    """One admitted request: ``model`` to parse its body with, ``infer`` to run its images (its deadline of
    ``timeout_s`` counted from ``arrived``, a ``time.monotonic()`` value: when its worker had it whole, so a wait for a
    request thread counts; None: from now); ``takes_pixels``: False when pixels (not images) must go to the default
    (PixelsForTheDefault)."""

    model: Signature
    takes_pixels: bool

    def infer(self, images: Sequence[bytes] = (), tensors: Sequence[Any] = (), *, timeout_s: float,
              names: Sequence[str | None] = (), client_gone: Callable[[], bool] | None = None,
              embedding: bool = False, arrived: float | None = None) -> Served: ...


class ServiceFace(Protocol):
    """What protocols and the web layer use of a service, in the worker (``Service``) or across the link
    (``RemoteService``)."""

    settings: Settings
    catalog: CatalogFace
    in_flight: InFlight

    def admit(self, name: str | None = None, version: str | None = None, client_key: str | None = None,
              images: int = 0, timeout_s: float | None = None, pixels: bool = False) -> ContextManager[CallFace]: ...
    @property
    def loaded(self) -> bool: ...
    @property
    def alive(self) -> bool: ...
    @property
    def ready(self) -> bool: ...
    @property
    def draining(self) -> bool: ...
    @property
    def refusing(self) -> bool: ...
    @property
    def stalled(self) -> str | None: ...
    @property
    def not_ready_reason(self) -> str | None: ...
    def begin_drain(self, within_s: float | None = None) -> None: ...
    def deadline_limit_s(self, request_timeout_s: float) -> float: ...
    def stop_serving(self) -> None: ...
    def shutdown(self, timeout: float | None = None) -> None: ...
    def wait_drained(self, min_s: float, max_s: float, answer_on: Callable[[], bool] | None = None) -> bool: ...
    def wait_loaded(self, timeout_s: float) -> None: ...
    def require_loaded(self) -> None: ...
    def require_ready(self) -> None: ...
    def explain(self, image: bytes, name: str | None = None, version: str | None = None, index: int | None = None,
                png: bool = False, timeout_s: float = 30.0) -> Explanation: ...
