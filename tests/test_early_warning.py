"""Early warning (``early_warning=True``, the default): an output near its dtype's largest value,
or growing geometrically towards it, is warned about before it overflows, once per module and
reason, without stopping the run; healthy training never warns."""

from __future__ import annotations

import contextlib
import json
import dataclasses
import math
import warnings

import pandas as pd
import pytest
import torch
from torch import nn

import nanwidget as nw
from nanwidget.core.early_warning import FOLD_BATCHES, MIN_GROWTH, EarlyWarnings, growth_rate
from nanwidget.core.persist import RunLoadError, load_run


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: a second thread only adds overhead on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CONTRACT_FIELDS = ["batch", "module", "role", "reason", "abs_max", "limit", "growth_per_batch",
                   "batches_to_limit"]


# ---------------------------------------------------------------------------- models and data
def _classification(count: int, dtype: torch.dtype = torch.float32) -> list[tuple]:
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 4, generator=generator)
    batches = []
    for _ in range(count):
        x = torch.randn(32, 16, generator=generator)
        batches.append((x.to(dtype), (x @ teacher).argmax(1)))
    return batches


def _regression(count: int, dtype: torch.dtype = torch.float32) -> list[tuple]:
    generator = torch.Generator().manual_seed(3)
    teacher = torch.randn(16, 4, generator=generator)
    batches = []
    for _ in range(count):
        x = torch.randn(32, 16, generator=generator)
        batches.append((x.to(dtype), (x @ teacher).to(dtype)))
    return batches


def _tokens(count: int, vocab: int = 50, length: int = 16) -> list[tuple]:
    """Sequences that count up (next token = this one + 1): learnable, so training moves."""
    generator = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(count):
        start = torch.randint(0, vocab, (8, 1), generator=generator)
        sequence = (start + torch.arange(length + 1)) % vocab
        batches.append((sequence[:, :-1], sequence[:, 1:]))
    return batches


def _mlp(width: int = 32, activation: type[nn.Module] = nn.ReLU,
         dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(16, width), activation(), nn.Linear(width, width),
                         activation(), nn.Linear(width, 4)).to(dtype)


