"""PyTorch's own training features under each watch (full, full + backward, sentinel, sentinel +
backward): activation checkpointing, parametrizations, pruning, SWA/EMA, schedulers, fused
optimizers, channels_last, attention with masks, torch.func.functional_call, no_grad and
inference_mode, BatchNorm in eval. Each trains bit-identical to the unwatched run with no warning,
no event and no hook left; NaNs planted where they live are named there."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import nanwidget as nw
from nanwidget.core.copies import is_nanwidget_hook

from conftest import hook_count

WATCHES = {"full": {"mode": "full"}, "full+backward": {"mode": "full", "backward": True},
           "sentinel": {"mode": "sentinel"},
           "sentinel+backward": {"mode": "sentinel", "backward": True}}
NAN = float("nan")


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def _train(model, *, steps=3, optimizer=None, x=None, forward=None, after_step=None):
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = _x(6, 8) if x is None else x
    results = []
    for _ in range(steps):
        out = forward(model, x) if forward else model(x)
        loss = out.pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step(loss)
        results += [out.detach().clone(), loss.detach().clone()]
    return results


# ------------------------------------------------------------------ the models and their loops
class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def _checkpointed(reentrant):
    model = _Checkpointed(reentrant)
    return model, lambda: _train(model, x=_x(6, 8).requires_grad_(reentrant))


def _checkpoint_wrapper():
    wrapper = pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
                                  reason="torch built without torch.distributed")
    model = _mlp()
    wrapper.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    return model, lambda: _train(model)


def _parametrized(kind):
    from torch.nn.utils import parametrizations, parametrize
    model = _mlp()
    if kind == "custom":
        model[2] = nn.Linear(16, 16)
        parametrize.register_parametrization(model[2], "weight", _Symmetric())
    elif kind == "old_weight_norm":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated, still in use
            torch.nn.utils.weight_norm(model[0])
    else:
        getattr(parametrizations, kind)(model[0] if kind != "orthogonal" else model[2])
    return model, lambda: _train(model)


class _Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


def _pruned():
    model = _mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.4)
    return model, lambda: _train(model)


def _averaged():
    from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    def run():
        swa = AveragedModel(model)
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        schedule = SWALR(optimizer, swa_lr=0.01, anneal_epochs=2)

        def average(_loss):
            schedule.step()
            swa.update_parameters(model)
            ema.update_parameters(model)
        results = _train(model, optimizer=optimizer, after_step=average)
        loader = [_x(6, 8, seed=seed) for seed in range(3)]
        update_bn(loader, swa)
        update_bn(loader, model)
        swa.eval()
        ema.eval()
        return results + [swa(_x(6, 8)).detach(), ema(_x(6, 8)).detach()] \
            + [t.clone() for t in (*swa.state_dict().values(), *ema.state_dict().values())]
    return model, run


def _scheduled(kind):
    model = _mlp()
    if kind == "one_cycle":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
        return model, lambda: _train(model, optimizer=optimizer,
                                     after_step=lambda _: schedule.step())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    return model, lambda: _train(model, optimizer=optimizer, steps=4,
                                 after_step=lambda loss: plateau.step(loss.item()))


def _optimizer(name, **options):
    model = _mlp()
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=0.01, **options)
    return model, lambda: _train(model, optimizer=optimizer)


def _channels_last():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 4)).to(memory_format=torch.channels_last)
    return model, lambda: _train(model, x=_x(4, 3, 8, 8).to(memory_format=torch.channels_last))


class _Attention(nn.Module):
    """nn.MultiheadAttention with need_weights=False and a key_padding_mask (its fast path in
    eval under no_grad), beside F.scaled_dot_product_attention with a boolean mask."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 4)
        self.padding = torch.zeros(3, 5, dtype=torch.bool)
        self.padding[1, 3:] = True

    def forward(self, x):
        y, _ = self.attn(x, x, x, need_weights=False, key_padding_mask=self.padding)
        q, k, v = (t.view(3, 5, 2, 4).transpose(1, 2) for t in self.qkv(y).chunk(3, -1))
        causal = torch.ones(5, 5, dtype=torch.bool).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        return self.head(y.transpose(1, 2).reshape(3, 5, 8))


def _attention():
    model = _Attention()

    def run():
        results = _train(model, x=_x(3, 5, 8))
        model.eval()
        with torch.no_grad():  # nn.MultiheadAttention's fast path
            results.append(model(_x(3, 5, 8, seed=2)))
        return results
    return model, run


