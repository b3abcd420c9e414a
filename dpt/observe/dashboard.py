"""What TensorBoard shows of a run or a sweep: run names, the HPARAMS experiment, the overlays.

TensorBoard names a run by its folder relative to `--logdir`, so folder names are the run names.
One run writes `<run>/tb/rank<k>/` and `<run>/tb/world/`. A job of a sweep writes under the
sweep instead, `<sweep>/tb/<job> <swept key=value,...>/rank<k>/`, so that the jobs' runs read
`tb/3 trainer.seed=2/rank0` rather than `3/tb/rank0`.

HPARAMS reads one experiment summary (every key, the values it took, whether it `differs`,
the metrics) and one session per run (its values, its end). The first experiment it finds wins,
so there is exactly one: rank 0 of a single run writes it, the sweep's callback writes a sweep's
(`<sweep>/tb/`, once every job has run). A session's metrics are the world folder's own scalar
tags (their last value), so nothing is written twice as single `hparam/*` points.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpt.config.tasks import ClassificationTaskConfig

TB_FOLDER = "tb"
WORLD = "world"


def session_metrics(val: Sequence[str]) -> tuple[str, ...]:
    """The metrics HPARAMS lists for each session: tags of the world folder, their last value:
    the training loss and speed, the task's validation metrics (`val`), and `objective`, what
    the run reports to a search (sweep.objective), the same in every run."""
    return ("train/loss", "train/samples_per_s", *val, "objective")


# Those of the default task, classification.
SESSION_METRICS = session_metrics(tuple(f"val/{m}" for m in ClassificationTaskConfig.reports))
# Custom scalars: one chart each, every rank's (and the world's) curve overlaid.
OVERLAYS = {
    "loss": r"^train/loss$",
    "samples/s": r"^train/samples_per_s$",
    "step time (s)": r"^time/step_s$",
}
OVERLAY_CATEGORY = "every rank"
MAX_LABEL = 120  # a folder name, well under file systems' 255 bytes


@dataclass(frozen=True)
class TbPlace:
    """Where a run's TensorBoard folders go, and what HPARAMS lists of its Hydra job. Made in
    the process where Hydra runs the job (dpt.launch.job_place), from Hydra's own config there,
    and handed to every rank resolved: a rank never reads Hydra's config again (its sweep folder
    is `multirun/${now:...}`, whose resolver and the time it gave live in that process only)."""

    folder: Path  # where this run's rank<k>/ and world/ folders go
    writes_experiment: bool  # False in a sweep: the sweep writes the one experiment
    groups: dict[str, str] = field(default_factory=dict)  # each config group's option
    sweep_dir: Path | None = None  # a sweep's job: the sweep's folder (its trackers' parent run)


def one_run(run_dir: Path) -> TbPlace:
    """A run of its own: `<run>/tb/`, no group options known (no Hydra job: a test, a script)."""
    return TbPlace(run_dir / TB_FOLDER, writes_experiment=True)


def job_label(job: int, overrides: list[str], swept: set[str]) -> str:
    """`3 strategy=ddp,optimizer.lr=0.00443`: the job number and its values of the swept keys."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    values = [short_override(o) for o in parsed if o.get_key_element() in swept]
    label = " ".join([str(job), ",".join(values)]).strip()
    # A "/" in a value (a path) would make nested folders, hence nested run names.
    return label.replace("/", "_")[:MAX_LABEL]


def short_override(override: Any) -> str:
    """`key=value` of a parsed Hydra override, a float in 4 significant digits (a search's
    trial draws 16: `optimizer.lr=0.004430375245218269` -> `optimizer.lr=0.00443`)."""
    value = override.value()
    text = f"{value:.4g}" if isinstance(value, float) else override.get_value_element_as_str()
    return f"{override.get_key_element()}={text}"


# --- summaries (protocol buffers TensorBoard's plugins read) -------------------------------------


