"""Why an event happened: ``event.diagnosis``, for every event, in both modes.

Kinds (the contract's): ``overflow``, ``domain``, ``masked-row``, ``divergence``,
``corrupted-weight``, ``bad-data``, ``loss``, ``unknown``. Parts: :mod:`.facts` gathers what a
diagnosis reads (the event, its trace's first bad op and its tensors, the held batch's inputs,
the history, the weights across batches), :mod:`.rules` decides the kind from those facts
alone (pure functions, the precedence in its docstring), :mod:`.fixes` holds the reviewed fix
texts per kind, :mod:`.feature` is the :class:`Diagnoser` a watch composes: a float per batch
of bookkeeping, and the work only when an event happens.
"""

from __future__ import annotations

from .facts import Facts, InputFacts, LossTold, OpFacts, WeightLog, loss_told
from .feature import MAX_DIAGNOSIS_REPLAYS, Diagnoser
from .rules import Growth, diagnose, growth_of

__all__ = ["Diagnoser", "diagnose", "Facts", "InputFacts", "LossTold", "OpFacts", "WeightLog",
           "loss_told", "Growth", "growth_of", "MAX_DIAGNOSIS_REPLAYS"]
