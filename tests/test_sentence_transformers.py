"""nanwidget on sentence-transformers: fine-tuning with SentenceTransformerTrainer (and its
legacy model.fit) and inference with model.encode(), on a tiny BERT with random weights and a
WordPiece tokenizer built here (no download)."""

from __future__ import annotations

import math
import warnings

import pytest

sentence_transformers = pytest.importorskip(
    "sentence_transformers", reason="sentence-transformers is optional (CI's extras job installs it): pip install sentence-transformers")
datasets = pytest.importorskip(
    "datasets", reason="datasets is optional (CI's extras job installs it): pip install datasets")

import torch  # noqa: E402
import transformers  # noqa: E402
from sentence_transformers import (  # noqa: E402
    SentenceTransformer,
    SentenceTransformerTrainer,
    SentenceTransformerTrainingArguments,
)

import nanwidget as nw  # noqa: E402
from nanwidget.integrations.transformers import NanWatchCallback  # noqa: E402

try:  # sentence-transformers 6 moved them; the old paths still import, with a warning
    from sentence_transformers.sentence_transformer import losses
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
except ImportError:  # pragma: no cover - older releases
    from sentence_transformers import losses
    from sentence_transformers.models import Pooling, Transformer

WORDS = "the a cat dog sat on mat ran in park bird flew over tree sun is hot cold day night".split()


def _sentences(rows: int, seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(
        0, len(WORDS), (int(torch.randint(3, 9, (1,), generator=generator)),),
        generator=generator)) for _ in range(rows)]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A 2-layer BERT of hidden size 16 with random weights and a WordPiece tokenizer trained
    on the test's own words, saved as from_pretrained reads them."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    path = str(tmp_path_factory.mktemp("tiny_bert"))
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(_sentences(50, 0) + WORDS, trainers.WordPieceTrainer(
        vocab_size=100, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    fast = transformers.BertTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=fast.vocab_size, hidden_size=16,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=64)
    transformers.BertModel(config).save_pretrained(path)
    return path


def _model(path: str) -> SentenceTransformer:
    torch.manual_seed(0)
    transformer = Transformer(path, max_seq_length=32)
    return SentenceTransformer(modules=[transformer, Pooling(16, "mean")], device="cpu")


def _pairs(rows: int = 16, negative: bool = False):
    columns = {"anchor": _sentences(rows, 1), "positive": _sentences(rows, 2)}
    if negative:
        columns["negative"] = _sentences(rows, 5)
    return datasets.Dataset.from_dict(columns)


def _scored(rows: int = 16, nan_row: int | None = None):
    scores = torch.rand(rows, generator=torch.Generator().manual_seed(3)).tolist()
    if nan_row is not None:
        scores[nan_row] = math.nan
    return datasets.Dataset.from_dict({"sentence1": _sentences(rows, 1),
                                       "sentence2": _sentences(rows, 2), "score": scores})


_LOSSES = {"mnrl": (losses.MultipleNegativesRankingLoss, lambda: _pairs(8)),
           "cosine": (losses.CosineSimilarityLoss, lambda: _scored(8)),
           "triplet": (losses.TripletLoss, lambda: _pairs(8, negative=True))}


def _trainer(model, loss, dataset, tmp_path, callbacks=(), **args) -> SentenceTransformerTrainer:
    options = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                   num_train_epochs=1, learning_rate=1e-3, report_to=[], seed=0,
                   save_strategy="no", logging_steps=100, disable_tqdm=True, use_cpu=True,
                   logging_nan_inf_filter=False)
    options.update(args)
    return SentenceTransformerTrainer(
        model=model, args=SentenceTransformerTrainingArguments(**options),
        train_dataset=dataset, loss=loss, callbacks=list(callbacks))


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def _nanwidget_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "nanwidget" in str(w.message)]


@pytest.mark.parametrize("loss_name", sorted(_LOSSES))
def test_healthy_fine_tuning_is_silent_and_bit_identical(bert_dir, tmp_path, loss_name):
    make_loss, make_data = _LOSSES[loss_name]

    def train(how: str):
        model = _model(bert_dir)
        calls = []
        model.register_forward_hook(lambda module, args, out: calls.append(1))
        callback = None
        if how.startswith("callback"):
            callback = NanWatchCallback(log_dir=False, backward=how == "callback-backward")
        trainer = _trainer(model, make_loss(model), make_data(), tmp_path,
                           [callback] if callback else [])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how == "sentinel":
                with nw.watch(model, mode="sentinel") as watch:
                    trainer.train()
            else:
                trainer.train()
                watch = callback.watch if callback else None
        return _weights(model), watch, callback, _nanwidget_warnings(caught), len(calls)

    unwatched, _, _, _, calls = train("none")
    # Two steps; the loss calls the model once per column (sentence-transformers 6 merges the
    # triplet loss's positive and negative columns into one forward).
    assert calls >= 4
    for how in ("callback", "callback-backward", "sentinel"):
        weights, watch, callback, said, _ = train(how)
        assert said == [] and watch.events == [] and watch.warnings == [], (how, said)
        assert callback is None or callback.stop is None
        assert watch.batch == calls, how  # every call of the model is a batch
        assert all(torch.equal(weights[name], unwatched[name]) for name in unwatched), how


