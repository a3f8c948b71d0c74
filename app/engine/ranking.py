"""Each row's highest columns as a stable sort ranks them (highest first, ties the lower index first, NaN last),
found by cheaper steps where they give the same answer: the top classes of an answer (``contract.Served.top_k``)
and a monitor's top-1 (``loaded/monitor.py``). numpy only: it runs on the HTTP side, which never imports torch."""
from __future__ import annotations

import numpy as np

ARGMAX_PASSES_K_MAX = 16  # top_indices' k up to which the k highest are found by k argmax passes: a one-image
# request's top 5 of 1,000 classes in 4.7 us against 13 for a partition of its row, 16 rows' in 17 against 174 for the
# partial sort on the whole (the 2-core VM); at k 16 about the same as the partition for one row, a third for 16
ROWS_RANKED_ONE_BY_ONE = 2  # top_indices' rows (k beyond the passes') up to which each is ranked alone: a row in 11 us
# against 30 for the partial sort's dozen numpy steps on the whole (the 2-core VM; 25 against 42 at two rows)


def top_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Each row's ``k`` highest columns, highest first, ties the lower index first, NaN last: a stable sort's first
    ``k``, found by argmax passes (``k`` up to ARGMAX_PASSES_K_MAX) or a partial sort (a stable sort of 1,000 classes
    took about 35 us a row on the 2-core VM). Rows with NaN, and those the shortcut cannot rank (ties across the
    ``k``-th place for the partial sort, -inf among the highest for the passes), take the stable sort itself."""
    def stable() -> np.ndarray:
        return np.argsort(-scores, axis=1, kind="stable")[:, :k]

    if 4 * k >= scores.shape[1]:
        return stable()
    if k == 1:  # the first of the highest: the lower index of a tie; argmax takes a row's first NaN, if it has one
        first = scores.argmax(axis=1)
        return stable() if np.isnan(scores[np.arange(len(scores)), first]).any() else first[:, None]
    if k <= ARGMAX_PASSES_K_MAX and scores.dtype.kind == "f":  # (a pass sets -inf: floating point only)
        passes = _top_by_argmax_passes(scores, k)
        return stable() if passes is None else passes
    if len(scores) <= ROWS_RANKED_ONE_BY_ONE:
        ranked = [_top_of_row(row, k) for row in scores]
        return stable() if None in ranked else np.array(ranked, dtype=np.intp).reshape(len(scores), k)
    if scores.size and np.isnan(scores.max()):  # the largest of scores with a NaN among them is NaN
        return stable()
    rows = np.arange(len(scores))[:, None]
    chosen = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    values = scores[rows, chosen]
    if ((scores >= values.min(axis=1, keepdims=True)).sum(axis=1) != k).any():  # a tie across the k-th place
        return stable()
    return chosen[rows, np.lexsort((chosen, -values), axis=-1)]


def _top_by_argmax_passes(scores: np.ndarray, k: int) -> np.ndarray | None:
    """Each row's ``k`` highest columns by ``k`` passes of argmax over a copy, each pass taking a row's first highest
    (the lower index of a tie, as a stable sort ranks it) and setting it to -inf for the next; None when a row has NaN
    (argmax takes a row's first NaN) or -inf among its ``k`` highest (a pass could take a column set to -inf again)."""
    work = scores.copy()
    if len(scores) == 1:  # one row (a one-image request's) in plain steps: a third of the 2-D steps' time
        row, picked = work[0], []
        for _ in range(k):
            column = int(row.argmax())
            if not row[column] > -np.inf:
                return None
            picked.append(column)
            row[column] = -np.inf
        return np.array([picked], dtype=np.intp)
    rows = np.arange(len(scores))
    picked = np.empty((len(scores), k), dtype=np.intp)
    for j in range(k):
        columns = work.argmax(axis=1)
        picked[:, j] = columns
        if j < k - 1:
            work[rows, columns] = -np.inf
    # the last pass's values above -inf: no pass took a column again; the values picked above it: no NaN
    kth_ok = (work[rows, columns] > -np.inf).all()
    return picked if kth_ok and (scores[rows[:, None], picked] > -np.inf).all() else None


def _top_of_row(row: np.ndarray, k: int) -> list[int] | None:
    """One row's ``k`` highest columns as a stable sort ranks them; None when the row has NaN. Every column at or above
    the ``k``-th highest value is a candidate, in column order, and Python's sort, stable also in reverse, keeps the
    lower index first among equal values, ties across the ``k``-th place included."""
    kth = np.partition(row, row.size - k)[row.size - k]
    candidates = np.flatnonzero(row >= kth).tolist()
    if len(candidates) < k:  # a partition puts NaN above every number, but NaN is at or above nothing
        return None
    values = row[candidates].tolist()
    return [candidates[j] for j in sorted(range(len(values)), key=values.__getitem__, reverse=True)[:k]]
