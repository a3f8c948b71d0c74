"""How pytest-xdist's workers share the tests out under `make test` (``-n 3 --dist loadgroup``; docs/testing.md).

Two rules on top of xdist's load scheduling, both only for speed (every test passes wherever and in whatever
order it runs):

* ``SAME_WORKER``: tests that share something costly run in one worker, so it is built once: the session's live
  server (gunicorn on the real model), and a module fixture that takes seconds to a minute (an export, a server).
  The session's exports (``real_weights``, ``small_weights``) need no rule: every worker reuses the first one's
  (tests/support/shared.py).
* ``LONG``: the longest tests start first, longest first, then the folders whose tests are long (servers,
  training), and the many short tests last, so the workers end together. A worker still busy with one of the
  ``LONG`` tests is handed its next tests from the short end of the queue, instead of holding a long one back.

pytest 9 ignores the node id suffix by which pytest-xdist 3.8 puts ``xdist_group`` marks together, hence these
rules on node ids (a suffix, where xdist manages to add one, still groups).
"""
from __future__ import annotations

from typing import Any

SAME_WORKER: tuple[tuple[str, str], ...] = (  # (node id prefix, group)
    ("tests/server/test_client.py::", "live_server"),
    ("tests/server/test_docs_commands.py::", "live_server"),
    ("tests/server/test_v2_triton.py::", "live_server"),
    ("tests/server/test_browser.py::test_the_demo_page_classifies_a_real_photo", "live_server"),
    ("tests/server/test_gunicorn_e2e.py::test_concurrent_requests_are_answered_right_and_batched", "e2e server"),
    ("tests/server/test_gunicorn_e2e.py::test_multipart_and_health_over_http", "e2e server"),
    ("tests/server/test_gunicorn_e2e.py::test_every_log_line_is_json_and_requests_name_their_peer", "e2e server"),
    ("tests/server/test_engine_process.py::", "engine server"),
    ("tests/server/test_engine_process_ops.py::test_ready", "engine server"),
    ("tests/server/test_engine_process_ops.py::test_a_refusal", "engine server"),
    ("tests/server/test_rollouts.py::", "two lite0 versions"),
    ("tests/server/test_http_framing.py::", "framing server"),
    ("tests/server/test_model_swaps.py::", "four exports"),
    ("tests/training/test_export_versions.py::", "a trained run"),
    ("tests/training/test_predict.py::", "predict's exports"),
    ("tests/app/test_packages.py::", "an AOTInductor package"),
    ("tests/app/test_int8_packages.py::", "an int8 package"),
    ("tests/app/test_onnx.py::", "an ONNX export"),
    ("tests/unit/test_house.py::", "the project parsed"),  # every file's syntax tree, built once a process
)
LONG = (  # about a minute or more on 2 cores, longest first
    "tests/server/test_docs_walkthrough.py::test_the_models_doc_runs_end_to_end",
    "tests/server/test_docs_walkthrough.py::test_the_training_doc_runs_end_to_end",
    "tests/server/test_rollouts.py::",
    "tests/server/test_bench_gpu.py::",
    "tests/training/test_training.py::test_the_summary_serves_what_the_run_exported",
    "tests/training/test_training.py::test_resnet18_from_scratch_with_the_default_recipe_learns_the_digits",
    "tests/unit/test_bench_report.py::test_the_request_path_is_the_apps_cpu_per_image_split_by_its_stage_counters",
    "tests/server/test_engine_process.py::",
    "tests/server/test_first_use.py::test_a_new_user_trains_exports_serves_and_calls_their_model",
    "tests/training/test_gpu_data.py::test_a_fine_tune_learns_the_same_on_both_paths",
    "tests/server/test_model_swaps.py::",
    "tests/app/test_int8_packages.py::",
    "tests/app/test_packages.py::",
)
FOLDERS = ("tests/server/", "tests/training/", "tests/deploy/")  # then the rest: tests/app/, tests/unit/


def rank(nodeid: str) -> int:
    """Where a test goes in the order the workers are handed tests (lower: earlier)."""
    order = LONG + FOLDERS
    return next((i for i, prefix in enumerate(order) if nodeid.startswith(prefix)), len(order))


def group(nodeid: str) -> str:
    """The unit of work ``nodeid`` belongs to: its SAME_WORKER group, else the test alone."""
    if nodeid.rfind("@") > nodeid.rfind("]"):  # an xdist_group mark, where xdist could add it
        return nodeid.rsplit("@", 1)[-1]
    return next((name for prefix, name in SAME_WORKER if nodeid.startswith(prefix)), nodeid)


def make_scheduler(config: Any, log: Any) -> Any:
    """pytest-xdist's scope scheduling with ``group`` as the scope, units in the collection's order (``rank``)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupsLongFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group(nodeid)

        def schedule(self) -> None:
            self.config.option.loadscopereorder = False  # the order is rank's, not the units' sizes
            super().schedule()

        def _assign_work_unit(self, node: Any) -> None:
            pending = [nodeid for unit in self.assigned_work.get(node, {}).values()
                       for nodeid, done in unit.items() if not done]
            short = next(reversed(self.workqueue), None)
            if short is not None and any(rank(nodeid) < len(LONG) for nodeid in pending):
                self.workqueue.move_to_end(short, last=False)  # the shortest next
            super()._assign_work_unit(node)

    return GroupsLongFirst(config, log)