class CausalMask(nn.Module):
    """The causal mask as a module output: -inf above the diagonal (allowed with allow_inf)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])


class CausalEncoder(nn.Module):
    """A tiny language model on nn.TransformerEncoder with a causal -inf mask."""

    def __init__(self, vocab: int = 50, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mask = CausalMask()
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = self.mask(tokens)
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       targets.reshape(-1))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[tuple], loss_fn,
           steps: int, *, lr_at=None, closure: bool = False,
           **options) -> tuple[nw.NanWatch, list]:
    """Train until the first NaN/Inf event (recorded, not raised); the Python warnings issued.
    ``closure``: the forward and backward run in a closure handed to ``optimizer.step``."""
    with warnings.catch_warnings(record=True) as issued:
        warnings.simplefilter("always")
        with nw.watch(model, on_nan="record", **options) as watched:
            for step in range(steps):
                if lr_at is not None:
                    for group in optimizer.param_groups:
                        group["lr"] = lr_at(step)
                x, y = batches[step % len(batches)]

                def forward_backward():
                    loss = loss_fn(model(x), y)
                    optimizer.zero_grad()
                    loss.backward()
                    return loss

                if closure:
                    optimizer.step(forward_backward)
                else:
                    forward_backward()
                    optimizer.step()
                if watched.events:
                    break
    return watched, [w for w in issued if issubclass(w.category, nw.EarlyWarningIssued)]


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y.float())


def _ramped_lr(peak: float, over: int = 40):
    """A linear learning-rate warm-up to ``peak``: fine at first, too high later."""
    return lambda step: peak * min(1.0, (step + 1) / over)


# ---------------------------------------------------------------------------- healthy runs
def _healthy_mlp(**options):
    torch.manual_seed(0)
    model = _mlp()
    return _train(model, torch.optim.Adam(model.parameters(), 1e-3), _classification(50),
                  nn.functional.cross_entropy, 150, **options)


def _healthy_encoder(**options):
    torch.manual_seed(0)
    model = CausalEncoder()
    return _train(model, torch.optim.Adam(model.parameters(), 1e-3), _tokens(50), _lm_loss, 150,
                  allow_inf=["mask"], **options)


def _healthy_gpt2(**options):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)  # random weights, nothing downloaded
    return _train(model, torch.optim.AdamW(model.parameters(), 3e-4), _tokens(50),
                  lambda out, y: _lm_loss(out.logits, y), 100, **options)


def _healthy_float16_mlp_sgd(**options):
    torch.manual_seed(0)
    model = _mlp(64, dtype=torch.float16)
    return _train(model, torch.optim.SGD(model.parameters(), 0.05, momentum=0.9),
                  _classification(50, torch.float16),
                  lambda out, y: nn.functional.cross_entropy(out.float(), y), 150, **options)


def _healthy_float16_mlp_adam(**options):
    # Its logits grow fastest of the healthy runs (about 1.5x per batch early on).
    torch.manual_seed(0)
    model = _mlp(64, dtype=torch.float16)
    return _train(model, torch.optim.Adam(model.parameters(), 1e-3, eps=1e-4),
                  _classification(50, torch.float16),
                  lambda out, y: nn.functional.cross_entropy(out.float(), y), 150, **options)


HEALTHY = {"mlp": _healthy_mlp, "transformer-encoder": _healthy_encoder, "gpt2": _healthy_gpt2,
           "float16-mlp-sgd": _healthy_float16_mlp_sgd,
           "float16-mlp-adam": _healthy_float16_mlp_adam}


def test_a_float16_head_leaving_a_small_initialisation_is_no_growth():
    # A head initialised at std 1e-4, trained with SGD and momentum: its output climbs 2-3x
    # per batch for the first few batches (quadratic in the step under momentum), from 3e-4 to
    # about 0.2, then settles. It read "passes float16's largest in about 14 batches".
    torch.manual_seed(3)
    model = _mlp(64, nn.GELU, torch.float16)
    nn.init.normal_(model[4].weight, std=1e-4)
    nn.init.zeros_(model[4].bias)
    watched, issued = _train(model, torch.optim.SGD(model.parameters(), 0.05, momentum=0.9),
                             _regression(12, torch.float16), _mse, 12)
    assert watched.events == [] and watched.warnings == [] and issued == []


@pytest.mark.parametrize("run", list(HEALTHY))
def test_healthy_training_never_warns(run):
    watched, issued = HEALTHY[run]()
    assert watched.events == []  # it trained to the end
    assert watched.batch >= 100
    assert watched.warnings == [] and issued == []


def test_healthy_training_never_warns_in_sentinel_mode_either():
    for run in ("transformer-encoder", "float16-mlp-adam"):
        watched, issued = HEALTHY[run](mode="sentinel", sample_every=5)
        assert watched.events == [] and watched.warnings == [] and issued == []


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_switching_to_evaluation_starts_a_new_series(mode):
    # A few training steps leave BatchNorm's running statistics far from the batch statistics
    # (inputs centred at 100, momentum 0.1): the first evaluation forwards' outputs are 60x the
    # training ones. That jump is the mode, not a growth (the same run trained on stays level).
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, mode=mode, on_nan="record") as w:
            for _ in range(4):
                x, y = torch.randn(16, 8, generator=data) + 100, torch.randn(16, 4, generator=data)
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
            model.eval()
            with torch.no_grad():
                outputs = [model(torch.randn(16, 8, generator=data) + 100) for _ in range(2)]
    history = w.history()
    root = history[history.module == ""].abs_max.tolist()
    assert max(root[:4]) < 5 and min(o.abs().max().item() for o in outputs) > 100  # the jump
    assert w.warnings == []
    assert not [c for c in caught if issubclass(c.category, nw.EarlyWarningIssued)]


def test_evaluating_between_training_steps_keeps_the_training_series():
    # The README's learning-rate blow-up, evaluated after every step: the training forwards
    # are still one series, warned about long before the NaN.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 4))
    teacher = torch.randn(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model, on_nan="record") as w:
            for step in range(100):
                optimizer.param_groups[0]["lr"] = min(2.0, 0.05 * (step + 1))
                model.train()
                x = torch.randn(32, 16)
                loss = nn.functional.mse_loss(model(x), x @ teacher)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                model.eval()
                with torch.no_grad():
                    model(torch.randn(32, 16))
                if w.event:
                    break
    assert w.event is not None and w.warnings
    growth = [warning for warning in w.warnings if warning.reason == "growth"]
    assert growth and growth[0].batch < w.event.batch - 4


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_lbfgs_line_search_trying_longer_steps_is_no_growth(mode):
    # A healthy least-squares fit: LBFGS's strong-Wolfe line search calls the closure again at
    # trial steps up to ten times longer each, so the outputs of the points it tries grow about
    # 5x per call for several calls (a growth warning in 5 batches before closures counted once
    # per step), while the fit converges.
    torch.manual_seed(0)
    x = torch.randn(128, 16)
    y = (x @ torch.randn(16, 4) + torch.randn(128, 4)) * 1000
    model = nn.Linear(16, 4)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1, line_search_fn="strong_wolfe")
    watched, issued = _train(model, optimizer, [(x, y)], _mse, 5, closure=True, mode=mode)
    assert watched.events == [] and watched.batch > 20  # many closure calls per step
    design = torch.cat([x, torch.ones(128, 1)], 1)
    best = nn.functional.mse_loss(design @ torch.linalg.lstsq(design, y).solution, y).item()
    assert nn.functional.mse_loss(model(x), y).item() < best * 1.01  # it fit
    assert watched.warnings == [] and issued == []


def test_the_step_in_progress_is_numbered_while_a_watch_is_live():
    from nanwidget.core.writes import step_in_progress
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    seen = []

    def closure():
        seen.append(step_in_progress())
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    with nw.watch(model):
        optimizer.step(closure)
        optimizer.step(closure)
        assert step_in_progress() == 0  # between steps
    optimizer.step(closure)  # no watch: the numbering hook is off
    assert seen[0] > 0 and seen[1] > seen[0] and seen[2] == 0


def test_forwards_after_an_optimizer_step_that_raised_are_each_looked_at():
    # A step that raised (Ctrl-C in opt.step()) runs no post-step hook: every forward after it
    # counted as a closure call inside that step, only the first was looked at, and outputs
    # growing tenfold per batch got no warning.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))

    class Interrupted(torch.optim.SGD):
        def step(self, closure=None):
            raise KeyboardInterrupt

    optimizer = Interrupted(model.parameters(), lr=0.1)
    x = torch.randn(16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model, on_nan="record") as w:
            nn.functional.mse_loss(model(x), torch.zeros(16, 4)).backward()
            with contextlib.suppress(KeyboardInterrupt):
                optimizer.step()
            with torch.no_grad():
                for batch in range(12):
                    model[2].weight.mul_(10.0)  # the outputs grow tenfold per batch
                    model(x)
    assert w.events == []
    assert [warning.module for warning in w.warnings if warning.reason == "growth"][:1] == ["2"]


def test_a_blow_up_in_closures_called_once_per_step_is_still_warned_about():
    torch.manual_seed(0)
    model = _mlp(64, nn.Tanh)
    watched, issued = _train(model, torch.optim.SGD(model.parameters(), 0.05), _regression(50),
                             _mse, 200, lr_at=_ramped_lr(2.0), closure=True)
    assert watched.event is not None
    assert watched.warnings and watched.warnings[0].batch <= watched.event.batch - 2
    assert len(issued) == len(watched.warnings)


# ---------------------------------------------------------------------------- gradual failures
def _mlp_learning_rate_blowup(**options):
    torch.manual_seed(0)
    model = _mlp(64, nn.Tanh)
    return _train(model, torch.optim.SGD(model.parameters(), 0.05), _regression(50), _mse, 200,
                  lr_at=_ramped_lr(2.0), **options)


def _encoder_learning_rate_blowup(**options):
    torch.manual_seed(0)
    model = CausalEncoder()
    return _train(model, torch.optim.SGD(model.parameters(), 20.0), _tokens(50), _lm_loss, 100,
                  allow_inf=["mask"], **options)


def _float16_overflow(**options):
    torch.manual_seed(0)
    model = _mlp(64, nn.Tanh, torch.float16)
    return _train(model, torch.optim.SGD(model.parameters(), 0.05), _regression(50, torch.float16),
                  _mse, 200, lr_at=_ramped_lr(2.0), **options)


FAILING = {"mlp-learning-rate": _mlp_learning_rate_blowup,
           "transformer-encoder-learning-rate": _encoder_learning_rate_blowup,
           "float16-overflow": _float16_overflow}


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("run", list(FAILING))
def test_gradual_failures_are_warned_about_two_batches_before_the_nan(run, mode):
    watched, issued = FAILING[run](mode=mode)
    event = watched.event
    assert event is not None, "the run must fail for this test to mean anything"
    first = watched.warnings[0]
    assert first.batch <= event.batch - 2, (str(first), event.summary())
    assert first.reason in ("growth", "near-limit") and first.abs_max < first.limit
    if mode == "sentinel":
        assert first.module == ""  # between sampled batches only the root's outputs are read
    # Each record issued exactly once, as a Python warning pointing at the user's line.
    assert [str(w.message) for w in issued] == [f"nanwidget: {w}" for w in watched.warnings]
    assert {w.filename for w in issued} == {__file__}


def test_the_float16_run_is_warned_about_in_float16_terms():
    watched, _ = _float16_overflow()
    event = watched.event
    assert watched.warnings and watched.warnings[0].batch <= event.batch - 2
    assert all(w.dtype == "float16" and w.limit == 65504.0 for w in watched.warnings)
    # Every module whose outputs neared float16's largest value before the NaN was warned
    # about, near-limit, by the batch it got there (or one inside it, whose output it hands
    # on). Where that happens depends on the CPU's float16 kernels: on an AMD EPYC the
    # activations neared it the batch before the NaN; with AVX512-FP16 they jumped from about
    # 1200 to inf in one batch (the growth warnings came 2 batches before).
    history = watched.history()
    neared = history[(history.batch < event.batch) & (history.abs_max >= 65504 / 4)
                     & (history.abs_max < 65504 / 1.01)]
    near = [w for w in watched.warnings if w.reason == "near-limit"]
    for module, batch in neared.groupby("module").batch.min().items():
        assert any(w.batch <= batch and (w.module == module or w.module.startswith(f"{module}.")
                                         or module == "") for w in near), (module, batch, near)


def test_a_growth_warning_says_how_fast_and_how_soon():
    watched, _ = _encoder_learning_rate_blowup()
    warning = next(w for w in watched.warnings if w.reason == "growth")
    assert warning.growth_per_batch >= MIN_GROWTH
    assert warning.limit == float(torch.finfo(torch.float32).max)
    expected = math.log(warning.limit / warning.abs_max) / math.log(warning.growth_per_batch)
    assert warning.batches_to_limit == pytest.approx(expected)
    assert 0 < warning.batches_to_limit <= 50
    # The history agrees: the module's abs max did grow that fast up to the warning.
    history = watched.history()
    rows = history[(history["module"] == warning.module) & (history["batch"] <= warning.batch)]
    values = rows.sort_values("batch")["abs_max"].tolist()
    assert values[-1] == pytest.approx(warning.abs_max)
    assert values[-1] / values[-4] >= MIN_GROWTH ** 3


# ---------------------------------------------------------------------------- the two reasons
class Scaled(nn.Module):
    """A float16 layer whose output is multiplied by ``gain``: the test raises it each batch."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).to(dtype)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.gain


