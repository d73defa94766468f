"""Hooks: removed on every exit path, the user's own hooks untouched, misuse named clearly."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from torch import nn

import nanwidget as nw
from tests.conftest import TinyMLP, hook_count


def test_close_removes_exactly_its_own_hooks_and_is_idempotent(tiny_mlp):
    seen = []
    user_handle = tiny_mlp.fc1.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    before = hook_count(tiny_mlp)
    w = nw.watch(tiny_mlp)
    assert hook_count(tiny_mlp) > before
    w.close()
    w.close()
    assert hook_count(tiny_mlp) == before
    tiny_mlp(torch.randn(2, 16))
    assert seen == [torch.Size([2, 32])]
    assert w.closed
    user_handle.remove()


def test_hooks_removed_when_the_block_raises(tiny_mlp):
    with pytest.raises(ValueError, match="user error"):
        with nw.watch(tiny_mlp):
            tiny_mlp(torch.randn(2, 16))
            raise ValueError("user error")
    assert hook_count(tiny_mlp) == 0


def test_hooks_removed_on_keyboard_interrupt_inside_forward(tiny_mlp):
    def interrupt(module, args, output):
        raise KeyboardInterrupt

    handle = tiny_mlp.fc2.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        with nw.watch(tiny_mlp) as w:
            tiny_mlp(torch.randn(2, 16))
    handle.remove()
    assert hook_count(tiny_mlp) == 0
    # What was recorded before the interrupt is kept, not lost.
    assert "fc1" in set(w.frames().module)


def test_an_interrupted_forward_keeps_its_frames_in_its_own_batch(tiny_mlp):
    def interrupt_once(module, args, output, state={"done": False}):
        if not state["done"]:
            state["done"] = True
            raise KeyboardInterrupt

    handle = tiny_mlp.fc2.register_forward_hook(interrupt_once)
    with nw.watch(tiny_mlp, max_frames=100) as w:
        with pytest.raises(KeyboardInterrupt):
            tiny_mlp(torch.randn(2, 16))
        tiny_mlp(torch.randn(2, 16))
        assert w.batch == 2 and w.interrupted_batches == [0]
        frames = w.frames()
    handle.remove()
    per_batch = {b: group.drop_duplicates("frame").module.tolist()
                 for b, group in frames.groupby("batch")}
    # The interrupted call stopped inside fc2 (KeyboardInterrupt skips every hook after it).
    assert per_batch[0] == ["fc1", "act"]
    assert per_batch[1] == ["fc1", "act", "fc2", "act", "head", ""]


def test_forward_that_raises_still_records_and_propagates_the_users_error():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            self.lin(x)
            raise RuntimeError("shape mismatch in user code")

    model = Fails()
    with nw.watch(model) as w:
        with pytest.raises(RuntimeError, match="shape mismatch in user code"):
            model(torch.full((1, 2), float("nan")))
        # The NaN seen before the failure is recorded; the user's error is what propagates.
        assert w.event is not None and w.event.module == "lin"
    assert hook_count(model) == 0


def test_second_watch_on_the_same_model_fails_clearly(tiny_mlp):
    with nw.watch(tiny_mlp):
        with pytest.raises(RuntimeError, match="already watched by another NanWatch"):
            nw.watch(tiny_mlp)
        with pytest.raises(RuntimeError, match="already watched"):
            nw.watch(tiny_mlp.fc1)
    with nw.watch(tiny_mlp) as w:  # after close, watching again works
        tiny_mlp(torch.randn(1, 16))
        assert w.batch == 1


class ParamsComparedElementwise(nn.Module):
    """Holds parameters and compares elementwise, as tensordict's TensorDictParams (a Module
    and a TensorDict, in every torchrl loss) does: ``a == b`` is a tensor, and its truth value
    raises."""

    __hash__ = nn.Module.__hash__

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16))

    def __eq__(self, other: object) -> torch.Tensor:  # type: ignore[override]
        return torch.zeros(2, dtype=torch.bool)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_module_that_compares_elementwise_is_watched_closed_and_watched_again(mode):
    # close() raised "Boolean value of Tensor ... is ambiguous" (tensordict: "Converting a
    # tensordict to boolean value is not permitted"), left the watch registered, and a second
    # nw.watch() of the model raised the same.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ParamsComparedElementwise())
    with pytest.raises(RuntimeError):
        bool(model[1] == model[1])
    for _ in range(2):
        watch = nw.watch(model, mode=mode, on_nan="record")
        model(torch.randn(2, 4))
        x = torch.randn(2, 4)
        x[1, 2] = float("nan")
        model(x)
        assert (watch.event.batch, watch.event.module) == (1, "0")
        assert watch.replay(1).reproduced
        assert nw.live_watches() == [watch]
        watch.close()
        assert hook_count(model) == 0 and nw.live_watches() == []


@pytest.mark.parametrize("bad, message", [
    (object(), "needs a torch.nn.Module"),
    ("model", "needs a torch.nn.Module"),
])
def test_not_a_module_is_a_type_error(bad, message):
    with pytest.raises(TypeError, match=message):
        nw.watch(bad)


def test_data_parallel_points_to_ddp(tiny_mlp):
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        nw.watch(nn.DataParallel(tiny_mlp))


def test_scripted_models_are_refused_and_compiled_ones_are_not_watched_in_full_mode(tiny_mlp):
    compiled = torch.compile(tiny_mlp)
    with pytest.raises(ValueError, match="mode='full' cannot watch a torch.compile'd model.*"
                                         "sentinel mode"):
        nw.watch(compiled, mode="full")
    scripted = torch.jit.script(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="TorchScript"):
        nw.watch(scripted)
    assert hook_count(tiny_mlp) == 0


@pytest.mark.parametrize("options, message", [
    ({"max_frames": 0}, "max_frames"),
    ({"on_nan": "explode"}, "on_nan must be one of raise, warn, record"),
    ({"abort_after": -1}, "abort_after"),
    ({"keep_batches": -2}, "keep_batches"),
    ({"grad_norm_warn": -1.0}, "grad_norm_warn"),
    ({"trace_batches": ["x"]}, "trace_batches"),
    ({"skip_types": [42]}, "skip_types"),
])
def test_bad_options_raise_one_clear_error_and_leave_no_hooks(tiny_mlp, options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        nw.watch(tiny_mlp, **options)
    assert hook_count(tiny_mlp) == 0


def test_watched_models_in_parallel_threads_keep_their_frames_apart():
    models = [TinyMLP() for _ in range(2)]
    watches = [nw.watch(m, on_nan="record", max_frames=10_000) for m in models]
    errors = []

    def run(model):
        try:
            for _ in range(25):
                model(torch.randn(4, 16))
        except Exception as error:  # pragma: no cover - the assertion below reports it
            errors.append(error)

    threads = [threading.Thread(target=run, args=(m,)) for m in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for w in watches:
        frames = w.frames()
        w.close()
        assert w.batch == 25
        assert not frames[["nan", "inf"]].any().any()
        assert (frames.note == "").all()
        # Every frame is whole and in its own batch: 6 frames per forward, 4 rows per Linear.
        assert set(frames.groupby("batch")["frame"].nunique()) == {6}
        linear = frames[frames.module_type == "Linear"].groupby(["batch", "frame"]).size()
        assert set(linear) == {4}
    assert not errors


def test_a_second_thread_entering_a_running_watched_forward_gets_a_clear_error():
    model = TinyMLP()
    inside, release = threading.Event(), threading.Event()

    def hold(module, args, output):
        inside.set()
        release.wait(10)

    handle = model.fc2.register_forward_hook(hold)
    caught = []

    def second():
        inside.wait(10)
        try:
            model(torch.randn(4, 16))
        except nw.ConcurrentForwardError as error:
            caught.append(error)
        finally:
            release.set()

    with nw.watch(model, max_frames=100) as w:
        other = threading.Thread(target=second)
        other.start()
        model(torch.randn(4, 16))  # runs in this thread, held inside fc2 until the other tried
        other.join()
        handle.remove()
        model(torch.randn(4, 16))
        frames = w.frames()
    assert len(caught) == 1 and "one forward at a time" in str(caught[0])
    # The refused call recorded nothing: both batches hold exactly one whole forward each.
    assert w.batch == 2
    assert frames.groupby("batch")["frame"].nunique().to_dict() == {0: 6, 1: 6}


# The thread of every forward of LogOfFirstColumn, replays included (outside the module: a
# replay puts the module's own attributes back as they were).
CALLERS: list[int] = []


class LogOfFirstColumn(nn.Module):
    """Two layers times log(x[:, 0]): a request with a negative first column is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLERS.append(threading.get_ident())
        return self.fc2(self.fc1(x)) * torch.log(x[:, :1])


