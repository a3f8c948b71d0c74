"""``Client``: /predict, health, readiness and model metadata over a pooled ``requests`` session, with retries."""
from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Callable, Sequence, Union, overload

import requests
from requests.adapters import HTTPAdapter

from visionserve_client.errors import VisionServeError
from visionserve_client.types import Embedding, ModelInfo, Prediction

ImageInput = Union[str, Path, bytes]
# Overloaded or not ready: the server says when to come back. Other errors are the caller's to handle.
RETRY_STATUSES = frozenset({429, 503})


def _read(image: ImageInput, position: int) -> tuple[str, bytes]:
    if isinstance(image, bytes):
        return f"image{position}", image
    path = Path(image)
    try:
        return path.name, path.read_bytes()
    except OSError as exc:
        _name_the_file(exc, str(image))
        raise


def _name_the_file(error: OSError, path: str) -> None:
    """``error`` naming the file in its repr too: an OSError's repr (what a REPL or a printed list of
    ``predict_each``'s results shows) leaves its filename out, ``FileNotFoundError(2, 'No such file or directory')``.
    Its type, errno and ``filename`` stay as they are, and so does str()."""
    if error.errno is None:  # an OSError without errno: its message is all it says
        error.args = (f"{path}: {error}",)
        return
    if error.filename is None:
        error.filename = path
    error.args = (error.errno, error.strerror, error.filename)  # repr: FileNotFoundError(2, '...', 'notes.txt')


def _route(model: str | None, version: str | None) -> dict[str, str]:
    """The ``model`` and ``version`` query parameters, those given (the server picks the rest)."""
    return {key: value for key, value in (("model", model), ("version", version)) if value is not None}


def _retry_after(response: requests.Response) -> float | None:
    try:
        return float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return None


def _error(response: requests.Response) -> VisionServeError:
    try:
        body = response.json()["error"]
        code, message, details = body.get("code", "error"), body.get("message", ""), body.get("details")
    except (ValueError, KeyError, TypeError, AttributeError):
        code, message, details = "http_error", response.text[:200] or response.reason, None
    return VisionServeError(message, status=response.status_code, code=code, details=details,
                            request_id=response.headers.get("X-Request-ID"), retry_after_s=_retry_after(response))


