"""The prediction monitor (app/engine/loaded/monitor.py): its window against a plain list of the last predictions, the PSI
against the formula, its bins, the reference (the manifest's or the first window), thread safety; and the metrics
observer's drift gauges once a version is unloaded."""
from __future__ import annotations

import math
import random
import threading

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from app.engine.loaded.monitor import PSI_EPSILON, PredictionMonitor, class_bins, population_stability_index
from app.metrics import BATCHER_EVENT_NAMES, STAGES, MetricsObserver
from models.export.manifest import PredictionReference

LABELS = [f"class{i}" for i in range(6)]


def _rows(classes: list[int], confidences: list[float], num_classes: int = len(LABELS)) -> torch.Tensor:
    """Probability rows whose top-1 is each class with that probability (the rest spread evenly)."""
    rows = []
    for index, top in zip(classes, confidences):
        rest = (1 - top) / (num_classes - 1)
        row = torch.full((num_classes,), rest)
        row[index] = top
        rows.append(row)
    return torch.stack(rows)


def _monitor(window: int = 10, min_predictions: int = 5, psi_bins: int = 20,
             reference: PredictionReference | None = None, labels: list[str] = LABELS) -> PredictionMonitor:
    return PredictionMonitor(labels, window=window, min_predictions=min_predictions, low_confidence_threshold=0.5,
                             psi_bins=psi_bins, reference=reference)


def _reference(class_counts: list[int]) -> PredictionReference:
    total = sum(class_counts)
    return PredictionReference(source="validation", predictions=total, class_counts=class_counts,
                               confidence_buckets=[0.5, 1.0], confidence_counts=[0, total],
                               low_confidence_threshold=0.5, low_confidence_share=0.0)


def test_psi_is_the_formula_and_zero_for_the_same_mix() -> None:
    assert population_stability_index(torch.tensor([5, 3, 2]), torch.tensor([50, 30, 20])) == pytest.approx(0)
    actual, expected = [0.5, 0.3, 0.2], [0.25, 0.25, 0.5]
    by_hand = sum((a - e) * math.log(a / e) for a, e in zip(actual, expected))
    assert population_stability_index(torch.tensor([50, 30, 20]), torch.tensor([1, 1, 2])) == pytest.approx(by_hand)
    # an empty bin counts as PSI_EPSILON: large but finite, on either side
    one_sided = (0.1 - PSI_EPSILON) * math.log(0.1 / PSI_EPSILON) + (0.9 - 1.0) * math.log(0.9 / 1.0)
    assert population_stability_index(torch.tensor([1, 9]), torch.tensor([0, 10])) == pytest.approx(one_sided)
    assert math.isfinite(population_stability_index(torch.tensor([0, 10]), torch.tensor([10, 0])))


def test_bins_are_classes_or_the_reference_s_frequent_classes_and_the_rest_dealt_by_index() -> None:
    assert class_bins(torch.tensor([3, 0, 1]), 5).tolist() == [0, 1, 2]
    # 8 classes in 4 bins: a class needs 1/8 of the reference (3 of 24) for a bin of its own; at most 3 get one
    # (ties: the lower index); the others are dealt over what is left by index
    assert class_bins(torch.tensor([1, 9, 0, 4, 4, 0, 3, 3]), 4).tolist() == [3, 0, 3, 1, 2, 3, 3, 3]
    assert class_bins(torch.tensor([1, 9, 0, 2, 2, 0, 2, 8]), 4).tolist() == [2, 0, 2, 3, 2, 3, 2, 1]


def test_the_window_holds_exactly_the_last_predictions() -> None:
    rng = random.Random(0)
    monitor = _monitor(window=7, min_predictions=1, reference=_reference([1] * 6))
    history: list[tuple[int, float]] = []
    for _ in range(40):
        size = rng.randint(1, 9)  # batches longer than the window too
        batch = [(rng.randrange(6), rng.choice([0.3, 0.45, 0.55, 0.9])) for _ in range(size)]
        seen = monitor.observe(_rows([c for c, _ in batch], [p for _, p in batch]))
        history += batch
        assert seen.labels == [LABELS[c] for c, _ in batch]
        assert seen.confidences == pytest.approx([p for _, p in batch])
        last = history[-7:]
        assert seen.low_confidence_ratio == pytest.approx(sum(p < 0.5 for _, p in last) / len(last))
        counts = torch.bincount(torch.tensor([c for c, _ in last]), minlength=6)
        assert seen.psi == pytest.approx(population_stability_index(counts, torch.ones(6)))
    snapshot = monitor.snapshot()
    assert (snapshot.predictions, snapshot.predictions_total, snapshot.window_size) == (7, len(history), 7)
    tally = {LABELS[c]: n for c, n in enumerate(torch.bincount(torch.tensor([c for c, _ in history[-7:]]),
                                                                 minlength=6).tolist()) if n}
    assert {c.label: c.count for c in snapshot.top_classes} == dict(sorted(tally.items(), key=lambda kv: -kv[1])[:5])