GOOD, BAD = torch.full((4, 8), 0.5), -torch.ones(4, 8)


def _healthy_requests(model: nn.Module):
    """A request another thread runs (model(GOOD) without gradients), what it returned and
    what it raised."""
    results: list = []
    errors: list = []

    def request() -> None:
        try:
            with torch.no_grad():
                results.append(model(GOOD))
        except Exception as error:
            errors.append(error)

    return request, results, errors


def test_another_threads_forward_waits_until_the_nan_batch_before_it_is_replayed():
    from nanwidget.core.recorder import Feature

    model = LogOfFirstColumn().eval()
    with torch.no_grad():
        expected = model(GOOD)
    CALLERS.clear()
    main, others = threading.get_ident(), []
    healthy_request, results, errors = _healthy_requests(model)

    class StartAnotherRequest(Feature):
        # Runs after the NaN batch ended, before the review that replays it.
        def find_event(self, batch, event, reason):
            if event is not None and not others:
                others.append(threading.Thread(target=healthy_request))
                others[0].start()
                others[0].join(0.5)  # time enough to run it, were it let in
            return None

    with nw.watch(model, on_nan="record", replay_on_nan=True) as w:
        w.add_feature(StartAnotherRequest())
        with torch.no_grad():
            model(BAD)
        others[0].join(10)
    assert not errors and torch.equal(results[0], expected)
    # The live NaN forward, its replay, then the other thread's: never inside the replay.
    assert [caller == main for caller in CALLERS] == [True, True, False]
    assert len(w.events) == 1 and w.events[0].trace is not None and w.batch == 2


