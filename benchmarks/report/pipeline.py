"""Section 3 of the report, from the `pipeline` section (benchmarks/pipeline.py): images/s per
loader worker, and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import Results, TargetRow, error_bars, fmt_ratio, md_table, target

PLOT = "perf_pipeline.png"
# The rows that make a whole training sample, each held to 0.9 of its decoder's decode-only rate.
TRAINING_SAMPLES = ("dpt train sample", "reduced decode", "train transform")


def targets(results: Results) -> list[TargetRow]:
    rows = []
    for r in results.get("pipeline", []):
        if r["what"] in TRAINING_SAMPLES:
            name = f"pipeline >= 0.9 of decode-only: {r['decoder']}"
            rows.append(target(name, r["vs_decode"], lambda v: v >= 0.9))
    return rows


def chapters(results: Results) -> list[str]:
    return [_pipeline(results)]


def plot(out: Path, results: Results) -> None:
    if "pipeline" in results:
        _plot_pipeline(out / PLOT, results["pipeline"])


def _pipeline(results: Results) -> str:
    if "pipeline" not in results:
        return ""
    rows = [
        (
            r["decoder"],
            r["what"],
            r["images_s"].fmt(),
            fmt_ratio(r["vs_decode"]),
            fmt_ratio(r["vs_sample"]) if "vs_sample" in r else "",
        )
        for r in results["pipeline"]
    ]
    return (
        "## 3. Input pipeline, per loader worker\n\n"
        f"{results['pipeline_files']} JPEGs of 640x480 (quality 90, photo-like content, about "
        "80 kB each), one process with one intra-op thread (what a DataLoader worker runs), "
        "every variant one pass over the files per round. *dpt train sample* is "
        "`CocoClassification.__getitem__` with `train_transform(224)`: read, `decode_jpeg`, "
        "`RandomResizedCrop(224)`, flip, float32, normalize. *crop+flip, uint8 out* is the same "
        "without the float conversion and normalization (what a worker would do if the trainer "
        "normalized on the device). *reduced decode* is `dpt.data.crop_decode."
        "RandomResizedCropDecode(224)` on the file's bytes: the same random draws, the JPEG "
        "decoded at 1/2, 1/4 or 1/8 of its size (PIL's `draft`) where the crop is at least 2, 4 "
        "or 8 times 224 px on both sides, whole by `decode_jpeg` elsewhere; at 224 px from "
        "640x480 only about 1 crop in 10 is that large. *PIL train transform*: the classic "
        "recipe, crop and flip on the PIL image, then to a normalized tensor. *vs decode-only* "
        "divides by the decode-only row of the same decoder (decode_jpeg's for the reduced "
        "decode), round by round; *vs dpt train sample* by the full-decode sample's rate.\n\n"
        + md_table(
            "decoder | variant | images/s per worker | vs decode-only | vs dpt train sample", rows
        )
        + f"\n\n![pipeline]({PLOT})"
    )


def _plot_pipeline(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.2))
    labels = [f"{r['decoder']}: {r['what']}" for r in rows][::-1]
    stats = [r["images_s"] for r in rows][::-1]
    colors = ["#9a9a9a" if r["what"] == "decode only" else "#2f6db5" for r in rows][::-1]
    y = range(len(rows))
    ax.barh(y, [s.median for s in stats], xerr=error_bars(stats), color=colors, capsize=3)
    ax.set_yticks(list(y), labels)
    ax.set_xlabel("images/s per worker (one thread); grey: decode-only ceiling")
    for i, r in enumerate(rows[::-1]):
        if r["what"] != "decode only":
            ax.annotate(
                f"{r['vs_decode'].median:.2f}x decode-only",
                (stats[i].high, i),
                textcoords="offset points",
                xytext=(4, -3),
                fontsize=8,
            )
    ax.margins(x=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