def _oldest_first(monitor: PredictionMonitor) -> list[tuple[int, bool]]:
    """The window's predictions (class, low), oldest first, wherever its ring puts them."""
    window = monitor._window
    at = window._next if window.filled == window.size else 0
    ring = list(zip(window.classes, window.low))
    return (ring[at:] + ring[:at])[:window.filled]


@pytest.mark.parametrize("classes, psi_bins", [(6, 20), (40, 5)])  # a bin a class; classes sharing bins
def test_settles_of_many_rows_leave_the_window_and_figures_as_rows_added_a_few_at_a_time(classes: int,
                                                                                          psi_bins: int) -> None:
    # settles of up to 250 rows (a busy engine's METRICS_FLUSH_MS, some more than the window) against the same rows
    # in settles of 1 to 5 (an idle one's): the same window, figures and snapshot after every settle
    rng = random.Random(classes)
    labels = [f"class{i}" for i in range(classes)]
    together, few = (_monitor(window=100, min_predictions=1, psi_bins=psi_bins, labels=labels,
                              reference=_reference([1 + i % 3 for i in range(classes)])) for _ in range(2))
    history: list[int] = []
    for _ in range(30):
        batch = [(rng.randrange(classes), rng.choice([0.3, 0.45, 0.55, 0.9])) for _ in range(rng.randint(1, 250))]
        seen = together.observe(_rows([c for c, _ in batch], [p for _, p in batch], classes))
        at = 0
        while at < len(batch):
            step = batch[at:at + rng.randint(1, 5)]
            alone = few.observe(_rows([c for c, _ in step], [p for _, p in step], classes))
            at += len(step)
        history += [c for c, _ in batch]
        assert _oldest_first(together) == _oldest_first(few)
        assert (together._window.class_counts, together._window.bin_counts, together._window.low_count,
                together._window.filled) == (few._window.class_counts, few._window.bin_counts,
                                             few._window.low_count, few._window.filled)
        assert together._window.class_counts == torch.bincount(torch.tensor(history[-100:]),
                                                               minlength=classes).tolist()
        assert (seen.low_confidence_ratio, seen.psi) == pytest.approx((alone.low_confidence_ratio, alone.psi))
    assert together.snapshot() == few.snapshot()


def test_the_manifest_reference_reports_after_min_predictions_and_rises_when_the_mix_changes() -> None:
    monitor = _monitor(window=40, min_predictions=20, reference=_reference([20, 20, 0, 0, 0, 0]))
    same = [0, 1] * 10
    assert monitor.observe(_rows(same[:19], [0.9] * 19)).psi is None  # 19 < min_predictions
    steady = monitor.observe(_rows(same[19:], [0.9])).psi
    assert steady == pytest.approx(0)
    changed = monitor.observe(_rows([2] * 20, [0.9] * 20)).psi  # half the window now a class never predicted
    assert changed is not None and changed > 0.2
    reference = monitor.snapshot().reference
    assert (reference.source, reference.predictions, reference.complete) == ("validation", 40, True)


def test_without_a_reference_the_first_window_becomes_it_and_the_window_starts_again() -> None:
    monitor = _monitor(window=10, min_predictions=5)
    first = monitor.observe(_rows([0, 1] * 4, [0.9, 0.3] * 4))
    assert first.psi is None and first.low_confidence_ratio == pytest.approx(0.5)  # 8 >= 5: the share reports
    assert monitor.snapshot().reference.complete is False
    completed = monitor.observe(_rows([0, 1], [0.9, 0.3]))  # the 10th prediction: the reference is complete
    assert completed.psi is None and completed.low_confidence_ratio is None  # the window is empty again
    snapshot = monitor.snapshot()
    assert (snapshot.predictions, snapshot.predictions_total) == (0, 10)
    assert (snapshot.reference.source, snapshot.reference.predictions, snapshot.reference.complete,
            snapshot.reference.low_confidence_share) == ("first_predictions", 10, True, 0.5)
    assert monitor.observe(_rows([1, 0] * 3, [0.9] * 6)).psi == pytest.approx(0)  # the same mix
    assert monitor.observe(_rows([3] * 6, [0.9] * 6)).psi > 0.2  # 6 of the last 10 a class never seen


