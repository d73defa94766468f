"""Recommendation models: sparse COO inputs, embedding tables read row by row (float16 casts,
max_norm renorms) and buffers no optimizer holds."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nanwidget as nw

MODES = ["full", "sentinel"]


def watch(model: nn.Module, mode: str, **options) -> nw.NanWatch:
    if mode == "sentinel":
        options["mode"] = "sentinel"
    return nw.watch(model, on_nan="record", **options)


class SparseMM(nn.Module):
    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(30, 8) * 0.1)
        self.fc = nn.Linear(8, 1)

    def forward(self, interactions):  # a sparse COO user x item matrix
        return self.fc(torch.sparse.mm(interactions, self.W)).squeeze(-1)


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_in_a_sparse_coo_input_is_bad_data_with_its_row(mode):
    torch.manual_seed(0)
    model = SparseMM()
    indices = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]])
    values = torch.tensor([.5, .6, .7, float("nan"), .8, .9])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interactions = torch.sparse_coo_tensor(indices, values, (6, 30))
    with watch(model, mode, replay_on_nan=True) as w:
        model(interactions)
    assert w.event.trace.first_bad is None  # the NaN came in: no op made it
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "bad-data"
    assert diagnosis.rows == [3]
    assert "input[0]" in diagnosis.summary


class Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8)
        self.fc = nn.Linear(8, 1)

    def forward(self, ids):
        return self.fc(self.emb(ids)).squeeze(-1)


@pytest.mark.parametrize("mode", MODES)
def test_a_float16_table_row_cast_to_inf_is_an_overflow_when_first_read_later(mode):
    torch.manual_seed(0)
    model = Table()
    with torch.no_grad():
        model.emb.weight[42, 3] = 1e5  # inf once cast to float16
    model = model.half()
    with watch(model, mode) as w, torch.no_grad():
        model(torch.tensor([1, 2, 3]))  # does not read row 42
        model(torch.tensor([4, 42]))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow"
    assert "cast" in diagnosis.summary
    assert not any("Adam" in fix for fix in diagnosis.suggestion)  # no optimizer ran


class MaxNormTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=1.0)
        self.fc = nn.Linear(4, 1)

    def forward(self, ids, x):
        return self.fc(self.emb(ids)).squeeze(-1) + torch.log(x)


def _train_max_norm(**options) -> torch.Tensor:
    torch.manual_seed(0)
    model = MaxNormTable()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = [(torch.tensor([5, 6]), torch.tensor([1.0, 2.0])),
               (torch.tensor([1, 2]), torch.tensor([1.0, -1.0]))]  # log(-1): NaN at batch 1
    watch = nw.watch(model, on_nan="record", **options) if options else None
    for ids, x in batches:
        out = model(ids, x)
        loss = out[out.isfinite()].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if watch is not None:
        assert watch.events and watch.events[0].batch == 1
        watch.close()
    return model.emb.weight.detach().clone()


@pytest.mark.parametrize("mode", MODES)
def test_the_replays_of_an_event_leave_a_max_norm_table_as_it_was(mode):
    """nn.Embedding(max_norm=...) renormalises the rows it reads in place, in its forward: the
    replay of the batch before the event (sentinel mode's context frames, no op trace) must not
    leave that write in the live weight."""
    assert torch.equal(_train_max_norm(mode=mode), _train_max_norm())


def test_sentinel_tells_a_max_norm_renorm_in_the_forward_from_a_write_between_batches():
    """nn.Embedding(max_norm=...) moves its weight's version counter inside every forward: a
    NaN row from the checkpoint, first read at batch 3 of an inference run, was there before the
    watch; no optimizer step or write came between the batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8, max_norm=1.0), nn.Linear(8, 1)).eval()
    with torch.no_grad():
        model[0].weight.mul_(3)
        model[0].weight[42] = float("nan")
    with nw.watch(model, mode="sentinel", on_nan="record") as w, torch.no_grad():
        for ids in ([1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 42]):
            model(torch.tensor(ids))
    diagnosis = w.event.diagnosis
    assert (w.event.batch, diagnosis.kind) == (3, "corrupted-weight")
    assert "since before the watch began" in diagnosis.summary
    assert not any("moved after" in line for line in diagnosis.evidence)


class LogQ(nn.Module):
    def __init__(self):
        super().__init__()
        self.user, self.item = nn.Embedding(50, 8), nn.Embedding(100, 8)
        counts = torch.arange(100).float() % 7 + 1
        counts[42] = 0  # an item never sampled: log q = -inf
        self.register_buffer("logq", torch.log(counts / counts.sum()))

    def forward(self, u, cand):
        return self.user(u) @ self.item(cand).T - self.logq[cand]


def test_sentinel_does_not_blame_the_optimizer_for_a_buffer_it_does_not_hold():
    torch.manual_seed(0)
    model = LogQ()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nw.watch(model, mode="sentinel", on_nan="record") as w:
        for cand in (torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 42, 7])):
            out = model(torch.tensor([0, 1, 2, 3]), cand)
            loss = nn.functional.cross_entropy(out.clamp(max=50), torch.arange(4))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    diagnosis = w.event.diagnosis
    assert (w.event.batch, w.event.role, diagnosis.kind) == (1, "logq", "corrupted-weight")
    assert "since before the watch began" in diagnosis.summary


class TwoTowerWithTemperature(nn.Module):
    def __init__(self, temperature: float):
        super().__init__()
        self.user, self.item = nn.Linear(8, 8), nn.Linear(8, 8)
        self.temperature = nn.Parameter(torch.tensor(temperature))

    def forward(self, u, i):
        cosine = nn.functional.normalize(self.user(u), dim=-1) \
            @ nn.functional.normalize(self.item(i), dim=-1).T
        return cosine / self.temperature  # in-batch softmax logits


@pytest.mark.parametrize("dtype, temperature", [(torch.float16, 2e-6), (torch.float32, 1e-39)])
@pytest.mark.parametrize("mode", MODES)
def test_a_collapsed_temperature_is_the_denominator_to_fix(mode, dtype, temperature):
    # Cosine logits in [-1, 1] over a learned temperature near 0: the fixes said to clamp or
    # scale the numerators (already within [-1, 1]) and nothing of the denominator.
    torch.manual_seed(0)
    model = TwoTowerWithTemperature(temperature).to(dtype)
    with watch(model, mode) as w, torch.no_grad():
        model(torch.randn(8, 8, dtype=dtype), torch.randn(8, 8, dtype=dtype))
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow"
    assert "its denominator is as small as" in diagnosis.summary
    assert diagnosis.suggestion[0].startswith("Keep the denominator")
    assert not any("Keep the values smaller" in fix or "runaway growth" in fix
                   for fix in diagnosis.suggestion)
