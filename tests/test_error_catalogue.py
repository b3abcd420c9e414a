"""Every row of docs/errors.md's bad-input table, run for real: the documented line, exactly.

A row caught `before run` is refused by the command's own process before any rank, fork server
or run folder exists: it runs in this process, through the command's entry point
(`dpt.launch.cli.main`, with `sys.argv`, the current folder and the import path as the command's
process has them; tests.helpers.train_in_process), which saves the start of a Python process per
row and proves the same: the exit code, stdout and stderr as that process would end with them.
A row caught `at start` starts a rank (or gets as far as the launcher) and runs as a command, in
a process of its own.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from scripts.make_coco_fixture import make_fixture
from tests.helpers import (
    FAST,
    REPO,
    read_checkpoint,
    runs_in_process,
    train,
    train_in_process,
    write_shards,
)

CATALOGUE = REPO / "docs" / "errors.md"
EXAMPLE = REPO / "examples" / "tasks"  # its classes and conf/ (rows that start there)
GPU_ROWS = ("GPUs that do not exist",)


def _rows() -> list[tuple[str, str, str, str]]:
    """(case, arguments, message, when) from the table under '## Bad input'."""
    text = CATALOGUE.read_text().split("## Bad input", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith(("| case", "| ---")):
            continue
        cells = [c.strip().strip("`").strip() for c in line.strip("|").split(" | ")]
        rows.append((cells[0], cells[1], cells[2], cells[3]))
    return rows


ROWS = _rows()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The bad inputs made in a moment: COCO fixtures, image folders, an old checkpoint file."""
    root = tmp_path_factory.mktemp("catalogue")
    coco = root / "coco"
    make_fixture(coco)
    empty = root / "empty_coco"
    (empty / "annotations").mkdir(parents=True)
    (empty / "train2017").mkdir()
    empty_json = root / "empty_json_coco"  # `{}`: valid JSON, not a COCO file
    (empty_json / "annotations").mkdir(parents=True)
    (empty_json / "train2017").mkdir()
    (empty_json / "annotations" / "instances_train2017.json").write_text("{}")
    truncated = root / "truncated_coco"  # the same fixture (its seed), its annotations cut
    shutil.copytree(coco, truncated)
    ann = truncated / "annotations" / "instances_train2017.json"
    ann.write_text(ann.read_text()[:500])
    old = root / "step-00000002.pt"  # a file, as checkpoints were before DCP
    torch.save({}, old)
    texts = root / "texts"  # for dataset=text: lines of sums, an empty text, one too short
    texts.mkdir()
    (texts / "sums.txt").write_text("".join(f"{a}+{b}={a + b}\n" for a in range(30)
                                            for b in range(30)))  # fmt: skip
    (texts / "empty.txt").write_text("")
    (texts / "short.txt").write_text("1+1=2\n")
    (texts / "broken.json").write_text('{"model": ')  # a tokenizers file cut off
    damaged_study = root / "damaged_study"  # a sweep folder whose optuna.db is not a database
    damaged_study.mkdir()
    (damaged_study / "optuna.db").write_bytes(b"not a database" * 100)
    own_conf = root / "own_conf"  # a data set of yours whose YAML has no `shuffle`
    (own_conf / "dataset").mkdir(parents=True)
    (own_conf / "dataset" / "plain.yaml").write_text(
        "_target_: simple.RandomDataset\nn_samples: 100\ninput_dim: 10\n"
    )
    return {
        "own_conf": own_conf,
        "damaged_study": damaged_study,
        **_image_folders(root, coco),
        "coco": coco,
        "empty_coco": empty,
        "empty_json_coco": empty_json,
        "truncated_coco": truncated,
        "old_checkpoint": old,
        "text": texts / "sums.txt",
        "empty_text": texts / "empty.txt",
        "short_text": texts / "short.txt",
        "broken_tokenizer": texts / "broken.json",
        "text_cache": root / "tokens",
    }