@pytest.mark.parametrize("power", [1, 4])  # 1: about even over 1,000 classes; 4: uneven, as real traffic often is
def test_many_classes_share_bins_so_the_same_mix_reads_stable(power: int) -> None:
    # Two samples of 1,000 of the same mix over 1,000 classes: one bin per class reads about 1.3; the top 19 classes
    # of the reference a bin each about 0.1 (0.13 on average for the even mix); these bins about 0.04.
    labels = [str(i) for i in range(1000)]
    readings = []
    for seed in range(5):
        generator = torch.Generator().manual_seed(seed)
        weights = torch.rand(1000, generator=generator) ** power
        monitor = _monitor(window=1000, min_predictions=200, psi_bins=20, labels=labels)
        for _ in range(2):  # the first 1,000: the reference; the next: the window
            drawn = torch.multinomial(weights, 1000, replacement=True, generator=generator)
            psi = monitor.observe(torch.nn.functional.one_hot(drawn, 1000).float()).psi
        readings.append(psi)
    assert max(readings) < 0.1, readings  # "stable"
    # the reference's five most frequent classes become a third of what it is sent: drift
    frequent = torch.tensor([c.index for c in monitor.snapshot().top_classes])
    shifted = weights / weights.sum() * 2 / 3
    shifted[frequent] += 1 / 15
    drawn = torch.multinomial(shifted, 1000, replacement=True, generator=generator)
    assert monitor.observe(torch.nn.functional.one_hot(drawn, 1000).float()).psi > 0.2


def test_nan_rows_count_as_no_confidence() -> None:
    monitor = _monitor(window=10, min_predictions=1)
    seen = monitor.observe(torch.full((2, len(LABELS)), float("nan")))
    assert seen.confidences == [0.0, 0.0] and seen.low_confidence_ratio == 1.0


def test_the_monitor_s_top_class_is_the_one_the_answers_rank_first_ties_nan_and_inf_included() -> None:
    # observe takes argmax and max where it can; it must name the class top_indices ranks first (ties: the lower
    # index; NaN last), with that class's probability, for every row of a batch that mixes ties, NaN and inf
    from app.engine.ranking import top_indices

    nan, inf = float("nan"), float("inf")
    rows = np.array([[0.1, 0.3, 0.3, 0.1, 0.1, 0.1], [nan, 0.2, 0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2, 0.2],
                     [0.0, 0.1, inf, 0.2, inf, nan], [nan] * 6, [-inf, -inf, 0.0, -inf, 0.1, 0.0],
                     [0.05, 0.05, 0.1, 0.7, 0.05, 0.05]], dtype=np.float32)
    for batch in (rows, rows[[0, 2, 6]], rows[[1]], rows[[5, 0]]):  # with NaN, inf and -inf, and without
        seen = _monitor(window=100).observe(batch)
        expected = top_indices(batch, 1)[:, 0]
        assert seen.labels == [LABELS[i] for i in expected]
        best = batch[np.arange(len(batch)), expected]
        assert seen.confidences == [0.0 if c != c else pytest.approx(c) for c in best.tolist()]


def test_observing_from_several_threads_loses_no_prediction() -> None:
    monitor = _monitor(window=1000, min_predictions=1)
    rows = _rows([0, 1, 2, 3], [0.9, 0.9, 0.2, 0.9])

    def send() -> None:
        for _ in range(50):
            monitor.observe(rows)
            monitor.snapshot()

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    snapshot = monitor.snapshot()
    assert snapshot.predictions_total == 800 and snapshot.low_confidence_ratio == pytest.approx(0.25)
    assert sorted(c.count for c in snapshot.top_classes) == [200, 200, 200, 200]


def test_an_unloaded_version_s_figures_read_zero_and_stay_there() -> None:
    def value(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"model": "retiring", "version": "1"})

    observer = MetricsObserver(model="retiring", version="1")
    observer.predictions(["a", "b", "a"], [0.9, 0.4, 0.8], low_confidence_ratio=1 / 3, psi=0.25)
    assert value("visionserve_prediction_drift_psi") == 0.25
    assert value("visionserve_low_confidence_ratio") == pytest.approx(1 / 3)
    assert REGISTRY.get_sample_value("visionserve_predicted_class_total",
                                     {"model": "retiring", "version": "1", "label": "a"}) == 2
    observer.retire()
    observer.predictions(["a"], [0.9], low_confidence_ratio=0.5, psi=0.9)  # a batch still queued at the unload
    assert value("visionserve_prediction_drift_psi") == 0 and value("visionserve_low_confidence_ratio") == 0
    assert value("visionserve_top1_confidence_count") == 4  # its predictions still count