def _grow(model: Scaled, factor: float, batches: int, **options) -> nw.NanWatch:
    x = torch.randn(4, 8).to(model.fc.weight.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model, on_nan="record", **options) as watched:
            for _ in range(batches):
                model(x)
                model.gain *= factor
                if watched.events:
                    break
    return watched


def test_a_slow_float16_growth_is_warned_about_near_the_limit():
    watched = _grow(Scaled(), 1.5, 60)
    assert watched.event is not None and watched.event.kind == "inf"
    first = watched.warnings[0]
    # 1.5x per batch is under the growth threshold: the near-limit check says it, in time.
    assert first.reason == "near-limit" and first.batch <= watched.event.batch - 2
    assert 65504 / 4 <= first.abs_max < 65504 and first.dtype == "float16"
    assert first.growth_per_batch == pytest.approx(1.5, rel=0.01)
    assert first.batches_to_limit == pytest.approx(
        math.log(65504 / first.abs_max) / math.log(first.growth_per_batch))
    assert [w.reason for w in watched.warnings] == ["near-limit"]  # once per module and reason
    assert {w.module for w in watched.warnings} == {""}  # the gain is the root's own


def test_a_near_limit_warning_after_one_jump_gives_no_rate_from_it():
    # The output dips, then one jump takes it into the near zone: one rise is no growth rate
    # (it read 13x per batch here, "the limit in half a batch").
    model = Scaled()
    x = torch.randn(4, 8).half()
    largest = float(model.fc(x).abs().max())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model, on_nan="record") as watched:
            for target in (1000.0, 2000.0, 1500.0, 20000.0):
                model.gain = target / largest
                model(x)
    near = [w for w in watched.warnings if w.reason == "near-limit"]
    assert len(near) == 1 and near[0].batch == 3
    assert math.isnan(near[0].growth_per_batch) and math.isnan(near[0].batches_to_limit)
    assert "growing" not in str(near[0])


def test_a_fast_growth_is_warned_about_long_before_the_limit():
    watched = _grow(Scaled(torch.float32), 10.0, 60)
    assert watched.event is not None
    growth = [w for w in watched.warnings if w.reason == "growth"]
    assert growth and growth[0].batch == 3  # three rises in a row, the earliest it can tell
    assert growth[0].growth_per_batch == pytest.approx(10.0, rel=0.01)
    assert growth[0].abs_max < 1e6 and watched.event.batch - growth[0].batch > 30


@pytest.mark.parametrize("factor", [1.2, 1.9])
def test_growth_slower_than_the_threshold_is_no_growth_warning(factor):
    watched = _grow(Scaled(torch.float32), factor, 40)
    assert watched.warnings == []