def test_a_forward_entered_while_a_replay_runs_waits_for_it_and_is_not_broken_by_its_hooks():
    model = LogOfFirstColumn().eval()
    with torch.no_grad():
        expected = model(GOOD)
    CALLERS.clear()
    main, others = threading.get_ident(), []
    healthy_request, results, errors = _healthy_requests(model)

    def start_during_the_replay(module, args):
        # The second forward on this thread is the sentinel's replay of the NaN batch: another
        # thread calls the model now, and takes the module hooks the replay put on.
        if threading.get_ident() == main and len(CALLERS) == 2 and not others:
            others.append(threading.Thread(target=healthy_request))
            others[0].start()
            others[0].join(0.3)  # it waits at the root for the replay to end

    handle = model.fc1.register_forward_pre_hook(start_during_the_replay)
    with nw.watch(model, mode="sentinel", on_nan="record") as w:
        with torch.no_grad():
            model(BAD)
        others[0].join(10)
    handle.remove()
    assert not errors and torch.equal(results[0], expected)
    assert [caller == main for caller in CALLERS] == [True, True, False]
    assert len(w.events) == 1 and w.events[0].trace is not None
    # The replay's frames are its own forward's: fc1, fc2 and the root, once each.
    frames = w.events[0].trace.frames
    assert frames.groupby("frame").module.first().tolist() == ["fc1", "fc2", ""]


def test_a_replay_asked_for_while_another_thread_runs_the_model_waits_for_that_forward():
    model = LogOfFirstColumn().eval()
    inside, release, replayed = threading.Event(), threading.Event(), threading.Event()
    traces, errors = [], []

    def hold(module, args, output):
        if threading.current_thread().name == "held forward":
            inside.set()
            release.wait(10)

    def forward_in_another_thread():
        try:
            with torch.no_grad():
                model(GOOD)
        except Exception as error:
            errors.append(error)

    def replay_batch_0():
        traces.append(w.replay(0))
        replayed.set()

    handle = model.fc2.register_forward_hook(hold)
    with nw.watch(model, on_nan="record", keep_batches=2) as w:
        with torch.no_grad():
            model(BAD)  # batch 0, held
        forward = threading.Thread(target=forward_in_another_thread, name="held forward")
        forward.start()
        inside.wait(10)
        replay = threading.Thread(target=replay_batch_0)
        replay.start()
        ran_meanwhile = replayed.wait(0.5)
        release.set()
        forward.join(10)
        replay.join(10)
    handle.remove()
    assert not ran_meanwhile  # the replay waited for the other thread's forward to end
    assert not errors and traces and traces[0].batch == 0 and w.batch == 2


def test_a_submodule_called_from_another_thread_is_refused_saying_that_it_already_ran():
    model = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 16), nn.Linear(16, 4)).train()
    inside, release = threading.Event(), threading.Event()

    def hold(module, args, output):
        if threading.current_thread() is threading.main_thread():
            inside.set()
            release.wait(10)

    handle = model[2].register_forward_hook(hold)
    caught, stats = [], []

    def call_the_norm_directly():
        inside.wait(10)
        before = model[0].running_mean.clone()
        try:
            model[0](torch.randn(8, 16) + 3)
        except nw.ConcurrentForwardError as error:
            caught.append(error)
        finally:
            stats.append(not torch.equal(model[0].running_mean, before))
            release.set()

    with nw.watch(model):
        other = threading.Thread(target=call_the_norm_directly)
        other.start()
        model(torch.randn(8, 16))
        other.join()
    handle.remove()
    # The refusal comes after the call ran, and says so: its running stats moved.
    assert len(caught) == 1 and stats == [True]
    assert "had already run when it was refused" in str(caught[0])
    assert "running statistics" in str(caught[0]) and "output is dropped" in str(caught[0])


