"""The service: readiness, draining, admitting a request, and the served models (``catalog``).

Protocols reach the engine in two ways only: a request through ``Service.admit``, which yields the request's
``Call`` (app/engine/call.py, whose ``infer`` runs the stages in order; the order lives there only), and everything
about models through ``Service.catalog`` (app/engine/catalog.py: plain data and the calls that change them).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

from app.config import Settings
from app.engine.call import Call, check_room
from app.engine.catalog import Catalog
from app.engine.contract import Explanation, PixelsForTheDefault
from app.engine.lifecycle import Lifecycle, not_ready
from app.engine.explain import ExplainLane
from app.engine.loaded.predictor import Predictor
from app.engine.loaded.version import LoadedVersion
from app.engine.rollouts.evidence import Traffic
from app.engine.rollouts.shadow import offer
from app.engine.versions.controller import VersionsController
from app.engine.versions.routing import Route
from app.engine.versions.sources import GivenSource, Source
from app.errors import DeadlinePassedBeforeQueue, ServiceError
from app.metrics import BATCHER_ALIVE, READY, VERSION_REQUEST_SECONDS, VERSION_REQUESTS, RequestTally, series

log = logging.getLogger(__name__)


class Service(Lifecycle):
    """Admitting requests to the served models (``catalog``), with liveness, readiness and draining
    (``contract.ServiceFace``; the lifecycle shared with the link's ``RemoteService``).

    ``build`` loads synchronously; ``start`` answers at once and loads in the background, so a worker that is
    still loading its models says so (503 with Retry-After) instead of leaving connections in the listen backlog.
    """

    def __init__(self, settings: Settings, source: Source) -> None:
        super().__init__()
        self.settings = settings
        self.controller = VersionsController(settings, source, on_report=self._reported)
        self.catalog = Catalog(settings, self.controller, self.wait_loaded)
        self._routes = self.controller.routes  # what serves now: the routing table
        self._loader: threading.Thread | None = None
        # Requests' outcomes held for the one thread that admits every request to write together (an event loop,
        # once a turn: app/link/loop.py); None: each written as its request ends (any thread)
        self.counts: RequestTally | None = None
        self.explanations = ExplainLane(settings)
        self._stall_said: float | None = None  # the start of the stalled batch last logged

    @classmethod
    def build(cls, settings: Settings, source: Source | Predictor) -> "Service":
        """A service whose models are ready when this returns."""
        service = cls(settings, GivenSource(source) if isinstance(source, Predictor) else source)
        service.controller.boot()
        service._started.set()
        service._update_ready_gauge()
        return service

    @classmethod
    def start(cls, settings: Settings, source: Source, on_error: Callable[[BaseException], None],
              ready_mark: Path | None = None) -> "Service":
        """A service that answers now and loads its models on a thread; ``on_error`` gets a failure; ``ready_mark``
        (an HTTP worker's, ``Lifecycle``): made once they serve."""
        service = cls(settings, source)
        service.ready_mark = ready_mark

        def run() -> None:
            try:
                service.controller.boot()
                service._started.set()
                service._serving_now()
                service._update_ready_gauge()
                log.info("ready to serve")
            except BaseException as exc:  # noqa: BLE001 - handed to on_error, which decides the worker's fate
                on_error(exc)

        service._loader = threading.Thread(target=run, name="model-loader", daemon=True)
        service._loader.start()
        return service

    def _reported(self) -> None:
        """Each report of this process (every EVIDENCE_S on the follow thread, and after each change): its ready
        mark written again if a write failed (``Lifecycle._keep_ready_mark``), and the ready gauge."""
        self._keep_ready_mark()
        self._update_ready_gauge()

    def _update_ready_gauge(self) -> bool:
        """Readiness now (``ready``), set in the ready gauge too; once the first models serve, the batcher gauge
        says ``alive``: every served version's thread runs (a thread's end sets it 0 at once: MetricsObserver; a
        version's start leaves it to this, as another's thread may have ended)."""
        alive = self.alive
        ready = self.loaded and not self._draining.is_set() and alive and self._every_worker_serves()
        if self._started.is_set():
            BATCHER_ALIVE.set(int(alive))
        READY.set(int(ready))
        return ready

    def loaded_version(self, name: str | None = None, version: str | None = None) -> LoadedVersion:
        """The loaded version a request for ``name`` and ``version`` would get now (NotReady while loading,
        NotFound): the engine's own object, for the engine and its tests; protocols read ``catalog``."""
        self.require_loaded()
        return self._routes.find(name, version)

    @property
    def loaded(self) -> bool:
        """The first models are loaded, warmed up and passed their canaries, and one serves at least."""
        return self._started.is_set() and bool(self._routes.all_versions())

    @property
    def alive(self) -> bool:
        """Liveness: every serving version's batcher thread runs and no batch of theirs has run past STALL_S
        (``stalled``), or the models are still loading."""
        if self._started.is_set():
            return all(m.batcher.is_alive() for m in self._routes.all_versions()) and self.stalled is None
        return self._loader is not None and self._loader.is_alive()

    @property
    def stalled(self) -> str | None:
        """Why a serving version is stuck: its batch has run longer than STALL_S (a forward pass that hangs), naming
        it and how long (logged once a batch); None when none is, or STALL_S is 0."""
        for loaded in self._routes.all_versions():
            why = _stall_of(loaded, self.settings.stall_s)
            if why is not None:
                since = loaded.batcher.running_since()
                if since != self._stall_said:
                    self._stall_said = since
                    log.error("liveness fails: %s", why)
                return why
        return None

    @property
    def ready(self) -> bool:
        """Models loaded, warmed up, canaries passed, batchers alive, not draining; and with several workers behind
        one port, every one of them serving, so that after a 200 no request meets a worker still loading. Each
        reading sets the ready gauge too (besides each report of this process): a process whose readiness waited
        for another's report says so in /metrics by the time /readyz, which reads this, says 200."""
        return self._update_ready_gauge()

    @property
    def not_ready_reason(self) -> str | None:
        """Why it is not ready where none of /readyz's checks says it: another worker process behind the port (or,
        in an engine, another engine) that does not serve yet; None when ready, or when a check says why."""
        serving, processes = self._workers_serving(), self.settings.model_processes()
        if not self.loaded or serving >= processes:
            return None
        kind = "engine" if self.settings.engines else "worker"
        return (f"{serving} of {processes} {kind} processes serve their models: the server is ready once every one "
                "does (each loads its own)")

    def _every_worker_serves(self) -> bool:
        return self._workers_serving() >= self.settings.model_processes()

    def _workers_serving(self) -> int:
        """The worker processes that serve their models (all of them counted as serving where there is one, or no
        control directory to tell)."""
        processes = self.settings.model_processes()
        if processes <= 1 or self.settings.control_dir is None:
            return processes
        return sum(1 for report in self.catalog.workers() if report.get("models"))

    def _drain_begun(self) -> None:
        READY.set(0)

    def shutdown(self, timeout: float | None = None) -> None:
        """Drain: refuse new work, finish what is queued, stop the worker threads."""
        self.stop_serving()
        self.controller.close()
        self.explanations.close()
        for model in self._routes.all_versions():
            model.batcher.stop(timeout)

    def explain(self, image: bytes, name: str | None = None, version: str | None = None, index: int | None = None,
                png: bool = False, timeout_s: float = 30.0) -> Explanation:
        """Why model ``name`` at ``version`` (None: as ``enter`` routes a request naming none; POST /explain names
        the version whose labels it read the class with) chooses class ``index`` (None: its top one) for ``image``:
        its Grad-CAM map, in the explanations' own lane (app/engine/explain.py), never in a batch. The version is
        held until it is answered."""
        route = self._held(name, version, None)
        try:
            return self.explanations.explain(route.version, image, index, png, timeout_s)
        finally:
            self._unhold(route)

    @contextlib.contextmanager
    def admit(self, name: str | None = None, version: str | None = None, client_key: str | None = None,
              images: int = 0, timeout_s: float | None = None, pixels: bool = False) -> Iterator[Call]:
        """One request's stay in the engine as a block (``enter`` says what it holds): the protocol parses its body
        with ``call.model``, then ``call.infer``; the block's exception, if any, is the request's outcome, but for
        PixelsForTheDefault (pixels its canary cannot take), which ends it uncounted: admitted again with
        ``pixels``, it goes to the default."""
        admission = self.enter(name, version, client_key, images, timeout_s, pixels)
        try:
            yield admission.call
        except PixelsForTheDefault:
            admission.withdraw()
            raise
        except BaseException as exc:
            admission.leave(exc)
            raise
        admission.leave()

    def enter(self, name: str | None = None, version: str | None = None, client_key: str | None = None,
              images: int = 0, timeout_s: float | None = None, pixels: bool = False) -> Admission:
        """One request's stay in the engine, from here to its ``leave``: readiness, then routing to the version of
        model ``name`` (None: the only one) at ``version`` (None: its default, or its rollout's canary, by
        ``client_key`` when given) that the request keeps to its answer, even if a newer one takes over meanwhile.
        Until its images are queued it counts as on its way, so a forming batch may wait for it; its outcome and
        time count in the version's traffic when it leaves. Raises a ServiceError (NotReady, NotFound, BadRequest)
        when the request cannot be admitted. ``images`` (what the request announces, before its body is parsed)
        with ``timeout_s``: refused at once (429 with Retry-After) when the queue cannot take them in time, so a
        request the server would refuse anyway costs no parsing and no decode. ``pixels``: the request sends
        pixels shaped for the default, which a canary of another input cannot take (routing.Route.takes_pixels)."""
        return self._admitted(self._held(name, version, client_key, pixels), images, timeout_s)

    def enter_many(self, name: str | None, version: str | None, client_key: str | None, count: int,
                   pixels: bool = False, one_call: bool = False, decode_runs: Sequence[int] = ()
                   ) -> list[Admission | ServiceError]:
        """``enter`` for ``count`` requests alike (an event loop turn's for one model, version and client key), in
        one pass: readiness, routing and what they hold counted once for them all, unless a rollout draws each its
        own version; each request its own Admission, in order, or the error that refused it (its version not live).
        Raises what refuses them all (NotReady, NotFound, BadRequest), holding nothing then. ``one_call``: where
        routing gave them all one route without a shadow, one Admission stands for all of them (``requests``), in
        every place of the list: one ``Call`` (room for all their images) and one arrival, their images queued as
        one request's (an event loop's bundle), each counted as a request when it leaves (``leave_one``, or all
        that are left at once); for encoded images the version decodes on the CPU, one for each run of
        ``decode_runs`` (the lengths of consecutive runs of them, each decoded by one thread: a loop's
        ``DecodeShares.runs``; none given: each request its own)."""
        self.in_flight.add(count)
        try:
            self.require_ready()
            routes = self._routes.hold_many(name, version, client_key, pixels, count)
        except BaseException:
            self.in_flight.add(-count)
            raise
        route = routes[0]
        if route is not routes[-1] or route.shadow is not None:  # a rollout's draws: admitted one by one
            return [self._admitted_or_refused(route) for route in routes]
        refusal = self._not_live(route)
        if refusal is not None:
            for _ in routes:
                self._unhold(route)
            return [refusal] * count
        traffic, started, max_images = self._traffic_of(route), time.perf_counter(), self.settings.max_images
        if one_call and (pixels or route.version.decoder.path == "device"):
            decode_runs = (count,)
        elif not one_call or not decode_runs:
            decode_runs = (1,) * count
        admissions: list[Admission | ServiceError] = []
        for requests, arrived in zip(decode_runs, route.version.arrivals.begin_many(len(decode_runs))):
            call = Call(route.version, arrived, max_images, None, route.takes_pixels, requests, route.drawn)
            admissions += [Admission(self, route, traffic, started, arrived, call, requests)] * requests
        return admissions

    def _admitted_or_refused(self, route: Route) -> Admission | ServiceError:
        try:
            return self._admitted(route)
        except ServiceError as exc:
            return exc

    def _not_live(self, route: Route) -> ServiceError | None:
        """NotReady when ``route``'s version would not run a request's batch: its batcher's thread ended, or its
        batch has run past STALL_S (either way the process is not live)."""
        stall = _stall_of(route.version, self.settings.stall_s)
        if stall is None and route.version.batcher.is_alive():
            return None
        return not_ready("the model is not ready" if stall is None else f"the model is stuck: {stall}")

    def _admitted(self, route: Route, images: int = 0, timeout_s: float | None = None) -> Admission:
        """A request held on ``route`` (``_held``) admitted, as ``enter`` says; nothing held when it raises."""
        refusal = self._not_live(route)
        if refusal is not None:
            self._unhold(route)
            raise refusal
        traffic = self._traffic_of(route)
        started = time.perf_counter()
        try:
            if images:
                check_room(route.version, images, timeout_s or self.settings.request_timeout_s, route.drawn)
            arrived = route.version.arrivals.begin()
        except BaseException as exc:
            self._left(route, traffic, time.perf_counter() - started, _outcome(exc))
            raise
        call = Call(route.version, arrived, self.settings.max_images,
                    None if route.shadow is None else self._shadow_offer(route), route.takes_pixels, drawn=route.drawn)
        return Admission(self, route, traffic, started, arrived, call)

    def _held(self, name: str | None, version: str | None, client_key: str | None, pixels: bool = False) -> Route:
        """A request in flight, once the service is ready, holding the version routing picks for it (released, and
        the request's flight ended, by the caller); nothing held when it raises."""
        self.in_flight.enter()
        try:
            self.require_ready()
            return self._routes.hold(name, version, client_key, pixels)
        except BaseException:
            self.in_flight.leave()
            raise

    def _shadow_offer(self, route: Route) -> Callable[..., None]:
        """A route with a shadow: what hands the shadow a request's images and answer (asked only then)."""
        assert route.shadow is not None
        comparison = self.controller.evidence.comparison(route.version.name, route.shadow.version,
                                                         route.version.version)
        return functools.partial(offer, route.version, route.shadow, comparison,
                                 max_age_s=self.settings.shadow_max_age_s,
                                 queue_limit=self.settings.shadow_queue_size)

    def _traffic_of(self, route: Route) -> Traffic | None:
        """The rollout evidence a request's outcome goes to: its version's traffic in the role routing gave it,
        taken as it is routed, as the shadow's comparison is (a promotion while a canary request is in flight starts
        the new default's traffic afresh: that request is no evidence of the default it became); None for a request
        that named its version (a candidate's own tests would promote it)."""
        if route.role == "named":
            return None
        return self.controller.evidence.traffic(route.version.name, route.version.version)

    def _left(self, route: Route, traffic: Traffic | None, seconds: float, outcome: str, requests: int = 1) -> None:
        """``requests`` requests left after ``seconds`` with ``outcome``: counted (in ``traffic`` too), their
        version released."""
        try:
            self._count(route, traffic, [seconds] * requests, outcome)
        finally:
            self._unhold(route, requests)

    def _unhold(self, route: Route, requests: int = 1) -> None:
        """What ``_held`` holds for ``requests`` requests, let go: their version (and shadow) and their flights."""
        self._routes.release(route, requests)
        self.in_flight.add(-requests)

    def leave_many(self, ended: Sequence[tuple[Admission, BaseException | None]]) -> None:
        """``Admission.leave`` for several requests at once (an event loop's answers of a turn, each with its error
        or None), those left already skipped: each counted with its outcome and time, what they held let go in one
        count for each route (the requests ``enter_many`` admitted alike share theirs), and their flights ended."""
        now = time.perf_counter()
        alike: dict[tuple[int, int, str], list[Admission]] = {}  # one route, traffic and outcome: counted together
        try:
            for admission, error in ended:
                outcome = "ok" if error is None else _outcome(error)
                if admission.leaving():
                    alike.setdefault((id(admission.route), id(admission.traffic), outcome), []).append(admission)
            for (_, _, outcome), admissions in alike.items():
                seconds = [now - admission.started for admission in admissions]
                if len(seconds) != sum([admission.requests for admission in admissions]):  # one stands for several
                    seconds = [now - admission.started for admission in admissions for _ in range(admission.requests)]
                self._count(admissions[0].route, admissions[0].traffic, seconds, outcome)
        finally:
            held: dict[int, list[Admission]] = {}  # each route's requests, let go in one count
            for (route_id, _, _), admissions in alike.items():
                held.setdefault(route_id, []).extend(admissions)
            released = 0
            for admissions in held.values():
                requests = sum([admission.requests for admission in admissions])
                self._routes.release(admissions[0].route, requests)
                released += requests
            self.in_flight.add(-released)

    def _count(self, route: Route, traffic: Traffic | None, seconds: list[float], outcome: str) -> None:
        """Requests of one route, traffic and outcome that left after ``seconds`` each: counted."""
        loaded = route.version
        refused = outcome == "refused"  # the client's error, or the server's capacity: not the version's time
        if self.counts is not None:
            self.counts.count(loaded.name, loaded.version, route.role, outcome, len(seconds),
                              None if refused else seconds)
        else:
            series(VERSION_REQUESTS, loaded.name, loaded.version, route.role, outcome).inc(len(seconds))
            if not refused:
                histogram = series(VERSION_REQUEST_SECONDS, loaded.name, loaded.version)
                for each in seconds:
                    histogram.observe(each)
        if not refused and traffic is not None:  # a rollout's evidence: the traffic it routed
            traffic.record(seconds, outcome == "failed")


def _stall_of(loaded: LoadedVersion, limit: float) -> str | None:
    """Why ``loaded`` is stuck: its batch running now has run longer than ``limit`` (STALL_S; 0: never), naming it
    and how long; else None."""
    since = loaded.batcher.running_since()
    if since is None or not limit:
        return None
    running_s = time.monotonic() - since
    if running_s <= limit:
        return None
    return (f"model {loaded.name} version {loaded.version}: its batch has run {running_s:.1f} s, past STALL_S "
            f"({limit:g} s)")


def _outcome(error: BaseException | None) -> str:
    """What a request's end counts as: ok, failed (the server's fault, or the deadline) or refused (the client's
    error, or the server's capacity)."""
    if error is None:
        return "ok"
    if isinstance(error, ServiceError):
        return "failed" if error.status in (500, 504) and not isinstance(error, DeadlinePassedBeforeQueue) else \
            "refused"
    return "failed" if isinstance(error, Exception) else "refused"


class Admission:
    """One request admitted (``Service.enter``), or ``requests`` alike admitted as one (``Service.enter_many``'s
    ``one_call``): its ``call``, holding its version until it ``leave``s, once."""

    __slots__ = ("call", "route", "traffic", "started", "requests", "_service", "_arrived", "_left")

    def __init__(self, service: Service, route: Route, traffic: Traffic | None, started: float,
                 arrived: Callable[[], None], call: Call, requests: int = 1) -> None:
        self._service, self.route, self.traffic = service, route, traffic  # its route, the traffic it counts in
        self.started, self._arrived = started, arrived  # (time.perf_counter() at its admission)
        self.call, self.requests = call, requests  # the requests it stands for, not yet left
        self._left = False

    def leave(self, error: BaseException | None = None) -> None:
        """The request ends (every one it still stands for), answered (None) or with ``error``: no longer on its
        way to a batch, its outcome and time counted, its version released. Once: a second call does nothing (nor
        one of ``Service.leave_many``)."""
        if self.leaving():
            self._service._left(self.route, self.traffic, time.perf_counter() - self.started, _outcome(error),
                                self.requests)

    def leave_one(self, error: BaseException | None = None) -> None:
        """One of the requests it stands for ends before the others (its client left, or it failed its checks):
        counted and let go alone; the last one as ``leave``."""
        if self.requests > 1 and not self._left:
            self.requests -= 1
            self._service._left(self.route, self.traffic, time.perf_counter() - self.started, _outcome(error))
        else:
            self.leave(error)

    def apart(self) -> "Admission":
        """One of the requests it stands for, admitted on its own from here (its own ``leave``), sharing its route,
        arrival and start, and a call of one request (``Call.one``: from here on, this one's too); the last one is
        this one."""
        self.call = self.call.one()
        if self.requests <= 1:
            return self
        self.requests -= 1
        return Admission(self._service, self.route, self.traffic, self.started, self._arrived, self.call)

    def withdraw(self) -> None:
        """The request leaves this route uncounted (it is admitted again elsewhere: PixelsForTheDefault): its
        version released, its flight ended. Once, as ``leave``."""
        if self.leaving():
            self._service._unhold(self.route, self.requests)

    def arrive(self) -> None:
        """No longer on its way to a batch (its images queued, or it ends): what ``Call.queue`` says as it queues
        them, said for a request that ends before (once counts: later calls do nothing)."""
        self._arrived()

    def leaving(self) -> bool:
        """Whether the request leaves now (not before): no longer on its way to a batch, what it holds the
        caller's to let go (``leave``, ``withdraw``, ``Service.leave_many``)."""
        if self._left:
            return False
        self._left = True
        self._arrived()
        return True