def _functional_call():
    from torch.func import functional_call
    model = _mlp()

    def run():
        params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
        results = []
        for _ in range(3):
            out = functional_call(model, params, (_x(6, 8),))
            grads = torch.autograd.grad(out.pow(2).mean(), list(params.values()))
            params = {k: (v - 0.1 * g).detach().requires_grad_()
                      for (k, v), g in zip(params.items(), grads)}
            results.append(out.detach())
        return results + list(params.values()) + [model(_x(6, 8)).detach()]
    return model, run


def _inference():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    def run():
        results = _train(model, steps=2)
        model.eval()
        with torch.no_grad():
            results.append(model(_x(6, 8, seed=3)))
        with torch.inference_mode():
            results.append(model(_x(6, 8, seed=4)).clone())
        model.train()
        return results + _train(model, steps=1)
    return model, run


FEATURES = {
    "checkpoint(use_reentrant=True)": lambda: _checkpointed(True),
    "checkpoint(use_reentrant=False)": lambda: _checkpointed(False),
    "checkpoint_wrapper": _checkpoint_wrapper,
    "weight_norm": lambda: _parametrized("weight_norm"),
    "spectral_norm": lambda: _parametrized("spectral_norm"),
    "orthogonal": lambda: _parametrized("orthogonal"),
    "register_parametrization": lambda: _parametrized("custom"),
    "old weight_norm": lambda: _parametrized("old_weight_norm"),
    "prune.l1_unstructured": _pruned,
    "AveragedModel SWA, EMA, update_bn": _averaged,
    "OneCycleLR": lambda: _scheduled("one_cycle"),
    "ReduceLROnPlateau": lambda: _scheduled("plateau"),
    "Adam(fused=True)": lambda: _optimizer("Adam", fused=True),
    "AdamW(fused=True)": lambda: _optimizer("AdamW", fused=True),
    "SGD(fused=True)": lambda: _optimizer("SGD", fused=True, momentum=0.9),
    "Adam(foreach=True)": lambda: _optimizer("Adam", foreach=True),
    "channels_last": _channels_last,
    "MultiheadAttention and SDPA with masks": _attention,
    "functional_call": _functional_call,
    "no_grad, inference_mode, eval BatchNorm": _inference,
}