class Spiky(nn.Module):
    """Outputs of a steady size with one huge spike (a bad batch, not a trend)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x) * (1e12 if self.calls == 6 else 1.0)


def test_a_one_batch_spike_is_not_a_growth():
    model = Spiky()
    with nw.watch(model) as watched:
        for _ in range(20):
            model(torch.randn(4, 8))
    assert watched.warnings == []


class Masked(nn.Module):
    """Fills masked scores with the dtype's most negative value, as attention code does."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.fc(x)
        mask = torch.ones_like(scores, dtype=torch.bool).triu(1)
        return scores.masked_fill(mask, torch.finfo(scores.dtype).min)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_mask_at_the_dtype_extreme_is_not_near_the_limit(dtype):
    model = Masked(dtype)
    with nw.watch(model) as watched:
        for _ in range(10):
            model(torch.randn(4, 8).to(dtype))
    assert watched.history()["abs_max"].max() == float(torch.finfo(dtype).max)
    assert watched.warnings == []


def test_growth_rate_is_the_median_of_the_pairwise_slopes():
    logs = [0.0, 1.0, 2.0, 3.0, 30.0]  # one odd batch in five does not make the trend
    assert growth_rate([0, 1, 2, 3, 4], logs) == pytest.approx(1.0)
    assert growth_rate([0, 2, 4], [0.0, 2.0, 4.0]) == pytest.approx(1.0)  # per batch, not point


# ---------------------------------------------------------------------------- never stopping
def test_a_warning_never_stops_the_run_even_when_warnings_are_errors():
    model = Scaled(torch.float32)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nw.EarlyWarningIssued)
        with nw.watch(model, on_nan="record") as watched:
            for _ in range(8):
                model(x)
                model.gain *= 10.0
    assert watched.batch == 8 and watched.warnings and watched.events == []


def test_no_early_warning_when_turned_off():
    with warnings.catch_warnings(record=True) as issued:
        warnings.simplefilter("always")
        watched = _grow(Scaled(), 1.5, 60, early_warning=False)
    assert watched.event is not None
    assert watched.warnings == [] and watched.parts.early_warning is None
    assert not watched.early_warning
    assert not [w for w in issued if issubclass(w.category, nw.EarlyWarningIssued)]
    assert not any(isinstance(f, EarlyWarnings) for f in watched.recorder.features)


def test_a_batch_that_already_holds_the_nan_gets_no_warning():
    watched = _grow(Scaled(), 300.0, 10)  # 1 -> 300 -> 9e4: overflows with no batch in between
    assert watched.event is not None and watched.warnings == []


# ---------------------------------------------------------------------------- showing them
def test_warnings_tabulate_and_read_in_one_line():
    watched = _grow(Scaled(), 1.5, 60)
    table = pd.DataFrame(watched.warnings)
    assert list(table.columns[:len(CONTRACT_FIELDS)]) == CONTRACT_FIELDS
    assert table.loc[0, "module"] == "" and table.loc[0, "reason"] == "near-limit"
    text = str(watched.warnings[0])
    assert "\n" not in text and text.startswith("early warning, batch ")
    assert "'<root>'" in text and "float16" in text and "65504" in text


def test_a_recording_keeps_the_warnings(tmp_path):
    watched = _grow(Scaled(), 1.5, 60, log_dir=tmp_path / "run")
    loaded = load_run(tmp_path / "run").warnings
    assert [str(w) for w in loaded] == [str(w) for w in watched.warnings] != []
    assert pd.DataFrame(loaded).equals(pd.DataFrame(watched.warnings))


def test_a_warning_is_on_disk_at_the_end_of_its_batch(tmp_path):
    model = Scaled(torch.float32)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        watched = nw.watch(model, log_dir=tmp_path)
        for _ in range(4):
            model(x)
            model.gain *= 10.0
        assert watched.warnings
        assert [str(w) for w in load_run(tmp_path).warnings] == [str(w) for w in watched.warnings]
        watched.close()


def test_recordings_without_warnings_load_with_none(tiny_mlp, tmp_path):
    with nw.watch(tiny_mlp, log_dir=tmp_path / "off", early_warning=False):
        tiny_mlp(torch.randn(2, 16))
    assert not list((tmp_path / "off").rglob("warnings.json"))
    assert load_run(tmp_path / "off").warnings == []


@pytest.mark.parametrize("damage", [
    {"format": "something else", "warnings": []},
    {"format": "nanwidget-warnings", "version": 1, "warnings": [{"batch": "3"}]},
    {"format": "nanwidget-warnings", "version": 1, "warnings": "none"},
])
def test_a_damaged_warnings_file_is_named(tmp_path, damage):
    _grow(Scaled(), 1.5, 60, log_dir=tmp_path)
    path = next(tmp_path.rglob("warnings.json"))
    path.write_text(json.dumps(damage))
    with pytest.raises(RunLoadError, match="warnings.json"):
        load_run(tmp_path)


def test_a_warning_of_an_unknown_reason_is_refused(tmp_path):
    _grow(Scaled(), 1.5, 60, log_dir=tmp_path)
    path = next(tmp_path.rglob("warnings.json"))
    data = json.loads(path.read_text())
    data["warnings"][0]["reason"] = "gut feeling"
    path.write_text(json.dumps(data))
    with pytest.raises(RunLoadError, match="reason"):
        load_run(tmp_path)


def test_sentinel_mode_reads_every_module_on_sampled_batches():
    model = nn.Sequential(Scaled(), nn.Identity())
    x = torch.randn(4, 8).half()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model, on_nan="record", mode="sentinel", sample_every=4) as watched:
            for _ in range(60):
                model(x)
                model[0].gain *= 1.5
                if watched.events:
                    break
    modules = {w.module for w in watched.warnings}
    assert "" in modules  # the root, read every batch
    assert modules <= {"", "0", "0.fc", "1"}
    assert all(w.batch % 4 == 0 for w in watched.warnings if w.module)  # sampled batches only


def test_the_python_warning_category_is_a_user_warning():
    assert issubclass(nw.EarlyWarningIssued, UserWarning)
    assert nw.EarlyWarning.__dataclass_fields__.keys() >= set(CONTRACT_FIELDS)


def test_manual_batch_numbers_are_followed():
    model = Scaled(torch.float32)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model) as watched:
            for batch in range(0, 40, 5):  # every 5th batch runs: 10x per 5 batches is slow
                watched.set_batch(batch)
                model(x)
                model.gain *= 10.0
    assert watched.warnings == []  # 10x per 5 batches is 1.6x per batch: no growth


