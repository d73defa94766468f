"""Trace mode: replaying a held batch names the op and the line that made the NaN, and leaves
the model, the RNG and the watch exactly as they were."""

from __future__ import annotations

import importlib.util
import inspect
import random
import sys
import threading
import time
import types
import warnings

import numpy
import pytest
import torch
from torch import nn

import nanwidget as nw
from nanwidget.core.replay import BatchNotHeldError, InputModifiedError, ReplayError, Trace


def line_of(function, marker: str) -> str:
    """``file:line`` of the line in ``function`` that contains ``marker``."""
    lines, first = inspect.getsourcelines(function)
    for offset, text in enumerate(lines):
        if marker in text:
            return f"{inspect.getsourcefile(function)}:{first + offset}"
    raise AssertionError(f"{marker!r} not in {function.__qualname__}")


class SqrtBetweenLayers(nn.Module):
    """A functional op between two modules: hooks only see the NaN arrive at ``second``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h = torch.sqrt(h - 5)  # negative -> NaN
        return self.second(h)


class SqrtOfInput(nn.Module):
    """NaN exactly when the batch holds a negative number."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.sqrt(x))


class NegativeLog(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.log(x - 10)  # every input here is far below 10 -> NaN

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / (x - 10)


class SquareWithBadGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.sqrt(-x.abs() - 1)  # finite forward, NaN gradient


class WithFunction(nn.Module):
    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.function = function
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.function.apply(self.inner(x)))


class MaskedAttention(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.query(x) @ self.key(x).transpose(-1, -2)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # a fully masked row -> NaN
        return weights @ x


class AttentionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = MaskedAttention()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, mask))


class NormDropNet(nn.Module):
    """BatchNorm and Dropout in train mode, an in-place ReLU and a frozen layer in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.5)
        self.frozen = nn.Linear(16, 16)
        self.frozen_bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act(self.bn(self.fc1(x))))
        h = self.frozen_bn(self.frozen(h))
        return self.head(torch.nn.functional.dropout(h, 0.3, self.training))


def frame_values(frames):
    return frames[["frame", "module", "call", "role", "abs_min", "abs_max", "nan", "inf",
                   "note"]].reset_index(drop=True)


# ------------------------------------------------------------------------------ finding the op
def test_functional_op_between_modules_names_sqrt_and_its_line():
    model = SqrtBetweenLayers()
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(5, 6))
    event = w.event
    assert (event.module, event.origin, event.role) == ("second", "input", "input[0]")
    trace = w.replay(event.batch)
    assert isinstance(trace, Trace)
    first = trace.first_bad
    assert first["op"] == "sqrt"
    assert first["module"] == ""  # the root's own forward, between the two Linear layers
    assert first["source"] == line_of(SqrtBetweenLayers.forward, "torch.sqrt")
    # The ops before it were finite: the subtraction that made the negative numbers is listed.
    before = trace.ops.iloc[:first["index"]]
    assert "sub" in set(before["op"]) and not before["nonfinite"].any()
    report = trace.report()
    assert "First non-finite op: sqrt" in report
    assert "h = torch.sqrt(h - 5)" in report  # the source line's text
    assert "finite values from -" in report  # its input was finite but negative
    assert "second Linear" in report  # followed by the frames


def test_custom_autograd_function_forward_nan_points_into_the_function():
    model = WithFunction(NegativeLog)
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(3, 4))
    trace = w.replay(0)
    assert trace.first_bad["op"] == "log"
    assert trace.first_bad["source"] == line_of(NegativeLog.forward, "torch.log")
    assert trace.first_bad["phase"] == "forward"


def test_custom_autograd_function_backward_nan_found_with_loss_fn():
    model = WithFunction(SquareWithBadGradient)
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(3, 4))
    assert w.event is None  # the forward is finite
    assert w.replay(0).first_bad is None
    trace = w.replay(0, loss_fn=lambda out: out.sum())
    first = trace.first_bad
    assert first["phase"] == "backward"
    assert first["op"] == "sqrt"
    assert first["source"] == line_of(SquareWithBadGradient.backward, "torch.sqrt")
    assert set(trace.ops["phase"]) == {"forward", "loss", "backward"}
    # Backward ops of ordinary modules are attributed to the module whose forward made them.
    backward = trace.ops[trace.ops["phase"] == "backward"]
    assert "out" in set(backward["module"])
    assert trace.loss is not None


def test_masked_softmax_with_a_fully_masked_row_is_named():
    model = AttentionModel()
    x = torch.randn(2, 5, 8)
    mask = torch.ones(2, 5, 5, dtype=torch.bool)
    mask[1, 3, :] = False  # query 3 of sample 1 may attend nothing
    with nw.watch(model, on_nan="record") as w:
        model(x, mask=mask)
    assert w.event.module == "attn"
    trace = w.replay(0)
    first = trace.first_bad
    assert "softmax" in first["op"]
    assert first["module"] == "attn"
    assert first["module_type"] == "MaskedAttention"
    assert first["source"] == line_of(MaskedAttention.forward, "torch.softmax")
    detail = trace.first_bad_tensors.set_index("role")
    assert detail.loc["output", "nan_count"] == 5  # exactly the masked row
    assert detail.loc["input self", "inf_count"] == 5


# ------------------------------------------------------------------------------ restoring state
def model_state(model: nn.Module) -> dict:
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()},
        "objects": {k: v for k, v in model.state_dict(keep_vars=True).items()},
        "versions": {k: v._version for k, v in model.state_dict(keep_vars=True).items()},
        "grads": {k: (p.grad, None if p.grad is None else p.grad.clone(), p.grad._version
                      if p.grad is not None else None) for k, p in model.named_parameters()},
        "requires_grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "training": {k: m.training for k, m in model.named_modules()},
        "rng": torch.get_rng_state(),
    }


def assert_same_state(before: dict, after: dict) -> None:
    for key, tensor in before["tensors"].items():
        assert torch.equal(tensor, after["tensors"][key]), key
        assert before["objects"][key] is after["objects"][key], key
    assert before["versions"] == after["versions"]
    for key, (grad, values, version) in before["grads"].items():
        now_grad, now_values, now_version = after["grads"][key]
        assert now_grad is grad, key
        if grad is not None:
            assert torch.equal(values, now_values) and version == now_version, key
    assert before["requires_grad"] == after["requires_grad"]
    assert before["training"] == after["training"]
    assert torch.equal(before["rng"], after["rng"])


def test_replay_restores_model_state_bit_for_bit():
    model = NormDropNet().train()
    model.frozen.requires_grad_(False)
    model.frozen_bn.eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nw.watch(model, on_nan="record") as w:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(8, 6)).square().mean().backward()
            optimizer.step()
        model.head.weight.grad = None  # mixed: some grads set, some None
        before = model_state(model)
        trace = w.replay(2, loss_fn=lambda out: out.square().mean())
        assert trace.first_bad is None and len(trace.ops) > 20
        assert_same_state(before, model_state(model))
        # The replay ran in train mode and updated its own copy of the running statistics.
        bn_ops = trace.ops[trace.ops["module"] == "bn"]
        assert "native_batch_norm" in set(bn_ops["op"])
        # Replaying from eval mode uses the flags of the batch, then puts eval back.
        model.eval()
        before = model_state(model)
        w.replay(2)
        assert_same_state(before, model_state(model))


def test_forward_writing_into_its_own_weights_is_undone_after_replay():
    class DecaysItsWeights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            self.fc.weight.data.mul_(0.5)  # through .data: no version bump, no autograd
            return self.fc(x)

    model = DecaysItsWeights()
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(2, 4))
        before = model_state(model)
        trace = w.replay(0)
        assert_same_state(before, model_state(model))
    assert "mul_" in set(trace.ops["op"])


# ------------------------------------------------------------------------ modules outside the model
def small_gan() -> tuple[nn.Module, nn.Module]:
    """A DCGAN in miniature: the discriminator keeps BatchNorm running statistics."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.ConvTranspose2d(8, 8, 4, 1, 0), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.ConvTranspose2d(8, 1, 4, 2, 1), nn.Tanh())
    discriminator = nn.Sequential(nn.Conv2d(1, 8, 4, 2, 1), nn.BatchNorm2d(8),
                                  nn.LeakyReLU(0.2), nn.Conv2d(8, 1, 4, 1, 0), nn.Flatten(0))
    return generator, discriminator