def _run(feature, options):
    torch.manual_seed(0)
    model, run = FEATURES[feature]()
    hooks = hook_count(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch = nw.watch(model, **options) if options is not None else None
        results = run()
        if watch is not None:
            watch.close()
    results += [t.detach().clone() for t in model.state_dict().values()]
    assert hook_count(model) == hooks
    assert not any(is_nanwidget_hook(hook) for module in model.modules()
                   for table in (module._forward_hooks, module._forward_pre_hooks)
                   for hook in table.values())
    return results, [str(w.message) for w in caught], watch


@pytest.mark.parametrize("feature", list(FEATURES))
def test_a_torch_training_feature_trains_bit_identical_and_quiet_under_each_watch(feature):
    expected, unwatched_warnings, _ = _run(feature, None)
    for name, options in WATCHES.items():
        results, said, watch = _run(feature, options)
        assert len(results) == len(expected), name
        assert all(torch.equal(a, b) for a, b in zip(results, expected)), name
        assert [m for m in said if m not in unwatched_warnings] == [], name
        assert watch.events == [] and watch.warnings == [], name


# ------------------------------------------------------------------ NaNs planted where they live
def _planted(feature, options, plant, *, at=1):
    """Trains ``feature``'s model with ``plant(model)`` written (in place, no_grad) before batch
    ``at``; the watch's first event."""
    torch.manual_seed(0)
    model, _ = FEATURES[feature]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    hooks = hook_count(model)  # the old weight_norm's and prune's own pre-hooks
    with nw.watch(model, on_nan="record", **options) as w:
        for step in range(at + 1):
            if step == at:
                with torch.no_grad():
                    plant(model)
            model(_x(6, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert hook_count(model) == hooks
    return w.event


def _first_pruned(model):
    row, column = (model[0].weight_mask == 0).nonzero()[0]
    model[0].weight_orig[row, column] = float("inf")  # inf * 0 = NaN in the computed weight


PLANTS = {  # feature, where the NaN/Inf is written, the name the event must give
    "weight_norm g": ("weight_norm", lambda m: m[0].parametrizations.weight.original0.fill_(NAN),
                      "0.parametrizations.weight.original0"),
    "spectral_norm": ("spectral_norm",
                      lambda m: m[0].parametrizations.weight.original[3, 1].fill_(NAN),
                      "0.parametrizations.weight.original"),
    "old weight_norm g": ("old weight_norm", lambda m: m[0].weight_g[3].fill_(NAN), "0.weight_g"),
    "pruned weight_orig": ("prune.l1_unstructured", _first_pruned, "0.weight_orig"),
    "checkpoint_wrapper": ("checkpoint_wrapper",
                           lambda m: m[2]._checkpoint_wrapped_module.weight[0, 0].fill_(NAN),
                           "2._checkpoint_wrapped_module.weight"),
}


@pytest.mark.parametrize("watch", ["full", "sentinel+backward"])
@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_nan_in_a_parametrized_or_pruned_weight_names_the_tensor_it_lives_in(plant, watch):
    feature, write, name = PLANTS[plant]
    event = _planted(feature, WATCHES[watch], write)
    diagnosis = event.diagnosis
    assert (event.batch, event.origin, diagnosis.kind) == (1, "weight", "corrupted-weight")
    assert f"{event.module}.{event.role}" == name
    assert diagnosis.summary.startswith(f"'{name}' became ")


@pytest.mark.parametrize("options", [WATCHES["sentinel"], WATCHES["sentinel+backward"],
                                     {"mode": "full", "replay_on_nan": True}],
                         ids=["sentinel", "sentinel+backward", "full+replay_on_nan"])
def test_a_nan_functional_call_fast_weight_is_not_blamed_on_a_load_in_sentinel_mode(options):
    # Sentinel mode (and full mode's replay) read the NaN fast weight as "'2.weight' became NaN
    # between batch 0 and batch 1: the load or assignment that replaced it", with
    # load_state_dict's fixes; full mode said what it is.
    from torch.func import functional_call
    torch.manual_seed(0)
    model = _mlp()
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    with nw.watch(model, on_nan="record", **options) as w:
        for step in range(3):
            if step == 1:
                with torch.no_grad():
                    params["2.weight"][0, 0] = NAN
            out = functional_call(model, params, (_x(6, 8),))
            grads = torch.autograd.grad(out.pow(2).mean(), list(params.values()))
            params = {k: (v - 0.1 * g).detach().requires_grad_()
                      for (k, v), g in zip(params.items(), grads)}
    diagnosis = w.event.diagnosis
    assert (w.event.batch, w.event.module, w.event.role) == (1, "2", "weight")
    assert diagnosis.kind == "corrupted-weight"
    assert diagnosis.summary.startswith(
        "'2.weight' held NaN in batch 1's forward, which ran with another tensor in its place "
        "(torch.func.functional_call")
    assert not any("load_state_dict" in fix for fix in diagnosis.suggestion)
    assert torch.isfinite(model[2].weight).all()


@pytest.mark.parametrize("need_weights, made_by_autograd", [(False, False), (True, False),
                                                              (False, True)])
def test_sentinel_replays_a_watched_multihead_attention_on_its_fast_path(need_weights,
                                                                         made_by_autograd):
    # attention(x, x, x) in eval under no_grad runs torch's fused kernel, which makes NaN of a
    # key_padding_mask row that masks every key (the modules' path gives 0). The replay passed
    # query, key and value as three tensors: torch took the other path, the NaN did not come
    # back, and the event read "unknown: what made it could not be told".
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[2] = True
    x = _x(3, 5, 8)
    if made_by_autograd:  # held as a detached alias: one for the three places
        x = x.requires_grad_() * 1.0
    with torch.no_grad():
        expected, _ = attention(x, x, x, need_weights=need_weights, key_padding_mask=padding)
    assert expected[2].isnan().all()
    with nw.watch(attention, mode="sentinel", on_nan="record") as w, torch.no_grad():
        out, _ = attention(x, x, x, need_weights=need_weights, key_padding_mask=padding)
    assert torch.equal(out.nan_to_num(7.0), expected.nan_to_num(7.0))
    event, diagnosis = w.event, w.event.diagnosis
    assert event.trace.reproduced
    assert (diagnosis.kind, diagnosis.rows) == ("masked-row", [2])
    assert diagnosis.summary.startswith("_native_multi_head_attention in module '<root>'")


def test_checkpoint_sequential_under_sentinel_says_where_to_call_it():
    # checkpoint_sequential(model, 2, x) calls the Sequential's modules one by one, never the
    # Sequential: sentinel mode checked nothing, and its warning said to watch each module.
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(model, x):
        return checkpoint_sequential(model, 2, x, use_reentrant=False)
    w = nw.watch(layers, mode="sentinel")
    _train(layers, steps=2, forward=forward)
    with pytest.warns(UserWarning, match=r"checked nothing: this Sequential .*"
                      r"checkpoint_sequential\(model, segments, x\) is such a loop \(it calls "
                      r"a Sequential's modules one by one.* make that call in the forward of a "
                      r"module that holds this Sequential"):
        w.close()

    class Checkpointed(nn.Module):  # the way the warning says
        def __init__(self) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, x):
            return checkpoint_sequential(self.layers, 2, x, use_reentrant=False)
    model = Checkpointed()
    with nw.watch(model, mode="sentinel", on_nan="record") as w:
        _train(model, steps=1)
        with torch.no_grad():
            layers[2].weight[0, 0] = NAN
        _train(model, steps=1)
    assert (w.event.batch, w.event.module, w.event.role) == (1, "layers.2", "weight")
    assert w.event.diagnosis.kind == "corrupted-weight"
    assert hook_count(model) == 0


def test_a_run_diverging_under_one_cycle_lr_is_told_to_lower_its_max_lr():
    # The first fix said "Lower the learning rate ... or warm it up over the first steps
    # (torch.optim.lr_scheduler.LinearLR, or OneCycleLR)" to a loop that runs OneCycleLR, which
    # warms up already and sets the learning rate from its max_lr at every step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3.0, total_steps=200)
    x, y = _x(64, 8), _x(64, 1, seed=2) * 10
    with nw.watch(model, on_nan="record") as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)  # it grows, as it should
        for _ in range(20):
            (model(x) - y).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            if w.event is not None:
                break
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "divergence"
    assert diagnosis.suggestion[0].startswith(
        "Lower OneCycleLR's max_lr (try 10x lower: it is 3; its schedule had the learning rate "
        "at ")
    assert not any("LinearLR" in fix for fix in diagnosis.suggestion)


def _one_cycle_over_a_long_warmup(mode: str) -> nw.NanWatch:
    """SGD under OneCycleLR(max_lr=3, total_steps=2000): healthy for hundreds of steps while
    its warmup (600 steps) raises the learning rate, then a climb into NaN weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3.0, total_steps=2000)
    x, y = _x(64, 8), _x(64, 1, seed=2) * 10
    options = {"mode": "sentinel"} if mode == "sentinel" else {}
    with nw.watch(model, on_nan="record", **options) as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        for _ in range(600):
            (model(x) - y).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            if w.event is not None:
                break
    return w


def test_a_one_cycle_lr_warmed_up_into_divergence_is_told_so_in_sentinel_mode_as_in_full():
    # Sentinel mode compares the weights when the watch began with the event's, over the
    # steps between: 1e12x over 458 steps is 1.06x per step on average, under the 1.1x a
    # divergence needs, so it read corrupted-weight (medium) with backward=True's and
    # clipping's fixes. The outputs' steep climb over the last steps dates it.
    full = _one_cycle_over_a_long_warmup("full").event
    event = _one_cycle_over_a_long_warmup("sentinel").event
    assert (full.batch, full.diagnosis.kind) == (event.batch, "divergence")
    assert full.batch > 300  # a long healthy stretch before the climb
    diagnosis = event.diagnosis
    assert (diagnosis.kind, diagnosis.confidence) == ("divergence", "medium")
    assert "since the watch began (the model's outputs " in diagnosis.summary
    assert "x per optimizer step over the last " in diagnosis.summary
    evidence = "\n".join(diagnosis.evidence)
    assert "too slow on average for a divergence, but the model's outputs then grew" in evidence
    assert diagnosis.suggestion[0] == full.diagnosis.suggestion[0]
    assert diagnosis.suggestion[0].startswith("Lower OneCycleLR's max_lr (try 10x lower: it is 3;")


@pytest.mark.parametrize("plant", [False, True])
def test_a_parametrized_weight_read_in_the_loss_counts_no_batch(plant):
    # A penalty on a parametrized weight (model[0].weight read after the forward, before the
    # backward) runs its parametrization outside the forward: full mode took each read for a
    # pass of the model and each step then for the end of a batch, so 4 steps counted 7
    # batches (sentinel mode counted 4) and a NaN written before the third forward was told at
    # batch 4.
    def train(mode):
        torch.manual_seed(0)
        model = _mlp()
        torch.nn.utils.parametrizations.weight_norm(model[0])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        with nw.watch(model, mode=mode, on_nan="record") as w:
            for step in range(4):
                if plant and step == 2:
                    with torch.no_grad():
                        model[0].parametrizations.weight.original1[0, 0] = NAN
                loss = model(_x(6, 8)).pow(2).mean() + 1e-3 * model[0].weight.pow(2).sum()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.detach())
                model[0].weight.norm()  # a log of it after the step
        return w, losses
    full, full_losses = train("full")
    sentinel, sentinel_losses = train("sentinel")
    assert full.batch == sentinel.batch == 4
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
               for a, b in zip(full_losses, sentinel_losses))
    if plant:
        for w in (full, sentinel):
            assert (w.event.batch, w.event.module, w.event.role) == \
                (2, "0.parametrizations.weight", "original1")
    else:
        assert full.events == sentinel.events == []
