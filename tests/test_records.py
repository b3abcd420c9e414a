"""dataset=records: a CSV (JSON lines, Parquet) of texts and labels for an encoder's own tasks.
A BERT folder (a WordPiece tokenizer and a tiny BertForSequenceClassification, made here) learns
a separable toy set of two classes, and dpt-evaluate gives its per-class table; labels become
classes, K-hot rows or values as their column says; bad input is one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from dpt.data.records import RecordsData
from dpt.errors import DptError
from tests.helpers import train_in_process

transformers = pytest.importorskip("transformers")

# Each class's words; every text also has filler words both classes use.
WORDS = {"good": ["great", "fine", "lovely", "superb", "bright", "happy"],
         "bad": ["awful", "poor", "dull", "grim", "sad", "broken"]}  # fmt: skip
FILLER = ["the", "a", "film", "day", "was", "very", "and", "it", "quite", "so"]
LENGTH = 16  # dataset.max_length: a text's tokens, [CLS] and [SEP] included


def _texts(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        label = rng.choice(sorted(WORDS))
        words = rng.sample(FILLER, 4) + rng.sample(WORDS[label], 2)
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return rows


def _csv(path: Path, rows: list[dict[str, object]]) -> Path:
    import pandas as pd

    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def bert_folder(folder: Path, texts: list[str]) -> Path:
    """A 2-layer BERT sequence classifier with a WordPiece tokenizer learned on `texts`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer()
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=120, special_tokens=special)
    )
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=wordpiece, pad_token="[PAD]",
                                                unk_token="[UNK]", cls_token="[CLS]",
                                                sep_token="[SEP]")  # fmt: skip
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=wordpiece.get_vocab_size(), hidden_size=32,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32,
                                     num_labels=2, pad_token_id=0)  # fmt: skip
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("records")
    data = out / "reviews"
    data.mkdir()
    train = _texts(320, seed=0)
    for name, rows in (("train", train), ("val", _texts(64, seed=1)), ("test", _texts(64, 2))):
        _csv(data / f"{name}.csv", rows)
    return {"out": out, "data": data, "bert": bert_folder(out / "bert", [r["text"] for r in train])}


@pytest.mark.slow  # a training run, and dpt-evaluate's
@pytest.mark.timeout(300)
def test_a_bert_folder_learns_two_classes_of_a_csv_and_evaluates_per_class(
    made: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from dpt.commands import evaluate

    run = made["out"] / "run"
    result = train_in_process(
        "model=hf", f"model.path={made['bert']}", "task=classification", "dataset=records",
        f"dataset.root={made['data']}", f"dataset.max_length={LENGTH}", "optimizer=adamw",
        "optimizer.lr=0.003", "trainer.batch_size=32", "trainer.epochs=6",
        "trainer.log_every_n_steps=10", f"hydra.run.dir={run}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "records: 320 training and 64 validation rows (2 classes: bad, good)" in result.stdout
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["val"]["val/acc1"] > 0.9, summary["val"]
    capsys.readouterr()
    evaluate.main([str(run)])  # the test split, which only dpt-evaluate reads
    printed = capsys.readouterr().out
    report = json.loads((run / "eval-test.json").read_text())
    assert [row["class"] for row in report["per_class"]] == ["bad", "good"]
    assert report["metrics"]["test/acc1"] > 0.9 and "good" in printed


def _records(root: Path, **extra: object) -> RecordsData:
    settings = {"text": "text", "label": "label", "tokenizer": None, "max_length": 8,
                "val_fraction": 0.0, "num_workers": 0, "seed": 0} | extra  # fmt: skip
    return RecordsData(root=str(root), **settings)  # type: ignore[arg-type]


def test_labels_become_classes_k_hot_rows_or_values_as_the_column_says(tmp_path: Path) -> None:
    words = _records(_csv(tmp_path / "words.csv", [{"text": "ab", "label": "z"},
                                                  {"text": "cd", "label": "y"}]))  # fmt: skip
    assert words.classes == ["y", "z"] and words.train[0][1] == 1
    numbers = _records(_csv(tmp_path / "numbers.csv", [{"text": "ab", "label": 10},
                                                      {"text": "cd", "label": 2}]))  # fmt: skip
    assert numbers.classes == ["2", "10"] and numbers.train[0][1] == 1  # 2 before 10
    lists = tmp_path / "lists.jsonl"
    lists.write_text('{"text": "ab", "label": ["x", "w"]}\n{"text": "cd", "label": []}\n')
    k_hot = _records(lists)
    assert k_hot.classes == ["w", "x"] and k_hot.train[0][1].tolist() == [1.0, 1.0]
    values = _records(_csv(tmp_path / "values.csv", [{"text": "ab", "label": 0.5},
                                                    {"text": "cd", "label": 1.5}]))  # fmt: skip
    assert values.train[1][1].tolist() == [1.5]
    ids, _ = words.train[0]
    assert ids.tolist() == [97, 98, 0, 0, 0, 0, 0, 0]  # bytes, padded with 0 to max_length


def test_a_missing_column_or_an_unseen_label_is_one_line(tmp_path: Path) -> None:
    path = _csv(tmp_path / "rows.csv", [{"review": "ab", "label": "z"}])
    with pytest.raises(DptError) as error:
        _records(path)
    assert str(error.value) == (
        f"dataset.root={path}: row 1: no column 'text' (dataset.label or dataset.text; the row "
        "has review, label)"
    )
    folder = tmp_path / "split"
    folder.mkdir()
    _csv(folder / "train.csv", [{"text": "ab", "label": "z"}])
    _csv(folder / "val.csv", [{"text": "ab", "label": "q"}])
    with pytest.raises(DptError) as error:
        _records(folder)
    assert str(error.value) == (
        f"dataset.root={folder / 'val.csv'}: row 1: label 'q' is not among the training rows' (z)"
    )
