"""The engine profile's summary of py-spy's collapsed stacks (bench/serving/engine_profile.py)."""
from __future__ import annotations

from bench.serving.engine_profile import summarise

ENTRY = "<module> (/x/engine_only.py:9);listen (/x/app/link/loop.py:166)"
RAW = "\n".join([
    f"{ENTRY};_loop (/x/app/link/loop.py:195);read (/x/app/link/wire.py:379) 6",
    f"{ENTRY};_loop (/x/app/link/loop.py:197);_run (/x/batcher.py:5);_rows (/x/predictor.py:99) 3",
    f"{ENTRY};_loop (/x/app/link/loop.py:195);_run (/x/batcher.py:7) 1",
    "_bootstrap (<frozen threading>:1);settle (/x/version.py:104) 2",
])


def test_functions_are_counted_once_a_stack_by_file_not_line_and_the_busiest_entry_is_left_out() -> None:
    total, inclusive, itself = summarise(RAW, top=3)
    assert total == 12
    # <module>, listen and _loop are on all 10 of the main thread's stacks: its entry, not a finding (_loop's two
    # lines are one function)
    assert inclusive == [("read (wire.py)", 6 / 12), ("_run (batcher.py)", 4 / 12), ("_rows (predictor.py)", 3 / 12)]
    assert itself == [("read (wire.py)", 6 / 12), ("_rows (predictor.py)", 3 / 12), ("settle (version.py)", 2 / 12)]


def test_an_empty_sampling_is_no_samples() -> None:
    assert summarise("", top=5) == (0, [], [])