def experiment(runs: list[dict[str, Any]], metrics: Sequence[str] = SESSION_METRICS) -> Any:
    """The HPARAMS experiment of these runs' hparams: every key with the values it took
    (`differs` where they are not all the same, or some run lacks the key) and the metrics."""
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    infos = []
    for key in sorted({k for hparams in runs for k in hparams}):
        values = [hparams[key] for hparams in runs if key in hparams]
        kind = _data_type(values, api_pb2)
        distinct = sorted({str(v) for v in values} if kind == api_pb2.DATA_TYPE_STRING
                          else set(values))  # fmt: skip
        info = api_pb2.HParamInfo(name=key, type=kind,
                                  differs=len(distinct) > 1 or len(values) < len(runs))  # fmt: skip
        info.domain_discrete.extend(distinct)
        infos.append(info)
    metrics = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag), display_name=tag)
               for tag in metrics]  # fmt: skip
    data = plugin_data_pb2.HParamsPluginData(
        experiment=api_pb2.Experiment(
            hparam_infos=infos, metric_infos=metrics, time_created_secs=time.time()
        )
    )
    return _hparams_summary(metadata.EXPERIMENT_TAG, data)


def _data_type(values: list[Any], api_pb2: Any) -> int:
    """One type for all of a key's values; a mix (e.g. a number and a string) is a string."""
    kinds = {bool if isinstance(v, bool) else str if isinstance(v, str) else float for v in values}
    if kinds == {bool}:
        return api_pb2.DATA_TYPE_BOOL
    return api_pb2.DATA_TYPE_FLOAT64 if kinds == {float} else api_pb2.DATA_TYPE_STRING


def session_start(hparams: dict[str, Any]) -> Any:
    """This run's hparam values. No group name: HPARAMS then groups the session by itself, under
    its run's name (two runs with the same values stay two rows)."""
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    info = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for key, value in hparams.items():
        info.hparams[key].CopyFrom(_value(value))
    return _hparams_summary(
        metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_start_info=info)
    )


def text(tag: str, value: str) -> Any:
    """A text summary (TensorBoard's Text tab), e.g. a monitor event's line."""
    from tensorboard.plugins.text.summary_v2 import text_pb

    return text_pb(tag, value)


def session_end(ok: bool) -> Any:
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    status = api_pb2.STATUS_SUCCESS if ok else api_pb2.STATUS_FAILURE
    info = plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=time.time())
    return _hparams_summary(
        metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=info)
    )


def overlay_layout() -> Any:
    """The custom-scalars layout. TensorBoard merges every run's layout and drops charts it has
    already seen, so each job of a sweep may write it and it still shows once."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    charts = [
        layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=[regex]))
        for title, regex in OVERLAYS.items()
    ]
    layout = layout_pb2.Layout(category=[layout_pb2.Category(title=OVERLAY_CATEGORY,
                                                             chart=charts)])  # fmt: skip
    tensor = TensorProto(dtype="DT_STRING", string_val=[layout.SerializeToString()],
                         tensor_shape=TensorShapeProto())  # fmt: skip
    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME))
    return Summary(value=[Summary.Value(tag=metadata.CONFIG_SUMMARY_TAG, tensor=tensor,
                                        metadata=meta)])  # fmt: skip


def _value(value: Any) -> Any:
    from google.protobuf import struct_pb2

    if isinstance(value, bool):
        return struct_pb2.Value(bool_value=value)
    if isinstance(value, int | float):
        return struct_pb2.Value(number_value=value)
    return struct_pb2.Value(string_value=str(value))


def _hparams_summary(tag: str, data: Any) -> Any:
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import metadata

    meta = metadata.create_summary_metadata(data)
    return Summary(value=[Summary.Value(tag=tag, metadata=meta, tensor=metadata.NULL_TENSOR)])


def write_sweep_experiment(
    sweep_dir: Path, runs: list[dict[str, Any]], metrics: Sequence[str] = SESSION_METRICS
) -> None:
    """The sweep's one experiment, beside its jobs' folders (`<sweep>/tb/`)."""
    if runs:
        from dpt.observe.event_file import write

        write(sweep_dir / TB_FOLDER, [experiment(runs, metrics)])