def test_forward_called_while_handling_an_exception_still_raises_nan_detected(tiny_mlp):
    bad = torch.full((1, 16), float("nan"))
    with nw.watch(tiny_mlp):
        try:
            raise KeyError("the user's own, already handled")
        except KeyError:
            with pytest.raises(nw.NanDetected):
                tiny_mlp(bad)


@pytest.mark.parametrize("mode", [None, "sentinel"])
def test_a_root_forward_hook_added_after_the_watch_that_makes_the_output_nan_is_seen(mode):
    """model(x) returns what the root's last forward hook makes of the output, also one the
    user adds after watch(): a NaN it makes is the root's output event, and the user's hook
    stays in place (and runs) after the watch is closed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with nw.watch(model, mode=mode) as w:
        user_handle = model.register_forward_hook(lambda m, args, out: torch.log(out))
        with pytest.raises(nw.NanDetected):
            model(torch.randn(3, 4))
        assert (w.event.module, w.event.role, w.event.origin) == ("", "output", "output")
        assert w.event.diagnosis.kind == "domain"
    assert list(model._forward_hooks) == [user_handle.id]
    x = torch.randn(3, 4)
    logged = model(x)
    user_handle.remove()
    torch.testing.assert_close(logged, torch.log(model(x)), equal_nan=True)


def test_a_forward_that_raised_has_no_output_row_and_a_none_output_keeps_its_own():
    class Refuses(nn.Module):
        def forward(self, x):
            raise ValueError("refused")

    class ReturnsNone(nn.Module):
        def forward(self, x):
            return None

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.refuses, self.returns_none, self.lin = Refuses(), ReturnsNone(), nn.Linear(2, 2)

        def forward(self, x, fail=False):
            try:
                self.refuses(x)
            except ValueError:
                self.returns_none(x)  # called while an exception is handled: it did return None
            y = self.lin(x)
            if fail:
                raise RuntimeError("user error after the last module")
            return y

    torch.manual_seed(0)
    model = Model()
    with nw.watch(model, max_frames=100) as w:
        model(torch.randn(1, 2))
        with pytest.raises(RuntimeError, match="user error"):
            model(torch.randn(1, 2), fail=True)
        frames, report = w.frames(), w.report()
    outputs = frames[frames.role == "output"]
    # A call that raised returned nothing: no output row (it read 'None output' before).
    assert "refuses" not in set(outputs.module)
    assert set(outputs[outputs.module == ""].batch) == {0}
    assert list(outputs[outputs.module == "returns_none"].note) == ["None", "None"]
    assert "None output" in report  # returns_none's; the raised root call adds none
    assert report.count("None output") == 2


def test_replays_asked_for_by_two_threads_run_one_after_the_other():
    # The second was refused: "a replay is already running (replay() cannot be called from
    # inside the model ...)", though it was not called from inside the model.
    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.05)  # long enough for the other thread's replay to arrive
            return torch.sqrt(self.fc(x))

    torch.manual_seed(0)
    model = Slow()
    with nw.watch(model, on_nan="record") as w:
        model(torch.randn(3, 4))
        start = threading.Barrier(2)
        results: list = []

        def replay() -> None:
            start.wait()
            try:
                results.append(w.replay(0))
            except Exception as error:  # noqa: BLE001 - the test reports it
                results.append(error)

        threads = [threading.Thread(target=replay) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert len(results) == 2 and all(isinstance(r, nw.Trace) and r.reproduced for r in results), \
        results


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_watch_whose_model_is_never_called_while_another_model_trains_says_so_at_close(mode):
    # A training wrapper that builds a new model for its fit (skorch's fit() makes a new
    # net.module_) left the watch on the old one: it checked nothing, and said nothing.
    torch.manual_seed(0)
    watched, trained = TinyMLP(), TinyMLP()
    watch = nw.watch(watched, mode=mode)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    for _ in range(3):
        trained(torch.randn(4, 16)).sum().backward()
        optimizer.step()
    with pytest.warns(UserWarning, match=r"checked nothing: its TinyMLP was never called while "
                                         r"3 optimizer steps ran"):
        watch.close()


class OwnCall(nn.Module):
    """A module whose class runs forward in its own __call__, never nn.Module's (GPyTorch's
    modules do): no hook of it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc.weight @ x.T + self.fc.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