class RarelyUsedHead(nn.Module):
    """A body that runs every batch and a head that runs only when asked (an evaluation head)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_head: bool = False) -> torch.Tensor:
        hidden = self.body(x)
        return self.head(hidden) if use_head else hidden


@pytest.mark.parametrize("how", ["a module that runs rarely", "batch numbers set far apart"])
def test_rows_thousands_of_batches_apart_are_compared_without_an_internal_error(how):
    # 2.0 ** 1100 overflows a float: the growth test used to raise inside the watch, which
    # said "internal error while recording" and skipped that batch's check.
    torch.manual_seed(0)
    model, x = RarelyUsedHead(), torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model) as watched:
            if how == "a module that runs rarely":
                model(x, use_head=True)
                for _ in range(1100):
                    model(x)
                model(x * 10, use_head=True)
            else:
                for batch, scale in ((0, 1.0), (1100, 10.0), (2200, 100.0), (3300, 1000.0)):
                    watched.set_batch(batch)
                    model(x * scale, use_head=True)
    assert [str(w.message) for w in caught] == []
    assert watched.warnings == []  # 10x per 1100 batches is no growth
    rows = watched.history()
    assert len(rows[rows.module == "head"]) == (2 if how == "a module that runs rarely" else 4)


# ---------------------------------------------------------------------------- plots and browser
def _warned_without_event() -> nw.NanWatch:
    """A root whose output grows 10x per batch: a growth warning at batch 3, no NaN yet."""
    return _grow(Scaled(torch.float32), 10.0, 6)


def test_the_history_plot_marks_each_warning_and_the_first_one():
    from nanwidget.plots import plot_history
    watched = _warned_without_event()
    assert watched.events == [] and len(watched.warnings) == 1
    warning = watched.warnings[0]
    for given in (watched.warnings, pd.DataFrame(watched.warnings)):
        ax = plot_history(watched.history(), [""], warnings=given).axes[0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "early warning" in legend and f"first warning: batch {warning.batch}" in legend
        rings = [line for line in ax.lines if line.get_label() == "early warning"]
        assert [tuple(xy) for xy in rings[0].get_xydata()] == [(warning.batch, warning.abs_max)]
    # A warning on a module that is not drawn is not marked.
    ax = plot_history(watched.history(), ["fc"], warnings=watched.warnings).axes[0]
    assert "early warning" not in [t.get_text() for t in ax.get_legend().get_texts()]


def test_the_browser_shows_the_warnings_of_a_watch_and_of_a_recording(tmp_path):
    from nanwidget.widgets import FrameBrowser
    model = Scaled(torch.float32)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model, log_dir=tmp_path) as watched:
            for _ in range(6):
                model(x)
                model.gain *= 10.0
    for source in (watched, load_run(tmp_path)):
        browser = FrameBrowser(source)
        assert "early warning, batch 3: output of '&lt;root&gt;'" in browser.status.value
        assert "nw-warning" in browser.status.value and "no NaN/Inf seen" in browser.status.value
        browser.plot_choice.value = "history"
        assert bytes(browser.history_image.value).startswith(b"\x89PNG")
        assert "early warning, batch 3" in browser.static_html()


class Classifier(nn.Module):
    """Returns class ids (an integer output) next to logits that grow 10x a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.fc(x)
        return logits, logits.argmax(-1)


def test_integer_outputs_are_no_trend_and_float_ones_still_warn():
    model = Classifier()
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model) as watched:
            for _ in range(6):
                model(x)
                with torch.no_grad():
                    model.fc.weight.mul_(10.0)
    assert [(w.module, w.role, w.reason) for w in watched.warnings] == [("fc", "output", "growth")]


def test_the_report_command_lists_the_warnings_before_the_events(tmp_path, capsys):
    from nanwidget.cli import main as cli_main
    watched = _grow(Scaled(), 1.5, 60, log_dir=tmp_path)
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert str(watched.warnings[0]) in out
    assert out.index(str(watched.warnings[0])) < out.index("=== event 1 of 1")


def test_an_output_that_starts_at_zero_grows_from_its_first_nonzero_value():
    """A zero-initialised output (a LoRA B matrix, a ReZero gate) is no run of rises from 0."""
    model = Scaled(torch.float32)
    model.gain = 0.0
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as issued:
        warnings.simplefilter("always")
        with nw.watch(model) as watched:
            for batch in range(8):
                model(x)
                model.gain = 10.0 ** batch  # 0, then 1, 10, 100, ...
    assert not [w for w in issued if "internal error" in str(w.message)]
    growth = [w for w in watched.warnings if w.reason == "growth"]
    assert growth and growth[0].batch == 4  # rises at batches 2, 3 and 4: the zero is no start


def test_batch_numbers_that_start_again_start_a_new_series():
    """set_batch(i) with i counted within each epoch: every epoch is looked at again."""
    model = Scaled(torch.float32)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model) as watched:
            for epoch in range(2):
                for batch in range(5):
                    watched.set_batch(batch)
                    model(x)
                    model.gain *= 10.0 if epoch == 1 else 1.0
    assert [(w.batch, w.reason) for w in watched.warnings] == [(3, "growth")]


def test_a_climb_from_near_zero_is_no_growth_rate():
    # A mean readout of centred features (GraphNorm before a mean aggregation) starts at 2e-7
    # and settles near 1 in three batches: the rate fitted from 2e-7 read 45x per batch, "the
    # limit in about 23 batches", in a healthy run.
    model = Scaled(torch.float32)
    x = torch.randn(4, 8)
    largest = float(model.fc(x).abs().max())
    with nw.watch(model, on_nan="record") as watched:
        for target in (2e-7, 0.03, 0.08, 1.04, 1.1, 1.2, 1.15, 1.3, 1.25, 1.38):
            model.gain = target / largest
            model(x)
    assert watched.warnings == []


def test_a_warning_counts_one_batch_in_the_singular():
    soon = nw.EarlyWarning(batch=4, module="attn", role="output", reason="near-limit",
                           abs_max=30000.0, limit=65504.0, growth_per_batch=2.5,
                           batches_to_limit=0.85, dtype="float16")
    assert soon.summary().endswith("(growing 2.5x per batch: about 1 batch left)")
    later = dataclasses.replace(soon, reason="growth", batches_to_limit=12.2)
    assert later.summary().endswith("in about 12 batches")


