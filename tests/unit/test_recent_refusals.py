"""The worker's loop refuses a route's requests itself for a while after the engine refused one for its backlog
(app/hosting/recent_refusals.py): only those whose deadline ends before that backlog clears, said and counted as
the app says and counts its own 429."""
from __future__ import annotations

import email.utils
import json
import re
import time
from functools import partial

import pytest
from prometheus_client import REGISTRY

from app.errors import Backlog
from app.hosting.recent_refusals import RecentRefusals, RouteKey, route_key
from app.web.auth import carries_key, key_forms


def _head(target: str = "/predict", timeout_ms: str | None = "500", *extra: str, method: str = "POST",
          version: str = "HTTP/1.1") -> bytes:
    fields = ["Host: x", "Content-Length: 6", *extra] + ([] if timeout_ms is None else
                                                          [f"X-Request-Timeout: {timeout_ms}"])
    return (f"{method} {target} {version}\r\n" + "".join(f"{f}\r\n" for f in fields) + "\r\n").encode() + b"jpeg.."


def _remembering(memory_s: float = 10.0, busy_for_s: float = 2.0, target: str = "/predict",
                 key_ok=None, image_s: float = 0.01) -> RecentRefusals:  # noqa: ANN001
    recent = RecentRefusals()
    recent.configure(memory_s, 30.0, 4, key_ok)  # MAX_IMAGES 4
    recent.remember(target, Backlog(time.monotonic() + busy_for_s, image_s, 0.002), "3")
    return recent


