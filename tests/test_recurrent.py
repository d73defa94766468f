"""Recurrent networks: nn.LSTM / nn.GRU with packed and padded sequences, state carried across
steps. What a sweep of that stack found wrong, each against a real recurrent model."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import nanwidget as nw


class PackedEncoder(nn.Module):
    """An LSTM over a packed batch of variable-length sequences, a head on the last state."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.rnn(packed)
        return self.head(h[-1])


def test_the_history_of_an_rnn_fed_a_packed_batch_follows_its_activations():
    # A PackedSequence output carries integer batch_sizes and sorted_indices: their largest
    # value is the batch size, not a magnitude of the activations.
    torch.manual_seed(0)
    model = PackedEncoder()
    with nw.watch(model) as w:
        for batch_size in (5, 40, 300):
            x = torch.randn(batch_size, 7, 4)
            lengths = torch.randint(1, 8, (batch_size,))
            model(x, lengths)
            frames = w.frames()
            own = frames[(frames.module == "rnn") & (frames.batch == w.batch - 1)
                         & frames.role.str.startswith("output")
                         & frames.dtype.str.startswith("float")]
            history = w.history()
            row = history[(history.module == "rnn") & (history.batch == w.batch - 1)].iloc[-1]
            assert row.abs_max == pytest.approx(float(own.abs_max.max()))
            assert row.abs_min == pytest.approx(float(own.abs_min.min()))
            assert row.abs_max < 5  # tanh-bounded states, never the batch size


class Padded(nn.Module):
    """A GRU's outputs padded with ``padding``, fed to a Linear before the mask: with -inf,
    the Linear makes NaN of it (inf - inf)."""

    def __init__(self, padding: float) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 6, batch_first=True)
        self.head = nn.Linear(6, 2)
        self.padding = padding

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(pack_padded_sequence(x, lengths, batch_first=True,
                                               enforce_sorted=False))
        padded, _ = pad_packed_sequence(out, batch_first=True, padding_value=self.padding)
        scores = self.head(padded)
        keep = (torch.arange(padded.shape[1])[None] < lengths[:, None])[..., None]
        return torch.where(keep, scores, 0.0).sum(1) / lengths[:, None]


def test_padding_inf_that_a_layer_turns_into_nan_is_not_told_to_be_allowed():
    torch.manual_seed(0)
    model = Padded(float("-inf"))
    x, lengths = torch.randn(5, 7, 4), torch.tensor([7, 3, 5, 1, 6])
    with nw.watch(model, on_nan="record", replay_on_nan=True) as w:
        model(x, lengths)
    diagnosis = w.event.diagnosis
    # The padding's Inf arrived (the kind); the Linear made NaN of it.
    assert (w.event.module, w.event.kind, w.event.made_kind) == ("head", "inf", "nan")
    assert diagnosis.kind == "masked-row"
    assert "made NaN of it" in diagnosis.summary
    assert not any("allow_inf=[" in fix for fix in diagnosis.suggestion)
    assert "padding_value=0.0" in diagnosis.suggestion[0]
    # The advice holds: the padding written finite, the model runs clean.
    finite = Padded(0.0)
    finite.load_state_dict(model.state_dict())
    with nw.watch(finite, on_nan="raise"):
        assert torch.isfinite(finite(x, lengths)).all()


class SeqFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.rnn = nn.LSTM(8, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.enc(x))[0])


def _events(**watch_kwargs) -> list[tuple]:
    torch.manual_seed(0)
    model = SeqFirst()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = nw.watch(model, on_nan="record", backward=True, **watch_kwargs)
        for step in range(7):
            x = torch.randn(4, 6, 4, generator=data)
            if step == 3:
                model.rnn.weight_hh_l0.data[0, 0] = float("nan")  # stays: the NaN spreads
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        w.close()
    return [(e.batch, e.is_backward, e.module, e.role, e.origin) for e in w.events]


def test_the_sentinel_repeats_a_spreading_nans_backward_events_where_full_mode_names_them():
    full = _events()
    sentinel = _events(mode="sentinel")
    assert len(full) == 8 and full[-1][:2] == (6, True)
    assert sentinel == full


def _bad_data(model: nn.Module, *args) -> nw.NanEvent:
    with nw.watch(model, on_nan="record") as w:
        model(*args)
    assert w.event.diagnosis.kind == "bad-data"
    return w.event


def test_bad_data_rows_of_a_recurrent_model_are_its_samples():
    # Sample 2 alone holds the NaN each time. A seq-first input is (time, batch, features), a
    # hidden state (layers, batch, hidden) even with batch_first, and a PackedSequence's data
    # holds time step after time step: their dim 0 is no sample.
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4)
    x[1, 2, 0] = float("nan")
    assert _bad_data(nn.LSTM(4, 6), x).diagnosis.rows == [2]

    h0, c0 = torch.zeros(2, 5, 6), torch.zeros(2, 5, 6)
    c0[1, 2, 0] = float("nan")
    event = _bad_data(nn.LSTM(4, 6, num_layers=2, batch_first=True), torch.randn(5, 3, 4), (h0, c0))
    assert event.diagnosis.rows == [2]
    assert any("in row 2 of 5 along dim 1" in line for line in event.diagnosis.evidence)

    padded = torch.randn(5, 7, 4)
    padded[2, 1, 0] = float("nan")
    packed = pack_padded_sequence(padded, torch.tensor([7, 3, 5, 1, 6]), batch_first=True,
                                  enforce_sorted=False)
    event = _bad_data(nn.GRU(4, 6), packed)
    assert event.diagnosis.rows == [2]
    assert any("PackedSequence of 5 samples): 1 NaN in sample 2" in line
               for line in event.diagnosis.evidence)
    assert "  Rows of the batch that hold it: 2" in event.diagnosis.lines()