def test_a_warning_under_half_a_batch_from_the_limit_says_the_next_batch_not_0_batches():
    # A float16 GCN's sum aggregation at 25400, growing 19.4x per batch, read "about 0 batches
    # left".
    soon = nw.EarlyWarning(batch=2, module="lin", role="output", reason="near-limit",
                           abs_max=25400.0, limit=65504.0, growth_per_batch=19.4,
                           batches_to_limit=0.32, dtype="float16")
    assert soon.summary().endswith("(growing 19.4x per batch: the next batch may pass it)")
    fast = dataclasses.replace(soon, reason="growth")
    assert fast.summary().endswith("passes float16's largest 65504 within the next batch")
    assert "0 batches" not in soon.summary() + fast.summary()


class _DelayedFloat8Cast(nn.Module):
    """Delayed scaling (TransformerEngine's, torchao's): the next scale is 448 / the recent abs
    max, so the float8_e4m3fn values fill the format's range by design."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("amax_history", torch.ones(16))
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.scale.clone()
        # Clamped to the format's range first, as the recipes do (torch before 2.13 casts a
        # value past 448 to NaN rather than saturating).
        cast = (x * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        with torch.no_grad():
            self.amax_history.copy_(torch.cat([self.amax_history[1:], x.abs().amax()[None]]))
            self.scale.fill_(448.0 / self.amax_history.max())
        return cast, scale


class _Float8Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.cast = _DelayedFloat8Cast()
        self.last = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cast, scale = self.cast(self.first(x))
        return self.last(cast.float() / scale)


def test_float8_values_scaled_to_fill_their_range_get_no_warning():
    # "reached abs max 416, within a factor 4 of float8_e4m3fn's largest 448": the recipe.
    torch.manual_seed(0)
    model = _Float8Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with nw.watch(model, on_nan="record") as w:
        for _ in range(20):
            model(torch.randn(32, 16)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert w.events == [] and w.warnings == []
    assert model.cast.scale.item() > 100  # the values did fill the range


class _WithPackedFloat4(nn.Module):
    """A float16 layer and a float4_e2m1fn_x2 output (torch.finfo has no max for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer(x), torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)


def test_a_float4_output_leaves_the_other_outputs_warnings_and_the_browser_working():
    # Its limit raised inside the early warning at every batch (an internal error each time,
    # no warning ever) and in the FrameBrowser's and plot_frames' dtype limits.
    torch.manual_seed(0)
    model = _WithPackedFloat4().half()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, on_nan="record") as w:
            for _ in range(20):
                with torch.no_grad():
                    model.layer.weight.mul_(2.0)
                model(torch.ones(2, 4, dtype=torch.half))
            assert [(x.module, x.reason) for x in w.warnings] == [("layer", "near-limit")]
            nw.FrameBrowser(w)
            nw.plots.plot_frames(w.frames())
    assert not [x for x in caught if "internal error" in str(x.message)]
    assert nw.core.dtype_max("float4_e2m1fn_x2") == math.inf
    assert nw.core.dtype_max(torch.complex64) == torch.finfo(torch.float32).max


class ComplexHead(nn.Module):
    """A spectral head: complex outputs whose components a gain sets (|z| = sqrt(2) x)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) * self.gain
        return torch.complex(y, y)


@pytest.mark.parametrize("component", [1e38, 3e38])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_complex_output_near_its_components_limit_is_warned_about_in_every_mode(mode, component):
    # Full mode gave complex outputs no near-limit zone (only sentinel warned), and |z| past
    # float32's largest (both components finite) would have read as a mask written on purpose.
    torch.manual_seed(0)
    model, x = ComplexHead(), torch.ones(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nw.watch(model, mode=mode, on_nan="record") as w:
            for _ in range(3):
                model(x)
            with torch.no_grad():
                model.gain = component / model.fc(x).abs().max().item()
            out = model(x)
            assert torch.view_as_real(out).isfinite().all()
            assert w.event is None
            assert [(x.module, x.reason) for x in w.warnings] == [("", "near-limit")]
    said = [str(x.message) for x in caught if issubclass(x.category, nw.EarlyWarningIssued)]
    assert len(said) == 1 and "3.40282e+38" in said[0]
    if mode == "full":
        assert "(complex64)" in said[0] and "the largest complex64 component" in said[0]


class BodyAndRouter(nn.Module):
    """Returns its body's output and its router's logits, as a mixture of experts returns
    router logits beside its hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.router = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.body(x), self.router(x)


def test_a_growth_warning_names_the_module_that_made_the_tensor_its_container_returns():
    # The model's abs max rose three times (its body's output twice, then the router's logits
    # jumping 1e10-fold), the router's own output only once: the warning named the model and
    # its "output[1]", not the router that made those logits (fp16 Mixtral's router_logits).
    torch.manual_seed(0)
    model, x = BodyAndRouter(), torch.ones(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw.watch(model, on_nan="record") as w, torch.no_grad():
            for batch in range(4):
                if batch:
                    model.body.weight.mul_(2.0)
                    model.body.bias.mul_(2.0)
                if batch == 3:
                    gain = 1e10 / model.router(x).abs().max().item()
                    model.router.weight.mul_(gain)
                    model.router.bias.mul_(gain)
                model(x)
            assert [(x.module, x.role, x.reason) for x in w.warnings] == \
                [("router", "output", "growth")]
            assert w.warnings[0].abs_max == pytest.approx(1e10, rel=1e-3)


class SumOverPositions(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=1)


def test_a_container_handing_on_its_last_layers_output_warns_once_through_it():
    # The model's output is its head's, near float16's limit for several batches: the head
    # warned, and then the model (named by the head, its maker) warned again every batch
    # (notebooks/08_why_nan.ipynb's pooled model).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), SumOverPositions(),
                          nn.Linear(64, 4)).half().eval()
    signal = torch.randn(8, 512, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model, on_nan="record") as w, torch.no_grad():
            for batch in range(20):
                model((signal * 1.5 ** batch).half())
                if w.event:
                    break
    assert [(x.module, x.reason) for x in w.warnings] == [("3", "near-limit"),
                                                          ("2", "near-limit")]


class ScaledLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = 1.0

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        return out.square().mean() * self.gain


