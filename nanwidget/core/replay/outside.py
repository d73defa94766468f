"""What a replay runs outside the watched model, left as it was.

A replay's ``loss_fn`` often runs other modules: a GAN generator's loss runs the discriminator
(``bce(D(fake), ones)``), a perceptual loss runs a feature network, and a forward may call a
module it keeps outside its own tree. Those modules are the caller's too: their parameters,
BatchNorm statistics, ``.grad``, train/eval flags and Python attributes must come out of the
replay as they went in (:class:`OutsideModules`), and a watch on one of them must not take the
replay for a batch of its own (:func:`other_watches_quiet`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from ..recorder import Recorder
from ..state import watching_recorders
from .shadows import ModuleAttributes, Shadows

__all__ = ["OutsideModules", "other_watches_quiet"]

# torch warns at every call of a torch.compile'd module while any global module hook is on;
# the replay's own (below) is on only while the replay runs and fires once per module.
_COMPILED_WITH_GLOBAL_HOOKS = r"Using `torch\.compile\(module\)` when there are global hooks"


class OutsideModules:
    """The modules a replay calls besides the model's own (``inside``), put back as they were
    by :meth:`restore`. At a module's first call on the replay's thread, it and every module
    under it (once each) get stand-ins for their parameters and buffers from ``shadows`` (their
    values, running statistics and ``.grad`` stay as they are; the replay's gradients land on
    the stand-ins), and their train/eval flags and Python attributes are saved. They are found
    by a global forward pre-hook, on only between :meth:`start` and :meth:`restore`: nothing is
    added to any module call outside a replay."""

    def __init__(self, inside: Iterable[nn.Module], shadows: Shadows) -> None:
        self._shadows = shadows
        self._seen = {id(module) for module in inside}  # the replay puts these back itself
        self._taken: list[nn.Module] = []  # held: their ids stay theirs while compared
        self._flags: list[bool] = []
        self._attributes: list[ModuleAttributes] = []
        self._thread = threading.get_ident()
        self._taken_ids: set[int] = set()
        self._tops: set[int] = set()  # the modules whose first call took their subtree
        #: Type names of taken modules another thread called while the replay ran: their calls
        #: ran on the stand-ins (the module's attributes are the process's), so what they wrote
        #: there is gone at :meth:`restore` (see :meth:`lost_calls`).
        self.called_elsewhere: list[str] = []
        self._handle: Any = None
        self._warnings: contextlib.ExitStack | None = None

    def start(self) -> None:
        """Put the global pre-hook on (after the hooks the replay runs once on the root)."""
        if "torch._dynamo" in sys.modules:
            self._warnings = contextlib.ExitStack()
            self._warnings.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message=_COMPILED_WITH_GLOBAL_HOOKS,
                                    category=UserWarning)
        self._handle = nn.modules.module.register_module_forward_pre_hook(self._first_call)

    def _first_call(self, module: nn.Module, args: tuple) -> None:
        # Another thread's call is none of the replay's; a module's first call takes its
        # subtree, before its own pre-hooks run (torch runs global ones first).
        if threading.get_ident() != self._thread:
            # Named once per call tree: the outermost module the other thread called.
            if id(module) in self._taken_ids and (id(module) in self._tops
                                                   or not self.called_elsewhere):
                name = type(module).__name__
                if name not in self.called_elsewhere:
                    self.called_elsewhere.append(name)
            return None
        if id(module) in self._seen:
            return None
        taken = []
        for each in module.modules():
            if id(each) not in self._seen:
                self._seen.add(id(each))
                taken.append(each)
        self._taken.extend(taken)
        self._taken_ids.update(map(id, taken))
        self._tops.add(id(module))
        self._flags.extend(each.training for each in taken)
        self._attributes.append(ModuleAttributes(taken))
        for each in taken:
            self._shadows.install_module(each)
        return None

    def stop(self) -> None:
        """Take the pre-hook off (first, in the replay's ``finally``)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._warnings is not None:
            self._warnings.close()
            self._warnings = None

    def lost_calls(self) -> str | None:
        """What to tell about modules another thread called while the replay stood in for their
        weights (None: no such call)."""
        if not self.called_elsewhere:
            return None
        names = ", ".join(self.called_elsewhere[:4])
        return (f"another thread called {names} (run outside the model by this replay) while "
                "the replay ran: those calls used the replay's stand-ins for its weights, so "
                "what they wrote there (BatchNorm statistics, .grad, in-place updates) was "
                "dropped with them; replay when no other thread runs it")

    def restore(self) -> None:
        """Flags and Python attributes as they were (the ``shadows`` restore the tensors)."""
        self.stop()
        for attributes in self._attributes:
            attributes.restore()
        for module, flag in zip(self._taken, self._flags):
            module.training = flag


@contextlib.contextmanager
def other_watches_quiet(replaying: Recorder) -> Iterator[None]:
    """While inside, every live watch but ``replaying``'s records nothing on this thread (the
    replay may run their models: a watched discriminator in the generator's loss); they
    record as usual on every other thread."""
    with contextlib.ExitStack() as stack:
        for recorder in watching_recorders():
            if recorder is not replaying:
                stack.enter_context(recorder.quiet_on_this_thread())
        yield
