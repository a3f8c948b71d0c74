"""One admitted request's inference (``Call``): its images checked and counted, decoded on the way its version's
decoder says, queued, and waited for until the deadline or the client hangs up; what comes back (``Served``); and
what the batcher's refusals mean to a client.

A protocol gets a ``Call`` from ``Service.admit`` (readiness, then the version the request keeps to its answer),
parses its body with ``call.model`` and calls ``call.infer``; the stages run in this order and nowhere else.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from app.engine.batching.batcher import Batcher
from app.engine.batching.types import (
    BatcherClosed,
    BatchRun,
    DeadlineExpired,
    DeadlineTooShort,
    DeadlineUnreachable,
    Group,
    QueueFull,
    ms,
)
from app.engine.contract import CLIENT_CHECK_S, Served
from app.engine.lifecycle import NOT_READY_RETRY_S
from app.engine.decoding.decoders import Prepared
from app.engine.decoding.device import check_header
from app.engine.decoding.image import DecodeLimits
from app.engine.loaded.predictor import NON_FINITE_OUTPUT
from app.engine.loaded.version import LoadedVersion
from app.errors import (
    ALSO_REFUSED,
    Backlog,
    BadRequest,
    ClientGone,
    DeadlineExceeded,
    DeadlinePassedBeforeQueue,
    InferenceFailed,
    NotReady,
    Overloaded,
    ServiceError,
    ShortDeadline,
    check_image_count,
    retry_after_header,
)


ShadowOffer = Callable[[Sequence[bytes], Sequence[np.ndarray | torch.Tensor], Sequence[Prepared],
                        Sequence[np.ndarray], Sequence[BatchRun]], None]


@dataclass(slots=True)
class Queued:
    """A request's images in its version's queue (``Call.queue``), one group: what its answer is made of once the
    group is done (``Call.answer``), or what is dropped when it ends first."""

    images: Sequence[bytes]
    pixels: list[np.ndarray | torch.Tensor]
    prepared: list[Prepared]
    group: Group[np.ndarray]  # (None only between ``Call.prepare`` and its queueing)
    deadline: float  # time.monotonic() after which the request is answered 504
    timeout_s: float
    names: Sequence[str | None]
    decode_s: float
    started_ns: int
    decode_cpu_s: float = 0.0  # the decode's CPU on the thread that queued it (not a batch it may have run inline)

    def done(self) -> bool:
        """Every image has its row (or one its error)."""
        return self.group.done()

    def drop(self) -> int:
        """Cancel the images still queued (they cost no forward pass) unless their batches began; how many were."""
        return len(self.prepared) if self.group.cancel() else 0


class Call:
    """A request admitted and routed to a loaded version; ``model`` is what the protocol parses and shapes with
    (its name, version, classes, input shape), ``infer`` runs its images and waits for them. An engine serving many
    connections from one thread runs the same steps without waiting: ``queue``, then ``answer`` once every future
    is done, or ``expired`` / ``hung_up`` when the deadline or the client's hang-up comes first. While the call is
    open the request counts as on its way to the version's next batch (``arrived`` ends that just before its images
    are queued). ``shadow`` (a rollout's shadow share) gets the images and the answer once it is ready, off the
    response path."""

    __slots__ = ("_version", "_arrived", "_max_images", "_shadow", "model", "takes_pixels", "requests", "drawn")

    def __init__(self, version: LoadedVersion, arrived: Callable[[], None], max_images: int,
                 shadow: ShadowOffer | None = None, takes_pixels: bool = True, requests: int = 1,
                 drawn: bool = False) -> None:
        self._version, self._arrived, self._shadow = version, arrived, shadow
        self._max_images = max_images  # a request's
        self.requests = requests  # the requests it runs: one, or a bundle's (``Service.enter_many``'s one call; as
        # many as it still runs once they are checked: ``EngineServer._admit_bundle``)
        self.model = version.signature
        self.takes_pixels = takes_pixels  # False: a canary of another input than the pixels of an unversioned
        # request are shaped for (the default's): the protocol raises PixelsForTheDefault on seeing pixels
        self.drawn = drawn  # a rollout's draw routed it: its refusal says nothing of its route's other requests

    def one(self) -> "Call":
        """A call for one of the requests this one runs (a bundle's, run apart, each then timed, counted and
        judged as a request alone): the same version, arrival and shadow, one request's room; itself when it runs
        one."""
        if self.requests == 1:
            return self
        return Call(self._version, self._arrived, self._max_images, self._shadow, self.takes_pixels, drawn=self.drawn)

    @property
    def decodes_on_host(self) -> bool:
        """Whether queueing an image decodes it here on the CPU (the PIL and tensor paths), not only reads its
        header (the device path decodes in the batch)."""
        return self._version.decoder.path != "device"

    def infer(self, images: Sequence[bytes] = (), tensors: Sequence[np.ndarray | torch.Tensor] = (), *,
              timeout_s: float, names: Sequence[str | None] = (),
              client_gone: Callable[[], bool] | None = None, embedding: bool = False,
              arrived: float | None = None) -> Served:
        """Encoded ``images`` (decoded here) or preprocessed ``tensors`` (float32 (C, H, W) arrays or tensors, or their
        (N, C, H, W) array), with the request's deadline (``timeout_s``, counted from ``arrived``, else this call: a
        wait for a request thread, the decode, the queue and the forward pass all count) and, where the request gave
        them, the images' file names (errors say
        which image); ``embedding``: answer each image's embedding too (NoEmbedding when the version has none).
        Once ``client_gone`` says the client hung up, the images still queued are dropped unrun. Raises a
        ServiceError for every refusal."""
        if embedding:
            self.model.check_embedding()
        queued = self.queue(images, tensors, timeout_s=timeout_s, names=names, arrived=arrived)
        while not queued.done():
            remaining = queued.deadline - time.monotonic()
            if remaining <= 0:
                raise self.expired(queued)
            # Without a client to watch, one wait to the deadline; else look every CLIENT_CHECK_S.
            queued.group.wait(remaining if client_gone is None else min(remaining, CLIENT_CHECK_S))
            if client_gone is not None and client_gone():
                raise self.hung_up(queued)
        return self.answer(queued, embedding=embedding)

    def queue(self, images: Sequence[bytes] = (), tensors: Sequence[np.ndarray | torch.Tensor] = (), *,
              timeout_s: float, names: Sequence[str | None] = (), inline: bool = True, defer: bool = False,
              client_gone: Callable[[], bool] | None = None, arrived: float | None = None) -> Queued:
        """The request's images checked, counted, decoded (or their headers read) and queued, all or none; its
        deadline counts from ``arrived`` (a ``time.monotonic()`` value: when its HTTP worker had it whole, or the
        engine process received it, so a wait for a decode thread counts too; by default now), before the decode
        (one the decode outlasts, or a wait before it, is a 504, nothing queued).
        ``inline=False``: never run on this thread, even when the batcher is idle; ``defer``: queued without waking
        the batcher's thread, for ``batcher.run_queued`` once the caller has queued the other requests it holds (a
        thread that serves many requests runs their batch itself when it is short).
        Once decoded, images whose client ``client_gone`` says has hung up are dropped there (ClientGone), not
        queued. Raises a ServiceError for every refusal."""
        queued = self.prepare(images, tensors, timeout_s=timeout_s, names=names, arrived=arrived)
        if client_gone is not None and client_gone():
            count = len(queued.prepared)
            self._version.observer.event("client_gone", count)
            raise ClientGone(f"the client closed the connection while its images were decoded; {count} dropped")
        self._arrived()
        try:
            queued.group = self._version.batcher.submit_group(queued.prepared, deadline=queued.deadline,
                                                              inline=inline, defer=defer)
        except (QueueFull, BatcherClosed, DeadlineTooShort, DeadlineExpired) as exc:
            raise _refused(exc, timeout_s, self.drawn) from None
        return queued

    def prepare(self, images: Sequence[bytes] = (), tensors: Sequence[np.ndarray | torch.Tensor] = (), *,
                timeout_s: float, names: Sequence[str | None] = (), arrived: float | None = None) -> Queued:
        """``queue``'s first half: the request's images checked, counted and decoded (or their headers read), its
        deadline set; nothing queued yet (its ``group`` None until ``queue_prepared``)."""
        if (len(images) > 0) == (len(tensors) > 0):  # tensors may be one (N, C, H, W) array: no truth value
            raise BadRequest("the request holds no images" if not images else "send images or tensors, not both")
        count = len(images) or len(tensors)
        check_image_count(count, self._max_images * self.requests)
        deadline = (time.monotonic() if arrived is None else arrived) + timeout_s  # and during the decode too
        if images:  # before any decode: what the queue would refuse costs nothing (submit_many checks pixels)
            _check_room(self._version, count, deadline, timeout_s, self.drawn,
                        decoding=self._version.arrivals.count() - 1)  # the others on their way (this call: one)
        started_ns = time.time_ns()
        pixels = list(tensors)  # made one tensor with their batch (Decoder.collate), not one by one here
        prepared, decode_s, decode_cpu_s = (self._prepare(images, names, deadline, timeout_s) if images
                                            else (list(pixels), 0.0, 0.0))
        return Queued(images, pixels, prepared, None, deadline, timeout_s, names, decode_s, started_ns, decode_cpu_s)

    @property
    def batcher(self) -> Batcher:
        """The batcher its images queue on (the version's): after ``queue(defer=True)``, its ``run_queued`` runs
        them (once for every call deferred on it)."""
        return self._version.batcher

    def expired(self, queued: Queued) -> DeadlineExceeded:
        """The deadline passed first: the images still queued dropped; the error to answer."""
        queued.drop()
        return DeadlineExceeded.of_request(queued.timeout_s)

    def hung_up(self, queued: Queued) -> ClientGone:
        """The client hung up first: the images still queued dropped (and counted); the error to answer."""
        dropped = queued.drop()
        self._version.observer.event("client_gone", dropped)
        return ClientGone(f"the client closed the connection; {dropped} queued images dropped")

    def answer(self, queued: Queued, labels: list[str] | None = None, embedding: bool = False) -> Served:
        """The answer of a request whose group is done (offered to the shadow first), with ``labels`` (None:
        the version's), and each image's embedding when asked for (the rows' last columns; else the rows are the
        probabilities alone, so nothing more is carried on); raises what failed."""
        values, runs = self._done_values(queued)
        if len(values) == 1 and isinstance(values[0], np.ndarray):  # one image: its row of the batch's array, not
            rows = values[0][None] if embedding or not self.model.embedding_dim else (  # a copy
                values[0][None, :len(self.model.labels)])
        elif embedding or not self.model.embedding_dim:
            rows = np.array(values)
        else:  # the probabilities' columns alone
            classes = len(self.model.labels)
            rows = np.array([value[:classes] for value in values])
        _numbers(rows)
        return Served(rows, runs, self.model.name, self.model.version,
                      self.model.labels if labels is None else labels, queued.decode_s, queued.started_ns,
                      self.model.embedding_dim if embedding else 0)

    def _done_values(self, queued: Queued) -> tuple[list[np.ndarray], tuple[BatchRun, ...]]:
        """A done group's rows, one per image, and the batches they ran in (offered to the shadow first); raises
        what failed."""
        try:
            values = queued.group.result()
        except DeadlineExpired:
            raise self.expired(queued) from None
        except BatcherClosed as exc:  # the inference thread ended with its images held or queued
            raise service_error(exc) from None
        except ServiceError as exc:  # an image the device path could not decode in its batch
            out_of_scale = (exc.code == NON_FINITE_OUTPUT and queued.pixels and self.requests == 1  # (a bundle's
                            and _out_of_scale(queued.pixels, queued.group.failed_at))  # run apart: app/link/loop.py)
            if out_of_scale:  # the client's own pixels, of values no preprocessing makes: theirs, not the model's
                raise out_of_scale from None
            raise _named(exc, queued.group.failed_at, queued.names) from None
        except Exception as exc:
            raise InferenceFailed.of(exc, "the model failed on this request's images") from exc
        runs = queued.group.runs()
        if self._shadow is not None:
            self._shadow(queued.images, queued.pixels, queued.prepared, values, runs)
        return values, runs

    def _prepare(self, images: Sequence[bytes], names: Sequence[str | None], deadline: float = math.inf,
                 timeout_s: float = math.inf) -> tuple[list[Prepared], float, float]:
        """The images decoded (or their headers read), one by one; DeadlineExceeded once the request's ``deadline``
        passes between two of them: the rest are not decoded for an answer nobody waits for (16 large PNGs held a
        worker past twice their deadline, a security review)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        prepared = []
        for index, data in enumerate(images):
            if index and time.monotonic() > deadline:
                raise DeadlinePassedBeforeQueue.of_request(
                    timeout_s, f"while its images were decoded ({index} of {len(images)})")
            try:
                prepared.append(self._version.decoder.prepare(data))
            except ServiceError as exc:
                raise _with_later_refusals(_named(exc, index, names), images, index, names,
                                           self._version.decoder.limits) from None
        decode_s, decode_cpu_s = time.perf_counter() - started, time.thread_time() - cpu_started
        self._version.batcher.note_decoded(len(images), decode_s)
        self._version.observer.decoded(decode_s, decode_cpu_s, self.requests)  # (a bundle's: each its decode stage)
        return prepared, decode_s, decode_cpu_s


def queue_prepared(calls: Sequence[Call], requests: Sequence[Queued]) -> list[Queued | Exception]:
    """Requests of one version, each ``prepare``d by its call, queued as ``Call.queue(defer=True)`` queues one
    (``run_queued`` runs them), under one hold of the version's queue (``Batcher.submit_groups``): each its Queued,
    in order, or what ``Call.queue`` would have raised for it (the ServiceError of a refusal)."""
    for call in calls:
        call._arrived()
    groups = calls[0].batcher.submit_groups([(queued.prepared, queued.deadline) for queued in requests])
    answers: list[Queued | Exception] = []
    for call, queued, group in zip(calls, requests, groups):
        if isinstance(group, Group):
            queued.group = group
            answers.append(queued)
        elif isinstance(group, (QueueFull, BatcherClosed, DeadlineTooShort, DeadlineExpired)):
            try:
                answers.append(_refused(group, queued.timeout_s, call.drawn))
            except Exception as exc:  # noqa: BLE001 - its own fault (a deadline's length that does not format):
                answers.append(exc)  # the others' groups are queued, and theirs to answer
        else:
            answers.append(group)
    return answers


def _numbers(rows: np.ndarray) -> None:
    """InferenceFailed unless ``rows`` hold numbers (objects: nothing a client can read, nor the link carry)."""
    if rows.dtype.hasobject:
        raise InferenceFailed(f"the model answered rows of {rows.dtype}, not numbers")


def _refused(exc: QueueFull | BatcherClosed | DeadlineTooShort | DeadlineExpired, timeout_s: float,
             drawn: bool = False) -> ServiceError:
    """What the queue's refusal of a request means to its client (``timeout_s``: its deadline's length; ``drawn``:
    a rollout's draw routed it)."""
    if _spent(exc, timeout_s):  # the decode outlasted it
        return DeadlinePassedBeforeQueue.of_request(timeout_s, "while its images were decoded")
    return _before_queue(service_error(exc, timeout_s, drawn))


def _before_queue(error: ServiceError) -> ServiceError:
    """A refusal of the queue's as what it means before the images queued: a 504 there is DeadlinePassedBeforeQueue
    (the version never had them)."""
    return DeadlinePassedBeforeQueue(error.message) if isinstance(error, DeadlineExceeded) else error


def _spent(exc: Exception, timeout_s: float) -> bool:
    """Whether the batcher's refusal is of a deadline that passed before its images queued though no shorter than
    their own inference (a decode, a wait for a busy engine spent it: 504), not of one too short (400)."""
    return isinstance(exc, DeadlineExpired) or (
        isinstance(exc, DeadlineTooShort) and exc.left_s <= 0 and exc.own_s <= timeout_s)


PIXELS_IN_SCALE = 1e4  # no preprocessing makes pixels beyond this (ImageNet's normalisation about +-3, raw 0-255)


def _out_of_scale(pixels: Sequence[np.ndarray | torch.Tensor], index: int) -> BadRequest | None:
    """A client's pixels the model answered NaN or infinity for, of values beyond PIXELS_IN_SCALE (finite, the
    protocol checked: 1e38 overflows its layers): a 400 saying their range, not the version's failure (a 500 counted
    against a rollout). None for pixels within it: then the model is at fault (NaN weights, a float16 overflow)."""
    batch = pixels[0] if len(pixels) == 1 and np.ndim(pixels[0]) == 4 else None  # one (N, C, H, W) array
    image = np.asarray(batch[index] if batch is not None else pixels[index], dtype=np.float64)
    if np.abs(image).max(initial=0.0) <= PIXELS_IN_SCALE:
        return None
    return BadRequest(f"image {index}: the model's output is not finite (NaN or infinity) for these pixels, of values "
                      f"from {image.min():.3g} to {image.max():.3g}: send pixels preprocessed as the model's "
                      f"`preprocess` in GET /v1/models/<name> says (resized, cropped, normalised), not raw values "
                      f"of that size")


NAME_SHOWN = 100  # the most of a file name an error message shows (its start and end), of a sender's any length
NAME_KEPT = 255  # the most of it an error's details keep: a longer one is no file name on any common file system


def _label(index: int, names: Sequence[str | None]) -> str:
    """How an error calls image ``index``: its position, and its file name (a multipart part's) shortened."""
    name = names[index] if index < len(names) else None
    shown = name if name is None or len(name) <= NAME_SHOWN else f"{name[:NAME_SHOWN - 21]}…{name[-20:]}"
    return f"image {index}" + (f" ({shown})" if name else "")


def _named(exc: ServiceError, index: int, names: Sequence[str | None]) -> ServiceError:
    """``exc`` saying which image it is about, so a client knows which of its images to fix: its position, and its
    file name (a multipart part's) shortened in the message, cut in ``details``: an answer never echoes a name of
    tens of kilobytes twice."""
    name = names[index] if index < len(names) else None
    exc.message = f"{_label(index, names)}: {exc.message}"
    exc.args = (exc.message,)
    exc.details = {"image": index, "filename": None if name is None else name[:NAME_KEPT],
                   **(exc.details if isinstance(exc.details, dict) else {})}
    return exc


ALSO_REFUSED_SHOWN = 5  # the most later refused images an error's message names (its details have them all)


def _with_later_refusals(exc: ServiceError, images: Sequence[bytes], index: int, names: Sequence[str | None],
                         limits: DecodeLimits) -> ServiceError:
    """``exc``, the refusal of image ``index`` (named), with the images after it whose header the decode rules
    refuse too (read, not decoded: a refused request's CPU stays small) in its details' ``also_refused`` (each
    {"image", "filename", "status", "code", "message"}) and named at the end of its message, so that a client
    fixes them all at once; an image after it whose pixels alone are broken is not found."""
    later = []
    for position in range(index + 1, len(images)):
        try:
            check_header(images[position], limits)
        except ServiceError as refusal:
            named = _named(refusal, position, names)
            later.append({**named.details, "status": named.status, "code": named.code, "message": named.message})
    if later:
        shown = ", ".join(_label(item["image"], names) for item in later[:ALSO_REFUSED_SHOWN])
        more = f" and {len(later) - ALSO_REFUSED_SHOWN} more" if len(later) > ALSO_REFUSED_SHOWN else ""
        exc.message = f"{exc.message}{ALSO_REFUSED}{shown}{more} (details' also_refused)"
        exc.args = (exc.message,)
        exc.details = {**exc.details, "also_refused": later}
    return exc


def check_room(version: LoadedVersion, count: int, timeout_s: float, drawn: bool = False) -> None:
    """Overloaded (429 with Retry-After), ShortDeadline or NotReady unless ``version``'s queue can take ``count``
    images to be answered within ``timeout_s`` from now (``drawn``: a rollout's draw routed the request there)."""
    _check_room(version, count, time.monotonic() + timeout_s, timeout_s, drawn)


def _check_room(version: LoadedVersion, count: int, deadline: float, timeout_s: float, drawn: bool = False,
                decoding: int = 0) -> None:
    """``check_room`` against a deadline (a ``time.monotonic()`` value) of ``timeout_s``; ``decoding``: other
    requests' images being decoded for the same queue now (``Batcher.check_room``)."""
    try:
        version.batcher.check_room(count, deadline, max(0, decoding))
    except (QueueFull, BatcherClosed, DeadlineTooShort, DeadlineExpired) as exc:  # (expired: a V2 timeout of a few
        if isinstance(exc, DeadlineTooShort) and _spent(exc, timeout_s):  # microseconds is past before it is
            raise DeadlinePassedBeforeQueue.of_request(timeout_s, "before its images were decoded") from None
            # (judged: too short)
        raise _before_queue(service_error(exc, timeout_s, drawn)) from None


def service_error(exc: Exception, timeout_s: float | None = None, drawn: bool = False) -> ServiceError:
    """What the batcher's own refusals mean to a client (``timeout_s``: the length of the request's deadline). A
    deadline is too short (400, no retry) when its length is, not when time spent before its images queued (their
    decode, a wait for the engine on a busy server) left too little of it: that is 429 deadline_unreachable.
    A backlog's refusal (DeadlineUnreachable) of a request its route alone sent there (not ``drawn`` by a rollout)
    says until when (``Backlog``): the HTTP worker refuses that route's requests whose deadline ends sooner before
    its app for a while (app/hosting/recent_refusals.py), as this would."""
    if isinstance(exc, DeadlineTooShort):
        if timeout_s is None or exc.own_s > timeout_s:
            return ShortDeadline(exc.said(exc.left_s if timeout_s is None else timeout_s))
        error = Overloaded(f"{ms(exc.left_s)} was left of the request's {ms(timeout_s)} deadline when its images "
                           f"queued, less than their own inference (about {ms(exc.own_s)}): the server is busy",
                           headers=retry_after_header(exc.retry_after_s))
        error.code = "deadline_unreachable"
        return error
    if isinstance(exc, DeadlineExpired):
        return DeadlineExceeded(str(exc))
    if isinstance(exc, QueueFull):
        error = Overloaded(str(exc), headers=retry_after_header(exc.retry_after_s))
        if isinstance(exc, DeadlineUnreachable):
            error.code = "deadline_unreachable"
            if not drawn:
                error.backlog = Backlog(exc.busy_until, exc.item_s, exc.company_s)
        return error
    # The batcher is closed: this worker is going away, so the client should reconnect elsewhere.
    return NotReady(str(exc), headers={**retry_after_header(NOT_READY_RETRY_S), "Connection": "close"})
