"""The diagnosis as a feature of the watch: a little bookkeeping per batch, the work at events.

Per batch (under the recorder's lock, never in a module hook): the weights' numbers of the
frames the watch recorded anyway go into a :class:`~.facts.WeightLog` (one float per batch,
and per module its first and last finite measurement). At an event (outside the lock, after
the replay and the sentinel attached their traces, before the consensus tells the other ranks
and the recording writes it): the facts are gathered and :func:`~.rules.diagnose` sets
``event.diagnosis``. In full mode an event without a trace gets one replay of its batch for
the diagnosis alone (the op and its line; not attached to the event), at most
:data:`MAX_DIAGNOSIS_REPLAYS` per watch. In sentinel mode, which records few batches or none
in full, each parameter's min and max are taken once when the watch begins (on its device, no
host read; about 35 ms per 100M parameters on one CPU thread) and read at an event only: the
start of a climb of the weights no batch measured.
"""

from __future__ import annotations

import math
import re
import sys
import weakref
from typing import Any, Callable

import pandas as pd
import torch
from torch import nn

from ..detect import additive_mask
from ..entries import Entry
from ..events import (LOSS_ROLE, NO_WEIGHTS_SEEN, NOT_REPLAYED, REPEATED_NOTES,
                      SCALER_IN_THE_LOOP, UNREAD_WEIGHTS, UNVERIFIED_NOTES, Diagnosis, NanEvent,
                      gradient_only_reduced, weights_unchecked)
from ..opaque import holds_packed_weights, packed_weights
from ..frames import Frame, weights_finite_last, weights_nonfinite_batches
from ..loads import LoadLog
from ..ranks import world_size
from ..recorder import Feature, ModuleInfo, Recorder
from ..schema import PACKED
from ..stats import (PLAIN_TENSOR_TYPES, functorch_unwrapped, is_distributed_tensor, local_shard,
                     storage_holds,
                     stood_for, version_of, vmapped_samples)
from ..writes import (last_step_writing, marks_kept_from, nonfinite_lr_in_step,
                      nonfinite_lr_step, optimizer_state_nonfinite, optimizers_holding,
                      optimizers_stepped, param_group_of, step_in_progress,
                      stepping_optimizer, steps_taken, written_since)
from . import fixes
from .facts import (HISTORY_BATCHES, Facts, LossTold, WeightLog, describe_input, op_facts,
                    output_grad_bad, packed_samples, weight_names)
from .rules import diagnose

__all__ = ["Diagnoser", "MAX_DIAGNOSIS_REPLAYS"]

MAX_DIAGNOSIS_REPLAYS = 4  # a diverged run makes an event per batch


def _sample_in_list(role: str, lists: dict[str, int]) -> tuple[str, int, str] | None:
    """(list, index, part) when ``role`` is a tensor inside one entry of a per-sample list
    input: ``input[1][0].boxes`` -> ("input[1]", 0, ".boxes"), ``input[0][1]`` ->
    ("input[0]", 1, ""); None otherwise."""
    for parent in lists:
        if not role.startswith(parent + "["):
            continue
        index, closed, part = role[len(parent) + 1:].partition("]")
        if closed and index.isdigit() and int(index) < lists[parent] \
                and (not part or part[0] in ".["):
            return parent, int(index), part
    return None


def _root_grad_bad(frames: Any, batch: int, root: str) -> bool | None:
    """:func:`~.facts.output_grad_bad` over a frames DataFrame."""
    if not isinstance(frames, pd.DataFrame) or frames.empty:
        return None
    rows = frames[(frames["module"] == root) & (frames["phase"] == "backward")
                  & (frames["batch"] == batch) & frames["role"].str.startswith("grad_output")]
    if rows.empty:
        return None
    return bool((rows["nan"] | rows["inf"]).any())


def _born_in_backward(trace: Any) -> bool:
    """Whether a replay's first bad op ran in the backward pass (an op of the model's own
    backward made the NaN that reached an output it also used inside)."""
    first = getattr(trace, "first_bad", None)
    return first is not None and first.get("phase") == "backward"


def _finite_in_earlier_call(event: NanEvent, names: list[str]) -> dict[str, int]:
    """Per weight of ``names``: the last earlier call of its module in the event's batch whose
    forward frame (in the event's window) measured it finite."""
    frames = event.frames
    if frames is None or frames.empty or event.is_backward:
        return {}
    rows = frames[(frames["batch"] == event.batch) & (frames["phase"] == "forward")]
    found = {}
    for name in names:
        module, _, role = name.rpartition(".")
        if module != event.module:
            continue
        own = rows[(rows["module"] == module) & (rows["role"] == role) & (rows["call"] < event.call)
                   & ~rows["nan"] & ~rows["inf"] & rows["abs_max"].notna()]
        if not own.empty:
            found[name] = int(own["call"].max())
    return found


_PASS_THE_SCALER_FIX = (
    "A GradScaler is among the training loop's variables: if it scales this loss (its scale "
    "starts at 65536), pass it: nw.watch(model, grad_scaler=scaler). Its scaled gradients "
    "overflow float16 now and then on purpose, and it skips those steps: with it the watch "
    "does too, and lists them in w.scaler_skips.")
# How the event's note names it, as the loop's variable (grad_scaler=fabric, =accelerator).
_PASSED_AS = re.compile(r"grad_scaler=(?!model\.optimizer)[A-Za-z_][A-Za-z0-9_]*")


_STACK_DEPTH = 60  # caller frames searched for a training wrapper
# Roles of inputs that hold state the model carried over from its previous call: a KV cache
# (transformers' cache=, past_key_values=, a Cache object's layers), a recurrent hidden state.
# Not a bare "state": an RL policy's state is its observation, data.
_CARRIED_STATE = re.compile(r"cache|past_key|past\b|hidden|(ssm|conv|recurrent|rnn)_?states?"
                            r"|mems\b|kwarg:(h|hx|h0)\b", re.IGNORECASE)


def _made_outside_forward(event: NanEvent, inputs: list[Any]) -> bool:
    """Whether ``event`` is a weight's whose module did not run in its replayed forward,
    while that forward's inputs held NaN/Inf (see :attr:`~.facts.Facts.made_outside_forward`)."""
    if event.origin != "weight" or event.is_backward or not any(i.nan or i.inf for i in inputs):
        return False
    frames = getattr(event.trace, "frames", None)
    if not isinstance(frames, pd.DataFrame) or frames.empty:
        return False
    ran = frames.loc[frames["phase"] == "forward", "module"]
    return not (ran == event.module).any()


def _wrapper_of(value: Any) -> str:
    """"fabric" for Lightning Fabric's ``Fabric`` or the ``_FabricModule`` that
    ``fabric.setup`` made, "skorch" for a skorch net (it holds its ``module_``), "sb3" for a
    Stable-Baselines3 algorithm (PPO, SAC, ...: it holds its ``policy`` and ``env``), "trainer"
    for transformers' ``Trainer`` (or a subclass: TRL's, Seq2SeqTrainer) that holds its
    ``args`` ("st-trainer" for sentence-transformers' ``SentenceTransformerTrainer``),
    "lightning" for Lightning's ``Trainer`` (it holds its ``fit_loop``), "timm" for timm's
    ``NativeScaler`` (it holds its GradScaler as ``_scaler``: the loop calls it for the
    backward, the clipping and the step), else ""; told by class and module name, nothing
    imported or called."""
    kind = type(value)
    if kind.__name__ in ("Fabric", "_FabricModule"):
        return "fabric" if "_strategy" in vars(value) else ""
    module = str(kind.__module__)
    if module.startswith("skorch.") and "module_" in vars(value):
        return "skorch"
    if module.startswith("timm.") and kind.__name__ == "NativeScaler" \
            and "_scaler" in vars(value):
        return "timm"
    if module.startswith("stable_baselines3.") and "policy" in vars(value) \
            and "env" in vars(value):
        return "sb3"
    if any(base.__name__ == "Trainer" and base.__module__ == "transformers.trainer"
           for base in kind.__mro__) and "args" in vars(value):
        # sentence-transformers' SentenceTransformerTrainer (or a subclass of it): its loss is
        # a module given as loss=, which runs the model inside its forward.
        return "st-trainer" if any(str(base.__module__).startswith("sentence_transformers.")
                                   for base in kind.__mro__) else "trainer"
    if any(base.__name__ == "Trainer" and base.__module__ in _LIGHTNING_TRAINERS
           for base in kind.__mro__) and "fit_loop" in vars(value):
        return "lightning"
    return ""


# Where Lightning's Trainer is defined (the lightning package, and its older standalone name).
_LIGHTNING_TRAINERS = ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer")


def _wrapper_clipping(wrapper: str, holder: Any) -> tuple[str, float | None]:
    """(``wrapper``, the norm or value it clips the gradients by, None when it does not) for the
    wrapper object ``holder`` found running the model: transformers' Trainer clips by its
    ``args.max_grad_norm`` (1.0 by default); Lightning's by ``gradient_clip_val`` (None by
    default), and not at all under manual optimization, where the wrapper is told
    "lightning-manual"."""
    state = vars(holder)
    if wrapper in ("trainer", "st-trainer", "st-fit"):
        clip = getattr(state.get("args"), "max_grad_norm", None)
    elif wrapper == "lightning":
        module = getattr(getattr(holder, "strategy", None), "lightning_module", None)
        if module is not None and getattr(module, "automatic_optimization", True) is False:
            return "lightning-manual", None
        clip = state.get("gradient_clip_val")
    else:
        clip = None
    return wrapper, (float(clip) if isinstance(clip, (int, float)) else None)