def test_the_queue_depth_is_written_when_it_changes_and_a_retired_version_s_reads_zero_again() -> None:
    def depth() -> float | None:
        return REGISTRY.get_sample_value("visionserve_queue_depth", {"model": "draining", "version": "1"})

    observer = MetricsObserver(model="draining", version="1")
    observer.queue_depth(3)
    assert depth() == 3
    observer.retire()
    assert depth() == 0
    observer._queue_depth.set(3)  # a submit's report that raced the retire and landed after it
    observer.queue_depth(2)  # the next report of the draining queue (a retired version's is 0)
    assert depth() == 0


def test_a_confidence_equal_to_the_threshold_is_not_low_whatever_its_decimal() -> None:
    # 0.7 is no float32: a float32 confidence of 0.7 equals the threshold as float32 holds it (as torch compared it).
    monitor = PredictionMonitor(LABELS, window=10, min_predictions=1, low_confidence_threshold=0.7, psi_bins=20)
    row = torch.full((1, len(LABELS)), 0.3 / (len(LABELS) - 1), dtype=torch.float32)
    row[0, 2] = 0.7
    assert monitor.observe(row).low_confidence_ratio == 0.0
    row[0, 2] = torch.nextafter(torch.tensor(0.7), torch.tensor(0.0))
    assert monitor.observe(row).low_confidence_ratio == 0.5


def test_a_serving_version_s_engine_series_exist_at_zero_from_its_start() -> None:
    # Before: its stage and batch series appeared with its first batch, so a rate() over them missed that batch
    observer = MetricsObserver(model="fresh", version="9")
    labels = {"model": "fresh", "version": "9"}
    assert REGISTRY.get_sample_value("visionserve_batch_size_count", labels) is None
    observer.serving(("fresh", "9", "cpu", "float32"), 64, 1000)
    names = [("visionserve_batch_size_count", {}), ("visionserve_batch_size_sum", {}),
             *(("visionserve_stage_duration_seconds_count", {"stage": stage}) for stage in STAGES),
             *(("visionserve_stage_cpu_seconds_total", {"stage": stage}) for stage in STAGES),
             *(("visionserve_batcher_events_total", {"event": event}) for event in BATCHER_EVENT_NAMES)]
    assert [REGISTRY.get_sample_value(name, {**labels, **more}) for name, more in names] == [0.0] * len(names)
    observer.retire()


def test_batches_figures_are_held_until_settled_then_written_as_each_batch_s_would_be() -> None:
    def sample(name: str, labels: dict[str, str] | None = None) -> float:  # the version's own series
        return REGISTRY.get_sample_value(name, {"model": "held", "version": "1", **(labels or {})}) or 0.0

    names = [("visionserve_batch_size_count", None), ("visionserve_batch_size_sum", None),
             ("visionserve_batch_size_bucket", {"le": "4.0"}),
             ("visionserve_stage_duration_seconds_count", {"stage": "inference"}),
             ("visionserve_stage_duration_seconds_sum", {"stage": "inference"}),
             ("visionserve_stage_duration_seconds_count", {"stage": "queue"}),
             ("visionserve_stage_duration_seconds_bucket", {"stage": "queue", "le": "0.01"}),
             ("visionserve_stage_cpu_seconds_total", {"stage": "inference"}),
             ("visionserve_stage_cpu_seconds_total", {"stage": "forward"}),
             ("visionserve_stage_duration_seconds_count", {"stage": "forward"}),
             ("visionserve_stage_duration_seconds_sum", {"stage": "forward"}),
             ("visionserve_stage_cpu_seconds_total", {"stage": "decode"})]
    before = [sample(*name) for name in names]
    observer = MetricsObserver(model="held", version="1")
    observer.forward_ran(0.0035, 0.002, 0.0007)  # the forward pass's wall time (waited for, as on a GPU) and its
    # CPU, and the CPU of decoding its batch's images as the batch was made (the device path's)
    observer.batch_done(3, 0.004, [0.001, 0.002, 0.02], 0.003)
    observer.batch_done(8, 0.006, [0.005] * 8, 0.005)  # no forward pass told
    assert [sample(*name) for name in names] == before  # nothing written yet
    observer.settle()
    written = [sample(*name) - b for name, b in zip(names, before)]
    assert written == pytest.approx([2, 11, 1, 2, 0.010, 11, 10, 0.008, 0.002, 1, 0.0035, 0.0007])
    observer.settle()  # nothing held: nothing written again
    assert [sample(*name) - b for name, b in zip(names, before)] == pytest.approx(written)