class HoldsAGrowingLoss(nn.Module):
    """A model holding its loss as a submodule, run on its output after the forward (a hand
    loop's ``loss = model.loss(model(x))``); the loss's gain grows, the model's outputs do not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.loss = ScaledLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_loss_the_model_holds_growing_is_warned_about_in_its_own_batch():
    # Its frames come after the forward ended the batch: they were looked at with the next
    # batch's (a batch late), and then, filed under their own batch, not at all.
    torch.manual_seed(0)
    model = HoldsAGrowingLoss()
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model, on_nan="record") as watched:
            for _ in range(8):
                model.loss(model(x))
                model.loss.gain *= 10.0
    growth = [w for w in watched.warnings if w.reason == "growth"]
    assert [(w.module, w.batch) for w in growth] == [("loss", 3)]
    assert growth[0].growth_per_batch == pytest.approx(10.0, rel=0.01)


# ---------------------------------------------------------------------------- healthy shapes
# Shapes of healthy training the runs above do not have, each of which was warned about.
class Denoiser(nn.Module):
    """A diffusion model's denoiser: noisy sample and its noise level in, the noise out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(17, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(),
                                 nn.Linear(64, 16))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, sigma.log()[:, None] / 4], 1))


def _denoiser_run(dtype: torch.dtype, steps: int, peak_lr: float | None = None, **options):
    """A denoiser trained at one random noise level per batch (sigma log-uniform from 0.002 to
    80, as EDM samples it, added to the data unscaled): its inputs' scale changes 40000-fold
    from batch to batch. Adam at 1e-3, or with ``peak_lr`` SGD ramped up to it (diverging)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = Denoiser().to(dtype)
    data = torch.randn(512, 16, generator=generator) @ torch.randn(16, 16, generator=generator)
    if peak_lr is None:
        optimizer = torch.optim.Adam(model.parameters(), 1e-3, eps=1e-4)
    else:
        optimizer = torch.optim.SGD(model.parameters(), 0.0, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(model, on_nan="record", **options) as watched:
            for step in range(steps):
                if peak_lr is not None:
                    optimizer.param_groups[0]["lr"] = _ramped_lr(peak_lr)(step)
                clean = data[torch.randint(0, 512, (64,), generator=generator)] * 0.5
                sigma = torch.empty(1).uniform_(math.log(0.002), math.log(80),
                                                generator=generator).exp().expand(64)
                noise = torch.randn(clean.shape, generator=generator)
                out = model((clean + sigma[:, None] * noise).to(dtype), sigma.to(dtype))
                loss = nn.functional.mse_loss(out.float(), noise)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if watched.events:
                    break
    return watched


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_inputs_whose_scale_varies_per_batch_are_no_growth(mode):
    # Three batches in a row at rising noise levels took the first layer from a low batch back
    # up towards where it had been: 4.55, 5.06, 19.3, 87.3 right after 156, read "output of
    # 'net.0' (float16) grows 3.2x per batch (abs max 87.3); at that rate it passes float16's
    # largest 65504 in about 6 batches" at batch 35. Growth counts from the recent high.
    options = {"mode": "sentinel", "sample_every": 5} if mode == "sentinel" else {}
    watched = _denoiser_run(torch.float16, 100, **options)
    assert watched.events == [] and watched.warnings == []


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_denoiser_diverging_is_still_warned_about(mode):
    options = {"mode": "sentinel", "sample_every": 5} if mode == "sentinel" else {}
    watched = _denoiser_run(torch.float32, 100, peak_lr=1.0, **options)
    assert watched.event is not None, "the run must fail for this test to mean anything"
    first = watched.warnings[0]
    assert first.reason == "growth" and first.batch <= watched.event.batch - 2


def _pretrained_trunk(generator: torch.Generator) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """An MLP trunk trained on a classification task (unwatched), its last layer scaled 4x:
    features of abs max 20-50 for a fresh head."""
    teacher = torch.randn(32, 10, generator=generator)
    x = torch.randn(4000, 32, generator=generator)
    y = (x @ teacher).argmax(1)
    trunk = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
    head = nn.Linear(256, 10)
    optimizer = torch.optim.Adam([*trunk.parameters(), *head.parameters()], 1e-3)
    for _ in range(200):
        rows = torch.randint(0, 4000, (128,), generator=generator)
        loss = nn.functional.cross_entropy(head(trunk(x[rows])), y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        trunk[2].weight *= 4
    return trunk, x, y


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_fresh_head_sharpening_and_levelling_off_is_no_growth(mode):
    # Fine-tuning a float16 model from a fresh head (SGD with momentum): its logits jumped from
    # 12 to 184 in the first step, then 313, 360, 442 and settled: "grows 2.29x per batch (abs
    # max 360); at that rate it passes float16's largest 65504 in about 6 batches". A run
    # slowing down grows no faster than its latest rises.
    options = {"mode": "sentinel", "sample_every": 5} if mode == "sentinel" else {}
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    trunk, x, y = _pretrained_trunk(generator)
    model = nn.Sequential(trunk, nn.Linear(256, 10)).half()
    batches = []
    for _ in range(12):
        rows = torch.randint(0, 4000, (64,), generator=generator)
        batches.append((x[rows].half(), (y[rows] + 3) % 10))  # a new task on the same inputs
    watched, issued = _train(model, torch.optim.SGD(model.parameters(), 0.05, momentum=0.9),
                             batches, lambda out, y: nn.functional.cross_entropy(out.float(), y),
                             12, **options)
    assert watched.events == [] and watched.warnings == [] and issued == []


class LayerScale(nn.Module):
    """A learnt per-channel gain (as in CaiT and DINOv2), initialised at 1e-6."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((width,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class LayerScaleBlock(nn.Module):
    """A pre-norm residual MLP block whose branch is scaled by a LayerScale."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.gain = LayerScale(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain(self.mlp(self.norm(x)))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_layerscale_gains_leaving_their_small_initialisation_are_no_growth(mode):
    # float16, AdamW at 1e-2. As the gains grow out of 1e-6 the gained branches jump, then
    # level off: the first went 8.9e-7, 0.38, 8.32, 16, 18.7, 20 ("grows 6.45x per batch (abs
    # max 16); at that rate it passes float16's largest 65504 in about 4 batches" at batch 3):
    # a run slowing down is levelling off. The fifth went 7.2e-7, 0.29, 2.45, 7.63, then 5.77
    # ("3.11x per batch" once the first rule held), still rising 3x at batch 3: a run that
    # begins below 1/16 counts its rises from its first value above it, as one from zero does.
    options = {"mode": "sentinel", "sample_every": 5} if mode == "sentinel" else {}
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 10, generator=generator)
    model = nn.Sequential(nn.Linear(16, 48), *[LayerScaleBlock(48) for _ in range(6)],
                          nn.Linear(48, 10)).half()
    batches = []
    for _ in range(20):
        x = torch.randn(64, 16, generator=generator)
        batches.append((x.half(), (x @ teacher).argmax(1)))
    watched, issued = _train(model, torch.optim.AdamW(model.parameters(), 1e-2, eps=1e-4),
                             batches, lambda out, y: nn.functional.cross_entropy(out.float(), y),
                             20, **options)
    assert watched.events == [] and watched.warnings == [] and issued == []


# ---------------------------------------------------------------------------- by optimizer step
class _GaussianPolicy(nn.Module):
    """A policy as RL libraries hold one: ``forward(obs)`` samples actions from a Gaussian
    whose log_std is a parameter (each rollout step calls it); the update reads the mean and
    the entropy without calling ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        self.log_std = nn.Parameter(torch.zeros(2))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.mean(obs) + self.log_std.exp() * torch.randn(obs.shape[0], 2)

    def entropy(self) -> torch.Tensor:
        return self.log_std.sum()  # a Gaussian's, up to a constant