def _is_dp_optimizer(value: Any) -> bool:
    """Whether ``value`` is an Opacus ``DPOptimizer`` (or a subclass: the per-layer, AdaClip
    and distributed ones): it wraps ``original_optimizer`` and clips per sample by
    ``max_grad_norm``; told by class module and attributes, nothing imported."""
    try:
        return str(type(value).__module__).startswith("opacus.") \
            and "original_optimizer" in vars(value) and "max_grad_norm" in vars(value)
    except TypeError:  # no __dict__
        return False


def _trains_with_watch_callback(holder: Any) -> bool:
    """Whether the wrapper object ``holder`` (Lightning's Trainer: ``callbacks``; transformers'
    Trainer: ``callback_handler.callbacks``) holds nanwidget's ``NanWatchCallback``; told by
    class and module name, nothing imported."""
    callbacks = getattr(holder, "callbacks", None)
    if not isinstance(callbacks, (list, tuple)):
        callbacks = getattr(getattr(holder, "callback_handler", None), "callbacks", None)
    if not isinstance(callbacks, (list, tuple)):
        return False
    return any(type(callback).__name__ == "NanWatchCallback"
               and type(callback).__module__.startswith("nanwidget.") for callback in callbacks)


def _running_wrapper() -> tuple[str, Any]:
    """The training wrapper that runs the model in this forward or backward pass, found on
    the stack (see :func:`_wrapper_of`): the innermost one, and the object; ("", None) for
    none."""
    frame = sys._getframe(1)
    for depth in range(_STACK_DEPTH):
        if frame is None:
            return "", None
        for value in list(frame.f_locals.values()):
            try:
                wrapper = _wrapper_of(value)
            except Exception:  # no __dict__, an odd object: no wrapper's
                continue
            if wrapper == "st-trainer" and _made_by_fit(frame, value, _STACK_DEPTH - depth):
                return "st-fit", value
            if wrapper:
                return wrapper, value
        frame = frame.f_back
    return "", None


def _made_by_fit(frame: Any, trainer: Any, depth: int) -> bool:
    """Whether ``trainer`` (a ``SentenceTransformerTrainer``) is the one sentence-transformers'
    legacy ``model.fit(train_objectives=...)`` made and runs: a ``fit`` of that package on the
    stack above ``frame`` holds it as ``trainer``. Its user sets ``fit``'s keywords
    (``optimizer_params``, ``warmup_steps``, ``max_grad_norm``, ``use_amp``), not
    ``TrainingArguments``."""
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "fit" \
                and str(frame.f_globals.get("__name__", "")).startswith("sentence_transformers.") \
                and frame.f_locals.get("trainer") is trainer:
            return True
        frame = frame.f_back
    return False


def _abs_max_per_module(recorder: Recorder) -> list[tuple[str, list[torch.Tensor]]]:
    """(module, its own parameters' min and max as 0-dim tensors on their devices) for every
    watched module with parameters holding values now: no host read (no wait for a device);
    parameters without values (lazy, on the meta device, freed by FSDP) are left out, and a
    DTensor is measured on this rank's shard. Empty when something refuses."""
    measured = []
    try:
        with torch.no_grad():
            for info in recorder.modules:
                if not info.has_state:
                    continue
                values = []
                for tensor in info.module.parameters(recurse=False):
                    if isinstance(tensor, nn.parameter.UninitializedParameter):
                        continue
                    tensor = local_shard(functorch_unwrapped(stood_for(tensor)).detach())
                    if tensor.numel() and tensor.is_floating_point() and not tensor.is_meta \
                            and storage_holds(tensor):
                        try:
                            values.extend(torch.aminmax(tensor))  # 10x vector_norm's speed
                        except RuntimeError:  # a dtype without it (float8): left out
                            continue
                if values:
                    measured.append((info.name, values))
    except Exception:  # only evidence for a diagnosis: go without it
        return []
    return measured


def _read_abs_max(measured: list[tuple[str, list[torch.Tensor]]]) -> dict[str, float]:
    """Module -> the largest of its measured values, for the modules whose values were all
    finite (read at an event only)."""
    read = {}
    for name, values in measured:
        numbers = [abs(float(value)) for value in values]
        if all(math.isfinite(number) for number in numbers):
            read[name] = max(numbers)
    return read