class Client:
    """A visionserve client. Thread-safe for concurrent calls; reuse one instance (it pools connections).

    429 and 503 answers and connection failures are retried up to ``retries`` times, waiting what the server's
    Retry-After says (at most ``max_backoff_s``), or an exponential backoff with jitter when it says nothing.
    ``client_id`` (sent as X-Client-ID) keeps this client on the same side of a canary rollout.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 client_id: str | None = None, timeout: float = 30.0, retries: int = 3, backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, pool_size: int = 16, sleep: Callable[[float], None] = time.sleep) -> None:
        if timeout <= 0 or retries < 0 or backoff_s < 0 or max_backoff_s < 0 or pool_size <= 0:
            raise ValueError("timeout and pool_size must be positive; retries and backoffs must not be negative")
        self.base_url = base_url.rstrip("/")
        self.timeout, self.retries = timeout, retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._sleep = sleep
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_size)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        if client_id:  # keeps this client on one side of a canary rollout (the server's CLIENT_KEY_HEADER)
            self.session.headers["X-Client-ID"] = client_id

    def close(self) -> None:
        """Close pooled connections."""
        self.session.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_s(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_backoff_s)
        return min(self.backoff_s * 2 ** attempt * (0.5 + random.random()), self.max_backoff_s)

    def _request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        for attempt in range(self.retries + 1):
            try:
                response = self.session.request(method, self.base_url + path, timeout=self.timeout, **kwargs)
            except requests.RequestException as exc:
                error = VisionServeError(str(exc), code="connection_error")
            else:
                if response.status_code == 200:
                    return response
                error = _error(response)
                if response.status_code not in RETRY_STATUSES:
                    raise error
            if attempt == self.retries:
                raise error
            self._sleep(self._wait_s(attempt, error.retry_after_s))
        raise AssertionError("unreachable")

    @overload
    def predict(self, images: ImageInput, top_k: int | None = None, *, deadline_ms: float | None = None,
                model: str | None = None, version: str | None = None) -> Prediction: ...

    @overload
    def predict(self, images: Sequence[ImageInput], top_k: int | None = None, *, deadline_ms: float | None = None,
                model: str | None = None, version: str | None = None) -> list[Prediction]: ...

    def predict(self, images: ImageInput | Sequence[ImageInput], top_k: int | None = None, *,
                deadline_ms: float | None = None, model: str | None = None,
                version: str | None = None) -> Prediction | list[Prediction]:
        """Classify one image (a path or the file's bytes) or a list of them, in one request, in order.

        ``top_k``: classes per image; left out, the server's default (``TOP_K``, at most the model's classes).
        ``model`` and ``version``: which served model and version answer; left out, the server's default model
        and that model's default version. Each prediction says which answered (``Prediction.model``, ``.version``).
        """
        single = isinstance(images, (str, Path, bytes))
        batch: Sequence[ImageInput] = [images] if single else images  # type: ignore[list-item, assignment]
        if not batch:
            raise ValueError("predict needs at least one image")
        files = [_read(image, i) for i, image in enumerate(batch)]
        predictions = self._predict_files(files, top_k, deadline_ms, _route(model, version))
        return predictions[0] if single else predictions

    @overload
    def embed(self, images: ImageInput, *, deadline_ms: float | None = None, model: str | None = None,
              version: str | None = None) -> Embedding: ...

    @overload
    def embed(self, images: Sequence[ImageInput], *, deadline_ms: float | None = None, model: str | None = None,
              version: str | None = None) -> list[Embedding]: ...

    def embed(self, images: ImageInput | Sequence[ImageInput], *, deadline_ms: float | None = None,
              model: str | None = None, version: str | None = None) -> Embedding | list[Embedding]:
        """The embedding of one image (a path or the file's bytes) or of each of a list, in one request, in order
        (``/predict?outputs=embedding``); a model exported without one answers VisionServeError ``no_embedding``.
        ``model`` and ``version`` as for ``predict``."""
        single = isinstance(images, (str, Path, bytes))
        batch: Sequence[ImageInput] = [images] if single else images  # type: ignore[list-item, assignment]
        if not batch:
            raise ValueError("embed needs at least one image")
        files = [_read(image, i) for i, image in enumerate(batch)]
        body = self._post_files(files, {**_route(model, version), "outputs": "embedding"}, deadline_ms)
        served = body.get("model") or {}
        embeddings = [Embedding(vector, served.get("name"), served.get("version")) for vector in body["embeddings"]]
        return embeddings[0] if single else embeddings

    def predict_each(self, images: Sequence[ImageInput], top_k: int | None = None, *,
                     deadline_ms: float | None = None, model: str | None = None,
                     version: str | None = None) -> list[Prediction | VisionServeError | OSError]:
        """Like ``predict`` for a list, but one bad image does not sink the others: each entry is its image's
        prediction, or the error for that image (the server's, or an OSError for a file that cannot be read, naming
        the file in its str() and repr() and as ``filename``).
        One request in the common case; when the server refuses one image, the rest are sent again without it."""
        route = _route(model, version)
        results: list[Prediction | VisionServeError | OSError | None] = [None] * len(images)
        files: dict[int, tuple[str, bytes]] = {}
        for i, image in enumerate(images):
            try:
                files[i] = _read(image, i)
            except OSError as exc:
                results[i] = exc
        while files:
            positions = list(files)
            try:
                answers = self._predict_files([files[i] for i in positions], top_k, deadline_ms, route)
            except VisionServeError as exc:
                if exc.image_index is None or not 0 <= exc.image_index < len(positions):
                    raise  # about the request as a whole (overload, auth...): the caller's to handle
                bad = positions[exc.image_index]
                results[bad] = exc
                del files[bad]
                continue
            for i, answer in zip(positions, answers):
                results[i] = answer
            break
        return results  # type: ignore[return-value]

    def _predict_files(self, files: list[tuple[str, bytes]], top_k: int | None, deadline_ms: float | None,
                       route: dict[str, str]) -> list[Prediction]:
        body = self._post_files(files, {**route, **({"top_k": str(top_k)} if top_k is not None else {})}, deadline_ms)
        served = body.get("model") or {}
        return [Prediction.from_json(p, model=served.get("name"), version=served.get("version"))
                for p in body["predictions"]]

    def _post_files(self, files: list[tuple[str, bytes]], params: dict[str, str],
                    deadline_ms: float | None) -> dict[str, Any]:
        headers = {"X-Request-Timeout": str(deadline_ms)} if deadline_ms is not None else {}
        response = self._request("POST", "/predict", params=params or None, files=[("image", f) for f in files],
                                 headers=headers)
        return response.json()

    def health(self) -> bool:
        """Liveness: True when the process and its inference thread run (no retries)."""
        return self._probe("/healthz")

    def ready(self) -> bool:
        """Readiness: True when the model is warm and the server accepts work (no retries)."""
        return self._probe("/readyz")

    def _probe(self, path: str) -> bool:
        try:
            return self.session.get(self.base_url + path, timeout=self.timeout).status_code == 200
        except requests.RequestException:
            return False

    def model(self, labels: bool = False, model: str | None = None) -> ModelInfo:
        """A served model's metadata at its default version (with its class names when ``labels``): ``model``, else
        the server's default model (``default_model`` of /v1/models), the one ``predict`` without ``model`` meets.
        With several models and none the default, it raises what ``predict`` gets then: a 400 ``invalid_request``
        naming them (``details["models"]``); the client never picks one the server would not."""
        response = self._request("GET", "/v1/models", params={"labels": "1"} if labels else None)
        body = response.json()
        name = model or body.get("default_model")
        if name is None:
            names = sorted({m["name"] for m in body["models"]})
            if len(names) > 1:  # the server's own words for a request naming no model (its RoutingTable)
                raise VisionServeError(
                    f"this server serves {len(names)} models ({', '.join(names)}) and none is the default "
                    "(DEFAULT_MODEL, or repository.json): name one (?model=NAME, or /v2/models/NAME/...)",
                    status=400, code="invalid_request", details={"models": names},
                    request_id=response.headers.get("X-Request-ID"))
            name = names[0] if names else None  # the only model is the default (a server that did not say so)
        entries = [m for m in body["models"] if m["name"] == name]
        if not entries:
            raise VisionServeError("the server serves no model" + (f" {name!r}" if name else ""), status=404,
                                   code="not_found")
        return ModelInfo.from_json(next((m for m in entries if m.get("default")), entries[0]))
