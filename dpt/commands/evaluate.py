"""The `dpt-evaluate` command: a finished run's model measured on its data set's test split (or
its validation split), the numbers computed as validation computes them.

`dpt-evaluate RUN [--split test|val] [--data PATH] [--last]` reads the run folder as dpt-predict
does (`.hydra/config.yaml`, `data.json`, `model_best.pt`, or `model.pt` with `--last` or where
there is no best), rebuilds the run's data set from its config (`--data` replaces its
`dataset.root`: data that moved) and its task, and runs validation's `evaluate`
(dpt/loop/evaluate.py) over the split in this one process. The splits are dpt.data.splits':
`test` by default, which only this command reads.

It writes `<run>/eval-<split>.json` (the metrics as `<split>/<name>`, the split, its size, the
weights; a classification's per-class table and confusion counts) and prints the metrics; a
classification also gets `<run>/confusion-<split>.png` (and the table printed), a regression
`<run>/scatter-<split>.png`; each plot is also an image in the run's TensorBoard world folder.
Last, the run's trackers get the metrics and files (dpt.observe.trackers.after_run).

torch is imported only after the arguments are parsed: `--help` and bad arguments answer fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpt import user_code
from dpt.commands.command import run_command
from dpt.config.tasks import LOSS
from dpt.data.splits import EVALUATED, VAL, has_split, missing_split, split_of
from dpt.errors import DptError
from dpt.state.results import METRICS_FILE

if TYPE_CHECKING:
    from dpt.commands.evaluate_report import Extra

DEFAULT_BATCH = 64  # a run config of before trainer.batch_size: any size gives the same numbers


@dataclass
class Evaluation:
    """One split's numbers, and where they came from."""

    split: str
    size: int  # the split's samples
    counted: int  # those read (an unreadable image is left out, as validation leaves it)
    weights: Path
    metrics: dict[str, float]  # `<split>/<name>`: the task's validation metrics, the loss first
    extra: Extra
    source: str  # where the split's data is (the data set's root), for people


# --- the run's parts --------------------------------------------------------------------------


def run_dataset(cfg: Any, data_path: str | None) -> Any:
    """The run's data set, built from its config as its ranks built it (`trainer.seed`: the
    same seeded validation split); `data_path` replaces `dataset.root`."""
    from omegaconf import OmegaConf

    from dpt.loop.parts import build_data

    node = cfg.dataset
    if data_path is not None:
        if "root" not in node:
            target = node.get("_target_")
            raise DptError(f"--data {data_path}: the run's data set ({target}) has no "
                           "dataset.root to replace: its keys say where its data is")  # fmt: skip
        node.root = data_path
    elif _local_root(node) and not Path(node.root).exists():
        raise DptError(f"dataset.root={node.root}: not found (the run's data set; --data PATH "
                       "reads it from where it is now)")  # fmt: skip
    seed = int(OmegaConf.select(cfg, "trainer.seed", default=0))
    return build_data(node, seed)[0]


def _local_root(node: Any) -> bool:
    """Whether the data set's root is a path here (not a URL, which shards may be)."""
    root = node.get("root")
    return isinstance(root, str) and "://" not in root


def choose_split(data: Any, asked: str | None) -> str:
    """`asked`, where the data set has it; else the first of EVALUATED it has. One line naming
    the data set and the splits it has where it has not."""
    if asked is not None:
        if not has_split(data, asked):
            raise DptError(f"--split {asked}: {missing_split(data, asked)}")
        return asked
    default = EVALUATED[0]
    if has_split(data, default):
        return default
    hint = f": --split {VAL} evaluates its validation split" if has_split(data, VAL) else ""
    raise DptError(f"{missing_split(data, default)}{hint}")


def measure(run_dir: Path, cfg: Any, data: Any, split: str, last: bool) -> Evaluation:
    """The run's model and task over `split`: validation's metrics, and its task's extras
    (`cfg`: the run's config)."""
    from omegaconf import OmegaConf

    from dpt.commands.evaluate_report import collector_for
    from dpt.commands.run_model import Predictor, task_config
    from dpt.data.loaders import ToDevice, eval_loader
    from dpt.distributed import DistEnv
    from dpt.loop.evaluate import evaluate
    from dpt.loop.parts import build_data_task
    from dpt.state.results import read_run_data

    predictor = Predictor.from_run(run_dir, last=last)
    if predictor.notice:
        print(f"Note: {predictor.notice}", file=sys.stderr)
    # Built as training built it, from the data set: its targets, its class names.
    task = build_data_task(task_config(run_dir, read_run_data(run_dir), cfg), data)
    task = task.to(predictor.device)
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=predictor.device)
    batch = int(OmegaConf.select(cfg, "trainer.batch_size", default=DEFAULT_BATCH))
    seed = int(OmegaConf.select(cfg, "trainer.seed", default=0))
    dataset = split_of(data, split)
    loader = eval_loader(data, dataset, env, batch, seed, task.targets)
    collector = collector_for(task, predictor.device)
    to_device = ToDevice(predictor.device, predictor.channels_last)
    found = evaluate(predictor.model, loader, env, task, predictor.autocast, to_device,
                     on_batch=collector.update)  # fmt: skip
    values = {key.removeprefix("val/"): value for key, value in found.items()}
    counted, missing = int(values.pop("samples")), int(values.pop("missing"))
    if missing:
        raise DptError(f"{missing} of the {split} split's {len(dataset)} samples could not be had "
                       "(their shards could not be fetched): no metrics of part of it")  # fmt: skip
    metrics = {f"{split}/{name}": values[name] for name in sorted(values, key=_loss_first)}
    return Evaluation(split, len(dataset), counted, predictor.weights, metrics,
                      collector.finish(split), data_source(data))  # fmt: skip


