"""The overload benchmark's search for the concurrency that saturates a server (bench/serving/overload.py)."""
from __future__ import annotations

import pytest

from bench.serving import overload


def _server(goodput: dict[int, float], asked: list[int]):
    def point(url: str, per_request: int, concurrency: int, seconds: float, warmup: float) -> dict[str, object]:
        asked.append(concurrency)
        return {"per_request": per_request, "concurrency": concurrency, "img_s": goodput[concurrency]}
    return point


def test_the_saturating_concurrency_is_the_smallest_within_5_percent_of_the_best(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(overload, "point", _server({1: 10.0, 2: 19.0, 4: 30.0, 8: 31.0, 16: 40.0}, asked))
    found, tried = overload.saturating("http://x", 16, 1.0, 0.5, limit=128)
    assert found == 4  # 8 gained 3% over 4's 30: the search stops there, never asks 16
    assert asked == [1, 2, 4, 8] and [row["concurrency"] for row in tried] == asked


def test_a_server_still_gaining_is_searched_up_to_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(overload, "point", _server({c: 10.0 * c for c in (1, 2, 4, 8, 16)}, asked))
    found, _ = overload.saturating("http://x", 1, 1.0, 0.5, limit=8)
    assert found == 8 and asked == [1, 2, 4, 8]


def test_a_drop_after_the_best_keeps_the_best(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(overload, "point", _server({1: 50.0, 2: 80.0, 4: 60.0}, asked))
    assert overload.saturating("http://x", 16, 1.0, 0.5, limit=128)[0] == 2