class SuperCall(OwnCall):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return nn.Module.__call__(self, x)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_model_whose_own_call_runs_no_hooks_is_said_unseen_at_close(mode, recwarn):
    torch.manual_seed(0)
    for kind in (OwnCall, SuperCall):
        model = kind()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        watch = nw.watch(model, mode=mode)
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
        watch.close()
    said = [str(w.message) for w in recwarn if str(w.message).startswith("nanwidget")]
    # The one whose __call__ runs forward itself only: the other's hooks ran.
    assert len(said) == 1 and "checked nothing" in said[0]
    assert f"({__name__}.OwnCall.__call__)" in said[0] and "was never called" not in said[0]


def test_a_watch_that_saw_its_model_or_no_training_stays_quiet_at_close(recwarn):
    torch.manual_seed(0)
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    nw.watch(TinyMLP()).close()                        # nothing trained meanwhile
    watch = nw.watch(model)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    watch.close()
    assert not [w for w in recwarn if "nanwidget" in str(w.message)]


def test_trials_that_build_and_drop_models_while_a_watch_stays_open_leave_no_step_marks():
    # A notebook keeps one watch open (a line %nanwatch) while a hyperparameter search builds,
    # trains and drops a model per trial: what the optimizer-step hook remembers of each
    # trial's parameters must go with them, not pile up for the whole session.
    from nanwidget.core.state import optimizer_steps

    kept = TinyMLP()
    log = optimizer_steps()

    def trial(seed: int) -> None:
        torch.manual_seed(seed)
        model = TinyMLP()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=seed % 2 == 0)
        with nw.watch(model) as w:
            for _ in range(3):
                optimizer.zero_grad()
                model(torch.randn(4, 16)).square().mean().backward()
                optimizer.step()
        assert w.batch == 3

    with nw.watch(kept):
        trial(0)
        gc.collect()  # a watched model is freed by the collector (its hooks form cycles)
        after_one = (len(log.marks), len(log.optimizers))
        for seed in range(1, 30):
            trial(seed)
        gc.collect()
        assert (len(log.marks), len(log.optimizers)) == after_one == (0, 0)
        # The open watch still learns of its own model's steps (fused: no version counter).
        optimizer = torch.optim.SGD(kept.parameters(), lr=0.1, fused=True)
        kept(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        with torch.no_grad():
            kept.head.bias.mul_(float("inf"))
        with pytest.raises(nw.NanDetected) as raised:
            kept(torch.randn(4, 16))
        assert (raised.value.event.batch, raised.value.event.module) == (1, "head")
    assert len(log.marks) == 0 and log.handle is None


class _Drafter(nn.Module):
    """A model and its smaller copy share their module names (a model and its assistant)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(4, width)
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_event_names_its_model_while_another_model_is_watched_too(mode, tmp_path):
    # Both watches name their modules 'fc' and 'head': "nan in batch 0 at module 'fc'" did not
    # say which model held the NaN.
    torch.manual_seed(0)
    big, small = _Drafter(16), _Drafter(8)
    with torch.no_grad():
        small.fc.weight[0, 0] = float("nan")
    with nw.watch(big, mode=mode) as w_big, \
            nw.watch(small, mode=mode, log_dir=tmp_path) as w_small:
        x = torch.randn(3, 4)
        big(x)
        with pytest.raises(nw.NanDetected) as raised:
            small(x)
    assert w_big.events == [] and w_small.event is raised.value.event
    assert w_small.event.model == "_Drafter of 58 parameters"
    assert "at module 'fc' (Linear, call 0) in _Drafter of 58 parameters, weight" in \
        str(raised.value)
    assert nw.load_run(tmp_path).event.model == "_Drafter of 58 parameters"


def test_an_event_of_one_of_two_models_alike_names_its_watch_and_alone_names_none():
    torch.manual_seed(0)
    policy, reference = _Drafter(8), _Drafter(8)
    with torch.no_grad():
        reference.head.bias[0] = float("inf")
    x = torch.randn(3, 4)
    with nw.watch(policy, on_nan="record"), nw.watch(reference, on_nan="record") as w:
        reference(x)
    assert w.event.model == "_Drafter of 58 parameters, nw.live_watches()[1]"
    with nw.watch(reference, on_nan="record") as alone:
        reference(x)
    assert alone.event.model == "" and " in _Drafter" not in alone.event.summary()
