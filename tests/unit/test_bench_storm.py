"""bench/serving/storm.py's readings: hey's answers by status, and a refusal's CPU against an answer's."""
from __future__ import annotations

import math

from bench.serving.storm import cpu_split, hey_statuses, refusal_share

HEY = """
Summary:
  Total:	8.0136 secs
  Requests/sec:	2312.4

Status code distribution:
  [200]	659 responses
  [429]	17858 responses
  [504]	16 responses
"""


def test_hey_s_status_distribution_is_read_as_counts() -> None:
    assert hey_statuses(HEY) == {200: 659, 429: 17858, 504: 16}
    assert hey_statuses("Summary:\n  Total: 1 secs\n") == {}


def test_a_refusal_s_cpu_is_what_the_storm_spent_beyond_its_answers_at_the_answered_cost() -> None:
    answered = {"requests": 1000, "http_cpu_s": 1.0, "engine_cpu_s": 9.0}  # 1 ms of HTTP, 10 ms in all, an answer
    storm = {"answered": 500, "late": 100, "refused": 2000, "http_cpu_s": 1.2}  # 0.6 s of it the answers'
    share = refusal_share(answered, storm)
    assert math.isclose(share["http_us_refusal"], 300.0) and math.isclose(share["refusal_of_answered"], 0.03)
    assert (share["http_us_answered"], share["whole_us_answered"]) == (1000.0, 10000.0)
    assert math.isnan(refusal_share(answered, {**storm, "refused": 0})["http_us_refusal"])


def test_the_server_s_cpu_is_split_into_its_http_workers_and_its_engines_without_the_master() -> None:
    before = {1: ("gunicorn master", 5.0), 2: ("gunicorn worker", 1.0), 3: ("python -m app.link.server", 2.0)}
    after = {1: ("gunicorn master", 6.0), 2: ("gunicorn worker", 1.5), 3: ("python -m app.link.server", 4.0),
             4: ("gunicorn worker", 0.3)}  # started in between: not in both readings
    assert cpu_split(before, after, master=1) == (0.5, 2.0)