def test_a_batch_s_every_forward_pass_is_held_with_it_those_that_raised_as_cpu_alone() -> None:
    # A batch split for memory: the whole pass raised (its CPU and its decoding spent, no forward pass's time), the
    # two halves answered; all three count with the one batch done, and nothing is left for the next batch
    def sample(stage: str, name: str = "visionserve_stage_cpu_seconds_total") -> float:
        return REGISTRY.get_sample_value(name, {"model": "split", "version": "1", "stage": stage}) or 0.0

    names = [("forward", "visionserve_stage_duration_seconds_count"),
             ("forward", "visionserve_stage_duration_seconds_sum"), ("forward",), ("decode",)]
    before = [sample(*name) for name in names]
    observer = MetricsObserver(model="split", version="1")
    observer.forward_ran(None, 0.004, 0.002)
    observer.forward_ran(0.001, 0.0005, 0.001)
    observer.forward_ran(0.002, 0.0006, 0.001)
    observer.batch_done(4, 0.01, [0.001] * 4, 0.009)
    observer.batch_done(1, 0.001, [0.001], 0.001)  # no forward pass told
    observer.settle()
    written = [sample(*name) - b for name, b in zip(names, before)]
    assert written == pytest.approx([2, 0.003, 0.0051, 0.004])


def test_several_batches_observed_together_add_what_their_rows_in_one_array_would() -> None:
    # A settle hands the monitor the batches it held, each where it lies: the same labels, confidences, window and
    # figures as their rows copied into one array, a NaN row and one batch alone included
    nan = float("nan")
    batches = [_rows([0, 1, 2], [0.9, 0.3, 0.8]).numpy(), np.full((1, len(LABELS)), nan, dtype=np.float32),
               _rows([3, 3], [0.6, 0.2]).numpy()]
    for held in (batches, batches[:1]):
        one, apart = _monitor(window=10, min_predictions=1), _monitor(window=10, min_predictions=1)
        together, each = one.observe(np.concatenate(held)), apart.observe_batches(held)
        assert (each.labels, each.confidences, each.low_confidence_ratio, each.psi) == (
            together.labels, together.confidences, together.low_confidence_ratio, together.psi)
        assert apart.snapshot() == one.snapshot()
    assert apart.observe_batches([]).labels == [] and apart.snapshot() == one.snapshot()  # nothing held: nothing added


def test_a_first_window_is_kept_and_the_reference_kept_first_is_the_one_judged_by() -> None:
    from app.engine.loaded.monitor import TakenReference

    kept: list[TakenReference] = []
    earlier = TakenReference([0, 0, 10, 0, 0, 0], 0.0)  # another worker's, kept first: all class2

    def keep(taken: TakenReference) -> TakenReference:
        kept.append(taken)
        return earlier

    monitor = PredictionMonitor(LABELS, window=10, min_predictions=5, low_confidence_threshold=0.5, psi_bins=20,
                                keep=keep)
    monitor.observe(_rows([0] * 10, [0.9] * 10))  # its own first window: all class0
    assert kept == [TakenReference([10, 0, 0, 0, 0, 0], 0.0)]
    assert monitor.observe(_rows([2] * 5, [0.9] * 5)).psi == pytest.approx(0.0, abs=1e-9)  # judged by the earlier

    def unwritable(taken: TakenReference) -> TakenReference:
        raise PermissionError("read-only CONTROL_DIR")

    alone = PredictionMonitor(LABELS, window=10, min_predictions=5, low_confidence_threshold=0.5, psi_bins=20,
                              keep=unwritable)
    alone.observe(_rows([0] * 10, [0.9] * 10))
    assert alone.observe(_rows([0] * 5, [0.9] * 5)).psi == pytest.approx(0.0, abs=1e-9)  # its own, kept or not
    wrong = PredictionMonitor(LABELS, window=10, min_predictions=5, low_confidence_threshold=0.5, psi_bins=20,
                              keep=lambda taken: TakenReference([5, 5], 0.0))  # another model's: not judged by
    wrong.observe(_rows([0] * 10, [0.9] * 10))
    assert wrong.observe(_rows([0] * 5, [0.9] * 5)).psi == pytest.approx(0.0, abs=1e-9)