def gan_optimizers(generator, discriminator) -> tuple:
    return (torch.optim.Adam(generator.parameters(), 2e-4),
            torch.optim.Adam(discriminator.parameters(), 2e-4))


def gan_step(generator, discriminator, optimizers) -> None:
    """One GAN step; the discriminator keeps the gradients of the generator's step."""
    optimizer_g, optimizer_d = optimizers
    real = torch.randn(6, 1, 8, 8).tanh()
    fake = generator(torch.randn(6, 8, 1, 1))
    optimizer_d.zero_grad()
    (bce(discriminator(real), torch.ones(6))
     + bce(discriminator(fake.detach()), torch.zeros(6))).backward()
    optimizer_d.step()
    optimizer_g.zero_grad()
    bce(discriminator(fake), torch.ones(6)).backward()
    optimizer_g.step()


def bce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, targets)


def generator_loss(discriminator):
    """The generator's loss, as every GAN has it: it runs the discriminator."""
    return lambda fake: bce(discriminator(fake), torch.ones(6))


def nan_noise() -> torch.Tensor:
    """Noise whose first sample holds a NaN: the generator's output is NaN."""
    z = torch.randn(6, 8, 1, 1)
    z[0, 0] = float("nan")
    return z


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_generator_replay_whose_loss_runs_the_discriminator_leaves_it_as_it_was(mode):
    # The generator's loss runs the discriminator (as in every GAN): the replay ran it in
    # train mode, so its BatchNorm statistics took the replay's NaN batch and its .grad the
    # replay's gradients.
    generator, discriminator = small_gan()
    optimizers = gan_optimizers(generator, discriminator)
    with nw.watch(generator, mode=mode, on_nan="record") as w:
        for _ in range(2):
            gan_step(generator, discriminator, optimizers)
        generator(nan_noise())  # the step is skipped; its batch is replayed below
        assert [event.batch for event in w.events] == [2]
        discriminator.get_submodule("3").bias.grad = None  # mixed: some grads set, some None
        before = model_state(discriminator)
        trace = w.replay(2, loss_fn=generator_loss(discriminator))
        assert trace.reproduced and trace.loss is not None
        assert_same_state(before, model_state(discriminator))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_automatic_replay_whose_loss_runs_the_discriminator_leaves_it_as_it_was(mode):
    # replay_on_nan runs the watch's loss_fn within the failing step: with on_nan="record"
    # training went on with the discriminator the replay had changed.
    generator, discriminator = small_gan()
    with nw.watch(generator, on_nan="record", mode=mode, replay_on_nan=True,
                  loss_fn=generator_loss(discriminator)) as w:
        for _ in range(2):
            bce(discriminator(generator(torch.randn(6, 8, 1, 1))), torch.ones(6)).backward()
        z = nan_noise()
        before = model_state(discriminator)
        generator(z)  # the NaN: replayed at once, through the discriminator
        assert [event.batch for event in w.events] == [2]
        assert w.events[0].trace is not None and w.events[0].trace.reproduced
        assert_same_state(before, model_state(discriminator))