def test_legacy_fit_under_a_watch_is_bit_identical(bert_dir):
    from torch.utils.data import DataLoader
    from sentence_transformers import InputExample

    def fit(options):
        model = _model(bert_dir)
        examples = [InputExample(texts=[a, b]) for a, b in zip(_sentences(8, 1), _sentences(8, 2))]
        loader = DataLoader(examples, shuffle=True, batch_size=4,
                            generator=torch.Generator().manual_seed(1))
        loss = losses.MultipleNegativesRankingLoss(model)
        watch = nw.watch(model, **options) if options is not None else None
        model.fit(train_objectives=[(loader, loss)], epochs=1, warmup_steps=1,
                  show_progress_bar=False)
        if watch is not None:
            watch.close()
            assert watch.events == [] and watch.batch == 4
        return _weights(model)

    unwatched = fit(None)
    for options in ({}, {"mode": "sentinel"}, {"backward": True}):
        weights = fit(options)
        assert all(torch.equal(weights[name], unwatched[name]) for name in unwatched), options


def test_the_callback_stops_a_divergence_before_the_nan_step(bert_dir, tmp_path):
    model = _model(bert_dir)
    callback = NanWatchCallback(log_dir=False)
    trainer = _trainer(model, losses.MultipleNegativesRankingLoss(model), _pairs(32), tmp_path,
                       [callback], learning_rate=1e6, max_grad_norm=0.0,
                       lr_scheduler_type="constant")
    trainer.train()
    stop = callback.stop
    assert stop is not None and stop.phase == "train" and trainer.state.global_step == stop.step
    assert "training step" in stop.reason and "forward" in stop.reason
    diagnosis = callback.event.diagnosis
    assert diagnosis.kind == "divergence", diagnosis.headline()
    assert any("TrainingArguments(learning_rate=" in fix for fix in diagnosis.suggestion)
    # The step that met the NaN changed no weight: every weight is finite.
    assert all(torch.isfinite(value).all() for value in model.state_dict().values()
               if value.is_floating_point())


def test_sentinel_mode_tells_a_one_step_blow_up_as_a_divergence(bert_dir, tmp_path):
    # Adam at lr=1e6 moves every weight by about 1e6 in its first step; the next forward
    # overflows in a LayerNorm, and the embeddings (mean pooled after it) never climbed, so the
    # sentinel's outputs alone tell nothing: its weights at the watch's start against now do.
    model = _model(bert_dir)
    callback = NanWatchCallback(log_dir=False, mode="sentinel")
    trainer = _trainer(model, losses.MultipleNegativesRankingLoss(model), _pairs(32), tmp_path,
                       [callback], learning_rate=1e6, max_grad_norm=0.0,
                       lr_scheduler_type="constant")
    trainer.train()
    assert callback.stop is not None and callback.watch.mode == "sentinel"
    diagnosis = callback.event.diagnosis
    assert diagnosis.kind == "divergence", diagnosis.headline()
    assert any("when the watch began" in line for line in diagnosis.evidence)
    assert any("TrainingArguments(learning_rate=" in fix for fix in diagnosis.suggestion)
    assert not any("clamp" in fix for fix in diagnosis.suggestion)


def test_a_nan_score_is_named_as_the_labels_of_the_loss_module(bert_dir, tmp_path):
    model = _model(bert_dir)
    callback = NanWatchCallback(log_dir=False)
    trainer = _trainer(model, losses.CosineSimilarityLoss(model), _scored(nan_row=5), tmp_path,
                       [callback])
    trainer.train()
    stop = callback.stop
    assert stop is not None and trainer.state.global_step == stop.step
    assert "the Trainer's loss (CosineSimilarityLoss) made it outside the model" in stop.reason
    assert "compute_loss_func" not in stop.reason
    # The loss of a micro-batch reads both of its forwards (the two sentence columns).
    assert "micro-batch 0, the loss of its 2 forwards (batches " in stop.reason
    diagnosis = stop.diagnosis
    assert diagnosis.kind == "loss" and "targets held a NaN" in diagnosis.headline()
    assert any(fix.startswith("Fix the targets") for fix in diagnosis.suggestion)
    assert any("nw.watch(loss)" in fix for fix in diagnosis.suggestion)
    assert all(torch.isfinite(value).all() for value in model.state_dict().values()
               if value.is_floating_point())