def _rollouts_then_updates(lr: float, ent_coef: float, updates: int, forwards: int = 16,
                           **options) -> tuple[nw.NanWatch, list[str]]:
    """``forwards`` rollout calls of the policy (evaluation mode, no grad) per optimizer step,
    then one update: a regression of the mean and an entropy bonus (Adam moves log_std by
    about ``lr`` per step when the bonus dominates). The watch, and the early warnings issued
    as Python warnings."""
    torch.manual_seed(0)
    policy = _GaussianPolicy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    obs, target = torch.randn(forwards, 8, 4), torch.randn(8, 2)
    with warnings.catch_warnings(record=True) as issued:
        warnings.simplefilter("always")
        with nw.watch(policy, on_nan="record", **options) as w:
            for _ in range(updates):
                policy.eval()
                with torch.no_grad():
                    for t in range(forwards):
                        policy(obs[t])
                if w.event:
                    break
                policy.train()
                loss = nn.functional.mse_loss(policy.mean(obs[0]), target) \
                    - ent_coef * policy.entropy()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    return w, [str(x.message) for x in issued if issubclass(x.category, nw.EarlyWarningIssued)]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_growth_over_optimizer_steps_many_forwards_apart_is_warned_about(mode):
    # An entropy bonus far too large at lr=2: Adam raises log_std by 2 per step, the sampled
    # actions grow 7.4x per step until they overflow. With 16 rollout forwards per step that
    # is 1.13x per batch, and the actions rise once per 16 batches: it was never warned about.
    w, issued = _rollouts_then_updates(lr=2.0, ent_coef=1.0, updates=100, mode=mode)
    assert w.event is not None and w.event.module == ""
    growth = [warning for warning in w.warnings if warning.reason == "growth"]
    assert [(g.module, g.per) for g in growth] == [("", "optimizer step")]
    warning = growth[0]
    assert w.event.batch - warning.batch > 35 * 16  # 35 steps or more before the overflow
    assert 5 < warning.growth_per_batch < 11
    assert "per optimizer step" in str(warning) and "optimizer steps" in str(warning)
    assert issued == [f"nanwidget: {x}" for x in w.warnings]  # each issued once as well


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_healthy_updates_many_forwards_apart_are_quiet(mode):
    w, issued = _rollouts_then_updates(lr=1e-2, ent_coef=0.01, updates=100, mode=mode)
    assert w.event is None and w.warnings == [] and issued == []


def test_a_step_per_batch_is_counted_by_batch_as_before():
    w, _ = _mlp_learning_rate_blowup()
    assert w.warnings and all(warning.per == "batch" for warning in w.warnings)


@pytest.mark.parametrize("apart", [FOLD_BATCHES - 1, FOLD_BATCHES])
def test_steps_a_few_forwards_apart_are_not_folded(apart):
    # A loop with a few forwards per step (gradient accumulation, a GAN's passes) pays no fold
    # at its steps: only steps FOLD_BATCHES forwards apart or more are counted by step.
    torch.manual_seed(0)
    policy = _GaussianPolicy()
    obs = torch.randn(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(policy) as w:
            optimizer = torch.optim.SGD([policy.log_std], lr=2.0)
            for _ in range(8):
                for _ in range(apart):
                    policy(obs)
                optimizer.zero_grad()
                (-policy.entropy()).backward()
                optimizer.step()
    by_step = [warning for warning in w.warnings if warning.per == "optimizer step"]
    assert bool(by_step) == (apart >= FOLD_BATCHES)


def test_a_recording_keeps_the_count_by_optimizer_step_and_older_ones_read_by_batch(tmp_path):
    torch.manual_seed(0)
    policy = _GaussianPolicy()
    obs = torch.randn(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nw.EarlyWarningIssued)
        with nw.watch(policy, log_dir=tmp_path) as w:
            optimizer = torch.optim.SGD([policy.log_std], lr=2.0)
            for _ in range(8):
                for _ in range(8):  # steps 8 forwards apart (FOLD_BATCHES)
                    policy(obs)
                optimizer.zero_grad()
                (-policy.entropy()).backward()
                optimizer.step()
    assert [warning.per for warning in w.warnings] == ["optimizer step"]
    assert [str(x) for x in load_run(tmp_path).warnings] == [str(x) for x in w.warnings]
    path = next(tmp_path.rglob("warnings.json"))
    data = json.loads(path.read_text())
    del data["warnings"][0]["per"]  # written before the field existed
    path.write_text(json.dumps(data))
    assert [x.per for x in load_run(tmp_path).warnings] == ["batch"]
    data["warnings"][0]["per"] = "epoch"
    path.write_text(json.dumps(data))
    with pytest.raises(RunLoadError, match="per"):
        load_run(tmp_path)