def test_another_thread_calling_the_discriminator_during_a_replay_is_told_not_lost_silently():
    # The replay's stand-ins for the discriminator's weights are the process's while it runs:
    # a call from another thread then (here, joined inside loss_fn) wrote its BatchNorm
    # statistics into them, and they were dropped without a word.
    generator, discriminator = small_gan()
    optimizers = gan_optimizers(generator, discriminator)
    with nw.watch(generator, on_nan="record") as w:
        for _ in range(2):
            gan_step(generator, discriminator, optimizers)
        generator(nan_noise())

        def loss_with_a_call_from_another_thread(fake):
            loss = generator_loss(discriminator)(fake)  # the replay stands in for D from here
            other = threading.Thread(target=lambda: discriminator(torch.randn(6, 1, 8, 8)))
            other.start()
            other.join()
            return loss

        with pytest.warns(RuntimeWarning, match="another thread called Sequential .* while the "
                                                "replay ran: those calls used the replay's "
                                                "stand-ins"):
            trace = w.replay(2, loss_fn=loss_with_a_call_from_another_thread)
    assert any(change.startswith("another thread called Sequential") for change in trace.changes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a replay no other thread disturbs says nothing
        assert not any("another thread" in c for c in
                       w.replay(2, loss_fn=generator_loss(discriminator)).changes)


def watch_records(w) -> tuple:
    return w.batch, w.frames(), w.history(), len(w.events), len(w.warnings)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_watch_on_the_discriminator_records_nothing_of_the_generators_replays(mode):
    # The discriminator's own watch took each replay that ran it for one of its batches: the
    # batch number moved on, and the replay's frames and history rows were recorded.
    generator, discriminator = small_gan()
    optimizers = gan_optimizers(generator, discriminator)
    # In sentinel mode every batch is recorded in full: frames and history to compare.
    sampled = {"sample_every": 1} if mode == "sentinel" else {}
    with nw.watch(discriminator, mode=mode, on_nan="record", **sampled) as wd, \
            nw.watch(generator, mode=mode, on_nan="record", replay_on_nan=True,
                     loss_fn=generator_loss(discriminator)) as wg:
        for _ in range(2):
            gan_step(generator, discriminator, optimizers)
        z = nan_noise()
        records, before = watch_records(wd), model_state(discriminator)
        generator(z)  # its automatic replay runs the discriminator
        assert wg.events[0].trace is not None and wg.events[0].trace.reproduced
        # And one asked for.
        assert wg.replay(2, loss_fn=generator_loss(discriminator)).reproduced
        now = watch_records(wd)
        assert now[0] == records[0]  # no batch counted
        assert now[1].equals(records[1]) and now[2].equals(records[2])
        assert now[3:] == records[3:]  # no event, no early warning
        assert_same_state(before, model_state(discriminator))
        gan_step(generator, discriminator, optimizers)
        assert wd.batch == records[0] + 3  # its own batches count as before


class SwapsItsWeightsIn(nn.Module):
    """As every torchrl loss does through tensordict's ``to_module``: the network it runs is
    no submodule; its weights are this module's, kept in a store object as well (a
    TensorDict), swapped into the network around each call and copied back out of it after
    the call."""

    def __init__(self) -> None:
        super().__init__()
        network = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
        self.__dict__["network"] = network  # not registered: run outside the model
        self.weights = types.SimpleNamespace(store=dict(network.named_parameters()))
        for name, p in self.store.items():
            self.register_parameter(name.replace(".", "_"), p)

    @property
    def store(self) -> dict[str, nn.Parameter]:
        return self.weights.store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owners = {name: self.network.get_submodule(name.rpartition(".")[0])
                  for name in self.store}
        saved = {}
        for name, p in self.store.items():
            slot = name.rpartition(".")[2]
            saved[name] = owners[name]._parameters[slot]
            owners[name]._parameters[slot] = p
        try:
            return self.network(x)
        finally:
            for name, owner in owners.items():  # copied back out, then put back as it was
                slot = name.rpartition(".")[2]
                self.store[name] = owner._parameters[slot]
                owner._parameters[slot] = saved[name]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_replay_leaves_no_stand_in_where_the_model_copies_weights_out_of_a_network(mode):
    # After a replay the store held the replay's stand-ins: backward reached no parameter the
    # optimizer holds, every step after it did nothing (torchrl's ClipPPOLoss, SACLoss, ...).
    def train(replay_at: int | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = SwapsItsWeightsIn()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        data = torch.Generator().manual_seed(1)
        watch = nw.watch(model, mode=mode) if replay_at is not None else None
        for step in range(4):
            loss = model(torch.randn(5, 3, generator=data)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            assert all(p.grad is not None for p in model.parameters())
            optimizer.step()
            if step == replay_at:
                assert watch.replay(step, loss_fn=lambda out: out.square().mean()).first_bad is None
        if watch is not None:
            watch.close()
        assert all(model.store[n] is p for n, p in model.network.named_parameters())
        return [p.detach().clone() for p in model.parameters()]

    unwatched = train(None)
    for replay_at in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(unwatched, train(replay_at)))


class KeepsPythonState(nn.Module):
    """Counts its calls, logs them, caches its last input, fills a dict and draws noise from
    its own generator, Python's and NumPy's: state a replay runs through. Its third call makes
    a NaN (a replay of that batch, on the count as it is after it, does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0
        self.log: list[int] = []
        self.by_call: dict[int, float] = {}
        self.noise = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.log.append(self.calls)
        self.by_call[self.calls] = float(x.sum())
        self.last_input = x.detach()
        scale = 1 + 0.1 * random.random() + 0.1 * float(numpy.random.rand())
        out = self.fc(x + torch.randn(x.shape, generator=self.noise)) * scale
        return out * float("nan") if self.calls == 3 else out


def _python_state(model: KeepsPythonState) -> tuple:
    return (model.calls, list(model.log), dict(model.by_call), model.last_input,
            model.noise.get_state().tolist(), random.getstate(), str(numpy.random.get_state()))


@pytest.mark.parametrize("options", [{}, {"replay_on_nan": True}, {"mode": "sentinel"}],
                         ids=["full", "replay_on_nan", "sentinel"])
def test_a_replay_leaves_the_modules_python_attributes_as_they_were(options):
    # A replay ran the forward again: the counter went on by one, so every later batch ran on
    # another count than without the watch (and the log and the dict grew).
    batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(b)) for b in range(5)]
    random.seed(3)
    numpy.random.seed(3)
    unwatched = KeepsPythonState()
    expected = [unwatched(x) for x in batches]
    unwatched_state = _python_state(unwatched)
    random.seed(3)
    numpy.random.seed(3)
    model = KeepsPythonState()
    model.load_state_dict(unwatched.state_dict())
    with nw.watch(model, on_nan="record", **options) as w:
        outputs = [model(x) for x in batches]
        assert [e.batch for e in w.events] == [2]  # its diagnosis or check replayed batch 2
        state = _python_state(model)
        assert state[:3] == unwatched_state[:3] and state[4:] == unwatched_state[4:]
        assert torch.equal(model.last_input, batches[-1])
        before = _python_state(model)
        trace = w.replay(3)  # and one asked for
        assert len(trace.ops) > 0 and _python_state(model) == before
        assert torch.equal(model.last_input, before[3])
    for out, want in zip(outputs, expected):
        torch.testing.assert_close(out, want, equal_nan=True, rtol=0, atol=0)


def test_batch_with_two_forwards_replays_both():
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    with nw.watch(model, on_nan="record", trace_batches=[0]) as w:
        w.set_batch(0)  # manual counting: two forwards accumulate into batch 0
        model(torch.randn(2, 3))
        model(torch.randn(2, 3))
        w.set_batch(1)
        recorded = w.frames(batch=0)
        trace = w.replay(0)
    assert trace.forwards == 2
    assert frame_values(trace.frames).equals(frame_values(recorded))


def test_replay_leaves_the_watch_recording_alone():
    model = NormDropNet()
    with nw.watch(model, on_nan="record", max_frames=5) as w:
        for _ in range(3):
            model(torch.randn(4, 6))
        ring, history, batch = w.frames(), w.history(), w.batch
        w.replay(1)
        assert w.batch == batch
        assert w.frames().equals(ring)
        assert w.history().equals(history)
        assert w.events == []
        model(torch.randn(4, 6))  # recording goes on as before
        assert w.batch == batch + 1


def test_replay_with_backward_frames_on_leaves_the_watch_alone():
    model = NormDropNet()
    with nw.watch(model, on_nan="record", backward=True, max_frames=50) as w:
        for _ in range(3):
            model(torch.randn(4, 6)).square().mean().backward()
        ring, batch = w.frames(), w.batch
        assert (ring["phase"] == "backward").any()
        trace = w.replay(2, loss_fn=lambda out: out.square().mean())
        assert (trace.ops["phase"] == "backward").any()
        assert w.batch == batch and w.frames().equals(ring) and w.events == []


def test_replay_reproduces_recorded_frames_with_the_same_dropout_masks():
    model = NormDropNet().train()
    x = torch.randn(8, 6)  # the same input every batch: only the dropout masks differ
    with nw.watch(model, trace_batches=[1, 2], on_nan="record") as w:
        for _ in range(3):
            with torch.no_grad():
                model(x)
        recorded = w.frames(batch=1)
        other = w.frames(batch=2)
        trace = w.replay(1)
    output = recorded[(recorded["module"] == "") & (recorded["role"] == "output")]
    other_output = other[(other["module"] == "") & (other["role"] == "output")]
    assert output["abs_max"].item() != other_output["abs_max"].item()  # masks do differ
    replayed = frame_values(trace.frames)
    # Weight rows match too except BatchNorm buffers, which batch 2 moved on since.
    keep = ~recorded["role"].isin(["running_mean", "running_var", "num_batches_tracked"]).to_numpy()
    assert replayed[keep].reset_index(drop=True).equals(frame_values(recorded)[keep].reset_index(drop=True))
    assert trace.weights_changed  # batch 2 updated the running statistics after batch 1
    assert "bn.running_mean" in trace.changed_weights


def test_weight_snapshots_make_a_replay_after_optimizer_steps_faithful():
    model = NormDropNet().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with nw.watch(model, trace_batches=[1], on_nan="record") as w:
        w.set_weight_snapshots()
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(8, 6)).square().mean().backward()
            optimizer.step()
        recorded = w.frames(batch=1)
        before = model_state(model)
        trace = w.replay(1)
        assert_same_state(before, model_state(model))
    assert trace.snapshot_used and not trace.weights_changed
    assert frame_values(trace.frames).equals(frame_values(recorded))  # BatchNorm buffers included
    assert "snapshot" in trace.report()


def test_replay_after_optimizer_step_says_weights_changed():
    model = SqrtOfInput()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nw.watch(model, on_nan="record") as w:
        model(torch.rand(2, 6)).sum().backward()
        assert not w.replay(0).weights_changed
        optimizer.step()
        trace = w.replay(0)
    assert trace.weights_changed
    assert trace.changed_weights == ["fc.weight", "fc.bias"]
    assert [c.split(":")[0] for c in trace.changes] == ["fc.weight", "fc.bias"]
    assert "Changed since batch 0 ran (2):" in trace.report()
    assert "snapshot_weights=True" in trace.report()


# ------------------------------------------------------------------- the model's Python state
class LinearWithAdapter(nn.Module):
    """A linear layer with a low-rank adapter that a Python flag switches off, as peft's LoRA
    layers do (``disable_adapters``, set by ``with model.disable_adapter():``)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.lora_A = nn.Linear(8, 2, bias=False)
        self.lora_B = nn.Linear(2, 8, bias=False)
        self.disable_adapters = False
        self.active_adapters = ["default"]
        self.scaling = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if not self.disable_adapters:
            out = out + self.scaling * self.lora_B(self.lora_A(x))
        return out


class AdaptedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = LinearWithAdapter()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.layer(x)))