@pytest.fixture(scope="module")
def made_by_runs(inputs: dict[str, Path]) -> dict[str, Path]:
    """The bad inputs that dpt's commands make first (seconds each; only rows that use them ask
    for them): shards without their training shards, broken copies of a run's checkpoint."""
    root = inputs["coco"].parent
    broken_shards = root / "broken_shards"  # dpt-shards' output, its training shards deleted
    write_shards("--coco", str(inputs["coco"]), "--out", str(broken_shards),
                 "--shard-size-mb", "0.02")  # fmt: skip
    for shard in broken_shards.glob("train2017-*.tar"):
        shard.unlink()
    run = root / "mlp_run"  # `python train.py ...`, in this process (one process, no workers)
    made = train_in_process(*FAST, "trainer.max_steps=2", f"hydra.run.dir={run}")
    assert made.returncode == 0, made.output
    damaged = root / "damaged_weights_run"  # the run, its model_best.pt overwritten with junk
    shutil.copytree(run, damaged)
    (damaged / "model_best.pt").write_bytes(b"\xbe" * 64)
    torch.save(torch.zeros(2, 32), root / "vectors.pt")  # the run's inputs: vectors of 32
    return {
        "damaged_weights_run": damaged,
        "vectors": root / "vectors.pt",
        "broken_shards": broken_shards,
        "mlp_run": run,  # a finished run of task=classification
        **_checkpoints(root, run / "checkpoints" / "step-00000002"),
    }


def _image_folders(root: Path, coco: Path) -> dict[str, Path]:
    """A good image folder made from the COCO fixture, and one of each bad layout."""
    image = next((coco / "train2017").glob("*.jpg"))

    def folder(name: str, files: list[str]) -> Path:
        made = root / name
        (made / "train").mkdir(parents=True)
        for file in files:
            path = made / file
            if file.endswith("/"):
                path.mkdir(parents=True, exist_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(image, path)
        return made

    return {
        "image_folder": folder("image_folder", ["train/red/a.jpg", "train/red/b.jpg"]),
        "flat_folder": folder("flat_folder", []),
        "loose_image_folder": folder("loose_image_folder", ["train/red/a.jpg", "train/stray.jpg"]),
        "empty_class_folder": folder("empty_class_folder", ["train/red/a.jpg", "train/green/"]),
        "other_val_folder": folder("other_val_folder", ["train/red/a.jpg", "val/purple/a.jpg"]),
        "imageless_folder": folder("imageless_folder", ["train/red/notes.txt"]),
    }


def _checkpoints(root: Path, good: Path) -> dict[str, Path]:
    """A good checkpoint folder, and broken copies of it (each under its own step-<n> name)."""
    copies = {name: root / name / good.name for name in ("corrupt", "uncommitted", "partless")}
    for copy in copies.values():
        shutil.copytree(good, copy)
    data = copies["corrupt"] / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:3000])
    (copies["uncommitted"] / "COMMITTED").unlink()
    _drop_part(copies["partless"], "early_stopping")
    unloadable = root / "unloadable_run"
    shutil.copytree(copies["corrupt"], unloadable / "checkpoints" / good.name)
    junked = root / "junked_run"  # every file overwritten, markers included
    shutil.copytree(good, junked / "checkpoints" / good.name)
    for path in (junked / "checkpoints" / good.name).iterdir():
        path.write_bytes(b"\x07junk" * 16)
    history = root / "history_run"  # results of a finished run, its checkpoints deleted
    history.mkdir()
    (history / "metrics.json").write_text("{}")
    junk_marker = root / "junk_marker" / good.name
    shutil.copytree(good, junk_marker)
    (junk_marker / "COMMITTED").write_bytes(b"\x07junk")
    return {
        "mlp_checkpoint": good,
        "corrupt_checkpoint": copies["corrupt"],
        "uncommitted_checkpoint": copies["uncommitted"],
        "partless_checkpoint": copies["partless"],
        "unloadable_run": unloadable,
        "junked_run": junked,
        "history_run": history,
        "junk_marker_checkpoint": junk_marker,
    }


def _drop_part(folder: Path, part: str) -> None:
    """Write the checkpoint again without one part (its marker kept)."""
    import torch.distributed.checkpoint as dcp

    state = read_checkpoint(folder, decoded=False)
    del state[part]
    marker = (folder / "COMMITTED").read_text()
    shutil.rmtree(folder)
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    (folder / "COMMITTED").write_text(marker)


