"""dataset=records: a CSV (JSON lines, Parquet) of texts and labels for an encoder's own tasks.
A BERT folder (a WordPiece tokenizer and a tiny BertForSequenceClassification, made here) learns
a separable toy set of two classes, and dpt-evaluate gives its per-class table; labels become
classes, K-hot rows or values as their column says; bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dpt.data.records import RecordsData
from dpt.errors import DptError
from tests.helpers import train_in_process
from tests.hf_folders import bert_folder, reviews, write_csv

transformers = pytest.importorskip("transformers")

LENGTH = 16  # dataset.max_length: a text's tokens, [CLS] and [SEP] included


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("records")
    data = out / "reviews"
    data.mkdir()
    train = reviews(320, seed=0)
    for name, rows in (("train", train), ("val", reviews(64, seed=1)), ("test", reviews(64, 2))):
        write_csv(data / f"{name}.csv", rows)
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


def _as_task(task: str, row: dict[str, str]) -> object:
    """A review's label for `task`: its class, a list of labels (the class, and `liked` for a
    good one), or a value (+1 good, -1 bad)."""
    if task == "multilabel":
        return [row["label"], *(["liked"] if row["label"] == "good" else [])]
    if task == "regression":
        return 1.0 if row["label"] == "good" else -1.0
    return row["label"]


# Each other task's file of the same reviews, and what its validation reaches.
OTHER_TASKS = {"binary": ("csv", "val/acc"), "multilabel": ("jsonl", "val/f1"),
               "regression": ("csv", "val/r2")}  # fmt: skip


@pytest.mark.slow  # a training run each
@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", sorted(OTHER_TASKS))
def test_one_file_of_records_trains_binary_multilabel_and_regression(
    made: dict[str, Path], task: str
) -> None:
    """A file alone (its last tenth validates), its labels as the task takes them: the model
    learns the reviews in each task's terms."""
    import pandas as pd

    suffix, metric = OTHER_TASKS[task]
    rows = [{"text": r["text"], "label": _as_task(task, r)} for r in reviews(320, seed=0)]
    path = made["out"] / f"{task}.{suffix}"
    if suffix == "csv":
        write_csv(path, rows)
    else:
        pd.DataFrame(rows).to_json(path, orient="records", lines=True)
    run = made["out"] / f"run-{task}"
    result = train_in_process(
        "model=hf", f"model.path={made['bert']}", f"task={task}", "dataset=records",
        f"dataset.root={path}", f"dataset.max_length={LENGTH}", "optimizer=adamw",
        "optimizer.lr=0.003", "trainer.batch_size=16", "trainer.epochs=6",
        "checkpoint.enabled=false", f"hydra.run.dir={run}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["val"][metric] > 0.9, summary["val"]
    named = {"binary": ["good"], "multilabel": ["bad", "good", "liked"], "regression": ["label"]}
    assert json.loads((run / "data.json").read_text())["classes"] == named[task]
    # The folder's head of 2 classes starts fresh at the task's outputs: said in one line
    # (transformers' load report, a table, is not shown)
    outputs = len(named[task])
    assert (
        f"model.path={made['bert']}: 2 tensors start fresh, of another shape in the folder "
        f"than the task's model: classifier.bias [2] -> [{outputs}], "
        f"classifier.weight [2, 32] -> [{outputs}, 32]\n"
    ) in result.stdout
    assert "LOAD REPORT" not in result.stdout + result.stderr
    _predicts_new_reviews(run, task, made["out"])


def _predicts_new_reviews(run: Path, task: str, out: Path) -> None:
    """dpt-predict on texts the run never saw (a .txt file, a text a line; a CSV's text column
    alike): each review's prediction in the task's terms is its class."""
    import pandas as pd

    from dpt.commands import predict

    fresh = reviews(8, seed=3)
    lines, table = out / f"{task}-new.txt", out / f"{task}-new.csv"
    lines.write_text("".join(f"{row['text']}\n" for row in fresh))
    write_csv(table, fresh)
    said = {}
    for source in (lines, table):
        written = out / f"{task}-{source.suffix[1:]}-predicted.csv"
        # the last epoch's model: on this toy set, multilabel's watched val/map is 1.0 from the
        # first epoch on, whose weights model_best.pt keeps (a tie is no better)
        predict.main([str(run), str(source), "--csv", str(written), "--last"])
        said[source] = pd.read_csv(written)
        assert list(said[source]["path"]) == [f"{source}:{i}" for i in range(len(fresh))]
    column = {"binary": "good", "regression": "label", "multilabel": "probabilities"}[task]
    assert list(said[lines][column]) == list(said[table][column])  # the same ids: the same
    if task == "binary":  # what it cannot read as texts: one line each
        image, other = out / "photo.png", write_csv(out / "other.csv", [{"review": "a", "n": 1}])
        image.write_bytes(b"")
        for path, line in (
            (image, f"{image}: the run's model takes texts: .txt, .jsonl, .json, .parquet, .csv "
                    "files (a text a line, or a table file's text column)"),
            (other, f"{other}: row 1: no column 'text' (the run's dataset.text; the row has "
                    "review, n)"),
        ):  # fmt: skip
            with pytest.raises(DptError) as error:
                predict.run(predict.parse_args([str(run), str(path)]))
            assert str(error.value) == line
    good = [row["label"] == "good" for row in fresh]
    if task == "multilabel":
        assert ["liked" in str(labels).split(";") for labels in said[lines]["labels"]] == good
    else:
        assert list(said[lines][column] > (0.5 if task == "binary" else 0.0)) == good
    _transformers_pipeline_says_the_same(run, task, out, [row["text"] for row in fresh],
                                         said[lines])  # fmt: skip


def _transformers_pipeline_says_the_same(
    run: Path, task: str, out: Path, texts: list[str], said: Any
) -> None:
    """The exported folder in transformers' own text-classification pipeline: its outputs
    named as the run names them, the scores dpt-predict gave (its problem type applies the
    task's sigmoid, or none)."""
    from dpt.commands import export

    export.main([str(run), "--to", "hf", str(out / f"{task}-hf"), "--last"])
    classify = transformers.pipeline("text-classification", model=str(out / f"{task}-hf"),
                                     top_k=None)  # fmt: skip
    scores = [{d["label"]: d["score"] for d in answer} for answer in classify(texts)]
    if task == "multilabel":
        above = [";".join(sorted(n for n, v in row.items() if v > 0.5)) for row in scores]
        assert above == [";".join(sorted(str(s).split(";"))) for s in said["labels"]]
    else:
        name = "good" if task == "binary" else "label"
        assert max(abs(row[name] - v) for row, v in zip(scores, said[name], strict=True)) < 1e-5


@pytest.mark.slow  # a training run
@pytest.mark.timeout(300)
def test_a_model_of_fresh_weights_from_its_config_trains_on_records(made: dict[str, Path]) -> None:
    """model.config, no folder (the pretrained guide's other source): transformers' config
    keys given whole on the command line; the texts as UTF-8 bytes (no folder, no tokenizer)."""
    run = made["out"] / "fresh"
    config = ("model.config={model_type: bert, hidden_size: 32, num_hidden_layers: 1, "
              "num_attention_heads: 2, intermediate_size: 64, vocab_size: 256}")  # fmt: skip
    result = train_in_process(
        "model=hf", config, "task=classification", "dataset=records",
        f"dataset.root={made['data']}", f"dataset.max_length={LENGTH}", "trainer.max_steps=4",
        "checkpoint.enabled=false", f"hydra.run.dir={run}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    kept = json.loads((run / "hf_config.json").read_text())
    assert (kept["model_type"], kept["hidden_size"], kept["num_hidden_layers"]) == ("bert", 32, 1)
    assert json.loads((run / "metrics.json").read_text())["steps"] == 4


@pytest.mark.slow  # training runs, and the exports
@pytest.mark.timeout(300)
def test_lora_on_a_classifier_trains_its_head_beside_the_adapters(
    made: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """finetune.lora.rank alone on a sequence classifier: the adapters on its query and value
    projections and its head (`classifier`, sized to the task, as peft's modules_to_save) train,
    the rest is the folder's; the checkpoint holds both (a run stopped and resumed ends with the
    uninterrupted one's weights); the peft export on the folder's model and the merged export
    give the run's logits."""
    import peft
    import torch

    from dpt.commands import export
    from dpt.models.lora import is_lora_key
    from tests.helpers import load_weights, max_abs_diff

    args = ["model=hf", f"model.path={made['bert']}", "task=classification", "dataset=records",
            f"dataset.root={made['data']}", f"dataset.max_length={LENGTH}",
            "finetune.lora.rank=4", "optimizer=adamw", "optimizer.lr=0.01",
            "trainer.batch_size=32", "checkpoint.every_n_steps=20"]  # fmt: skip
    whole, stopped = made["out"] / "lora", made["out"] / "lora-stopped"
    assert train_in_process(*args, "trainer.max_steps=40", f"hydra.run.dir={whole}").returncode == 0
    cut = train_in_process(*args, "trainer.max_steps=20", f"hydra.run.dir={stopped}")
    assert cut.returncode == 0, cut.stderr
    resumed = train_in_process(*args, "trainer.max_steps=40", f"hydra.run.dir={stopped}")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr
    trained = load_weights(whole)
    assert max_abs_diff(load_weights(stopped), trained) < 1e-6
    assert json.loads((whole / "metrics.json").read_text())["val"]["val/acc1"] > 0.9
    folder = transformers.AutoModelForSequenceClassification.from_pretrained(made["bert"])
    moved = {k for k, v in folder.state_dict().items() if not torch.equal(trained[k], v)}
    assert moved == {"classifier.weight", "classifier.bias"}  # the base is the folder's
    assert {k.split(".")[-2] for k in trained if is_lora_key(k)} == {"lora_A", "lora_B"}
    capsys.readouterr()
    export.main([str(whole), "--to", "peft", str(made["out"] / "peft"), "--last"])
    export.main([str(whole), "--to", "hf", str(made["out"] / "merged"), "--last"])
    adapted = peft.PeftModel.from_pretrained(folder, made["out"] / "peft").eval()
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(made["out"] / "merged")
    ids = torch.randint(4, 100, (3, LENGTH), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (adapted(ids).logits - merged.eval()(ids).logits).abs().max() < 1e-5


def _records(root: Path, **extra: object) -> RecordsData:
    settings = {"text": "text", "label": "label", "tokenizer": None, "max_length": 8,
                "val_fraction": 0.0, "num_workers": 0, "seed": 0} | extra  # fmt: skip
    return RecordsData(root=str(root), **settings)  # type: ignore[arg-type]


def test_labels_become_classes_k_hot_rows_or_values_as_the_column_says(tmp_path: Path) -> None:
    words = _records(write_csv(tmp_path / "words.csv", [{"text": "ab", "label": "z"},
                                                  {"text": "cd", "label": "y"}]))  # fmt: skip
    assert words.classes == ["y", "z"] and words.train[0][1] == 1
    numbers = _records(write_csv(tmp_path / "numbers.csv", [{"text": "ab", "label": 10},
                                                      {"text": "cd", "label": 2}]))  # fmt: skip
    assert numbers.classes == ["2", "10"] and numbers.train[0][1] == 1  # 2 before 10
    lists = tmp_path / "lists.jsonl"
    lists.write_text('{"text": "ab", "label": ["x", "w"]}\n{"text": "cd", "label": []}\n')
    k_hot = _records(lists)
    assert k_hot.classes == ["w", "x"] and k_hot.train[0][1].tolist() == [1.0, 1.0]
    values = _records(write_csv(tmp_path / "values.csv", [{"text": "ab", "label": 0.5},
                                                    {"text": "cd", "label": 1.5}]))  # fmt: skip
    assert values.train[1][1].tolist() == [1.5]
    ids, _ = words.train[0]
    assert ids.tolist() == [97, 98, 0, 0, 0, 0, 0, 0]  # bytes, padded with 0 to max_length


def test_a_missing_column_or_an_unseen_label_is_one_line(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "rows.csv", [{"review": "ab", "label": "z"}])
    with pytest.raises(DptError) as error:
        _records(path)
    assert str(error.value) == (
        f"dataset.root={path}: row 1: no column 'text' (dataset.label or dataset.text; the row "
        "has review, label)"
    )
    folder = tmp_path / "split"
    folder.mkdir()
    write_csv(folder / "train.csv", [{"text": "ab", "label": "z"}])
    write_csv(folder / "val.csv", [{"text": "ab", "label": "q"}])
    with pytest.raises(DptError) as error:
        _records(folder)
    assert str(error.value) == (
        f"dataset.root={folder / 'val.csv'}: row 1: label 'q' is not among the training rows' (z)"
    )
