"""gunicorn's gthread worker, changed so that a slow client costs a connection, never a thread.

gunicorn hands a connection to a thread as soon as its first byte arrives; the thread then blocks reading the rest
of the headers and the body. Enough clients sending one byte a second hold every thread, and every other request
times out, for slow headers and slow bodies alike (docs/performance.md: Figures behind the code's choices).
Here the event loop reads each request itself, as a buffering proxy would: the headers, then the body, framed,
bounded and refused as app/hosting/request_framing.py says, and only a whole request goes to a thread (the parser
then reads it from memory). A client that takes longer than ``client_header_timeout_s`` for its headers, or stays
silent longer than ``client_body_timeout_s`` in its body, gets ``408`` and the connection closes.

Under ENGINE=process a request read whole runs on the loop itself, as a greenlet, not on a thread
(app/hosting/loop_requests.py, ``LOOP_REQUESTS``). Every answer is written without blocking
(app/hosting/client_socket.py): what the client does not take at once, a loop request waits for on the loop and a
request thread leaves to the loop to write (``finish_request``), the thread going on. A connection closed after its
answer lingers for the client's end on the loop (``close_gracefully``), not in a blocking read. New connections are
left in the shared listen backlog while the worker does not serve and another does (``set_accept_enabled``), and
accepting pauses when the worker runs out of file descriptors.

``NoAccessLog`` is gunicorn's logger without its access line: the app writes one structured line per request.

The master loads these classes: they import gunicorn, greenlet and the standard library only (and app.hosting's
control, waiting, loop_requests, request_framing and client_socket, which are plain).
"""
from __future__ import annotations

import contextlib
import errno
import os
import resource
import select
import selectors
import socket
import time
from concurrent import futures
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

from greenlet import getcurrent
from gunicorn import util as gunicorn_util
from gunicorn.glogging import Logger
from gunicorn.http import get_parser
from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER, TConn, ThreadWorker

from app.hosting import control, waiting
from app.hosting.browser_origins import LOOP_ORIGINS
from app.hosting.client_socket import ClientConn, ClientCounts, ClientSocket, Counted, Joined
from app.hosting.loop_requests import LoopRequests
from app.hosting.recent_refusals import RECENT, LoopRefusal
from app.hosting.request_framing import (CONTINUE, HEADER_END, HELD_PIECE, ChunkedBody, Framing, HeldUnreader,
                                         ReadLimits, Reading, Refusal, head_framing, continued_request, head_refusal,
                                         parser_refusal, skip_held_body, target_path)

OVER_LIMIT_WAIT_S = 1.0  # how long a connection over MAX_CONNECTIONS_PER_CLIENT is given to begin its request (its
# 429 then says its path's error shape) before it is answered 429 all the same
CLOSE_LINGER_S = 5.0  # a connection's graceful close reads (and drops) what the client still sends for this long at
# most, whatever its size (as nginx's lingering close): a client still sending a body refused from its head (413 over
# MAX_BODY_BYTES) reads the answer before it sees its connection reset (Node's fetch failed with EPIPE, half the time)
CLOSE_DRAIN_TURN_BYTES = 16 * HELD_PIECE  # and at most this much at a turn of the loop, so a fast sender holds it not
CLOSE_DRAIN_BODIES = 4  # and at most this many MAX_BODY_BYTES in all (the body refused and what may follow it); a
# lingering connection counts against MAX_CONNECTIONS and its client's MAX_CONNECTIONS_PER_CLIENT until it closes
# accept(2)'s errors that end one connection before it was taken (Linux passes a pending network error on as accept's;
# EPERM: a firewall refused it): the listener is asked again for the next one
ACCEPT_GONE = frozenset(getattr(errno, name) for name in (
    "EAGAIN", "EWOULDBLOCK", "ECONNABORTED", "EINTR", "EPROTO", "EPERM", "ENETDOWN", "ENETUNREACH", "ENOPROTOOPT",
    "EHOSTDOWN", "EHOSTUNREACH", "EOPNOTSUPP", "ENONET") if hasattr(errno, name))
# and those that say there is no room for one more connection now (the open-file limit, the system's, memory)
ACCEPT_NO_ROOM = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
ACCEPT_PAUSE_S = 0.1  # out of file descriptors: new connections wait in the listen backlog this long, the loop
# serving the open ones, before it accepts again (as the engine's loop, app/link/loop.py)
ACCEPT_WARN_EVERY_S = 60.0  # the warning that it paused, at most this often
# A health probe's request line, as kubelet, compose's and the image's checks send it (no query): answered on the
# probes' own thread, never behind requests (``enqueue_req``)
PROBE_HEADS = tuple(b"GET %s HTTP/1." % path for path in (b"/healthz", b"/readyz", b"/v2/health/live",
                                                           b"/v2/health/ready"))
PROBE_THREADS = 4  # a readiness check that waits on a stuck engine (5 s at most) holds one, not the liveness checks
OWN_FILES = 64  # what a worker opens beside its clients' connections (its listeners, poller and pipes, metrics files,
# its engine connections beyond THREADS): 10 measured in an idle inline worker, with room