def run_with_adapter_disabled_in_batch_1(model: AdaptedNet, **watch_kwargs) -> nw.NanWatch:
    """Three batches, the second run with the adapter off (DPO's reference pass on a shared
    base model), as the repro's ``with model.disable_adapter():``."""
    w = nw.watch(model, on_nan="record", **watch_kwargs)
    with torch.no_grad():
        for batch in range(3):
            model.layer.disable_adapters = batch == 1
            model(torch.randn(4, 8))
    model.layer.disable_adapters = False
    return w


def test_a_batch_run_with_the_adapter_disabled_is_not_claimed_reproduced_by_a_replay_with_it_on():
    # The replay ran lora_A and lora_B (the adapter on, as the model is now), which the batch
    # never ran, yet said changes [] and reproduced True.
    torch.manual_seed(0)
    model = AdaptedNet()
    with run_with_adapter_disabled_in_batch_1(model) as w:
        trace = w.replay(1)
        faithful = w.replay(2)  # ran with the adapter on, as now: nothing differs
    assert set(trace.frames["module"]) >= {"layer.lora_A", "layer.lora_B"}
    [change] = trace.changes
    assert change.startswith("modules ran in the replay that did not run in the batch "
                             "(layer.lora_A, layer.lora_B): the model's Python state differs")
    assert "the replay ran with adapters enabled (active: 'default')" in change
    assert not trace.reproduced
    assert trace.summary().startswith("trace of batch 1: the batch was not reproduced, because "
                                      "the replay did not run as the batch did: modules ran")
    assert "Not reproduced: the batch recorded no event and the replay met none, but" \
        in trace.report()
    assert faithful.changes == [] and faithful.reproduced


def test_a_replay_with_the_adapter_disabled_names_the_modules_the_batch_ran_and_it_did_not():
    torch.manual_seed(0)
    model = AdaptedNet()
    with run_with_adapter_disabled_in_batch_1(model) as w:
        model.layer.disable_adapters = True
        trace = w.replay(2)
    [change] = trace.changes
    assert change.startswith("modules ran in the batch that did not run in the replay "
                             "(layer.lora_A, layer.lora_B)")
    assert "the replay ran with adapters disabled" in change
    assert not trace.reproduced


def test_a_flag_that_changes_values_only_shows_as_outputs_that_differ_from_the_batch():
    # Same modules run either way: what differs is the adapter's scaling, a plain attribute.
    torch.manual_seed(0)
    model = AdaptedNet()
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(4, 8))
        model.layer.scaling = 4.0
        trace = w.replay(0)
    [change] = trace.changes
    assert change.startswith("the outputs of 'layer' and 2 more modules differ from the batch's "
                             "beyond rounding (abs max ")
    assert "the model's Python state differs from when the batch ran" in change
    assert not trace.reproduced


def test_a_sentinel_replay_of_a_batch_run_with_the_adapter_disabled_says_its_outputs_differ():
    # Sentinel mode keeps the root's outputs per batch (their abs max, for trends and early
    # warnings): a replay whose outputs differ from them did not run as the batch did.
    torch.manual_seed(0)
    model = AdaptedNet()
    with run_with_adapter_disabled_in_batch_1(model, mode="sentinel") as w:
        trace = w.replay(1)
        faithful = w.replay(2)
    [change] = trace.changes
    assert change.startswith("the model's outputs differ from the batch's beyond rounding")
    assert "adapters enabled" in change and not trace.reproduced
    assert faithful.changes == [] and faithful.reproduced


# ------------------------------------------------------------------------------ refusals
def test_input_modified_in_place_is_refused():
    model = SqrtBetweenLayers()
    x = torch.randn(3, 6)
    with nw.watch(model, on_nan="record") as w:
        model(x)
        x.add_(1.0)
        with pytest.raises(InputModifiedError, match=r"input\[0\].*modified in place after"):
            w.replay(0)