def test_watching_the_loss_module_makes_one_batch_per_step_and_sees_the_labels(bert_dir,
                                                                               tmp_path):
    model = _model(bert_dir)
    loss = losses.CosineSimilarityLoss(model)
    trainer = _trainer(model, loss, _scored(nan_row=5), tmp_path)
    with nw.watch(loss, on_nan="record") as watch:
        trainer.train()
    event = watch.event
    # The loss's forward runs the model: the root is the loss, the model is 'model'.
    assert 0 <= event.batch < 4 and event.role.startswith("input")
    assert event.module in ("", "loss_fct") and event.diagnosis.kind == "bad-data"
    assert set(watch.history()["module"]) >= {"", "model", "model.0"}


def test_fit_is_told_its_own_keywords(bert_dir):
    from torch.utils.data import DataLoader
    from sentence_transformers import InputExample
    model = _model(bert_dir)
    examples = [InputExample(texts=[a, b]) for a, b in zip(_sentences(16, 1), _sentences(16, 2))]
    loader = DataLoader(examples, shuffle=True, batch_size=4,
                        generator=torch.Generator().manual_seed(1))
    with nw.watch(model, on_nan="record") as watch:
        model.fit(train_objectives=[(loader, losses.MultipleNegativesRankingLoss(model))],
                  epochs=1, warmup_steps=0, optimizer_params={"lr": 1e6}, max_grad_norm=0,
                  show_progress_bar=False)
    diagnosis = watch.event.diagnosis
    assert diagnosis.kind == "divergence", diagnosis.headline()
    said = " ".join(diagnosis.suggestion)
    assert 'model.fit(optimizer_params={"lr": ...})' in said and "max_grad_norm" in said
    assert "TrainingArguments" not in said and "clip_grad_norm_" not in said


def test_encode_is_unchanged_and_names_a_nan(bert_dir):
    model = _model(bert_dir)
    sentences = _sentences(10, 7)
    unwatched = model.encode(sentences, batch_size=4, convert_to_tensor=True)
    for options in ({}, {"mode": "sentinel"}):
        with nw.watch(model, **options) as watch:
            watched = model.encode(sentences, batch_size=4, convert_to_tensor=True)
        assert torch.equal(watched, unwatched) and watch.events == [] and watch.batch == 3
    # A NaN a token's embedding path makes (any data-dependent NaN would do).
    cat = model.tokenizer.convert_tokens_to_ids("cat")
    embeddings = model[0].auto_model.embeddings.word_embeddings
    handle = embeddings.register_forward_hook(
        lambda module, args, out: out.masked_fill((args[0] == cat)[..., None], math.nan))
    with nw.watch(model, on_nan="record") as watch:
        out = model.encode(["the dog sat", "the cat ran", "sun is hot"], batch_size=2,
                           convert_to_tensor=True)
    handle.remove()
    assert torch.isnan(out).any(dim=1).tolist() == [False, True, False]
    event = watch.event
    assert event.module == "0.model.embeddings.word_embeddings" and event.origin == "output"
    assert "masked_fill" in event.diagnosis.headline()
    # A NaN weight: named as the weight it is, before the first batch watched.
    with torch.no_grad():
        model[0].auto_model.encoder.layer[1].intermediate.dense.weight[3, 2] = math.nan
    for options in ({}, {"mode": "sentinel"}):
        with pytest.raises(nw.NanDetected) as raised, nw.watch(model, **options):
            model.encode(sentences, batch_size=4)
        event = raised.value.event
        assert event.module == "0.model.encoder.layer.1.intermediate.dense"
        assert event.origin == "weight" and event.diagnosis.kind == "corrupted-weight"
        # At batch 0 no batch ran before it: nothing the sentinel left unmeasured.
        assert not any("could not be checked" in line for line in event.diagnosis.evidence)


def test_bf16_autocast_on_cpu_is_silent_and_bit_identical(bert_dir, tmp_path):
    def train(callback):
        model = _model(bert_dir)
        trainer = _trainer(model, losses.MultipleNegativesRankingLoss(model), _pairs(8),
                           tmp_path, [callback] if callback else [], bf16=True)
        trainer.train()
        return _weights(model)

    unwatched = train(None)
    callback = NanWatchCallback(log_dir=False)
    weights = train(callback)
    assert callback.stop is None and callback.watch.events == []
    assert all(torch.equal(weights[name], unwatched[name]) for name in unwatched)
    assert "bfloat16" in set(callback.watch.frames()["dtype"])