class Diagnoser(Feature):
    """Sets ``event.diagnosis`` on every event of a watch (see the module docstring).

    ``capture``: the watch's :class:`~nanwidget.core.replay.capture.BatchCapture` (the held
    batches' inputs and weight versions), or None. ``replay``: makes a trace of an event's
    batch, or None when it cannot (full mode; None in sentinel mode, whose events carry theirs).
    ``loss_fn``: the watch has one, so a replay of a gradient made in the loss names its op.
    ``sample_every``: sentinel mode's (what the diagnosis says it could not check).
    ``scaler_run``: with a GradScaler, the skipped steps behind an event of its
    ``scaler_patience``-th skip in a row (None for any other event).
    ``checks_gradients``: the watch checks every backward pass's gradients (``backward=True``);
    ``backward_passes``: how many it checked so far (None: not counted).
    """

    reviews_without_event = False  # its review only adds to an event

    def __init__(self, recorder: Recorder, *, capture: Any = None,
                 replay: Callable[[NanEvent], Any] | None = None, sentinel: bool = False,
                 loss_fn: bool = False, sample_every: int | None = None,
                 scaler_run: Callable[[NanEvent], Any] | None = None,
                 unreplayable: Callable[[], str] | None = None,
                 checks_gradients: bool = False,
                 backward_passes: Callable[[], int] | None = None) -> None:
        self.recorder = recorder
        self.checks_gradients = checks_gradients
        self.backward_passes = backward_passes
        # Optimizer steps seen before this watch began: a parameter no step marked since is
        # one no optimizer step wrote while it watched.
        self.steps_at_start = steps_taken()
        # Why this process alone cannot replay the model ("" when it can): then the
        # suggestions name what to do instead of a replay that would be refused.
        self.unreplayable = unreplayable
        self.capture = capture
        self.replay = replay
        self.sentinel = sentinel
        self.sample_every = sample_every
        self.loss_fn = loss_fn
        self.scaler_run = scaler_run
        self.weights = WeightLog(is_buffer=recorder.is_buffer)
        # Sentinel mode records no weights per batch: their abs max now, when the watch begins
        # (a min and a max per parameter, on its device, read at an event only), is where a
        # climb through the optimizer steps starts (rules._growth_since_start).
        self._at_start = _abs_max_per_module(recorder) if sentinel else []
        # The loads of the model's state while watched (load_state_dict, DCP's set_*_state_dict)
        self.loads = LoadLog(recorder.model, lambda: recorder.batch)
        # The modules that keep weights without being called, and those weights' entries
        # queued for the batch running now (see on_batch_output).
        self._holders: list[ModuleInfo] = []
        self._holders_of: tuple[int, int] | None = None
        self._held: list[tuple[str, list[Entry]]] = []
        self.replays = 0
        self._resolved: list[Frame] = []  # the frames last resolved within a batch (backward)
        # (earlier event, weight names) -> what its window says (see _finite_in_window).
        self._window_findings: dict[tuple[int, frozenset], tuple[NanEvent, dict[str, int]]] = {}
        # Parameter name -> (its .grad weakly, storage, version, the event that explains it),
        # for the gradients non-finite when the last backward event's pass ended.
        self._bad_grads: dict[str, tuple[Any, int, int, NanEvent]] = {}

    # ------------------------------------------------------------------ per batch (under the lock)
    def on_batch_output(self, batch: int, output: Any) -> None:
        # Weights kept by a module that is never called (a ParameterDict the forward reads
        # from; Keras keeps every weight in one): no frame measures them, so they are queued
        # here, with the batch's frames, in the batches recorded in full; from the weight
        # cache, that is read again only once they changed.
        holders = self._weight_holders()
        if holders and self.recorder.module_hooks_attached:
            builder = self.recorder.entries
            self._held = []
            for info in holders:
                entries: list[Entry] = []
                builder.weight_entries(info.weights, entries)
                self._held.append((info.name, entries))

    def on_batch_end(self, batch: int, frames: list[Frame]) -> None:
        held, self._held = self._held, []
        if frames or held:
            self.weights.take(frames, held, batch)

    def _weight_holders(self) -> list[ModuleInfo]:
        """The watched modules that keep weights but cannot be called: their class has no
        forward of its own (``ParameterDict``, ``ParameterList``, a plain holder). Found again
        only when the watched modules change."""
        modules = self.recorder.modules
        key = (id(modules), len(modules))
        if self._holders_of != key:
            self._holders_of = key
            self._holders = [info for info in modules
                             if info.has_state and not info.is_root and info.has_no_forward]
        return self._holders

    def on_frames_replayed(self, frames: list[Frame]) -> None:
        batch = frames[0].batch if frames else -1  # one group: one batch
        self.weights.take(frames, self._holders_as_batch_ran(batch), batch)

    def _holders_as_batch_ran(self, batch: int) -> list[tuple[str, list[Entry]]]:
        """(module, its weight entries) of the modules that keep weights but are never
        called, measured now, when none of their weights was written since held ``batch``
        started (version counters): a replay's frames never measure them, and sentinel mode
        records no other batch of theirs (a torchrl loss keeps every weight in such a module).
        Empty when that cannot be told. Replays only."""
        holders = self._weight_holders()
        if not holders or self.capture is None:
            return []
        versions = {name: version for name, version, _ in self.capture.held_weights(batch)}
        if not versions:
            return []
        held = []
        for info in holders:
            tensors = [(f"{info.name}.{key}", tensor)
                       for group in (info.weights._parameters, info.weights._buffers)
                       for key, tensor in group.items() if tensor is not None]
            if any(versions.get(name) != version_of(tensor) for name, tensor in tensors):
                continue  # written since that batch ran: its values now are not the batch's
            entries: list[Entry] = []
            self.recorder.entries.weight_entries(info.weights, entries)
            held.append((info.name, entries))
        return held

    def on_frames_resolved(self, frames: list[Frame]) -> None:
        self._resolved = frames

    # ------------------------------------------------------------------ at an event
    def review_event(self, batch: int, event: NanEvent | None, reason: str) -> NanEvent | None:
        if event is not None and event.diagnosis is None:
            event.diagnosis = self.diagnose(event, may_replay=True)
        return event

    def on_event(self, event: NanEvent) -> None:
        # Events recorded without a review (at close(), after an interrupted forward).
        if event.diagnosis is None:
            event.diagnosis = self.diagnose(event, may_replay=False)

    def diagnose(self, event: NanEvent, *, may_replay: bool = False,
                 loss_told: LossTold | None = None) -> Diagnosis:
        """The diagnosis of ``event``; never raises (a failure is an "unknown" that says so).
        ``loss_told``: what a loss computed outside the model told of itself (its function,
        its targets), for a loss event made by ``NanWatch.explain_loss``."""
        try:
            facts = self.facts(event, may_replay=may_replay)
            facts.loss_told = loss_told
            if facts.weights_unseen:  # the event's own words must not claim them finite
                event.note = f"{event.note}; {facts.unseen_note}" if event.note \
                    else facts.unseen_note
            held = self.capture is not None and event.batch in self.capture.held_batches()
            diagnosis = diagnose(facts, replayable=held and not facts.replay_refused)
            if SCALER_IN_THE_LOOP in event.note and diagnosis.kind in ("overflow", "loss"):
                # An Inf gradient with a GradScaler in the loop the watch was not told of: most
                # likely its loss scale (65536 at first); that first, before scaling the loss or
                # its targets down or naming the loss's op.
                holder = _PASSED_AS.search(event.note)
                diagnosis.suggestion.insert(0, _PASS_THE_SCALER_FIX.replace(
                    "grad_scaler=scaler", holder.group(0) if holder else "grad_scaler=scaler"))
            wrapper, holder = _running_wrapper()
            if wrapper:
                # The Trainer clips by default (max_grad_norm=1.0), Lightning's when told
                # (gradient_clip_val=): its fixes say so.
                wrapper, clip = _wrapper_clipping(wrapper, holder)
                diagnosis.suggestion = fixes.in_wrapper_terms(diagnosis.suggestion, wrapper, clip)
                if _trains_with_watch_callback(holder):
                    diagnosis.suggestion = fixes.without_watch_callback(diagnosis.suggestion)
            elif diagnosis.kind == "divergence":
                cycle = self._one_cycle()
                if cycle is not None:
                    diagnosis.suggestion = fixes.with_one_cycle(diagnosis.suggestion, *cycle)
            if not self._reduced_precision(facts):
                diagnosis.suggestion = fixes.in_full_precision(diagnosis.suggestion)
            if any("clip_grad_norm_" in text for text in diagnosis.suggestion):
                private = self._dp_optimizer()
                if private is not None:
                    diagnosis.suggestion = fixes.in_dp_terms(
                        diagnosis.suggestion, diagnosis.kind, *private)
            return diagnosis
        except Exception as error:
            self.recorder.internal_error(error)
            return Diagnosis("unknown", f"The diagnosis failed ({type(error).__name__}: {error}).",
                             confidence="low")

    def _reduced_precision(self, facts: Facts) -> bool:
        """Whether float16, bfloat16 or a float8 may be in play where ``facts.event`` was made:
        in its frames, its replay's ops or the watched weights, under autocast, with a
        GradScaler or an FSDP2 MixedPrecisionPolicy. An event without frames (sentinel mode's,
        not replayed) is told by the weights alone."""
        event = facts.event
        if facts.policy_dtype or self.scaler_run is not None or SCALER_IN_THE_LOOP in event.note:
            return True
        frames = event.frames
        dtypes = set(frames["dtype"].dropna().astype(str).unique()) \
            if isinstance(frames, pd.DataFrame) and "dtype" in frames.columns else set()
        ops = getattr(facts.trace, "ops", None)
        if isinstance(ops, pd.DataFrame) and "dtype" in ops.columns:
            dtypes.update(ops["dtype"].dropna().astype(str).unique())
        for info in self.recorder.modules:
            try:
                dtypes.update(str(p.dtype).replace("torch.", "")
                              for p in info.weights.parameters(recurse=False))
            except Exception:  # a container that cannot list them (TorchScript)
                continue
        if any(d in ("float16", "bfloat16") or d.startswith("float8") for d in dtypes):
            return True
        try:
            return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))
        except Exception:  # an older torch without the device argument
            return torch.is_autocast_enabled()

    def _dp_optimizer(self) -> tuple[float | None, float | None] | None:
        """(max_grad_norm, noise_multiplier) of the Opacus ``DPOptimizer`` that trains the
        model, found on the stack (the training loop's variable), or (None, None) when only the
        model's parameters tell (a DPOptimizer marks each with ``summed_grad``); None without
        one. Told by class module and attributes, nothing imported."""
        frame = sys._getframe(1)
        for _ in range(_STACK_DEPTH):
            if frame is None:
                break
            for value in list(frame.f_locals.values()):
                if _is_dp_optimizer(value):
                    norm, noise = value.max_grad_norm, value.noise_multiplier
                    return (float(norm) if isinstance(norm, (int, float)) else None,
                            float(noise) if isinstance(noise, (int, float)) else None)
            frame = frame.f_back
        for info in self.recorder.modules:
            try:
                if any(hasattr(p, "summed_grad") for p in info.weights.parameters(recurse=False)):
                    return None, None
            except Exception:  # a container that cannot list them (TorchScript)
                continue
        return None

    def _one_cycle(self) -> tuple[float, float] | None:
        """(max_lr, lr) of the param group of an optimizer that stepped the model's first
        parameter, when a ``torch.optim.lr_scheduler.OneCycleLR`` drives it (it puts
        ``max_lr`` in the group); None otherwise. Event time only."""
        first = next(iter(self.recorder.model.parameters()), None)
        if first is None:
            return None
        for _optimizer, group in optimizers_holding(first):
            max_lr, lr = group.get("max_lr"), group.get("lr")
            if isinstance(max_lr, (int, float)) and isinstance(lr, (int, float)):
                return float(max_lr), float(lr)
        return None

    def facts(self, event: NanEvent, *, may_replay: bool = False) -> Facts:
        """What the rules read about ``event`` (see :class:`~.facts.Facts`)."""
        recorder = self.recorder
        root = self._pass_root(event)
        outside = root != recorder.modules[0].name
        facts = Facts(event=event, trace=event.trace, weights=self.weights,
                      sentinel=self.sentinel, sample_every=self.sample_every,
                      is_mask=self._is_mask, is_buffer=self._is_buffer,
                      has_loss_fn=bool(self.loss_fn),
                      scaler_run=self.scaler_run(event) if self.scaler_run else None)
        if outside:
            facts.outside_pass = root
        facts.policy_dtype = self._policy_dtype(event)
        self._read_inputs(facts)
        facts.made_outside_forward = _made_outside_forward(event, facts.inputs)
        if not event.is_backward and event.origin != "peer" and not facts.made_outside_forward:
            facts.state_from = self._state_carried_from(facts)
            if facts.state_from is not None:
                return facts  # the step that first wrote it says why
        if event.is_backward and event.origin != "peer":
            facts.accumulated_from = self._track_gradients(event)
            if facts.accumulated_from is not None:
                return facts  # the pass that made it non-finite says why
            facts.from_another_rank = world_size() > 1 and gradient_only_reduced(event)
            if facts.from_another_rank:
                return facts  # that rank's diagnosis says why
        if event.is_backward:
            forward = next(
                (e for e in self.recorder.events if e.batch == event.batch and e.rank == event.rank
                 and not e.is_backward and e.origin != "peer" and e.diagnosis is not None), None)
            # The loss carried it on only when the model's output was non-finite too, or the
            # forward event was made by a loss the model holds, run on its output.
            if forward is not None and (not self._output_finite(event.batch, root)
                                        or self._called_on_output(forward)):
                facts.forward_event = forward
                return facts  # the forward's diagnosis says why
            facts.output_grad_bad = self._output_grad_bad(event, root)
            earlier = next(
                (e for e in self.recorder.events if e.batch == event.batch and e.rank == event.rank
                 and e.is_backward and e is not event and e.origin != "peer"
                 and e.diagnosis is not None), None)
            # An earlier backward pass of the batch (torch.autograd.grad(create_graph=True): a
            # PINN's derivatives, a gradient penalty) made an event, and the loss took its
            # result: the gradient reached the model's output non-finite in this pass (its
            # frames, resolved last: the event's window may hold only the earlier passes').
            if earlier is not None and self._pass_output_grad_bad(event, root):
                facts.earlier_pass_event = earlier
                return facts  # that pass's diagnosis says why
            facts.called_on_output = self._called_on_output(event)
        elif event.origin != "peer":
            facts.called_on_output = self._called_on_output(event)
            capture = self.capture
            if capture is not None and capture.watched_adapters is not None:
                facts.adapters_disabled = bool(capture.adapters_disabled(event.batch))
                facts.adapters_switched = capture.adapters_switched(event.batch) or ()
                facts.adapters_watched = capture.watched_adapters
                if facts.adapters_disabled or facts.adapters_switched:
                    facts.ran_with_grad = capture.ran_with_grad(event.batch)
                    facts.ran_in_train_mode = capture.ran_in_train_mode(event.batch)
            held = self._nonfinite_outputs(event.batch, root) or []
            facts.outputs_holding = held
            # A loss the model holds ends the pass: nothing after it could absorb the value.
            facts.absorbed_in = held if root not in held and not facts.called_on_output else []
        if (facts.trace is None and may_replay and self.replay is not None
                and self._needs_op(facts)):
            if self.replays < MAX_DIAGNOSIS_REPLAYS:
                self.replays += 1
                try:
                    facts.trace = self.replay(event)
                except Exception as error:  # this rank alone cannot run it (FSDP2, tensor
                    # parallel), or an input was written in place since (a cache)
                    self.replays -= 1  # none ran
                    facts.replay_refused = getattr(error, "reason", "") or str(error)
                    written = getattr(error, "by_model", None)
                    if written is None:
                        facts.replay_refused_sharded = True
                    else:
                        facts.replay_refused_written = "model" if written else "caller"
                if event.is_backward and facts.trace is not None and not facts.output_grad_bad:
                    facts.output_grad_bad = _root_grad_bad(facts.trace.frames, event.batch, root)
                elif event.is_backward and facts.output_grad_bad and not self.loss_fn \
                        and not _born_in_backward(facts.trace):
                    facts.trace = None  # no op of the model's backward made it: the loss did
            else:
                facts.replays_spent = MAX_DIAGNOSIS_REPLAYS
                facts.same_place = next(
                    (e for e in reversed(self.recorder.events) if e is not event
                     and (e.module, e.role, e.is_backward) == (event.module, event.role,
                                                               event.is_backward)
                     and e.diagnosis is not None and e.diagnosis.kind != "unknown"), None)
        if facts.trace is None and not facts.replay_refused and self.unreplayable is not None:
            facts.replay_refused = self.unreplayable()  # e.g. a sentinel event not replayed
            facts.replay_refused_sharded = bool(facts.replay_refused)
        if facts.trace is None and not facts.replay_refused and self.sentinel \
                and event.note.startswith(NOT_REPLAYED) \
                and not event.note.startswith(REPEATED_NOTES):
            # The sentinel tried and could not (a static cache written in place since)
            facts.replay_refused = event.note[len(NOT_REPLAYED):]
        facts.op = op_facts(facts.trace)
        facts.unseen_note = self._unread_weights(event) if self._claims_weights(event) else ""
        facts.unseen_quantized = bool(facts.unseen_note)
        if not facts.unseen_note and facts.op is None and self._claims_weights(event) \
                and self._holds_no_weights(event):
            facts.unseen_note = NO_WEIGHTS_SEEN
        facts.weights_unseen = bool(facts.unseen_note)
        with recorder.lock:
            history = recorder.records.history
            facts.history_batches, facts.history = history.recent(HISTORY_BATCHES)
            facts.history_modules = list(history.modules)
        if event.origin == "weight" or any(kind == "weight" for kind, _ in
                                           getattr(facts.trace, "came_with", None) or []):
            self._weights_last_finite(facts)
            self._stepped_with_nonfinite_lr(facts)
            self._not_stepped(facts)
            self._wrapper_state(facts)
            self._written_outside_step(facts)
            self._loaded(facts)
            facts.optimizers = optimizers_stepped()
            # Full mode measures no gradient of a parameter FSDP2 shards (it has no entry):
            # such a weight's gradients were not checked, whatever backward=True says.
            facts.sharded_gradients_unchecked = not self.sentinel \
                and self._sharded_weights(facts)
            facts.checks_gradients = self.checks_gradients \
                and not facts.sharded_gradients_unchecked
            facts.backward_passes = self.backward_passes() if self.backward_passes else None
            facts.gradient_event_before = self._gradient_event_before(event)
        # The event's batch, with a non-finite weight, against the batch before it: a jump.
        jumped = bool(self.weights.series) and self.weights.finite_part is not None \
            and self.weights.finite_part[0] == event.batch
        if self.weights.first and (len(self.weights.series) >= 3 or jumped):
            self._weights_now(facts)  # divergence may be told
        if self.capture is not None and (len(self.weights.series) >= 2 or jumped):
            facts.optimizer_steps = self.capture.optimizer_steps()
        facts.lbfgs = self._lbfgs_step(event)
        if self._at_start and self.capture is not None and len(self.weights.series) < 3:
            steps = self.capture.optimizer_steps().get(event.batch)
            # LBFGS's first step under the watch, still in progress: its closure calls (one per
            # iteration, more with a line search) are the updates counted.
            calls = event.batch - facts.lbfgs["first_batch"] \
                if facts.lbfgs is not None and steps == self.steps_at_start else 0
            # One step is enough for a jump by rules._JUMP (the rules want two for a climb).
            if steps is not None and (steps - self.steps_at_start >= 1 or calls >= 2):
                facts.weights_at_start = _read_abs_max(self._at_start)
                facts.steps_since_start = steps - self.steps_at_start or calls
                facts.calls_since_start = steps == self.steps_at_start
                self._weights_now(facts, facts.weights_at_start)
                # The held batches' steps: whether steps ran between the batches whose outputs
                # climbed (rules._outputs_climb; the weights' series is empty here).
                facts.optimizer_steps = facts.optimizer_steps or self.capture.optimizer_steps()
        return facts

    def _lbfgs_step(self, event: NanEvent) -> dict[str, Any] | None:
        """When ``event``'s forward ran as a closure inside the step in progress of a
        torch.optim.LBFGS: its lr, max_iter, line_search_fn and the first batch of that step
        (the batch after the last one the weight log saw end before it; else the first held
        batch inside it, or the first the log has). None otherwise."""
        if self.capture is None:
            return None
        stepping = self.capture.steps_in_progress(event.batch)
        if not stepping or not stepping[-1] or stepping[-1] != step_in_progress():
            return None
        optimizer = stepping_optimizer()
        if not isinstance(optimizer, torch.optim.LBFGS) or not optimizer.param_groups:
            return None
        group = optimizer.param_groups[0]
        steps = steps_taken()  # the steps ended: every batch of this one ended with this count
        before = [batch for count, batch, _ in self.weights.by_step if count < steps]
        if before:
            first = before[-1] + 1
        elif steps == self.steps_at_start:
            first = 0  # no step ended under the watch: every batch ran before or inside this one
        else:
            inside = [b for b in self.capture.held_batches()
                      if self.capture.steps_in_progress(b)[:1] == [stepping[-1]]]
            first = min(inside + [b for b, _ in self.weights.series], default=event.batch)
        # The held calls of this step ran on the very same input tensors, unchanged since
        # (a closure re-evaluating one batch): only the weights changed between them.
        capture = self.capture
        held = [capture.held_inputs(b) for b in capture.held_batches()
                if b <= event.batch and capture.steps_in_progress(b)[:1] == [stepping[-1]]]
        same = len(held) >= 2 and bool(held[0]) and all(
            len(inputs) == len(held[0])
            and all(a is b for (_, a), (_, b) in zip(inputs, held[0])) for inputs in held)
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = float(lr)  # a tensor lr, read at the event only
        return {"lr": lr, "max_iter": group.get("max_iter"),
                "line_search_fn": group.get("line_search_fn"), "first_batch": first,
                "same_inputs": same}

    def _gradient_event_before(self, event: NanEvent) -> NanEvent | None:
        """The latest backward event of this process before ``event`` (a non-finite gradient
        the watch saw), or None."""
        events = self.recorder.events
        at = next((i for i, e in enumerate(events) if e is event), len(events))
        earlier = events[:at]
        return next((e for e in reversed(earlier) if e.is_backward and e.origin != "peer"
                     and e.rank == event.rank and e.batch <= event.batch), None)

    @staticmethod
    def _claims_weights(event: NanEvent) -> bool:
        """Whether ``event`` says its module made the value from finite inputs and weights."""
        return event.origin == "output" and not event.is_backward and event.role != LOSS_ROLE \
            and not event.note.startswith(UNVERIFIED_NOTES) and not weights_unchecked(event.note)

    def _modules_within(self, event: NanEvent) -> list[Any]:
        """The watched modules of ``event``'s module: itself and every module inside it."""
        inside = event.module + "."
        return [info for info in self.recorder.modules
                if not event.module or info.name == event.module or info.name.startswith(inside)]

    def _unread_weights(self, event: NanEvent) -> str:
        """The note of an event whose module (or one inside it) reads weights the watch could
        not read, measured now (event time): torch.ao's packed weights that its ``weight()``
        and ``bias()`` do not hand out (a dynamic quantized LSTM's), tensor subclasses that
        neither their inner tensor nor ``dequantize()`` give the values of; "" when none."""
        packed, unread, kinds, offloaded = [], [], [], []
        unpacked = False
        for info in self._modules_within(event):
            if holds_packed_weights(info.module):
                packed.append(info.name)
            groups = (info.weights._parameters, info.weights._buffers)
            # On the meta device between calls (accelerate's offloading loads them inside the
            # forward and puts them back before the hooks run): the frames measured no values.
            offloaded += [f"{info.name}.{name}" if info.name else name for group in groups
                          for name, t in group.items() if t is not None and t.is_meta]
            if not any(t is not None and type(t) not in PLAIN_TENSOR_TYPES
                       for group in groups for t in group.values()) \
                    and not packed_weights(info.module):
                continue  # plain weights: the frames measured them
            for entry in self.recorder.weights_now(info.name) or ():
                unpacked = unpacked or entry.note == PACKED
                if entry.stats is None and entry.note.startswith(("not read", "unsupported")) \
                        or entry.stats is not None and entry.stats.note.startswith("unsupported"):
                    unread.append(f"{info.name}.{entry.role}" if info.name else entry.role)
                    tensor = next((group[entry.role] for group in groups
                                   if group.get(entry.role) is not None), None)
                    kinds.append(type(tensor).__name__)
        said = []
        if packed and not unpacked:
            said.append("packed by torch.ao quantization (in "
                        + ", ".join(f"'{name}'" for name in packed[:3])
                        + "), no Parameter or buffer, and not unpacked")
        if unread:
            said.append(", ".join(unread[:3]) + (" ..." if len(unread) > 3 else "")
                        + f" ({', '.join(sorted(set(kinds)))}: a tensor subclass it cannot read)")
        if offloaded:
            said.append(", ".join(offloaded[:3]) + (" ..." if len(offloaded) > 3 else "")
                        + " (on the meta device outside its calls: offloaded, loaded inside "
                        "the forward, so the frames hold no values of them)")
        return f"{UNREAD_WEIGHTS}: {'; '.join(said)}" if said else ""

    def _holds_no_weights(self, event: NanEvent) -> bool:
        """Whether ``event``'s module, and every module inside it, holds no parameter or
        buffer now, and reads tensors of another kind: a tensor attribute (a weight computed
        from another module's parameter) or one its class's ``__getattr__`` makes (a
        PyroSample's, drawn there). Those were never measured. A module with no weight at all
        (x / x.norm()) makes no such claim."""
        unmeasured = False
        for info in self._modules_within(event):
            weights = info.weights
            if any(t is not None for group in (weights._parameters, weights._buffers)
                   for t in group.values()):
                return False
            module = info.module
            unmeasured = unmeasured or type(module).__getattr__ is not nn.Module.__getattr__ \
                or any(isinstance(value, torch.Tensor) for value in vars(module).values())
        return unmeasured

    def _is_buffer(self, weight: str) -> bool:
        """Whether the weight of this qualified name is one of its module's buffers."""
        return self.recorder.is_buffer(*self.recorder.weight_owner(weight))

    def _is_mask(self, weight: str) -> bool:
        """Whether the weight of this qualified name is an additive mask kept as a buffer
        (measured now: :func:`~nanwidget.core.detect.additive_mask`)."""
        module, role = self.recorder.weight_owner(weight)
        if not self.recorder.is_buffer(module, role):
            return False
        entry = next((e for e in self.recorder.weights_now(module) or () if e.role == role), None)
        return entry is not None and additive_mask(entry)

    def _track_gradients(self, event: NanEvent) -> NanEvent | None:
        """The earlier event whose non-finite parameter gradient ``event``'s pass only added to
        (the same ``.grad`` tensor, one version up, or more while the pass's own module
        gradients stayed finite: zero_grad() replaces or zeroes it), or None;
        and which parameter gradients are non-finite now, for the next backward event. Reads
        the gradients once, at an event (never per batch); plain tensors only (a sharded
        DTensor's reduction would need every rank)."""
        named = [(f"{info.name}.{role}" if info.name else role, p.grad)
                 for info in self.recorder.modules  # the names events use (DDP's unwrapped)
                 # where frames read weights: a module, or a TorchScript child's gathered ones
                 for role, p in info.weights._parameters.items()
                 if p is not None and type(p.grad) is torch.Tensor and p.grad.is_floating_point()
                 and p.grad.layout is torch.strided and p.grad.device.type != "meta"]
        try:
            bad = torch.stack([g.isfinite().all() for _, g in named]).logical_not().tolist() \
                if named else []
        except Exception:  # a dtype or device that cannot tell: nothing carried over
            bad = [False] * len(named)
        before, now = self._bad_grads, {}
        # More than one write since (DDP's all-reduce at the group's last micro-batch) still
        # only carries it on when this pass's own module gradients stayed finite.
        own_finite = gradient_only_reduced(event)
        for (name, grad), nonfinite in zip(named, bad):
            if not nonfinite:
                continue
            prior = before.get(name)
            carried = prior is not None and prior[0]() is grad \
                and prior[1] == grad.data_ptr() \
                and (prior[2] + 1 == grad._version or (own_finite and prior[2] < grad._version))
            now[name] = (weakref.ref(grad), grad.data_ptr(), grad._version,
                         prior[3] if carried else event)  # type: ignore[index]
        self._bad_grads = now
        cause = now.get(event.qualified_role)
        return cause[3] if cause is not None and cause[3] is not event else None

    def _pass_root(self, event: NanEvent) -> str:
        """The module whose call was the event's pass: the root, or for a model driven without
        its forward (a GAN's wrapper of G and D) the outermost module around the event's that
        ran in its batch (its output is what the loss took)."""
        root = self.recorder.modules[0].name
        frames = event.frames
        if not self.recorder.ran_outside_root(event.batch) or frames is None or frames.empty:
            return root
        batch = frames[(frames["batch"] == event.batch) & (frames["phase"] == "forward")]
        ran = set(batch["module"])
        root_frames = batch.loc[batch["module"] == root, "frame"]
        if root in ran and (event.is_backward or root_frames.max() > event.frame):
            return root  # the event ran inside the root's forward (or cannot be told apart)
        # The call that encloses the event's returns after it: its frame is past the event's
        # window (in the ring, the pass's last frame), so the ring is read too.
        ran |= {f.module for f in self.recorder.held_frames()
                if f.batch == event.batch and f.phase == "forward" and f.index > event.frame}
        parts = event.module.split(".")
        return next((name for name in (".".join(parts[:n]) for n in range(1, len(parts) + 1))
                     if name in ran), root)

    def _nonfinite_outputs(self, batch: int, root: str) -> list[str] | None:
        """The modules whose outputs held NaN/Inf in ``batch``, in the model's order, when the
        history's row of the batch (still open during its backward) has the root's outputs;
        None when it cannot tell."""
        with self.recorder.lock:
            history = self.recorder.records.history
            row = history.current_row(batch)
            modules = list(history.modules)
            if row is None or root not in modules or modules.index(root) not in row:
                return None
            return [modules[i] for i in sorted(row) if row[i][2]]

    def _output_finite(self, batch: int, root: str) -> bool:
        """Whether the root's outputs of ``batch`` were all finite; False when it cannot tell."""
        bad = self._nonfinite_outputs(batch, root)
        return bad is not None and root not in bad

    def _needs_op(self, facts: Facts) -> bool:
        """Whether the diagnosis needs the op that made the value (a replay): not for a weight
        that came non-finite, NaN in the data, or a gradient made in the loss (unless the watch
        has the loss_fn that names its op)."""
        event = facts.event
        if event.origin not in ("output", "input", "grad") or any(i.nan for i in facts.inputs):
            return False
        if facts.called_on_output and not event.is_backward and not self.loss_fn:
            return False  # a loss the model holds, run after its forward: no replay runs it
        if event.role == LOSS_ROLE and not event.is_backward and not self.loss_fn:
            return False  # a loss computed outside the model: a replay runs the forward only
        # A non-finite gradient at the root's output is made in the loss only when no op of
        # the model added it: an output the model also used inside (an SDF's spatial gradient
        # returned as normals and fed to an eikonal term) receives what the model's own
        # backward made. The replay runs from the gradients the outputs received and tells.
        return True

    def _read_inputs(self, facts: Facts) -> None:
        event = facts.event
        held = self.capture.held_inputs(event.batch) if self.capture is not None else []
        batch_dim = self._batch_dims()
        unreadable = 0
        for role, tensor in held:
            try:
                # A batch run under torch.func.vmap: its rows are the vmap's samples.
                values, samples_dim = vmapped_samples(tensor)
                described = describe_input(role, values, batch_dim(role, tensor)
                                           if samples_dim is None else samples_dim)
            except Exception:  # a tensor that cannot be read here: skip it
                unreadable += 1
                continue
            if described is not None:
                facts.inputs.append(described)
        # None read: the root's frame says which held NaN, below.
        facts.inputs_held = bool(held) and unreadable < len(held)
        if facts.inputs_held:
            packed = self.capture.packed_sequences(event.batch)
            for item in facts.inputs if packed else ():
                sequence = packed.get(item.role[:-3]) if item.role.endswith("[0]") else None
                if sequence is not None:  # its data's rows are time steps of the samples
                    order = sequence.sorted_indices
                    item.rows = packed_samples(item.rows, sequence.batch_sizes.tolist(),
                                               order.tolist() if order is not None else None)
                    item.packed_samples = int(sequence.batch_sizes[0])
            # A list of per-sample entries (a list of images, of per-image targets): a
            # sample's row in the batch is its index in the list, not a row of its own tensor
            # (an image's channel, a target's box); those stay as where in the sample.
            lists = self.capture.sample_lists(event.batch)
            for item in facts.inputs if lists else ():
                found = _sample_in_list(item.role, lists)
                if found is not None:
                    item.sample_of, index, item.part = found
                    item.within = item.rows
                    item.rows = [index] if item.nan or item.inf else []
            return
        if facts.outside_pass:
            # A part called outside the model's forward (DQN's q_net(obs), an encoder that
            # generate() runs): its inputs are never held, but its frame says which held NaN,
            # and the frames before it which calls ran earlier in the batch.
            facts.bad_input_roles, facts.outside_earlier = self._outside_call_nan_inputs(
                event, facts.outside_pass)
            return
        # Not held: the root's frame of the batch says which of its inputs held NaN (in the
        # event's window, the trace, or the ring: the root's frame is the batch's last).
        root = self.recorder.modules[0].name
        for frames in (event.frames, getattr(event.trace, "frames", None)):
            if not isinstance(frames, pd.DataFrame) or frames.empty:
                continue
            rows = frames[(frames["module"] == root) & (frames["phase"] == "forward")
                          & (frames["batch"] == event.batch)
                          & frames["role"].str.startswith(("input", "kwarg:")) & frames["nan"]]
            if not rows.empty:
                facts.bad_input_roles = list(dict.fromkeys(rows["role"]))
                return
        for frame in self.recorder.held_frames():
            if frame.module == root and frame.phase == "forward" and frame.batch == event.batch:
                roles = [e.role for e in frame.inputs() if e.stats is not None and e.stats.nan]
                if roles:
                    facts.bad_input_roles = list(dict.fromkeys(roles))
                    return

    def _outside_call_nan_inputs(self, event: NanEvent, part: str
                                 ) -> tuple[list[str], list[str] | None]:
        """The inputs that held NaN when module ``part`` (called outside the model's forward,
        around ``event``'s module) was called in ``event``'s batch, read from its frame in the
        ring (none when it is gone), and the outermost modules whose calls ran before it in the
        batch ([] when none did; None when the ring no longer tells)."""
        frames = [f for f in self.recorder.held_frames()
                  if f.batch == event.batch and f.phase == "forward"]
        own = next((f for f in frames if f.module == part), None)
        if own is None:
            return [], None
        roles = list(dict.fromkeys(e.role for e in own.inputs()
                                   if e.stats is not None and e.stats.nan))
        if event.frame == 0:  # the event's frame is the batch's first: nothing ran before
            return roles, []
        if frames[0].index != 0:
            return roles, None  # the batch's first frames left the ring
        inside = part + "."
        start = next(f.index for f in frames if f.module == part or f.module.startswith(inside))
        earlier = [f.module for f in frames if f.index < start]
        outermost = [name for name in dict.fromkeys(earlier)
                     if not any(name.startswith(other + ".") for other in earlier)]
        return roles, outermost

    def _batch_dims(self) -> Callable[[str, torch.Tensor], int]:
        """The dim that holds the samples of each of the root's inputs: 1 for a recurrent root's
        (nn.LSTM, nn.GRU, nn.RNN) hidden state, and for its input unless ``batch_first``
        (batched, 3-D, tensors only); 0 for the rest."""
        root = self.recorder.modules[0].module
        if not isinstance(root, nn.RNNBase):
            return lambda role, tensor: 0

        def batch_dim(role: str, tensor: torch.Tensor) -> int:
            if tensor.dim() != 3:
                return 0
            if role.startswith(("input[1]", "kwarg:hx")):  # (layers x directions, batch, hidden)
                return 1
            return 1 if role == "input[0]" and not root.batch_first else 0

        return batch_dim

    def _called_on_output(self, event: NanEvent) -> bool:
        """Whether the event's module (not the root) ran after a root forward returned,
        outside it, on what it gave back: a loss the model holds, called on its output."""
        frames = event.frames
        if event.module == self.recorder.modules[0].name or frames is None or frames.empty:
            return False
        own = frames[(frames["phase"] == "forward") & (frames["module"] == event.module)
                     & (frames["batch"] == event.batch) & (frames["call"] == event.call)]
        return any(self.recorder.ran_on_output(int(batch), int(frame)) for batch, frame
                   in own[["batch", "frame"]].drop_duplicates().itertuples(index=False))

    def _pass_output_grad_bad(self, event: NanEvent, root: str) -> bool:
        """Whether the root's frame of ``event``'s backward pass (the frames resolved last)
        holds a non-finite ``grad_output``."""
        with self.recorder.lock:
            resolved = list(self._resolved)
        if not any(f.batch == event.batch and f.index == event.frame for f in resolved):
            return False  # another pass's frames
        return bool(output_grad_bad(resolved, event.batch, root))

    def _output_grad_bad(self, event: NanEvent, root: str) -> bool | None:
        for frames in (event.frames, getattr(event.trace, "frames", None)):
            found = _root_grad_bad(frames, event.batch, root)
            if found is not None:
                return found
        with self.recorder.lock:
            resolved = list(self._resolved)
        return output_grad_bad(resolved, event.batch, root)

    def _weights_last_finite(self, facts: Facts) -> None:
        """For each non-finite weight: the last batch that ran with it finite, and whether its
        version counter moved after that batch. The latest batch any source shows wins: the
        frames (the event's window, earlier events' windows, the trace's) that measured the
        weight finite, whatever an event of that batch was about; and the batches before this
        one that ran (recorded or held) without an event, whose weights were finite (a
        non-finite weight is an event, or makes the outputs non-finite)."""
        event = facts.event
        # The weights the rules name: those the trace's value came with, else the event's own.
        names = ([name for kind, name in getattr(facts.trace, "came_with", None) or []
                  if kind == "weight" and not self._is_mask(name)]
                 or weight_names(event, self._is_mask))
        events = self.recorder.events
        # A batch whose events all came in its backward pass ran its forward on finite
        # weights (a non-finite weight is a forward event): it counts as clean.
        eventful = {e.batch for e in events if not e.is_backward}
        column = (facts.history_modules.index(event.module)
                  if event.module in facts.history_modules else None)
        ran = [b for row, b in enumerate(facts.history_batches)
               if column is not None and facts.history[row, column] == facts.history[row, column]]
        held = self.capture.held_batches() if self.capture is not None else []
        # A held batch in which the module did not run (an expert the router sent no token)
        # says nothing of its weights. Full mode's history tells which batches it ran in.
        # (No value there may also be outputs that held only NaN: a batch with an event ran.)
        idle = set() if column is None or self.sentinel else \
            set(facts.history_batches).difference(ran, (e.batch for e in events))
        facts.idle_batches = sorted(idle)
        clean = [b for b in set(ran) | set(held)
                 if b < event.batch and b not in eventful and b not in idle]
        facts.replaced_modules, facts.new_modules = self._in_added_modules(names)
        facts.earlier_batches_here = sorted(
            e.batch for e in events if e is not event and not e.is_backward
            and e.batch < event.batch and e.rank == event.rank
            and (e.module, e.role) == (event.module, event.role))
        facts.nonfinite_before = sorted(set(facts.earlier_batches_here)
                                        | weights_nonfinite_batches(event.frames, names,
                                                                    event.batch))
        seen: dict[str, list[int]] = {name: [max(clean)] if clean else [] for name in names}
        if self.sentinel and self.capture is not None:
            seen = self._sentinel_clean(facts, names, [b for b in clean if b in held], held)
        by_outputs = {name: batches[0] for name, batches in seen.items() if batches} \
            if self.sentinel else {}
        known = getattr(facts.trace, "weights_last_finite", None) or {}
        found_in_windows = [weights_finite_last(event.frames, names, event.batch)] + [
            self._finite_in_window(e, names) for e in events
            if e is not event and e.batch < event.batch]
        kept = {id(e) for e in events}  # only what the next events may ask for
        self._window_findings = {key: value for key, value in self._window_findings.items()
                                 if id(value[0]) in kept}
        for found in [known] + found_in_windows:
            for name, batch in found.items():
                if name in seen:
                    seen[name].append(int(batch))
        # The weight log saw every recorded batch's weights, also those whose frames left the
        # ring: the latest batch before this one that measured the weight's module all finite.
        logged = self.weights.last_finite
        for name in names:
            # Its module by what it keeps: a TensorDictParams keeps "module.0.weight" itself.
            batch = logged.get(self.recorder.weight_owner(name)[0], -1)
            if 0 <= batch < event.batch:
                seen[name].append(batch)
        if event.origin == "weight":
            facts.substituted = {name for name in names
                                 if self.recorder.substituted(*self.recorder.weight_owner(name))}
            if self.sentinel and self.capture is not None:
                # The forward has returned and put the parameters back: the held batch tells
                # what its slots held while it ran.
                facts.substituted |= self.capture.substituted_in(event.batch) & set(names)
        if self.capture is not None:
            facts.written_in_forward = self.capture.buffers_written(event.batch) & set(names)
        for name in names:
            if seen[name]:
                facts.weights_last_finite[name] = max(seen[name])
                if by_outputs.get(name) == max(seen[name]) \
                        and seen[name].count(by_outputs[name]) == 1 \
                        and (self._partly_read(name) or name in facts.replaced_modules):
                    facts.finite_by_outputs.add(name)  # no frame measured it then
            last = facts.weights_last_finite.get(name)
            if last is not None and self.capture is not None:
                then = {n: v for n, v, _ in self.capture.held_weights(last)}
                now = {n: v for n, v, _ in self.capture.held_weights(event.batch)}
                if name in then and name in now:
                    facts.weights_written[name] = then[name] != now[name]
                if name in self.capture.replaced_between(last, event.batch):
                    facts.weights_replaced.add(name)
        unseen = [name for name in names if not seen[name]]
        if unseen and not self.sentinel and self.capture is not None \
                and any(b < event.batch for b in idle) and not clean:
            # Full mode, a module that ran in no batch before this one (an expert the router
            # sent no token): no frame measured its weights finite. Its version counter tells,
            # as in sentinel mode, since when nothing wrote them.
            self._sentinel_clean(facts, unseen, [], held)
        for name in names:
            slices = self._nonfinite_slices(name)
            if slices is not None:
                facts.nonfinite_slices[name] = slices
        facts.poisoned_by = self._poisoned_by(facts, names)
        facts.finite_earlier_in_batch = _finite_in_earlier_call(event, names)
        if self.sentinel and self.capture is not None and not facts.finite_earlier_in_batch:
            # A replay runs every forward of the batch on the weights as they are now: the
            # held forwards' versions tell a write between them.
            within = self.capture.written_between_forwards(event.batch)
            if names and all(n in within for n in names):
                facts.written_between_forwards = {n: within[n] for n in names}

    def _sharded_weights(self, facts: Facts) -> bool:
        """Whether one of the event's non-finite weights is a DTensor parameter (FSDP2's
        sharded ones), whose gradient full mode does not measure."""
        for name in facts.weights_last_finite:
            tensor = self.recorder.weight(*self.recorder.weight_owner(name))
            if tensor is not None and is_distributed_tensor(tensor):
                return True
        return False

    def _policy_dtype(self, event: NanEvent) -> str:
        """The dtype the event's frames show a parameter of a module FSDP2 manages in, when it
        is not the dtype of the sharded parameter (FSDP2's MixedPrecisionPolicy cast it for the
        forward); "" otherwise."""
        sharded = {info.name: info.sharded_parameters for info in self.recorder.modules
                   if info.sharded_parameters}
        frames = event.frames
        if not sharded or frames is None or not len(frames):
            return ""
        for module, role, dtype in zip(frames["module"], frames["role"], frames["dtype"]):
            parameter = sharded.get(module, {}).get(role)
            if parameter is not None and dtype and str(dtype) != str(parameter.dtype).replace(
                    "torch.", ""):
                return str(dtype)
        return ""

    def _nonfinite_slices(self, name: str) -> tuple[list[int], int] | None:
        """Which experts hold the NaN/Inf of a non-finite weight of a mixture of experts'
        ``experts`` module that keeps every expert's matrix in one 3-D weight (transformers'
        grouped-GEMM experts: dim 0 indexes the experts), with their number; None for other
        weights (a convolution's 3-D weight is no experts')."""
        if "expert" not in name.lower():
            return None
        tensor = self.recorder.weight(*self.recorder.weight_owner(name))
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 3 \
                or not tensor.is_floating_point() or tensor.is_meta or not tensor.numel() \
                or is_distributed_tensor(tensor):  # a shard's rows are not all the experts
            return None
        try:
            with torch.no_grad():
                bad = ~torch.isfinite(tensor.detach()).flatten(1).all(dim=1)
                slices = bad.nonzero().flatten().tolist()
        except Exception:  # a subclass or layout that refuses: the rest of the diagnosis stands
            return None
        return (slices, tensor.shape[0]) if slices else None

    def _stepped_with_nonfinite_lr(self, facts: Facts) -> None:
        """The non-finite parameters an optimizer step with a NaN/Inf learning rate wrote after
        their last finite batch (the step hook keeps that step for each parameter it wrote)."""
        steps = self.capture.optimizer_steps() if self.capture is not None else {}
        for name, last in facts.weights_last_finite.items():
            tensor = self.recorder.weight(*self.recorder.weight_owner(name))
            step = nonfinite_lr_step(tensor) if tensor is not None else None
            if step is None:
                continue
            count, kind, lr = step
            # When the last finite batch is held, the step must come after it started.
            if last in steps and count <= steps[last]:
                continue
            facts.nonfinite_lr[name] = (kind, lr)
        # A forward inside the step in progress (LBFGS's closure, called several times per
        # step) meets the weights the step wrote before its end: no post-step hook marked them.
        stepping = self.capture.steps_in_progress(facts.event.batch) \
            if self.capture is not None else []
        if not stepping or stepping[-1] == 0 or stepping[-1] != step_in_progress():
            return
        for name in facts.weights_last_finite:
            if name in facts.nonfinite_lr:
                continue
            tensor = self.recorder.weight(*self.recorder.weight_owner(name))
            in_step = nonfinite_lr_in_step(tensor) if tensor is not None else None
            if in_step is not None:
                facts.nonfinite_lr[name] = in_step[1:]
                facts.lr_step_in_progress = True

    def _wrapper_state(self, facts: Facts) -> None:
        """The non-finite weights whose optimizer wrapper (Lookahead) keeps a non-finite state
        tensor for them (its slow weights), while their gradient, if any, is finite."""
        for name in facts.weights_last_finite:
            tensor = self.recorder.weight(*self.recorder.weight_owner(name))
            # (A DTensor's gradient, FSDP2's, on this rank's shard: no collective.)
            if tensor is None or (tensor.grad is not None
                                  and not bool(torch.isfinite(local_shard(tensor.grad)).all())):
                continue
            bad = optimizer_state_nonfinite(tensor)
            if bad:
                facts.wrapper_state_nonfinite[name] = bad

    def _written_outside_step(self, facts: Facts) -> None:
        """The non-finite parameters written in place after their last finite batch (the
        version counter moved) that no optimizer step wrote since, while the event's forward
        ran outside any step: a write between steps did it (SAM's first_step). Or, when the
        forward was a closure inside the step in progress of a SAM (``sam.step(closure)``), that
        step's first_step wrote them before its base optimizer stepped. Told only when every
        step since was marked and the last finite batch is held."""
        if self.capture is None or facts.event.is_backward:
            return
        steps = self.capture.optimizer_steps()
        stepping = self.capture.steps_in_progress(facts.event.batch)
        inside = None  # the SAM whose step the event's forward ran inside
        if stepping and stepping[-1] and stepping[-1] == step_in_progress():
            inside = stepping_optimizer()
            if inside is None or not hasattr(inside, "first_step"):
                return
        elif not stepping or stepping[-1] != 0:
            return
        for name, last in facts.weights_last_finite.items():
            if not facts.weights_written.get(name) or last not in steps \
                    or marks_kept_from() > steps[last]:
                continue
            tensor = self.recorder.weight(*self.recorder.weight_owner(name))
            if tensor is None or (last_step_writing(tensor) or 0) > steps[last]:
                continue
            if inside is not None:
                group = param_group_of(inside, tensor)
                holding = [] if group is None else [(inside, group)]
            else:
                holding = optimizers_holding(tensor)
            if not holding:
                continue  # no optimizer holds it: a write, an EMA, a load (told elsewhere)
            sam = any("rho" in group or hasattr(optimizer, "first_step")
                      for optimizer, group in holding)
            facts.written_outside_step[name] = ("SAM step" if inside is not None else "SAM") \
                if sam else ""

    def _loaded(self, facts: Facts) -> None:
        """The non-finite weights a load of the model's state wrote last (``Facts.loaded``):
        after the last batch that ran with them finite, not after the event's batch began, and
        with no write since (the version counter where the load left it, no fused optimizer
        step after it)."""
        event = facts.event
        names = ([name for kind, name in getattr(facts.trace, "came_with", None) or []
                  if kind == "weight" and not self._is_mask(name)]
                 or weight_names(event, self._is_mask))
        for name in names:
            tensor = self.recorder.weight(*self.recorder.weight_owner(name))
            load = self.loads.wrote(name, tensor)
            if load is None or load.batch > event.batch:
                continue
            last = facts.weights_last_finite.get(name)
            if last is not None and load.batch <= last:
                continue  # finite after that load: a write it does not show made it
            if (last_step_writing(tensor) or 0) > load.steps:
                continue  # a fused optimizer step wrote it since (no version counter moves)
            facts.loaded[name] = load

    def close(self) -> None:
        self.loads.close()

    def _not_stepped(self, facts: Facts) -> None:
        """The non-finite weights no optimizer step wrote (see ``Facts.not_stepped``). A
        parameter counts only while optimizer steps were seen under the watch (an update torch's
        step hook does not see, ``p.data -= lr * p.grad``, then marks nothing) and it holds no
        gradient (such an update reads one); or, when no optimizer step ran under the watch at
        all, when no batch since it was last finite can have made a gradient for such an update
        (they ran under torch.no_grad(), or it needs none)."""
        steps_seen = steps_taken() > self.steps_at_start
        complete = marks_kept_from() <= self.steps_at_start
        for name, last in facts.weights_last_finite.items():
            module, role = self.recorder.weight_owner(name)
            if self.recorder.is_buffer(module, role):
                facts.not_stepped[name] = "buffer"
                continue
            tensor = self.recorder.weight(module, role)
            if tensor is None or tensor.grad is not None:
                continue
            if steps_seen and complete and last_step_writing(tensor) is None:
                facts.not_stepped[name] = "parameter"
            elif not steps_seen and not (tensor.requires_grad
                                         and self._may_have_had_gradients(last, facts.event.batch)):
                facts.not_stepped[name] = "no step"

    def _may_have_had_gradients(self, last: int, batch: int) -> bool:
        """Whether a batch from ``last`` up to ``batch`` may have run with gradients on (then a
        backward and an update by hand, ``p -= lr * p.grad``, may have followed): True when
        one of them is not held, so it cannot be told."""
        if self.capture is None:
            return True
        return any(self.capture.ran_with_grad(b) is not False for b in range(last, batch))

    def _in_added_modules(self, names: list[str]) -> tuple[dict[str, str], set[str]]:
        """Of the weight names ``names``: those whose module was added or replaced after
        watch() (a fused conv put in the model's place), with that module's name; and those of
        these modules whose name held no module when watched (added, not replaced). The watch's
        slots still hold a replaced module's tensors. Walks the model: event time only."""
        if not names:
            return {}, set()
        added, removed = self.recorder.structure_changes()
        added_names = {name for name, _ in added}
        found = {name: name.rpartition(".")[0] for name in names
                 if name.rpartition(".")[0] and name.rpartition(".")[0] in added_names}
        return found, {module for module in found.values() if module not in removed}

    def _state_carried_from(self, facts: Facts) -> NanEvent | None:
        """The first forward event of the run of batches, each with a forward event, that ends
        just before the event's, when the batch's only non-finite inputs are state the model
        carries from step to step (a KV cache, a recurrent hidden state): generate() feeds
        each step the cache the step before wrote, so a NaN the first step made is in every
        later step's inputs. None otherwise (those inputs came with the batch)."""
        event = facts.event
        bad = [i for i in facts.inputs if i.nan or (i.inf and not i.mask)]
        if event.batch < 1 or not facts.inputs_held or not bad \
                or not all(_CARRIED_STATE.search(i.role) for i in bad):
            return None
        first: dict[int, NanEvent] = {}
        for earlier in self.recorder.events:
            if earlier.batch < event.batch and earlier.rank == event.rank \
                    and not earlier.is_backward and earlier.origin != "peer" \
                    and earlier.diagnosis is not None:
                first.setdefault(earlier.batch, earlier)
        batch = event.batch - 1
        if batch not in first:
            return None
        while batch - 1 in first:
            batch -= 1
        return first[batch]

    def _poisoned_by(self, facts: Facts, names: list[str]) -> NanEvent | None:
        """The earliest earlier forward event whose batch's forward wrote into these buffers
        (BatchNorm's running statistics, updated from that batch's NaN data) after the last
        batch that showed them finite: that forward made them non-finite, not a step or a
        load between batches."""
        event = facts.event
        if not names or event.origin != "weight" or self.capture is None \
                or not all(self.recorder.is_buffer(*self.recorder.weight_owner(n)) for n in names):
            return None
        last = max((facts.weights_last_finite.get(n, -1) for n in names), default=-1)
        for earlier in sorted((e for e in self.recorder.events
                               if last < e.batch < event.batch and not e.is_backward
                               and e.origin != "peer" and e.diagnosis is not None),
                              key=lambda e: e.batch):
            if set(names) <= self.capture.buffers_written(earlier.batch):
                return earlier
        return None

    def _partly_read(self, name: str) -> bool:
        """Whether a batch may leave some of this weight's values unread, so that its finite
        outputs do not show the weight finite: an embedding's rows (a lookup), a mixture of
        experts' experts (one a batch routes no token to)."""
        module = self.recorder.weight_owner(name)[0]
        if "expert" in name.lower():
            return True
        return any(info.name == module and isinstance(info.module, (nn.Embedding, nn.EmbeddingBag))
                   for info in self.recorder.modules)

    def _sentinel_clean(self, facts: Facts, names: list[str], clean: list[int],
                        held: list[int]) -> dict[str, list[int]]:
        """Sentinel mode measures no weights: a batch without an event read only finite values
        of them, and a row of an embedding or an expert it did not use stays unseen. So such a
        batch shows a weight finite only when the weight was written after it (its version
        counter or the optimizer's steps moved); the earliest held batch since which it was
        not goes into ``facts.unwritten_since``."""
        event, capture = facts.event, self.capture
        earlier = [b for b in held if b < event.batch]
        versions = {b: {n: v for n, v, _ in capture.held_weights(b)} for b in earlier}
        # A write a forward made into its own weight (max_norm's renorm) is no write between
        # batches: for those, compare each held batch's end with the next one's start.
        after = {b: capture.versions_after(b) for b in earlier}
        written_in = {b: capture.buffers_written(b) for b in clean}
        now = {n: v for n, v, _ in capture.held_weights(event.batch)}
        # Another tensor in the slot (a load with assign=True): its counter is a new one's.
        replaced = {b: capture.replaced_between(b, event.batch) for b in earlier}
        steps = capture.optimizer_steps()
        # The optimizer steps that wrote each parameter (one without a gradient is skipped):
        tensors = {n: t for n, t in zip(capture.slots.names, capture.slots.read())
                   if isinstance(t, torch.Tensor)}

        def written_after(batch: int, name: str) -> bool:
            if name in replaced[batch]:
                return True
            then = versions[batch]
            if name in after[batch] and steps.get(batch) == steps.get(event.batch):
                for k in range(batch, event.batch):
                    ended = after.get(k, {}).get(name)
                    started = (now if k + 1 == event.batch else versions.get(k + 1, {})).get(name)
                    if ended is None or started is None or ended != started:
                        return True
                return False
            # An optimizer steps parameters: a buffer it does not hold is written with a
            # version bump (or by the forward itself: buffers_written).
            stepped = steps.get(batch) != steps.get(event.batch) \
                and not self.recorder.is_buffer(*self.recorder.weight_owner(name)) \
                and (name not in tensors or steps.get(batch) is None
                     or written_since(tensors[name], steps[batch]))
            return name not in then or name not in now or then[name] != now[name] or stepped

        seen: dict[str, list[int]] = {}
        for name in names:
            if name in facts.replaced_modules:
                # Its slot still reads the tensor of the module it replaced: that one's counter
                # says nothing of it. A batch whose outputs were finite likely ran before it.
                seen[name] = [max(clean)] if clean else []
                continue
            # A training forward that updated a buffer (BatchNorm's running statistics) did not
            # read it: its finite outputs say nothing of it.
            proven = [b for b in clean if written_after(b, name) and name not in written_in[b]]
            seen[name] = [max(proven)] if proven else []
            unwritten = [b for b in earlier if not written_after(b, name)]
            if unwritten and not proven:
                facts.unwritten_since[name] = min(unwritten)
        return seen

    def _finite_in_window(self, earlier: NanEvent, names: list[str]) -> dict[str, int]:
        """:func:`weights_finite_last` of an earlier event's window, read once per event and
        weight names: a weight that stays non-finite makes an event every batch, and reading
        every earlier window again at each of them made each diagnosis slower than the last."""
        key = (id(earlier), frozenset(names))
        cached = self._window_findings.get(key)
        if cached is None or cached[0] is not earlier:
            # Its window's frames all ran before this event's batch: nothing to cut.
            cached = self._window_findings[key] = (
                earlier, weights_finite_last(earlier.frames, names, earlier.batch + 1))
        return cached[1]

    def _weights_now(self, facts: Facts, wanted: Any = None) -> None:
        """Each module first seen by the weight log (or in ``wanted``): its own weights' abs
        max now (the finite values), to tell which grew most. Measured at the event only. A
        module whose weights hold no finite value is left out (no measure of it now, where 0
        took it for weights that shrank to nothing)."""
        wanted = self.weights.first if wanted is None else wanted
        with torch.no_grad():
            for info in self.recorder.modules:
                if info.name not in wanted:
                    continue
                largest = 0.0
                measured = unmeasurable = False
                for tensor in info.module.parameters(recurse=False):
                    # Not an ExpandedWeight (it refuses .detach()), nor a vmap's batched
                    # tensor (an ensemble's stacked weights: its boolean-mask indexing fails),
                    # but the values they hold.
                    tensor = functorch_unwrapped(stood_for(tensor))
                    # A DTensor (FSDP2) is read on this rank's shard: indexing the DTensor
                    # itself fails, and reducing it would run a collective on one rank only.
                    values = local_shard(tensor.detach())
                    # storage freed between forwards (FSDP): nothing to read, reading crashes;
                    # on the meta device between calls (accelerate's offloading): no values
                    if values.numel() and values.is_floating_point() and not values.is_meta \
                            and storage_holds(values):
                        finite = values[torch.isfinite(values)]
                        if finite.numel():
                            largest = max(largest, float(finite.abs().max()))
                            measured = True
                        else:
                            unmeasurable = True
                if measured or not unmeasurable:
                    facts.weights_now[info.name] = largest