class NoAccessLog(Logger):
    """gunicorn's logger, its access log off. The app writes one structured line per request itself
    (visionserve.access); gunicorn counts a ``logconfig_dict`` as access logging on and built every request's log
    atoms (about 4% of an HTTP worker's CPU per request, sampled) for a logger that dropped them."""

    def access(self, resp: Any, req: Any, environ: Any, request_time: Any) -> None:
        """Nothing: the app's own access line is the one."""


@dataclass(eq=False)
class Writing:
    """A connection whose request thread left the rest of its answer (``ClientSocket.unsent``) to the loop: written
    as the client reads it, then settled as the thread left it (``outcome``: its ``handle``'s)."""
    conn: TConn
    outcome: Any  # the request thread's future
    last_progress: float
    sent: int = 0  # how much of the rest went


@dataclass(eq=False)
class Closing:
    """A connection half-closed after its last answer: read until the client closes its end, CLOSE_LINGER_S has
    passed or CLOSE_DRAIN_BODIES bodies came, then closed (RFC 9112 9.6: no reset that would cut the answer short);
    counted meanwhile as an open connection, of its client's (``counted``) and of the worker's."""
    sock: socket.socket
    deadline: float
    counted: Counted | None = None
    drained: int = 0


class BufferingWorker(LoopRequests, ThreadWorker):
    """gthread with requests read in the event loop (see the module's docstring)."""

    limits = ReadLimits()
    control_dir: Path | None = None  # CONTROL_DIR (gunicorn.conf.py's post_fork): the workers' ready marks
    loop_requests = False  # LOOP_REQUESTS under ENGINE=process (gunicorn.conf.py's post_fork)
    accept_paused_until = 0.0  # out of file descriptors: no accept before then (time.monotonic())
    accept_warned_at = -ACCEPT_WARN_EVERY_S  # when the last pause was said in the log
    held_back_draining = False  # the reason held back last said in the log: its drain, or not serving yet
    draining = False  # its drain began (app/hosting/drain.py): it takes new connections only if none serves, and
    # refuses none of them itself (``_handle_one``: the app answers a draining worker's requests)
    client_counts = ClientCounts(0)  # its open connections by client (``init_process``: MAX_CONNECTIONS_PER_CLIENT)
    accepts = 0  # connections taken from the listen backlog (app/hosting/drain.py takes it whole before it closes)
    probes: futures.ThreadPoolExecutor | None = None  # the health probes' own threads (``enqueue_req``), once one came

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reading: set[Reading] = set()
        self.held_back = False  # new connections left to the workers that serve (said in the log once a reason)
        self.closing: set[Closing] = set()  # connections half-closed after their last answer
        self.writing: set[Writing] = set()  # connections whose answer's rest the loop writes
        self.init_loop_requests()

    def init_process(self) -> None:
        """The loop's greenlet noted (app/hosting/loop_requests.py) and, with ``loop_requests``, every wait of a
        request on it handed to it; MAX_CONNECTIONS fitted to the open-file limit; then gthread's start (which runs
        the loop)."""
        self.loop_greenlet = getcurrent()
        if self.loop_requests:
            waiting.wait_on(self)
        self._fit_connections_to_file_limit()
        self.client_counts = ClientCounts(self._per_client())
        super().init_process()

    def _fit_connections_to_file_limit(self) -> None:
        """MAX_CONNECTIONS (gunicorn's worker_connections) with this worker's own files, within its open-file limit
        (``raise_file_limit``); where even the hard limit is below, it takes fewer connections at once, keeping room
        for its own files (a report, a metrics file, an engine connection), and says so. Past the limit accept fails
        (EMFILE), which pauses accepting (``_pause_accepting``)."""
        own = self.cfg.threads + OWN_FILES
        limit = raise_file_limit(self.worker_connections + own)
        if limit == resource.RLIM_INFINITY or limit >= self.worker_connections + own:
            return
        fitted = max(limit - own, 1)
        self.log.warning("worker %d may open %d files (ulimit -n), below the %d that MAX_CONNECTIONS=%d and its own "
                         "files need: it takes %d connections at once, the rest wait in the listen backlog; raise "
                         "the hard limit (LimitNOFILE, docker run --ulimit nofile) or lower MAX_CONNECTIONS",
                         os.getpid(), limit, self.worker_connections + own, self.worker_connections, fitted)
        self.worker_connections = fitted
        self.max_keepalived = min(self.max_keepalived, fitted - self.cfg.threads)  # gthread's room for active ones

    def _per_client(self) -> int:
        """MAX_CONNECTIONS_PER_CLIENT, at most half of the connections this worker takes (one client holding more
        would leave the others less than it), said in the log when that lowers it."""
        limit, half = self.limits.per_client, max(self.worker_connections // 2, 1)
        if limit > half:
            self.log.warning("worker %d takes %d connections at once: one client may hold %d of them, not "
                             "MAX_CONNECTIONS_PER_CLIENT=%d (0: no limit, as behind a proxy)", os.getpid(),
                             self.worker_connections, half, limit)
            return half
        return limit

    def enqueue_req(self, conn: TConn) -> None:
        """A health probe read whole runs on the probes' own threads (``PROBE_HEADS``: never behind a backlog of
        requests, where a busy worker's probes took 3-5 s, past kubelet's 3 s timeout: a pod marked unready, then
        restarted, for being busy); a request the loop read whole runs on the loop itself (``loop_requests``:
        ``run_on_loop``); any other (a body announced over the limit, a head the parser refuses) goes to a request
        thread, as in gthread."""
        prefetched = getattr(conn, "prefetched", None)
        if prefetched and prefetched.startswith(PROBE_HEADS):
            if self.probes is None:
                self.probes = futures.ThreadPoolExecutor(max_workers=PROBE_THREADS, thread_name_prefix="probes")
            done = self.probes.submit(self._handle_one, conn)  # (not lingering for the connection's next request,
            # which would then run on the probes' thread)
            done.add_done_callback(lambda fut: self.method_queue.defer(self.finish_request, conn, fut))
            return
        if self.loop_requests and prefetched and conn.body_held and getcurrent() is self.loop_greenlet:
            self.run_on_loop(conn)
            return
        super().enqueue_req(conn)

    def set_accept_enabled(self, enabled: bool) -> None:
        """gthread's, but a worker that does not serve (a killed one's replacement, importing the app and loading or
        reaching its models; one whose engine restarts; or one draining: a HUP's old worker, one told to stop alone)
        takes no new connection while another worker serves: they wait in the shared listen backlog for a worker
        that answers them, instead of a 503 from this one. gthread's loop asks again each turn (a second apart at
        most) until it serves, or no other does; one that takes connections is asked at each (``accept``). A server
        starting (no worker serves) takes them all, each worker answering 503 while it loads; so does a server
        stopping (every worker draining), until each closes its listener, and one whose only engine restarts. Nor
        does one while its pause after running out of file descriptors lasts (``_pause_accepting``)."""
        if enabled and time.monotonic() < self.accept_paused_until:
            return
        if enabled and self._another_serves_instead():
            self._hold_back()
            return
        if enabled and self.held_back:
            self.held_back = False
            if self.draining:
                self.log.info("worker %d drains and no other worker serves any more (they drain too): taking new "
                              "connections", os.getpid())
            elif self._marked():
                self.log.info("worker %d serves: taking new connections", os.getpid())
            else:  # none serves: its one engine restarts, or the worker that served drains
                self.log.info("worker %d takes new connections: no worker serves (503 until one does)", os.getpid())
        super().set_accept_enabled(enabled)

    def _serving_others(self) -> list[int]:
        """The other workers that serve now (their ready marks), this master's and those of a master beside it
        (USR2's old or new one: ``control.masters_beside``), for the log."""
        try:
            return [pid for directory in (self.control_dir, *control.masters_beside(self.control_dir))
                    for pid in control.ready_workers(directory) if pid != os.getpid()]
        except (OSError, TypeError):  # (a directory that cannot be looked into, or none)
            return []

    def _marked(self) -> bool:
        """This worker's ready mark is there: it serves."""
        try:
            return self.control_dir is not None and control.ready_mark(self.control_dir, os.getpid()).exists()
        except OSError:
            return False

    def _hold_back(self) -> None:
        """New connections left in the listen backlog to the workers that serve (said in the log once a reason: a
        worker held back while it loaded, then told to stop before its loop asked again, says it drains)."""
        if not self.held_back or self.held_back_draining != self.draining:
            self.held_back, self.held_back_draining = True, self.draining
            if self.draining:  # (which: a server stopping as a whole says next that they drain too)
                self.log.info("worker %d drains: new connections go to the workers that serve (%s)", os.getpid(),
                              ", ".join(map(str, self._serving_others())) or "none now")
            else:
                self.log.info("worker %d takes new connections once it serves (another worker serves them)",
                              os.getpid())
        super().set_accept_enabled(False)

    def leaves_backlog(self) -> bool:
        """Whether this worker's drain, at its end, leaves the listen backlog to another: a worker serves still
        (asked then: when every other one has begun its drain too, this one takes its share, answered, rather than
        leaving it to be reset when the last listener closes)."""
        return self._another_serves_instead()

    def _another_serves_instead(self) -> bool:
        """This worker does not serve (not yet, or no longer: draining, or its engine restarting) and another live
        one does (CONTROL_DIR's ready marks)."""
        return self.control_dir is not None and not control.takes_connections(self.control_dir, os.getpid())

    def accept(self, listener: Any) -> None:
        """A new connection waits in the loop for its request (app/hosting/drain.py counts ``accepts``). A worker
        that does not serve takes none while another worker serves: it holds back (``set_accept_enabled``). Asked
        here, at each connection, for gthread asks ``set_accept_enabled`` only when accepting should change for its
        own reasons: a worker that began taking them while none served (a server starting), or that served until
        its drain or its engine's end, would take them for good."""
        if getattr(listener, "sock", listener) is None:
            # Closed by app/hosting/drain.py's last step, which ran earlier in the same poller turn that found it
            # readable (gthread's accept raised here: the worker died and its open connections were reset).
            return
        if self._another_serves_instead():
            self._hold_back()
            return
        try:
            accepted, client = listener.accept()
        except OSError as exc:
            if exc.errno in ACCEPT_NO_ROOM:
                self._pause_accepting(exc)
            elif exc.errno not in ACCEPT_GONE:
                raise
            return
        self.accepts += 1
        sock = ClientSocket(accepted.family, accepted.type, accepted.proto, fileno=accepted.detach())
        sock.answer_timeout_s, sock.loop_writes = self.limits.answer_timeout_s, True
        conn = ClientConn(self.cfg, sock, client, listener.getsockname())  # non-blocking
        joined = self.client_counts.join(conn, client)
        if joined is Joined.REFUSED_AT_ONCE:
            self._refuse_at_once(conn)
            return
        self.nr_conns += 1
        conn.closer = self.close_gracefully
        reading = self._start_reading(conn)
        if joined is Joined.REFUSED_ON_ITS_LINE:  # its client holds MAX_CONNECTIONS_PER_CLIENT of ours: 429 once its
            # request line comes (its path gives the error's shape), or after OVER_LIMIT_WAIT_S without it
            reading.refuse_on_line = self.client_counts.refusal(client)
            reading.header_deadline = reading.last_data + OVER_LIMIT_WAIT_S

    def _refuse_at_once(self, conn: ClientConn) -> None:
        """A connection whose client holds MAX_CONNECTIONS_PER_CLIENT of this worker's and REFUSALS_AWAITED more:
        429 in the error shape of the path it sent already (if any), and closed at once (a flood holds nothing)."""
        sock = conn.sock
        try:
            sent = sock.recv(self.limits.request_line_limit, socket.MSG_PEEK)
        except OSError:  # (nothing came yet: BlockingIOError)
            sent = b""
        _tell(self.client_counts.refusal(conn.client), sock.send, _peer(conn),
              target_path(sent) if b"\n" in sent else None, sent)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        sock.close()

    def _pause_accepting(self, exc: OSError) -> None:
        """No room for one more connection (EMFILE: the open-file limit; ENFILE, ENOBUFS, ENOMEM): new connections
        wait in the listen backlog for ACCEPT_PAUSE_S while the loop serves the open ones, instead of the worker's
        end (gthread's accept raised: every connection it held was reset, and the backlog did the same to its
        replacement). Said in the log once a minute at most."""
        now = time.monotonic()
        if now - self.accept_warned_at >= ACCEPT_WARN_EVERY_S:
            self.accept_warned_at = now
            self.log.warning("worker %d cannot accept a connection (%s) with %d open: new connections wait %.0f ms "
                             "at a time; raise the open-file limit (ulimit -n, LimitNOFILE) or lower "
                             "MAX_CONNECTIONS", os.getpid(), exc, self.nr_conns, ACCEPT_PAUSE_S * 1000)
        self.accept_paused_until = now + ACCEPT_PAUSE_S
        super().set_accept_enabled(False)

    def wait_for_and_dispatch_events(self, timeout: float) -> None:
        """The loop's turn (app/hosting/loop_requests.py's), ending by the end of a pause of accepting, when gthread's
        loop asks to accept again."""
        paused_s = self.accept_paused_until - time.monotonic()
        if paused_s > 0:
            timeout = min(timeout, paused_s)
        super().wait_for_and_dispatch_events(timeout)

    def on_client_socket_readable(self, conn: TConn, client: Any) -> None:
        """A kept-alive connection's next request: read in the loop too, at once (its bytes are there), the socket
        kept in the poller with its callback changed (no system call)."""
        self.keepalived_conns.remove(conn)
        reading = self._reading(conn)
        self.poller.modify(client, selectors.EVENT_READ, partial(self._on_data, reading))
        self._on_data(reading, client)

    def _start_reading(self, conn: TConn) -> Reading:
        reading = self._reading(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_data, reading))
        return reading

    def _reading(self, conn: TConn) -> Reading:
        """A request starting to arrive on ``conn``, watched by the loop's timeouts (``reading``)."""
        reading = self._new_reading(conn)
        self.reading.add(reading)
        return reading

    def _new_reading(self, conn: TConn, held: bytes = b"") -> Reading:
        """A request starting now on ``conn`` with ``held`` already read; its header time counted from now."""
        now = time.monotonic()
        reading = Reading(conn, now + self.limits.header_timeout_s, now)
        reading.take(held)
        return reading

    def _on_data(self, reading: Reading, sock: Any) -> None:
        """What the socket holds, read on at once while a read took all it asked for and the request is not whole
        (a photo's body that came with its headers is read in this wake-up, not the loop's next turn)."""
        while True:
            wanted = reading.wanted()
            try:
                data = sock.recv(wanted)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:  # the client went away before its request was whole
                reading.left_mid_body(_peer(reading.conn))
                self._close(reading)
                return
            reading.take(data)
            reading.last_data = time.monotonic()
            if self._whole(reading):
                self._dispatch(reading)
                return
            if len(data) < wanted:
                break
        if reading.continue_owed:  # its head is in, and the client waits for this to send the body
            self._continue(reading)

    def _whole(self, reading: Reading) -> bool:
        """Whether the loop's wait for the request is over: it is whole (its body too when the loop reads it), or
        refused (``reading.refusal``: from its head, or from its chunked framing; ``refuse_on_line``: once its
        request line is in), or its head goes to the parser as it is (``to_parser``); the same when asked again."""
        if reading.refusal is not None or reading.to_parser:
            return True
        if reading.refuse_on_line is not None:
            if b"\n" not in reading.buffer and len(reading.buffer) < self.limits.request_line_limit:
                return False
            reading.refusal = reading.refuse_on_line
            return True
        if reading.body_end is None:
            buffer, start = reading.buffer, reading.scanned
            end = buffer.find(HEADER_END, max(start - len(HEADER_END) + 1, 0))
            reading.scanned = len(buffer)
            reading.refusal = head_refusal(buffer, start, end, self.limits.request_line_limit,
                                           self.limits.head_limit)
            if reading.refusal is not None:
                return True
            if end < 0:
                return False
            framing = head_framing(bytes(buffer[:end]))
            if isinstance(framing, Refusal):
                reading.refusal = framing
                return True
            if not isinstance(framing, int):  # chunked, Expect, or a head the parser refuses
                return self._framed(reading, end, framing)
            if framing > self.limits.max_body_bytes:
                reading.to_parser = True
                return True
            reading.body_end, reading.body_since = end + len(HEADER_END) + framing, time.monotonic()
        if len(reading.buffer) < reading.body_end:
            return False
        return reading.chunked is None or self._chunks_whole(reading)

    def _framed(self, reading: Reading, end: int, framing: Framing | None) -> bool:
        """``_whole`` for a head that ``head_framing`` did not frame by a length alone (its end at ``end``): a chunked
        body, or one after ``Expect: 100-continue``, is read on here as its ``framing`` says, the client that waits
        for it owed its ``100 Continue`` (``continue_owed``: once the loop waits for the body, ``_continue``); any
        other head (None), and a Content-Length over the limit, go to the parser as they are (True), but for one after
        ``Expect: 100-continue``, refused here (413) before its client is asked for the body it announced."""
        if framing is not None and framing.length > self.limits.max_body_bytes and framing.expects_continue:
            reading.refusal = Refusal(413, "Request Entity Too Large",
                                      f"the request body is over the {self.limits.max_body_bytes} byte limit")
            return True
        if framing is None or framing.length > self.limits.max_body_bytes:
            reading.to_parser = True
            return True
        start = reading.body_end = end + len(HEADER_END)
        reading.body_since = time.monotonic()
        if framing.chunked:
            reading.chunked = ChunkedBody(start)
        else:
            reading.body_end += framing.length
        # nothing of the body came yet: the client waits for the 100 (one sending it anyway needs none, RFC 9110 10.1.1)
        reading.continue_owed = (framing.expects_continue and (framing.chunked or framing.length > 0)
                                 and len(reading.buffer) == start)
        return self._whole(reading)

    def _chunks_whole(self, reading: Reading) -> bool:
        """Whether a chunked body came whole, its framing read on as far as it came (``ChunkedBody.scan``); refused
        (``reading.refusal``) when that framing is malformed or over its limits."""
        reach = reading.chunked.scan(reading.buffer, self.limits)  # type: ignore[union-attr]
        if isinstance(reach, Refusal):
            reading.refusal = reach
            return True
        reading.body_end = reach
        return reading.chunked.end is not None  # type: ignore[union-attr]

    def _continue(self, reading: Reading) -> None:
        """``100 Continue`` to a client that waits for it to send its body (``Expect: 100-continue``), said by the
        loop, which then reads that body; the parser says it no more once the request reaches it
        (``continued_request``)."""
        reading.continue_owed = False
        conn = reading.conn
        with contextlib.suppress(OSError):  # small: fits the socket buffer (a client gone: its next read says so)
            conn.sock.send(CONTINUE)
        if conn.parser is None:  # the connection's first request: its parser made here, as gthread's init would
            conn.parser = get_parser(self.cfg, conn.sock, conn.client)
        conn.parser.mesg_class = partial(continued_request, conn.parser)

    def _dispatch(self, reading: Reading) -> None:
        if reading.refusal is not None:
            self._refuse(reading)
            return
        self._forget(reading)
        self._hand_over(reading)
        self.enqueue_req(reading.conn)

    @staticmethod
    def _hand_over(reading: Reading) -> None:
        """A whole request's bytes given to its connection's parser (``_handle_one``)."""
        conn = reading.conn
        conn.data_ready = True  # gthread's handle() must not wait for data again
        conn.prefetched, conn.request_end = reading.buffer, reading.body_end
        _body_held(conn, reading.body_end is not None, reading.last_data)  # only once the whole body is in

    def handle(self, conn: TConn) -> Any:
        """In a request thread: the request, then the connection's next ones while it is kept alive and no other
        request waits for a thread (``_next_request``: one already read behind it, or one that arrives within
        ``linger_s`` of the answer) instead of handing it back to the loop, which would read the next request and
        hand it to a thread again (the loop woken twice and a thread once, for each request). A request begun and not
        whole by then goes back to the loop (``finish_request``), which reads the rest with its timeouts: a slow client
        holds this thread ``linger_s`` at most. An answer whose rest the client has not taken yet (``unsent``) ends
        the lingering: the loop writes it, then reads the next request."""
        keepalive = self._handle_one(conn)
        while (keepalive is True and self.alive and self.limits.linger_s > 0 and self.tpool._work_queue.empty()
               and not getattr(conn.sock, "unsent", None)):  # an answer's rest held: the loop writes it first
            reading = self._next_request(conn)
            if reading is None or reading is False:  # nothing came (kept alive, watched by the loop), or it closed
                return reading is None
            if not self._whole(reading) or reading.refusal is not None:  # the loop reads on, or refuses it
                return reading
            self._hand_over(reading)
            keepalive = self._handle_one(conn)
        return keepalive

    def _next_request(self, conn: TConn) -> Reading | bool | None:
        """The connection's next request: what the parser holds past the last one (pipelined), then what arrives
        within ``linger_s``; its Reading once whole or when the time is up, None when nothing came, False when the
        client closed the connection."""
        reading = self._new_reading(conn, _held(conn))
        deadline = reading.last_data + self.limits.linger_s
        poller = select.poll()  # (a socket of any number: select's fd limit does not apply)
        poller.register(conn.sock, select.POLLIN)
        while not (reading.buffer and self._whole(reading)) and (left := deadline - time.monotonic()) > 0:
            if not poller.poll(left * 1000):
                break
            try:
                data = conn.sock.recv(reading.wanted(), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                reading.left_mid_body(_peer(conn))
                return False
            reading.take(data)
            reading.last_data = time.monotonic()
        return reading if reading.buffer else None

    def finish_request(self, conn: TConn, fs: Any) -> None:
        """On the loop, once a request thread is done with the connection: a request begun on it (pipelined behind
        the last answer, or begun while the thread lingered) is read on here and handed to a thread once whole;
        the rest as gthread does (kept alive in the poller, or closed; empty lines held behind the last answer
        leave it kept alive). First, the rest of the thread's answer that the client had not taken (``unsent``),
        written as it reads it (``_write_unsent``)."""
        if getattr(conn.sock, "unsent", None):
            self._write_unsent(Writing(conn, fs, time.monotonic()))
            return
        result = fs.result() if not fs.cancelled() and fs.exception() is None else None
        if result is True and (held := _held(conn)) and (reading := self._new_reading(conn, held)).buffer:
            result = reading
        if not isinstance(result, Reading):
            super().finish_request(conn, fs)
        elif not self._whole(result):
            conn.sock.setblocking(False)
            self.reading.add(result)
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_data, result))
            if result.continue_owed:
                self._continue(result)
        elif result.refusal is not None:
            self._refuse(result)
        else:
            self._hand_over(result)
            self.enqueue_req(conn)

    def _write_unsent(self, writing: Writing, _sock: Any = None) -> None:
        """On the loop: what the socket takes now of the rest of the answer, watched for room (EVENT_WRITE) until all
        of it went, then the connection settled as its thread left it (``finish_request``); a client gone meanwhile
        closes it, one that takes nothing for ``answer_timeout_s`` too (``murder_pending``)."""
        conn = writing.conn
        unsent = conn.sock.unsent
        try:
            with memoryview(unsent) as view:
                while writing.sent < len(view):
                    writing.sent += conn.sock.send(view[writing.sent:], socket.MSG_DONTWAIT)
                    writing.last_progress = time.monotonic()
        except (BlockingIOError, InterruptedError):
            if writing not in self.writing:
                self.writing.add(writing)
                self.poller.register(conn.sock, selectors.EVENT_WRITE, partial(self._write_unsent, writing))
            return
        except (OSError, ValueError):  # the client went away (or its socket was closed): the connection ends
            self._end_writing(writing, gone=True)
            return
        self._end_writing(writing)
        self.finish_request(conn, writing.outcome)

    def _end_writing(self, writing: Writing, gone: bool = False) -> None:
        """The loop writes no more for ``writing``; ``gone``: its connection closes."""
        if writing in self.writing:
            self.writing.discard(writing)
            self._unwatch(writing.conn.sock)
        writing.conn.sock.unsent = None
        if gone:
            self.nr_conns -= 1
            writing.conn.close()

    def _handle_one(self, conn: TConn) -> Any:
        """In a request thread or a loop request: give the parser what the loop read, then gthread's own handling."""
        prefetched = getattr(conn, "prefetched", None)
        sock = conn.sock
        sock.stays_nonblocking = bool(prefetched) and conn.body_held and waiting.on_loop() is not None
        if prefetched:
            conn.prefetched = None
            conn.init()  # plain HTTP/1.1 (no TLS or HTTP/2 configured): only makes the parser
            if not isinstance(conn.parser.unreader, HeldUnreader):  # the connection's first request
                conn.parser.unreader = HeldUnreader(conn.sock)
            refused = (RECENT.refusal(prefetched, sock.received_at, _peer(conn), self._kept_alive_s)
                       if conn.body_held and sock.received_at is not None and not self.draining else None)
            if refused is not None:  # what came past it (pipelined) is the parser's next request
                conn.parser.unreader.unread_request(prefetched[conn.request_end:])
                sock.stays_nonblocking = False
                return _send_refusal(sock, refused)
            conn.parser.unreader.unread_request(prefetched)
        else:  # a request gthread hands over itself (bytes its parser read ahead): its body may be on the socket
            _body_held(conn, False)
        sock.answer_begins()
        sock.request_head = prefetched or b""  # what a refusal of its parser answers by (``handle_error``)
        try:
            return super().handle(conn)
        finally:  # an answer gthread gave after an error (its own, whole): the connection closes after it
            sock.request_head = b""  # (not held past its request: it may hold a large body)
            with contextlib.suppress(OSError):
                sock.answer_ends()
            sock.stays_nonblocking = False

    def _kept_alive_s(self) -> int:
        """For how long gthread would keep a connection open idle after its answer now (its handle_request's
        judgement; 0: it closes it)."""
        kept = self.alive and bool(self.cfg.keepalive) and len(self.keepalived_conns) < self.max_keepalived
        return int(self.cfg.keepalive) if kept else 0

    def _keepalive_after(self, conn: TConn, keepalive: bool) -> bool:
        """Whether the connection serves another request, once its answer is written (a head held alone goes now:
        a client gone meanwhile closes it, as gthread closes it on a write): a body the loop held whole is skipped in
        memory, whatever the app left of it; others as gthread does (a bounded read of the socket, else closed)."""
        conn.sock.answer_ends()
        if keepalive and getattr(conn, "body_held", False):
            return skip_held_body(conn.parser)
        return super()._keepalive_after(conn, keepalive)

    def murder_pending(self) -> None:
        """Every loop turn: gthread's own sweep, then the requests that arrive too slowly, the answers whose client
        took none of them for ``answer_timeout_s`` and the closes that have lingered long enough."""
        super().murder_pending()
        now = time.monotonic()
        for reading in [r for r in self.reading if self._expired(r, now)]:
            self._time_out(reading, now)
        for writing in [w for w in self.writing if now - w.last_progress > w.conn.sock.answer_timeout_s]:
            writing.conn.sock.left()
            self._end_writing(writing, gone=True)
        for closing in [c for c in self.closing if c.deadline <= now]:
            self._closed(closing)

    def close_gracefully(self, sock: socket.socket, counted: Counted | None = None) -> None:
        """gunicorn's graceful close on the loop: the write side shut (the client sees the answer end), then what
        the client still sends read as it comes (``_drain``), and the socket closed once it closes its end; counted
        meanwhile as an open connection, its client's (``counted``) and the worker's (a client refused again and
        again held thousands of files in lingering closes, past both limits: a security review)."""
        closing = Closing(sock, time.monotonic() + CLOSE_LINGER_S, counted)
        self.nr_conns += 1  # (its close took it off; the linger holds its file)
        self.closing.add(closing)
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
            self.poller.register(sock, selectors.EVENT_READ, partial(self._drain, closing))
        except (OSError, ValueError):
            self._closed(closing)

    def _drain(self, closing: Closing, _sock: Any = None) -> None:
        turn = 0
        while turn < CLOSE_DRAIN_TURN_BYTES:  # the rest at the loop's next turn (the socket still readable)
            try:
                data = closing.sock.recv(HELD_PIECE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            turn += len(data)
            closing.drained += len(data)
            if not data or closing.drained > CLOSE_DRAIN_BODIES * self.limits.max_body_bytes:
                self._closed(closing)
                return

    def _closed(self, closing: Closing) -> None:
        """A lingering close's end: the socket closed, its counts left (once, whichever ends it)."""
        if closing not in self.closing:  # ended already
            return
        self.closing.discard(closing)
        self._unwatch(closing.sock)
        closing.sock.close()
        self.nr_conns -= 1
        if closing.counted is not None:
            ClientCounts.leave(*closing.counted)

    def _expired(self, reading: Reading, now: float) -> bool:
        if reading.body_end is not None:
            return now - reading.last_data > self.limits.body_timeout_s or self._too_slow(reading, now)
        deadline = reading.header_deadline
        if not reading.buffer:  # idle (empty lines at most came): a kept-alive connection ends with its keep-alive
            kept_until = getattr(reading.conn, "timeout", None)  # gthread's, set when it was kept alive
            if kept_until is not None:
                deadline = min(deadline, kept_until)
            if not self.alive:  # stopping: an idle connection is not kept, as gthread's own
                deadline = min(deadline, reading.last_data + STOP_KEEPALIVE_LINGER)
        return now > deadline

    def _too_slow(self, reading: Reading, now: float) -> bool:
        """Whether a body comes slower than CLIENT_BODY_MIN_RATE on average: past CLIENT_BODY_TIMEOUT_S from its
        head, each second more must have brought that many bytes (as Apache's mod_reqtimeout's MinRate). A
        client dripping a byte within each silence's limit held its connection for ever: two thousand of them, a
        few bytes a second each, took every connection of the server (a security review)."""
        rate = self.limits.body_min_rate
        return bool(rate) and now - reading.body_since > self.limits.body_timeout_s + len(reading.buffer) / rate

    def _time_out(self, reading: Reading, now: float) -> None:
        if reading.refuse_on_line is not None:  # refused before its request line came (MAX_CONNECTIONS_PER_CLIENT)
            reading.refusal = reading.refuse_on_line
            self._refuse(reading)
            return
        if reading.buffer:  # a request was started: say why it ends (nothing started: close quietly)
            if reading.body_end is None:
                message = f"the request headers did not arrive within {self.limits.header_timeout_s:g}s"
            elif self._too_slow(reading, now):
                message = (f"the body came slower than {self.limits.body_min_rate:g} bytes a second "
                           "(CLIENT_BODY_MIN_RATE)")
            else:
                message = (f"no byte of the body came for {self.limits.body_timeout_s:g}s "
                           "(CLIENT_BODY_TIMEOUT_S)")
            self._answer(reading, Refusal(408, "Request Timeout", message))
        self._close(reading)

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        """A request gunicorn's parser refused (a request line or header it cannot read): its status, in the JSON
        error shape of the path its head targets, as the loop's own refusals (gunicorn's own answer is an HTML page;
        before, the service's shape under /v2 too); any other error as gunicorn answers it."""
        refusal = parser_refusal(exc)
        if refusal is None:
            super().handle_error(req, client, addr, exc)
            return
        head = getattr(client, "request_head", b"")
        _tell(refusal, partial(gunicorn_util.write_nonblock, client), addr[0] if isinstance(addr, tuple) else None,
              target_path(head), head)

    def _refuse(self, reading: Reading) -> None:
        """A request whose head the loop refuses: told why, then its connection closes gracefully (the client may
        still be sending: a reset must not cut its answer short)."""
        assert reading.refusal is not None
        self._answer(reading, reading.refusal)
        self._close(reading, graceful=True)

    @staticmethod
    def _answer(reading: Reading, refusal: Refusal) -> None:
        """The loop's own answer to a request it ends, and its access line."""
        _tell(refusal, reading.conn.sock.send, _peer(reading.conn),  # small: fits the socket buffer
              target_path(reading.buffer), reading.buffer)

    def _forget(self, reading: Reading) -> None:
        self.reading.discard(reading)
        self._unwatch(reading.conn.sock)

    def _unwatch(self, sock: socket.socket) -> None:
        """``sock`` out of the loop's poller, if it was in it (closed meanwhile, or never registered: nothing)."""
        try:
            self.poller.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass

    def _close(self, reading: Reading, graceful: bool = False) -> None:
        self._forget(reading)
        self.nr_conns -= 1
        reading.conn.close(graceful)


def raise_file_limit(needed: int) -> int:
    """The soft open-file limit (RLIMIT_NOFILE: each client connection is a file) raised to the hard one where it is
    below ``needed`` (systemd's default soft limit is 1024, below the default MAX_CONNECTIONS and a worker's own
    files); the soft limit now (RLIM_INFINITY: none)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    wanted = needed if hard == resource.RLIM_INFINITY else hard
    with contextlib.suppress(ValueError, OSError):  # refused: the limit stays, and the caller says so
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _body_held(conn: TConn, held: bool, whole_at: float | None = None) -> None:
    """Note whether the request's whole body is in memory, on the connection and its socket (app/web/hooks.py then
    sets no timeout for reading a body that no read will wait for), and when it was whole (``whole_at``: its
    deadline counts from there)."""
    conn.body_held = held
    if isinstance(conn.sock, ClientSocket):
        conn.sock.body_held, conn.sock.received_at = held, whole_at if held else None


def _send_refusal(sock: ClientSocket, refused: LoopRefusal) -> bool:
    """A request refused before the app (app/hosting/recent_refusals.py): its answer written as the app's would be;
    whether the connection stays open."""
    try:
        sock.sendall(refused.answer)
    except OSError:  # the client went away
        return False
    return refused.keep_alive


def _held(conn: TConn) -> bytes:
    """What the connection's parser holds past the request it answered: the start of the next one (pipelined)."""
    unreader = getattr(conn.parser, "unreader", None)
    return unreader.take_buffered() if isinstance(unreader, HeldUnreader) else b""


def _peer(conn: TConn) -> str | None:
    client = getattr(conn, "client", None)
    return client[0] if isinstance(client, tuple) and client else None


def _tell(refusal: Refusal, send: Callable[[bytes], object], client: str | None, path: str | None,
          head: bytes | bytearray) -> None:
    """The loop's own answer, with the CORS headers the app's would have for the origin its ``head`` says."""
    refusal.tell(send, client, path, head, LOOP_ORIGINS.header_lines(head))