def test_a_cache_the_model_fills_in_place_is_refused_with_advice_the_user_can_follow():
    class StaticCacheModel(nn.Module):  # a static KV cache: written in place at every step
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, past_key_values: torch.Tensor) -> torch.Tensor:
            past_key_values[0].copy_(x[0])
            return self.fc(x) + past_key_values.sum()

    model = StaticCacheModel()
    cache = torch.zeros(4, 3)
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(2, 3), past_key_values=cache)
        with pytest.raises(InputModifiedError) as refused:
            w.replay(0)
    message = str(refused.value)
    assert "kwarg:past_key_values" in message and "by the model's own forward" in message
    assert "a cache the model fills in place" in message and "DynamicCache" in message
    assert "clone() it" not in message  # the user hands no tensor they could clone


def test_a_cache_the_model_wrote_is_still_blamed_on_the_model_after_later_steps():
    # generate() runs its next steps on the same cache (Mamba's states): the version of the
    # first step's input moves on after it, but it was the model that wrote it, not the caller.
    class StaticCacheModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
            cache.mul_(0.5).add_(x.mean(0))
            return self.fc(x) + cache

    model = StaticCacheModel()
    cache = torch.zeros(3)
    with nw.watch(model, on_nan="record") as w:
        for _ in range(3):
            model(torch.randn(2, 3), cache=cache)
        with pytest.raises(InputModifiedError) as refused:
            w.replay(0)
    message = str(refused.value)
    assert "kwarg:cache" in message and "by the model's own forward" in message
    assert "after the batch ran" not in message and "clone() it" not in message
    assert "use_cache=False" in message


def test_input_modified_by_the_forward_itself_is_refused_with_that_reason():
    class ScalesItsInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(x.mul_(2))

    model = ScalesItsInput()
    with nw.watch(model, on_nan="record") as w:
        with torch.no_grad():
            model(torch.randn(2, 3))
        with pytest.raises(InputModifiedError, match="by the model's own forward"):
            w.replay(0)


def test_batch_not_held_lists_the_held_batches():
    model = SqrtOfInput()
    with nw.watch(model, on_nan="record", keep_batches=2, trace_batches=[1]) as w:
        for _ in range(5):
            model(torch.rand(2, 6))  # finite: no event batches pinned
        assert w.events == []
        assert w.held_batches() == [1, 3, 4]
        with pytest.raises(BatchNotHeldError, match=r"batch 0 is not held.*held batches: 1, 3, 4"):
            w.replay(0)


def test_only_the_last_keep_batches_stay_held_when_none_is_pinned():
    model = SqrtOfInput()
    with nw.watch(model, mode="sentinel", on_nan="record", keep_batches=2) as w:
        for batch in range(5):
            model(torch.rand(2, 6))  # finite, no trace batches: the oldest go one by one
            assert w.held_batches() == list(range(max(0, batch - 1), batch + 1))
        assert w.events == []
        assert w.replay(4).first_bad is None


def test_event_batches_stay_held_beyond_keep_batches():
    model = SqrtOfInput()
    with nw.watch(model, on_nan="record", keep_batches=1) as w:
        model(-torch.rand(2, 6))  # NaN: batch 0 is an event
        for _ in range(3):
            model(torch.rand(2, 6))
        assert [e.batch for e in w.events] == [0]
        assert w.held_batches() == [0, 3]
        assert w.replay(0).first_bad["op"] == "sqrt"


def test_no_capture_when_nothing_is_kept():
    model = SqrtBetweenLayers()
    with nw.watch(model, keep_batches=0) as w:
        assert w.parts.capture is None and w.parts.replayer is None
        with pytest.raises(ReplayError, match="keep_batches=0"):
            w.replay(0)


def test_held_inputs_are_references_not_copies():
    model = SqrtOfInput()
    x = torch.rand(2, 6)
    with nw.watch(model, on_nan="record") as w:
        model(x)
        held = w.parts.capture.held[0].forwards[0]
    assert held.args[0] is x


# ------------------------------------------------------------------------------ automatic mode
def test_replay_on_nan_attaches_the_trace_and_the_message_names_op_and_line():
    model = SqrtBetweenLayers()
    with nw.watch(model, replay_on_nan=True) as w:
        with pytest.raises(nw.NanDetected) as raised:
            model(torch.randn(4, 6))
    event = raised.value.event
    assert isinstance(event.trace, Trace)
    message = str(raised.value)
    assert "first bad op sqrt at " + line_of(SqrtBetweenLayers.forward, "torch.sqrt") in message
    assert event.trace.first_bad["op"] == "sqrt"
    # The replay was not counted as a batch and made no event of its own.
    assert w.batch == 1 and len(w.events) == 1
    assert "First non-finite op: sqrt" in w.report()


def test_replay_after_the_watch_was_closed_by_the_exception():
    model = AttentionModel()
    mask = torch.ones(1, 4, 4, dtype=torch.bool)
    mask[0, 0] = False
    with pytest.raises(nw.NanDetected):
        with nw.watch(model) as w:
            model(torch.randn(1, 4, 8), mask=mask)
    assert w.closed
    assert "softmax" in w.replay(w.event.batch).first_bad["op"]


# ------------------------------------------------------------------------------ a real model
def test_gpt2_replay_reproduces_frames_and_reports_its_time():
    transformers = pytest.importorskip(
        "transformers", reason="the GPT-2 replay needs the bench extra (transformers)")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300,
                                     n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    with nw.watch(model, trace_batches=[0], on_nan="record") as w:
        with torch.no_grad():
            model(input_ids=tokens)
        start = time.perf_counter()
        trace = w.replay(0)
        seconds = time.perf_counter() - start
    print(f"\nGPT-2 2x32 replay: {seconds:.3f} s, {len(trace.ops)} ops")
    assert trace.first_bad is None and not trace.ops["nonfinite"].any()
    assert frame_values(trace.frames).equals(frame_values(w.frames(batch=0)))
    sources = trace.ops["source"]
    assert sources.str.contains("modeling_gpt2.py").any()
    assert not sources.str.contains("/torch/").any()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_transformer_encoder_on_its_nested_tensor_fast_path_is_replayed(mode):
    # Inference with a padding mask: the encoder packs its input into a nested tensor, whose
    # ops the replay traces (they have no one shape).
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2,
        enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 8)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        encoder.layers[1].linear1.weight[0, 0] = float("nan")
        expected = encoder(x, src_key_padding_mask=padding)
    with nw.watch(encoder, mode=mode, on_nan="record", replay_on_nan=True) as w, torch.no_grad():
        out = encoder(x, src_key_padding_mask=padding)
    # The layers keep their fused path (core.fastpath): the same bits as unwatched, and in
    # full mode the weight is named from the layer's frame, which ran as one module.
    assert torch.equal(out.nan_to_num(7.0), expected.nan_to_num(7.0))
    event = w.event
    assert (event.module, event.role, event.origin) in [("layers.1.linear1", "weight", "weight"),
                                                        ("layers.1", "linear1.weight", "weight")]
    assert event.diagnosis.kind == "corrupted-weight"
    assert "'layers.1.linear1.weight' holds NaN" in event.diagnosis.summary
    assert event.trace.reproduced