def _answer(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    assert int(headers["content-length"]) == len(body)
    return int(status_line.split()[1]), headers, json.loads(body)


@pytest.mark.parametrize("target, key", [
    ("/predict", RouteKey("/predict", None, None)),
    ("/predict?top_k=3&model=lite0&version=2", RouteKey("/predict", "lite0", "2")),
    ("/v2/models/lite0/infer", RouteKey("/v2/models/<name>/infer", "lite0", None)),
    ("/v2/models/lite%2D0/versions/7/infer", RouteKey("/v2/models/<name>/versions/<version>/infer", "lite-0", "7")),
    ("/predict?model=a&model=b", None),  # the app's 400
    ("/explain", None), ("/v2/models/lite0/ready", None), ("/v2/models/lite0/infer/x", None),
])
def test_a_route_is_the_app_s_rule_and_the_model_and_version_its_target_names(target: str, key) -> None:  # noqa: ANN001
    assert route_key(target) == key


def test_a_request_whose_deadline_ends_before_the_remembered_backlog_clears_is_refused_as_the_app_refuses() -> None:
    recent = _remembering(busy_for_s=60.0)  # (margins a loaded host's stalls cannot eat)
    before = REGISTRY.get_sample_value("visionserve_requests_total", {"endpoint": "/predict", "status": "429"}) or 0
    rejected = REGISTRY.get_sample_value("visionserve_rejected_total", {"reason": "deadline_unreachable"}) or 0
    refused = recent.refusal(_head("/predict", "5000", "X-Request-ID: caller-7"), time.monotonic(), "10.0.0.1")
    assert refused is not None and refused.keep_alive
    status, headers, body = _answer(refused.answer)
    assert (status, headers["content-type"], headers["retry-after"], headers["x-request-id"]) == (
        429, "application/json", "3", "caller-7")
    assert "connection" not in headers and "keep-alive" not in headers  # kept alive (for a time not said)
    assert body["error"]["code"] == "deadline_unreachable" and body["error"]["request_id"] == "caller-7"
    assert re.fullmatch(r"the queue ahead may need up to \d\d\.\d{3}s, more than the \d\.\d{3}s deadline",
                        body["error"]["message"]), body
    assert refused.answer.endswith(b"}\n") and email.utils.parsedate_to_datetime(headers["date"])  # as Flask's
    assert REGISTRY.get_sample_value("visionserve_requests_total",
                                     {"endpoint": "/predict", "status": "429"}) == before + 1
    assert REGISTRY.get_sample_value("visionserve_rejected_total", {"reason": "deadline_unreachable"}) == rejected + 1


def test_a_refusal_says_how_long_the_worker_keeps_its_connection_or_that_it_closes() -> None:
    recent = _remembering(busy_for_s=60.0)
    kept = recent.refusal(_head("/predict", "5000"), time.monotonic(), None, lambda: 5)  # the worker's KEEPALIVE_S
    assert kept is not None and kept.keep_alive
    assert ("connection" in _answer(kept.answer)[1], _answer(kept.answer)[1]["keep-alive"]) == (False, "timeout=5")
    full = recent.refusal(_head("/predict", "5000"), time.monotonic(), None, lambda: 0)  # its keep-alive slots full
    assert full is not None and not full.keep_alive
    assert (_answer(full.answer)[1]["connection"], "keep-alive" in _answer(full.answer)[1]) == ("close", False)


def test_a_v2_refusal_has_the_protocol_s_error_shape_and_a_http_1_0_one_closes() -> None:
    recent = _remembering(target="/v2/models/lite0/infer")
    refused = recent.refusal(_head("/v2/models/lite0/infer", "100", version="HTTP/1.0"), time.monotonic(), None)
    assert refused is not None and not refused.keep_alive
    status, headers, body = _answer(refused.answer)
    assert (status, headers["connection"], set(body)) == (429, "close", {"error"})
    assert isinstance(body["error"], str)
    closing = recent.refusal(_head("/v2/models/lite0/infer", "100", "Connection: close"), time.monotonic(), None)
    assert closing is not None and not closing.keep_alive


@pytest.mark.parametrize("head", [
    _head("/predict", "5000"),  # its deadline ends after the backlog clears: the engine may take it
    _head("/predict", None),  # REQUEST_TIMEOUT_S (30 s)
    _head("/predict?model=lite0", "500"),  # another route
    _head("/predict", "500", method="PUT"),
    _head("/predict", "500", "Origin: https://app.example"),  # CORS: the app answers with its headers
    _head("/predict", "soon"), _head("/predict", "-5"), _head("/predict", "nan"),  # the app's 400
    _head("/predict", "1_000"), _head("/predict", "+500"), _head("/predict", "inf"),  # (float() took them)
    _head("/predict", "500", "X-Request-Timeout: 400"),  # given twice: the app decides
    _head("/predict", "500", "Origin : https://app.example"),  # a name that is no token: gunicorn's 400
])
def test_what_the_engine_might_take_or_the_app_must_answer_goes_to_the_app(head: bytes) -> None:
    assert _remembering(busy_for_s=2.0).refusal(head, time.monotonic(), None) is None


def test_a_deadline_counts_from_when_the_loop_had_the_request_whole() -> None:
    recent = _remembering(busy_for_s=3.0)
    now = time.monotonic()
    assert recent.refusal(_head("/predict", "5000"), now, None) is None
    assert recent.refusal(_head("/predict", "5000"), now - 4.5, None) is not None  # 4.5 s waited in the worker


def test_a_refusal_is_remembered_for_memory_s_and_until_its_backlog_clears_only() -> None:
    assert _remembering(memory_s=0.0).refusal(_head(), time.monotonic(), None) is None  # REFUSAL_MEMORY_MS=0
    stale = _remembering(memory_s=0.05, busy_for_s=5.0)
    time.sleep(0.06)
    assert stale.refusal(_head(), time.monotonic(), None) is None
    cleared = _remembering(busy_for_s=0.02)
    time.sleep(0.03)
    assert cleared.refusal(_head("/predict", "1"), time.monotonic(), None) is None


def test_where_an_api_key_is_set_only_a_request_that_carries_it_is_refused_here() -> None:
    recent = _remembering(key_ok=partial(carries_key, forms=key_forms("s3cret")))
    now = time.monotonic()
    assert recent.refusal(_head(), now, None) is None  # the app's 401
    assert recent.refusal(_head("/predict", "500", "X-API-Key: wrong"), now, None) is None
    assert recent.refusal(_head("/predict", "500", "authorization: Bearer s3cret"), now, None) is not None
    assert recent.refusal(_head("/predict", "500", "X-API-Key: s3cret"), now, None) is not None


def test_a_head_without_fields_is_judged_by_the_server_s_longest_deadline() -> None:
    recent = _remembering(busy_for_s=60.0)
    assert recent.refusal(b"POST /predict HTTP/1.1\r\n\r\n", time.monotonic(), None) is not None


def test_a_deadline_that_may_be_too_short_for_a_request_s_own_inference_goes_to_the_app() -> None:
    # The engine says 400 deadline_too_short where a request's own inference (its images, and a batch's wait)
    # outlasts the deadline's whole length, busy or not: here, for a request of up to MAX_IMAGES (4) images of 50 ms
    recent = _remembering(busy_for_s=5.0, image_s=0.05)
    now = time.monotonic()
    assert recent.refusal(_head("/predict", "150"), now, None) is None  # 4 x 50 ms + 2 ms: maybe too short
    assert recent.refusal(_head("/predict", "250"), now, None) is not None


def test_a_deadline_under_the_floor_goes_to_the_app_and_its_400() -> None:
    # Before: the floor was the app's alone: raised (MIN_REQUEST_TIMEOUT_MS 50), a 20 ms deadline during a storm
    # was refused here 429 deadline_unreachable, a retry invited, where the app answers 400 deadline_too_short
    recent = _remembering(busy_for_s=5.0, image_s=0.001)
    recent.configure(10.0, 30.0, 4, None, min_deadline_ms=50)
    recent.remember("/predict", Backlog(time.monotonic() + 5.0, 0.001, 0.002), "3")
    now = time.monotonic()
    assert recent.refusal(_head("/predict", "20"), now, None) is None
    assert recent.refusal(_head("/predict", "60"), now, None) is not None


def test_a_deadline_that_passed_while_the_request_waited_in_its_worker_is_the_app_s_504() -> None:
    recent = _remembering(busy_for_s=5.0)
    assert recent.refusal(_head("/predict", "500"), time.monotonic() - 0.6, None) is None


def test_the_connection_stays_open_only_where_the_worker_would_keep_it_after_an_answer_of_the_app_s() -> None:
    refused = _remembering().refusal(_head(), time.monotonic(), None, lambda: False)  # KEEPALIVE_S=0, or stopping
    assert refused is not None and not refused.keep_alive and b"\r\nConnection: close\r\n" in refused.answer


def test_the_access_line_says_a_trusted_forwarded_for_as_the_app_s(caplog: pytest.LogCaptureFixture) -> None:
    recent = _remembering()
    recent.forwarded_for = True
    with caplog.at_level("INFO", logger="visionserve.access"):
        assert recent.refusal(_head("/predict", "500", "X-Forwarded-For: 203.0.113.9"), time.monotonic(), "10.1.1.1")
    [line] = [r for r in caplog.records if r.name == "visionserve.access"]
    assert (line.status, line.route, line.client, line.forwarded_for, line.error) == (
        429, "/predict", "10.1.1.1", "203.0.113.9", "deadline_unreachable")
