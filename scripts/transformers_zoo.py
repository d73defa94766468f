"""Every architecture of one transformers task family, tiny and random, trained and run under
each watch: the results must be bit-identical to the unwatched run's, with no event, no
nanwidget warning and no early warning.

    python scripts/transformers_zoo.py                       # causal LMs (about 10 minutes here)
    python scripts/transformers_zoo.py --family seq2seq t5 bart
    python scripts/transformers_zoo.py --family image        # image classifiers

For each model type: two AdamW steps in train mode (loss and backward), an eval forward and, for
language models, a greedy ``generate()``, first unwatched, then under full, full with
``backward=True``, sentinel and sentinel with ``backward=True``, each from the same weights and
seeds. A model type whose tiny config cannot be built or run unwatched, is still large (a nested
config the shrinking below missed), or whose two unwatched runs differ is skipped, saying why.
Prints one line per model type, then the counts; exits 1 when a watch changed a result, warned,
raised or found a NaN/Inf.

Not a test of the suite: it takes minutes and depends on the transformers release installed.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy  # noqa: E402
import torch  # noqa: E402

import nanwidget as nw  # noqa: E402

# Set on a config (and its text_config) where it has the attribute: small enough for CPU.
SMALL = dict(
    hidden_size=32, n_embd=32, d_model=32, num_hidden_layers=2, n_layer=2, num_layers=2,
    num_decoder_layers=2, encoder_layers=2, decoder_layers=2, num_attention_heads=2, n_head=2,
    num_heads=2, encoder_attention_heads=2, decoder_attention_heads=2, num_key_value_heads=2,
    intermediate_size=64, n_inner=64, ffn_dim=64, d_ff=64, encoder_ffn_dim=64,
    decoder_ffn_dim=64, d_kv=16, head_dim=16, vocab_size=128, max_position_embeddings=64,
    n_positions=64, num_experts=4, num_local_experts=4, n_routed_experts=4,
    moe_intermediate_size=32, num_experts_per_tok=2, attention_window=8, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# Image classifiers: their sizes too.
SMALL_IMAGE = dict(SMALL, image_size=32, patch_size=8, num_channels=3, embed_dim=16,
                   num_labels=3)
# A config the shrinking above missed (nested sub-configs): too big to run here.
MAX_PARAMETERS = 20_000_000
MODES = [("full", False), ("full", True), ("sentinel", False), ("sentinel", True)]


class _Timeout(Exception):
    pass


def _on_alarm(*_: object) -> None:
    raise _Timeout()


def tiny_config(model_type: str, family: str) -> object:
    from transformers import AutoConfig
    config = AutoConfig.for_model(model_type)
    for holder in (config, getattr(config, "text_config", None)):
        if holder is None or isinstance(holder, dict):
            continue
        for key, value in (SMALL_IMAGE if family == "image" else SMALL).items():
            if hasattr(holder, key):
                try:
                    setattr(holder, key, value)
                except Exception:  # a read-only property of that config
                    pass
    if family == "seq2seq":  # labels are shifted right into decoder inputs: both are needed
        config.decoder_start_token_id = config.pad_token_id = 0
    return config


def inputs(config: object, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    if family == "image":
        size = getattr(config, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(config, "num_channels", 3)
        return torch.randn(2, channels, size, size, generator=generator), torch.tensor([0, 2])
    ids = torch.randint(3, 100, (2, 12), generator=generator)
    return ids, ids


def run(model: torch.nn.Module, data: torch.Tensor, labels: torch.Tensor, family: str
        ) -> list[torch.Tensor]:
    """What the model gives: its losses, eval logits and generated tokens, from fixed seeds."""
    torch.manual_seed(1)
    numpy.random.seed(1)
    random.seed(1)
    model.zero_grad(set_to_none=True)
    key = "pixel_values" if family == "image" else "input_ids"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    results = []
    model.train()
    for _ in range(2):
        loss = model(**{key: data}, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        results.append(loss.detach().clone())
    model.eval()
    with torch.no_grad():
        extra = {"decoder_input_ids": data[:, :4]} if family == "seq2seq" else {}
        results.append(model(**{key: data}, **extra).logits.clone())
    if family in ("causal", "seq2seq"):
        results.append(model.generate(data[:, :5], max_new_tokens=4, do_sample=False).clone())
    return results


def identical(expected: list[torch.Tensor], got: list[torch.Tensor]) -> bool:
    """Bit for bit (a NaN the model itself makes counts as equal to a NaN in its place)."""
    return len(expected) == len(got) and all(
        a.shape == b.shape and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        for a, b in zip(expected, got))


def check(model_type: str, class_name: str, family: str, seconds: int) -> tuple[str, list[str]]:
    """("ran", problems) or ("skipped", [why])."""
    import transformers
    signal.alarm(seconds)
    try:
        config = tiny_config(model_type, family)
        with torch.device("meta"):  # counted before any memory is taken
            size = sum(p.numel() for p in getattr(transformers, class_name)(config).parameters())
        if size > MAX_PARAMETERS:
            return "skipped", [f"{size / 1e6:.0f}M parameters: its config did not shrink"]
        torch.manual_seed(0)
        model = getattr(transformers, class_name)(config)
        weights = {name: value.clone() for name, value in model.state_dict().items()}
        data, labels = inputs(config, family)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = run(model, data, labels, family)
            model.load_state_dict(weights)
            if not identical(expected, run(model, data, labels, family)):
                return "skipped", ["two unwatched runs differ (its own randomness)"]
    except _Timeout:
        return "skipped", ["timeout"]
    except Exception as error:
        return "skipped", [f"{type(error).__name__}: {str(error)[:100]}"]
    finally:
        signal.alarm(0)
    problems = []
    signal.alarm(seconds)
    try:
        for mode, backward in MODES:
            label = mode + (" backward=True" if backward else "")
            model.load_state_dict(weights)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    with nw.watch(model, mode=mode, backward=backward, on_nan="record") as watch:
                        got = run(model, data, labels, family)
            except _Timeout:
                raise
            except Exception as error:
                problems.append(f"{label}: raised {type(error).__name__}: {str(error)[:200]}")
                continue
            if not identical(expected, got):
                problems.append(f"{label}: results changed")
            if watch.events:
                problems.append(f"{label}: event {watch.events[0].summary()[:200]}")
            ours = [str(w.message)[:200] for w in caught if "nanwidget" in str(w.message)
                    or issubclass(w.category, nw.EarlyWarningIssued)]
            if ours:
                problems.append(f"{label}: warned {ours[0]}")
    except _Timeout:
        problems.append(f"timed out after {seconds}s")
    finally:
        signal.alarm(0)
    return "ran", problems


def main() -> int:
    from transformers.models.auto import modeling_auto as auto
    families = {"causal": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                "seq2seq": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                "image": auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", help="only these (config model_type names)")
    parser.add_argument("--family", choices=sorted(families), default="causal")
    parser.add_argument("--seconds", type=int, default=120,
                        help="time limit per model type, all runs together (default 120)")
    options = parser.parse_args()
    torch.set_num_threads(1)
    import transformers
    transformers.logging.set_verbosity_error()
    signal.signal(signal.SIGALRM, _on_alarm)
    mapping = families[options.family]
    chosen = options.model_types or sorted(mapping)
    unknown = [name for name in chosen if name not in mapping]
    if unknown:
        parser.error(f"not {options.family} model types: {', '.join(unknown)}")
    ran = failed = skipped = 0
    for model_type in chosen:
        class_name = mapping[model_type]
        if isinstance(class_name, (tuple, list)):  # several heads (DeiT's): the first
            class_name = class_name[0]
        if not hasattr(transformers, class_name):
            continue
        status, notes = check(model_type, class_name, options.family, options.seconds)
        if status == "skipped":
            skipped += 1
            print(f"{model_type}: skipped ({notes[0]})", flush=True)
            continue
        ran += 1
        failed += bool(notes)
        print(f"{model_type}: " + ("ok" if not notes else "PROBLEM " + "; ".join(notes)),
              flush=True)
    print(f"{ran} model types ran under {len(MODES)} watches each: {ran - failed} unchanged and "
          f"quiet, {failed} with problems; {skipped} skipped (each says why above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
