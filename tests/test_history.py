"""history(): exact per batch, bounded forever, merged windows recorded, never dropped."""

from __future__ import annotations

import numpy as np

from nanwidget.core.history import History


def _feed(history: History, batches: int, n_modules: int) -> None:
    for batch in range(batches):
        for module in range(n_modules):
            history.record(batch, module, float(batch + module), float(batch) / 10, batch == 7)


def test_full_resolution_rows_are_exact():
    history = History(["a", "b"], ["Linear", "ReLU"])
    _feed(history, 10, 2)
    table = history.to_dataframe()
    assert len(table) == 20
    row = table[(table.batch == 7) & (table.module == "b")].iloc[0]
    assert (row.abs_max, row.abs_min, row.nonfinite, row.batch_end) == (8.0, 0.7, True, 7)


def test_old_batches_merge_into_windows_keeping_max_min_and_nonfinite():
    history = History(["a"], ["Linear"], full_batches=50, window=10, max_windows=1000)
    _feed(history, 200, 1)
    table = history.to_dataframe().sort_values("batch")
    windows = table[table.batch != table.batch_end]
    full = table[table.batch == table.batch_end]
    assert len(full) >= 50 and full.batch.max() == 199
    # Every batch is covered exactly once: windows then full rows, contiguous.
    spans = list(zip(table.batch, table.batch_end))
    assert spans[0][0] == 0 and all(b == e_prev + 1 for (_, e_prev), (b, _) in zip(spans, spans[1:]))
    first = windows.iloc[0]
    assert (first.batch, first.batch_end, first.abs_max, first.abs_min, first.nonfinite) == (0, 9, 9.0, 0.0, True)


def test_windows_double_when_there_are_too_many():
    history = History(["a"], ["Linear"], full_batches=20, window=2, max_windows=8)
    _feed(history, 500, 1)
    table = history.to_dataframe()
    assert len(table[table.batch != table.batch_end]) <= 9
    assert table.batch.min() == 0 and table.batch_end.max() == 499
    assert table.abs_max.max() == 499.0


def test_a_200_module_model_over_100000_batches_stays_under_64_mib():
    history = History([f"m{i}" for i in range(200)], ["Linear"] * 200)
    for batch in range(100_000):
        history.record(batch, batch % 200, 1.0, 0.5, False)
    history.commit()
    assert history.nbytes() < 64 * 2**20
    table = history.to_dataframe()
    full = table[table.batch == table.batch_end]
    assert full.batch.nunique() >= 10_000
    assert table.batch_end.max() == 99_999


def test_module_whose_outputs_were_only_nan_has_nan_stats():
    history = History(["a"], ["Linear"])
    history.record(0, 0, float("nan"), float("nan"), True)
    row = history.to_dataframe().iloc[0]
    assert np.isnan(row.abs_max) and np.isnan(row.abs_min) and row.nonfinite


def test_the_table_does_not_depend_on_when_it_is_read():
    # Closed rows are written to the arrays in blocks whose size depends on how many entries
    # they hold (one entry per batch, as the sentinel records: hundreds at a time); reading
    # writes them at once. Either way the same rows, windows and values come out.
    def fed(n_modules: int, read_every: int | None) -> object:
        history = History([f"m{i}" for i in range(n_modules)], ["Linear"] * n_modules,
                          full_batches=300, window=40, max_windows=6)
        for batch in range(1300):
            for module in range(n_modules):
                history.record(batch, module, float((batch * 7 + module) % 101), 0.5,
                               batch % 211 == 0)
            if batch % 50 == 9:  # a replayed earlier batch folded into its row
                history.record(batch - 3, 0, 1000.0 + batch, 0.1, False)
            if read_every and batch % read_every == 0:
                history.to_dataframe()
        return history.to_dataframe()

    for n_modules in (1, 9):
        once = fed(n_modules, None)
        assert once.equals(fed(n_modules, 37))
        assert once.batch.min() == 0 and once.batch_end.max() == 1299
        assert once.abs_max.max() == 1000.0 + 1259


def test_a_stretch_of_batches_folds_into_one_row_written_or_not():
    # 300 batches: the older ones written to the arrays, the newest still held as rows.
    history = History(["a", "b"], ["Linear", "ReLU"])
    _feed(history, 300, 2)
    assert history._closed_rows and history._full.size  # both places hold batches
    for first, end in [(0, 5), (5, 10), (200, 270), (250, 300), (290, 300), (0, 300)]:
        row = history.row_between(first, end)
        assert row == {0: [float(end - 1), first / 10, first <= 7 < end],
                       1: [float(end), first / 10, first <= 7 < end]}
    assert history.row_between(400, 410) == {}
    assert len(history.to_dataframe()) == 600  # reading changed nothing


def test_a_stretch_stops_where_batch_numbers_started_again():
    history = History(["a"], ["Linear"])
    for batch in [*range(20, 30), *range(10, 15)]:  # set_batch(10) after batch 29
        history.record(batch, 0, float(batch), 0.0, False)
    history.commit()
    assert history.row_between(10, 30)[0][0] == 14.0  # not batch 29 of the numbering before
