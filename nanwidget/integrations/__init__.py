"""Training frameworks: one-line callbacks for transformers' Trainer, Lightning and fastai.

    from nanwidget.integrations.transformers import NanWatchCallback   # needs nanwidget[transformers]
    from nanwidget.integrations.lightning import NanWatchCallback      # needs nanwidget[lightning]
    from nanwidget.integrations.fastai import NanWatchCallback         # needs nanwidget[fastai]

Each submodule imports its framework; this package imports none, so ``import nanwidget``
never pulls in transformers, lightning or fastai. Accelerate needs no callback: see the README's recipe
(``nw.watch(accelerator.unwrap_model(model))`` with ``set_trigger`` / ``check_trigger``).
"""

__all__: list[str] = []