def test_a_manual_replay_of_a_backward_event_with_a_loss_checks_for_that_event():
    # It looked for the batch's forward event only: with none, any replay read reproduced=True,
    # also one whose every value stayed finite.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    with nw.watch(model, backward=True, on_nan="record") as w:
        (nn.functional.normalize(model(x), dim=-1).sum() * 3e38).backward()  # overflows
        assert w.event.is_backward
        same = w.replay(0, loss_fn=lambda out: nn.functional.normalize(out, dim=-1).sum() * 3e38)
        finite = w.replay(0, loss_fn=lambda out: nn.functional.normalize(out, dim=-1).sum())
    assert same.reproduced
    assert not finite.reproduced and "(backward)" in finite.expected
    assert "the loss function this replay ran is not the one the batch ran" in finite.summary()


def test_a_forward_only_replay_of_a_backward_event_is_not_reproduced_and_says_why():
    # It read reproduced=True ("the replay met the recorded event again") although a replay
    # without a backward pass cannot meet an event made in the backward pass.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8)

    def loss_fn(out):
        return torch.sqrt(out[:, 0]).mean()  # NaN made in the loss

    with nw.watch(model, backward=True, loss_fn=loss_fn, on_nan="record") as w:
        loss_fn(model(x)).backward()
        assert [e.is_backward for e in w.events] == [True]
        forward_only = w.replay(0)
        with_loss = w.replay(0, loss_fn=loss_fn)
    assert not forward_only.reproduced and "(backward)" in forward_only.expected
    assert "ran the forward only" in forward_only.summary()
    assert "replay(0, loss_fn=...)" in forward_only.report()
    assert with_loss.reproduced and with_loss.first_bad["op"] == "sqrt"


class NumpyLayerDrop(nn.Module):
    """Layer drop drawn from NumPy's global generator (as wav2vec2 draws its time masks): the
    second layer, which makes a NaN, runs when the draw is below 0.6."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x):
        x = self.first(x)
        if numpy.random.rand() < 0.6:
            x = self.second(x).log()
        return x


def test_a_replay_whose_forward_draws_from_numpy_says_its_draws_differ():
    torch.manual_seed(0)
    model = NumpyLayerDrop()
    numpy.random.seed(0)  # draws 0.549 (the layer runs: NaN), then 0.715 (the replay skips it)
    with nw.watch(model, keep_batches=1, on_nan="record") as w:
        model(torch.randn(3, 4))
        assert [e.batch for e in w.events] == [0]
        state = str(numpy.random.get_state())
        trace = w.replay(0)
        assert str(numpy.random.get_state()) == state  # put back: the training draws as before
    assert not trace.reproduced
    assert "NumPy's global generator (np.random)" in trace.why_not_reproduced()
    assert any("whose state a batch does not keep" in c for c in trace.changes)
    # A forward that draws nothing has no such change.
    quiet = nn.Linear(4, 4)
    with nw.watch(quiet, keep_batches=1) as w:
        quiet(torch.randn(2, 4))
        assert w.replay(0).changes == []


class SqrtAfterFirst(nn.Module):
    """``sqrt`` of a linear layer's output: a domain NaN between ``fc1`` and ``fc2``."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(features, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(torch.sqrt(self.fc1(x)))


def _abs_max(frames, module: str, role: str) -> float:
    return frames[(frames.module == module) & (frames.role == role)].abs_max.iloc[0]


@pytest.mark.parametrize("mode", [None, "sentinel"])
def test_a_root_pre_hook_registered_before_the_watch_runs_once_in_a_replay(mode):
    """The watch holds the inputs as the forward receives them, after the user's root
    pre-hooks registered before it: a replay does not run those again (a hook that adds a
    column would break the replay, one that scales would give other numbers)."""
    torch.manual_seed(0)
    model, x = SqrtAfterFirst(features=5), torch.randn(3, 4)
    model.register_forward_pre_hook(lambda m, args: (torch.cat([torch.ones(3, 1), args[0]], 1),))
    scale = model.register_forward_pre_hook(lambda m, args: (args[0] * 10,))
    with nw.watch(model, on_nan="record", mode=mode) as w:
        model(x)
        trace = w.replay(0)
        assert w.event.diagnosis.kind == "domain"
    assert trace.first_bad["op"] == "sqrt" and trace.reproduced and trace.changes == []
    received = (torch.cat([torch.ones(3, 1), x], 1) * 10).abs().max().item()  # by the forward
    assert _abs_max(w.event.frames, "fc1", "input[0]") == received
    assert _abs_max(trace.frames, "fc1", "input[0]") == received
    assert _abs_max(trace.frames, "", "input[0]") == received  # the root's frame: the same
    scale.remove()


@pytest.mark.parametrize("mode", [None, "sentinel"])
def test_a_global_pre_hook_runs_once_on_the_root_in_a_replay_and_on_every_other_module(mode):
    """A global forward pre-hook runs before the watch's root pre-hook: the held inputs are
    what it made of them, so the replay skips it on the root's call only; it still runs on
    every submodule, and is torch's own again afterwards."""
    calls: list[str] = []

    def scale_root_inputs(module, args):
        calls.append(type(module).__name__)
        if isinstance(module, SqrtAfterFirst):
            return (args[0] * 10,)
        return None

    torch.manual_seed(0)
    model, x = SqrtAfterFirst(), torch.randn(3, 4)
    handle = nn.modules.module.register_module_forward_pre_hook(scale_root_inputs)
    try:
        with nw.watch(model, on_nan="record", mode=mode) as w:
            model(x)
            live_calls = list(calls)
            calls.clear()
            trace = w.replay(0)
            event_frames = w.event.frames
        assert nn.modules.module._global_forward_pre_hooks[handle.id] is scale_root_inputs
    finally:
        handle.remove()
    assert live_calls.count("SqrtAfterFirst") == 1 and "Linear" in live_calls
    assert "SqrtAfterFirst" not in calls and "Linear" in calls  # the root's inputs were held after it
    truth = (x * 10).abs().max().item()
    assert _abs_max(event_frames, "fc1", "input[0]") == truth
    assert _abs_max(trace.frames, "fc1", "input[0]") == truth
    assert trace.first_bad["op"] == "sqrt" and trace.reproduced and trace.changes == []