def _loss_first(name: str) -> tuple[bool, str]:
    return name != LOSS, name


def data_source(data: Any) -> str:
    """The data set's root where it has one, else its class."""
    root = getattr(data, "root", None)
    kind = type(data)
    return str(root) if root is not None else f"{kind.__module__}.{kind.__qualname__}"


# --- what it leaves ---------------------------------------------------------------------------


def eval_file(run_dir: Path, split: str) -> Path:
    return run_dir / f"eval-{split}.json"


def write_outputs(run_dir: Path, result: Evaluation) -> list[Path]:
    """eval-<split>.json and the plots' PNGs (also in TensorBoard's world folder): the files
    written, the JSON first."""
    from dpt.commands.evaluate_report import tensorboard_images
    from dpt.observe.dashboard import WORLD, one_run

    record = {
        "split": result.split,
        "size": result.size,
        "samples": result.counted,
        "weights": str(result.weights),
        "data": result.source,
        "metrics": result.metrics,
        **result.extra.report,
    }
    path = eval_file(run_dir, result.split)
    path.write_text(json.dumps(record, indent=2) + "\n")
    written = [path]
    for plot in result.extra.plots:
        png = run_dir / f"{plot.name}-{result.split}.png"
        png.write_bytes(plot.png)
        written.append(png)
    if result.extra.plots:
        world = one_run(run_dir).folder / WORLD
        tensorboard_images(world, result.extra.plots, result.split, run_steps(run_dir))
    return written


def run_steps(run_dir: Path) -> int:
    """The steps the run trained (metrics.json), where its images go on TensorBoard's slider."""
    try:
        return int(json.loads((run_dir / METRICS_FILE).read_text()).get("steps", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def report_lines(result: Evaluation, written: list[Path]) -> list[str]:
    """What the console shows: the split and weights, the metrics, the task's table, the files."""
    unread = result.size - result.counted
    skipped = f" ({unread} unreadable, left out)" if unread else ""
    lines = [f"{result.split} split of {result.source}: {result.size} samples{skipped}; weights "
             f"{result.weights}"]  # fmt: skip
    width = max(len(key) for key in result.metrics)
    lines += [f"{key:<{width}}  {value:.6g}" for key, value in result.metrics.items()]
    if result.extra.lines:
        lines += ["", *result.extra.lines]
    lines.append(f"wrote {', '.join(str(p) for p in written)}")
    return lines


def send_to_trackers(run_dir: Path, metrics: dict[str, float], files: list[Path]) -> None:
    """The run's trackers (MLflow, ...) get the evaluation, as they got the run's metrics; a
    line names those that took it (a run without trackers: none)."""
    from dpt.observe.trackers.after_run import log_evaluation

    took = log_evaluation(run_dir, metrics, files, run_steps(run_dir))
    if took:
        print(f"logged to {', '.join(took)}")


# --- the command ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpt-evaluate",
        description=(
            "Measure a finished run's model on its data set's test split (or validation "
            "split), with the metrics its validation reports; a classification also gets a "
            "per-class table and a confusion matrix, a regression a scatter plot."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN", help="the run folder (holds data.json)")
    parser.add_argument(
        "--split",
        choices=EVALUATED,
        help=f"the split to measure (default: {EVALUATED[0]}, where the data set has one)",
    )
    parser.add_argument(
        "--data",
        metavar="PATH",
        help="where the run's data set is now (replaces its dataset.root): data that moved",
    )
    parser.add_argument(
        "--last", action="store_true", help="use model.pt (the last epoch), not model_best.pt"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    from dpt.commands.run_model import run_config, run_folder, weights_file
    from dpt.state.results import read_run_data

    run_dir = run_folder(Path(args.run_dir))  # the cheap checks first: the data takes time
    read_run_data(run_dir)
    weights_file(run_dir, args.last)
    cfg = run_config(run_dir)
    data = run_dataset(cfg, args.data)
    split = choose_split(data, args.split)
    result = measure(run_dir, cfg, data, split, args.last)
    written = write_outputs(run_dir, result)
    print("\n".join(report_lines(result, written)))
    send_to_trackers(run_dir, result.metrics, written)


def main(argv: Sequence[str] | None = None) -> None:
    """`dpt-evaluate`: errors as one line on stderr (exit 1), never a traceback."""
    args = parse_args(argv)
    user_code.add_start_folder()  # a run's own data set or model imports as under `dpt`
    run_command(lambda: run(args))


if __name__ == "__main__":
    main()