def test_the_catalogue_covers_what_the_issue_lists() -> None:
    cases = " ".join(row[0] for row in ROWS).replace("`", "")
    for needed in (
        "unknown group option",
        "unknown key",
        "wrong type",
        "out-of-range number",
        "dataset path that does not exist",
        "truncated annotation JSON",
        "image model on vector data",
        "vector model on image data",
        "`launcher=torchrun` outside torchrun",
        "resume path that does not exist",
        "checkpoint from a different model",
        "`ddp` asked for GPUs",
        "`dp` asked for GPUs",
    ):
        assert needed.replace("`", "") in cases, needed


# A path a row names: `{text}`; other braces are the command's own (`model.config={a: 1}`).
_PLACE = re.compile(r"\{(\w+)\}")


def _paths(request: pytest.FixtureRequest, text: str) -> dict[str, Path]:
    """The paths a row names: `inputs`, and `made_by_runs` only where the row names one of
    those."""
    paths = request.getfixturevalue("inputs")
    if set(_PLACE.findall(text)) - set(paths):
        paths = {**paths, **request.getfixturevalue("made_by_runs")}
    return paths


def _filled(text: str, paths: dict[str, Path]) -> str:
    """`text` with each path it names in place."""
    return _PLACE.sub(lambda found: str(paths[found.group(1)]), text)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "arguments", "message", "when"),
    # Rows caught before the run are answered by one process in seconds: the quick loop's;
    # those caught at start run a rank first.
    [pytest.param(*r, marks=() if r[3] == "before run" else pytest.mark.slow) for r in ROWS],
    ids=[f"{i:02d}-{r[0]}" for i, r in enumerate(ROWS)],
)
def test_documented_message(
    request: pytest.FixtureRequest, tmp_path: Path, case: str, arguments: str, message: str,
    when: str,
) -> None:  # fmt: skip
    if torch.cuda.is_available() and any(g in case for g in GPU_ROWS):
        pytest.skip("documented for a machine without CUDA")
    paths = _paths(request, arguments + message)
    args = shlex.split(_filled(arguments, paths))
    expected = _filled(message, paths)
    run_dir = tmp_path / "run"
    explicit_dir = any(a.startswith("hydra.run.dir=") for a in args)
    argv = [*args, *([] if explicit_dir else [f"hydra.run.dir={run_dir}"])]
    # As `python train.py ARGS` from the checkout, in this process where the command runs no
    # other process (tests.helpers.runs_in_process: every row refused before the run, and those
    # refused at the start of a one-process run, before any loader worker).
    if when == "before run" or runs_in_process(argv, REPO, (EXAMPLE,), loader_workers=True):
        result = train_in_process(*argv, cwd=REPO, import_from=(EXAMPLE,))
    else:
        result = train(None, *argv, check=False, timeout=110,
                       env={"PYTHONPATH": str(EXAMPLE)})  # the tasks example's modules  # fmt: skip
    assert result.returncode == 1, result.output
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    if expected.endswith("…"):
        assert line.startswith(expected.removesuffix("…").rstrip()), line
    else:
        assert line == expected
    assert "step 1/" not in result.stdout and "| step " not in result.stdout  # no training step
    if when == "before run":
        assert not run_dir.exists(), "a run folder was made for input rejected up front"
    else:
        assert not list(run_dir.glob("checkpoints/step-*")), "left a checkpoint for resume=auto"


# --- the other commands: docs/errors.md's table of them -------------------------------------------


def _command_rows() -> list[tuple[str, str, str]]:
    """(case, command line, message) from the table under '## Other commands'."""
    text = CATALOGUE.read_text().split("## Other commands", 1)[1].split("\n## ", 1)[0]
    return [tuple(c.strip().strip("`").strip() for c in line.strip("|").split(" | "))[:3]
            for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| case", "| ---"))]  # fmt: skip


@pytest.mark.parametrize(("case", "command", "message"), _command_rows())
def test_documented_message_of_another_command(
    request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    case: str, command: str, message: str,
) -> None:  # fmt: skip
    """Each command's `main`, in this process: one line on stderr, exit 1."""
    import importlib

    paths = {**_paths(request, (command + message).replace("{tmp}", "")), "tmp": tmp_path}
    program, *args = shlex.split(_filled(command, paths))
    module = {"dpt-generate": "generate", "dpt-tokenizer": "tokenizer", "dpt-shards": "shards",
              "dpt-predict": "predict", "dpt-evaluate": "evaluate"}  # fmt: skip
    main = importlib.import_module(f"dpt.commands.{module[program]}").main
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 1
    assert capsys.readouterr().err.strip() == _filled(message, paths)