class AssertsFinite(nn.Module):
    """Checks its state and raises once it went NaN (an ODE solver's step-size assert, a
    distribution's argument check): the forward raises after the op that made the NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.second(torch.sqrt(self.first(x) - 5))  # negative -> NaN
        if not torch.isfinite(h).all():  # not an assert: pytest would rewrite its message
            raise AssertionError("the state is not finite")
        return self.head(h)


@pytest.mark.parametrize("replay_on_nan", [False, True])
def test_a_forward_that_raises_after_its_nan_is_replayed_up_to_the_exception(replay_on_nan):
    torch.manual_seed(0)
    model = AssertsFinite()
    sqrt_line = line_of(AssertsFinite.forward, "torch.sqrt")
    with nw.watch(model, replay_on_nan=replay_on_nan) as w:
        with pytest.warns(nw.NanWarning), pytest.raises(AssertionError, match="not finite"):
            model(torch.randn(4, 6))
        event = w.event
        assert (event.batch, event.module, event.role) == (0, "second", "input[0]")
        assert (event.trace is not None) == replay_on_nan
        # Its diagnosis replays the batch: the exception no longer hides the op.
        assert event.diagnosis.kind == "domain"
        assert "sqrt" in event.diagnosis.summary and sqrt_line in event.diagnosis.summary
        trace = w.replay(0)  # kept the ops up to the exception, instead of raising it again
    assert trace.first_bad["op"] == "sqrt" and trace.first_bad["source"] == sqrt_line
    assert trace.raised == "the forward raised AssertionError (the state is not finite)"
    assert "The replay stopped where the forward raised AssertionError" in trace.report()
    assert "head" not in set(trace.frames.module)  # nothing after the exception ran


class MaskedActionsAgent(nn.Module):
    """CleanRL's invalid-action masking: logits of invalid actions set to -inf, then a
    Categorical over them, whose argument check raises on the NaN a row with every action
    masked normalises to."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        logits = self.actor(x).masked_fill(~valid, float("-inf"))
        # validate_args as by default; said here, since importing torch._dynamo (any
        # torch.compile earlier in the process) turns the process-wide default off.
        dist = torch.distributions.Categorical(logits=logits, validate_args=True)
        return dist.log_prob(dist.sample())


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_forward_raising_on_a_fully_masked_row_replays_to_the_op_that_made_its_nan(mode):
    # No module returned the NaN (the distribution raised first), so no event; the replay said
    # "No NaN/Inf reached an event: ... intended or allowed" and named no op.
    torch.manual_seed(0)
    agent = MaskedActionsAgent()
    categorical_line = line_of(MaskedActionsAgent.forward, "Categorical(logits=logits,")
    x, valid = torch.randn(8, 4), torch.ones(8, 3, dtype=torch.bool)
    valid[1, 0] = False  # some actions invalid: fine
    with nw.watch(agent, mode=mode, on_nan="record") as w:
        with torch.no_grad():
            agent(x, valid)
        valid[3] = False  # no valid action at all in row 3
        with torch.no_grad(), pytest.raises(ValueError, match="invalid values"):
            agent(x, valid)
        assert w.events == []
        trace = w.replay(1)
    assert trace.raised.startswith("the forward raised ValueError")
    assert trace.first_bad is not None
    assert trace.first_bad["op"] == "sub" and trace.first_bad["source"] == categorical_line
    report = trace.report()
    assert "intended or allowed" not in report
    assert "A fully masked row: 1 row of its input self is all -inf" in report
    assert "mask with torch.finfo(dtype).min instead of -inf" in report


# ------------------------------------------------------------------ Pyro's effect handlers
class _SiteRecorder:
    """Stands in for Pyro's ``poutine.trace``: records each sample site once, as SVI's does."""

    def __init__(self) -> None:
        self.sites: list[str] = []

    def process(self, name: str) -> None:
        if name in self.sites:
            raise RuntimeError(f"Multiple sample sites named '{name}'")
        self.sites.append(name)


class ReplayMessenger:
    """Stands in for Pyro's ``poutine.replay`` (the guide's values): records nothing."""

    def process(self, name: str) -> None:
        pass


class SampledScaleLog(nn.Module):
    """Draws a sample site (as ``pyro.sample`` does, through the handler stack), then takes the
    log of a linear layer's output: NaN where it is negative."""

    def __init__(self, stack: list) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.stack = stack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for handler in reversed(self.stack):
            handler.process("sigma")
        return torch.log(self.fc(x)).squeeze(-1)


@pytest.mark.parametrize("options", [{"replay_on_nan": True}, {"mode": "sentinel"}])
def test_an_automatic_replay_runs_outside_pyros_handlers_and_puts_them_back(monkeypatch, options):
    # Inside SVI's step every replay failed ("Multiple sample sites named 'sigma'": the step's
    # poutine.trace saw the site again), so a log of a negative value read "unknown".
    import types

    runtime = types.ModuleType("pyro.poutine.runtime")
    recorder, replayer = _SiteRecorder(), ReplayMessenger()
    runtime._PYRO_STACK = [recorder, replayer]
    monkeypatch.setitem(sys.modules, "pyro.poutine.runtime", runtime)
    stack = runtime._PYRO_STACK
    torch.manual_seed(0)
    model = SampledScaleLog(stack)
    with nw.watch(model, on_nan="record", **options) as w:
        model(torch.randn(8, 3))
    assert w.event.diagnosis.kind == "domain"
    assert w.event.trace.first_bad["op"] == "log"
    assert runtime._PYRO_STACK is stack and stack == [recorder, replayer]
    assert recorder.sites == ["sigma"]  # the replay added no site to the step's trace


def test_a_pyro_models_nan_inside_svi_step_is_replayed_and_named():
    pyro = pytest.importorskip("pyro", reason="pyro is optional, not in the dev extra")
    import pyro.distributions as dist
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoNormal
    from pyro.nn import PyroModule

    class Regression(PyroModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = PyroModule[nn.Linear](3, 1)

        def forward(self, x, y=None):
            sigma = pyro.sample("sigma", dist.Uniform(0.1, 3.0))
            mean = torch.log(self.lin(x).squeeze(-1))  # NaN where negative
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Normal(mean, sigma, validate_args=False), obs=y)
            return mean

    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    model = Regression()
    svi = SVI(model, AutoNormal(model), pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Pyro's "Encountered NaN: loss"
        with nw.watch(model, on_nan="record", mode="sentinel") as w:
            svi.step(torch.randn(20, 3), torch.randn(20))
    assert w.event.diagnosis.kind == "domain"
    assert w.event.diagnosis.op.startswith(f"log at {line_of(Regression.forward, 'torch.log(')}")


class LogOfLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.lin(x)).squeeze(-1)  # NaN where negative


