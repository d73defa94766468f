"""Training frameworks: one-line callbacks for transformers' Trainer and for Lightning.

    from nanwidget.integrations.transformers import NanWatchCallback   # needs nanwidget[transformers]
    from nanwidget.integrations.lightning import NanWatchCallback      # needs nanwidget[lightning]

Each submodule imports its framework; this package imports neither, so ``import nanwidget``
never pulls in transformers or lightning. Accelerate needs no callback: see the README's recipe
(``nw.watch(accelerator.unwrap_model(model))`` with ``set_trigger`` / ``check_trigger``).
"""

__all__: list[str] = []