def _framework_op_layer(root) -> object:
    """A module at keras/src/backend/torch/numpy.py under ``root``, as Keras' torch backend
    passes each op on (``def log(x): return torch.log(x)``); loaded under its own name."""
    path = root / "keras" / "src" / "backend" / "torch" / "numpy.py"
    path.parent.mkdir(parents=True)
    path.write_text("import torch\n\n\ndef log(x):\n    return torch.log(x)\n")
    spec = importlib.util.spec_from_file_location("nw_test_op_layer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LogThroughAnOpLayer(nn.Module):
    def __init__(self, ops) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.log(self.lin(x))  # NaN where negative


def test_an_op_passed_on_by_a_frameworks_op_layer_is_named_at_the_line_that_called_it(tmp_path):
    # Every op of a Keras model runs through the same line of keras/src/backend/torch/numpy.py:
    # the source and the fix name the model's line that called the op instead.
    torch.manual_seed(0)
    model = LogThroughAnOpLayer(_framework_op_layer(tmp_path))
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(8, 3))
        trace = w.replay(0)
    line = line_of(LogThroughAnOpLayer.forward, "self.ops.log(")
    assert trace.first_bad["op"] == "log" and trace.first_bad["source"] == line
    assert line in w.event.diagnosis.suggestion[0]


def _graph_op_layers(root) -> object:
    """PyTorch Geometric's plumbing under ``root``: a scatter in torch_geometric/utils/_scatter.py
    and the ``propagate`` it renders from a template into a temporary file
    (``<module>_<Class>_propagate_<random>.py``) that calls it."""
    scatter = root / "torch_geometric" / "utils" / "_scatter.py"
    scatter.parent.mkdir(parents=True)
    scatter.write_text("import torch\n\n\ndef scatter(x):\n    return torch.log(x)\n")
    generated = root / "nw_test_LogConv_propagate_k2j4h1x9.py"
    generated.write_text(f"import importlib.util\n\nspec = importlib.util.spec_from_file_location("
                         f"'nw_test_scatter', {str(scatter)!r})\n_scatter = importlib.util.module_from_spec(spec)\n"
                         "spec.loader.exec_module(_scatter)\n\n\ndef propagate(x):\n"
                         "    return _scatter.scatter(x)\n")
    spec = importlib.util.spec_from_file_location("nw_test_propagate", generated)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LogConv(nn.Module):
    def __init__(self, plumbing) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.plumbing = plumbing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plumbing.propagate(self.lin(x))  # NaN where negative


def test_an_op_in_pytorch_geometric_plumbing_is_named_at_the_conv_line_that_called_it(tmp_path):
    # Every GNN's aggregation runs through the same line of torch_geometric/utils/_scatter.py,
    # called from a propagate() that PyG renders into a temporary file: the source and the fix
    # named one of those, not the conv's self.propagate(...) line.
    torch.manual_seed(0)
    model = LogConv(_graph_op_layers(tmp_path))
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(8, 3))
        trace = w.replay(0)
    line = line_of(LogConv.forward, "self.plumbing.propagate(")
    assert trace.first_bad["op"] == "log" and trace.first_bad["source"] == line
    assert line in w.event.diagnosis.suggestion[0]


def test_a_snapshot_replay_is_not_stopped_by_weights_written_non_finite_after_its_batch():
    # The step after the NaN loss wrote NaN into lin; the replay ran with the snapshot (its own
    # frame shows lin.weight finite) and made the NaN again, yet read "not reproduced: met
    # another event first: lin.weight is non-finite" (the live weight, measured after it).
    torch.manual_seed(0)
    model = LogOfLinear()
    with nw.watch(model, on_nan="record", snapshot_weights=True) as w:
        model(torch.randn(8, 3))
        with torch.no_grad():
            model.lin.weight[0, 0] = float("nan")  # as that step would
        trace = w.replay(0)
    assert trace.reproduced and trace.first_bad["op"] == "log"
    assert trace.first_bad["source"] == line_of(LogOfLinear.forward, "torch.log(")
    assert torch.isnan(model.lin.weight[0, 0])  # the model's own weight, left as it was


class _OffloadedLinear(nn.Linear):
    """A Linear whose weights stay on the meta device between calls and are loaded from a
    store inside its forward, then put back: what accelerate's cpu_offload / disk_offload do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.store = {name: p.detach().clone() for name, p in self.named_parameters()}
        self._offload()

    def _offload(self):
        for name in ("weight", "bias"):
            self._parameters[name] = nn.Parameter(torch.empty_like(self.store[name], device="meta"))

    def forward(self, x):
        for name in ("weight", "bias"):
            self._parameters[name] = nn.Parameter(self.store[name].to(x.device))
        try:
            return super().forward(x)
        finally:
            self._offload()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_in_weights_loaded_inside_the_forward_is_a_corrupted_weight_and_replays_loaded(mode):
    # The frames see such weights as meta (the forward put them back before its hook ran):
    # the NaN was "made here from finite inputs and weights; what made it could not be told"
    # (unknown), the replay's frame showed the weight as meta, and every weight was listed as
    # "replaced by another tensor since the batch ran".
    torch.manual_seed(0)
    model = nn.Sequential(_OffloadedLinear(8, 16), nn.ReLU(), _OffloadedLinear(16, 4)).eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
    with nw.watch(model, mode=mode, on_nan="record") as watch, torch.no_grad():
        assert torch.equal(model(x), expected)
        model[2].store["weight"][1, 3] = float("nan")  # a bad checkpoint, read at the next call
        model(x)
        event = watch.event
        trace = watch.replay(event.batch)
    assert (event.batch, event.module) == (1, "2")
    assert event.diagnosis.kind == "corrupted-weight", event.diagnosis.summary
    assert "'2.weight'" in event.diagnosis.summary
    if mode == "full":  # its frame saw the weights on meta: it claims no finite weights
        assert event.origin_words == "made here from finite inputs"
        assert "2.weight, 2.bias (on the meta device outside its calls" in event.note
    weight = trace.frames[(trace.frames.module == "2") & (trace.frames.role == "weight")]
    assert bool(weight.nan.iloc[0]) and weight.note.iloc[0] == ""  # loaded, not "meta"
    assert trace.reproduced and trace.changes == []
    assert all(p.is_meta for p in model.parameters())  # still offloaded afterwards


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_replay_on_nan_met_inside_jacrev_says_to_replay_once_the_transform_returns(mode):
    """An event met inside torch.func.jacrev (a Jacobian of a watched model's functional_call):
    the automatic replay ran inside the transform and torch refused it ('You are attempting to
    call Tensor.requires_grad_() ... inside of a function being transformed'), which was all
    the warning or the sentinel event's note said. It now says why and what to do, and that
    replay, after the transform, reproduces the NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    x = torch.randn(6)
    x[1] = float("nan")
    params = dict(model.named_parameters())
    with nw.watch(model, mode=mode, replay_on_nan=True) as w:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(nw.NanDetected) as raised:
                torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(params)
        told = [str(c.message) for c in caught] + [str(raised.value)]
        assert any("torch.func transform" in t and "w.replay(0)" in t for t in told), told
        assert not any("requires_grad_" in t for t in told), told
        trace = w.replay(0)
        assert trace.frames["nan"].any()
        if mode == "full":
            assert trace.reproduced
