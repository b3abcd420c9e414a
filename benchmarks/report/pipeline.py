"""Section 3 of the report, from the `pipeline` section (benchmarks/pipeline.py): images/s per
loader worker, from files and from shards, the shard cache's counters, the verdicts, and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.pipeline import HTTP_SHARDS, HTTP_SMALL_CACHE, LOCAL_SHARDS, SAMPLE, SIZE
from benchmarks.report.common import Results, TargetRow, error_bars, fmt_ratio, md_table, target
from benchmarks.runner import Stat

PLOT = "perf_pipeline.png"
SAMPLE_TARGET = 0.9  # dpt's whole training sample from files, against decoding alone
SHARDS_TARGET = 0.95  # the sample from local shards, against the same from files
SHARD_ROWS = (LOCAL_SHARDS, HTTP_SHARDS, HTTP_SMALL_CACHE)
REMOTE_LABELS = {
    HTTP_SHARDS: "Shards over HTTP, cached",
    HTTP_SMALL_CACHE: "Shards over HTTP through a cache of half the set",
}


def targets(results: Results) -> list[TargetRow]:
    """Per size measured: the whole sample against decode-only, local shards against files."""
    rows = []
    for r in results.get("pipeline", []):
        px = _px(r)
        if r["what"] == SAMPLE:
            name = f"pipeline: dpt train sample (files) >= {SAMPLE_TARGET} of decode-only, {px}"
            rows.append(target(name, r["vs_decode"], lambda v: v >= SAMPLE_TARGET))
        elif r["what"] == LOCAL_SHARDS and "vs_sample" in r:
            name = f"pipeline: shards (local) >= {SHARDS_TARGET} of files, {px}"
            rows.append(target(name, r["vs_sample"], lambda v: v >= SHARDS_TARGET))
    return rows


def chapters(results: Results) -> list[str]:
    return [_pipeline(results)]


def plot(out: Path, results: Results) -> None:
    if "pipeline" in results:
        _plot_pipeline(out / PLOT, results["pipeline"])


def _px(row: dict[str, Any]) -> str:
    # Rows saved before the size was recorded were all at 224 px.
    size = row.get("size", SIZE)
    return f"{size} px" if size else "-"


def _pipeline(results: Results) -> str:
    if "pipeline" not in results:
        return ""
    rows = [
        (
            r["decoder"],
            r["what"],
            _px(r),
            r["images_s"].fmt(),
            fmt_ratio(r["vs_decode"]),
            fmt_ratio(r["vs_sample"]) if "vs_sample" in r else "",
        )
        for r in results["pipeline"]
    ]
    table = md_table(
        "decoder | variant | output | images/s per worker | vs decode-only | vs dpt train sample "
        "(files)",
        rows,
    )
    parts = [
        _intro(results),
        table,
        _cache_table(results),
        _verdicts(results["pipeline"]),
    ]
    return "\n\n".join(p for p in parts if p) + f"\n\n![pipeline]({PLOT})"


def _intro(results: Results) -> str:
    shards = results.get("pipeline_shards")
    as_shards = (
        f" The same files as {shards['count']} WebDataset shards of about "
        f"{shards['largest'] / 1e6:.1f} MB ({shards['bytes'] / 1e6:.1f} MB in all), written by "
        "`dpt-shards --coco`."
        if shards
        else ""
    )
    rounds = results["pipeline"][0]["images_s"].n if results["pipeline"] else 0
    return (
        "## 3. Input pipeline, per loader worker\n\n"
        f"{results['pipeline_files']} JPEGs of 640x480 (quality 90, photo-like content, about "
        f"80 kB each), laid out as COCO.{as_shards} One process with one intra-op thread (what a "
        f"DataLoader worker runs), every variant one pass over the images per round, {rounds} "
        "rounds after a warmup round. Before each sample torch's CPU generator is seeded with "
        "its index, as dpt seeds a training sample (dpt/data/seeded.py), so every variant draws "
        "the same crops and flips (the section checks that dpt's sample is the same tensor from "
        "every form).\n\n"
        "- *dpt train sample*: what `dataset=coco` (and `dataset=image_folder`) train on, "
        "`CocoClassification.__getitem__` with `RandomResizedCropDecode(S)` "
        "(dpt/data/crop_decode.py): the file read, `RandomResizedCrop`'s draws, the crop's box "
        "of the JPEG decoded, at 1/2, 1/4 or 1/8 of the image's size where the crop is at least "
        "2, 4 or 8 times S on both sides, then resampled, and flipped and normalized to float32 "
        "in one vectorized pass (dpt/data/_normalize.c; torch's passes where it is not built). "
        "*dpt box decoder*: dpt's compiled decoder (dpt/data/_jpeg_box.c, on libjpeg-turbo) "
        "decodes the box alone: the rows above it only entropy-decoded, the columns beside it "
        "not transformed, the rows below it not read. *PIL draft / decode_jpeg* (where it is "
        "not built): the whole image, at the reduction (PIL's `draft`) or whole (`decode_jpeg`), "
        "then cropped. At 224 px from 640x480 about 1 crop in 10 is large enough for 1/2; at "
        "128 px, 3 in 4.\n"
        "- *local shards*: the same sample from the shards in a folder, "
        "`ShardsData(root=<folder>).train[i]` (`dataset=shards`): the shard opened in place and "
        "indexed (wids), the member's bytes, the same decoder.\n"
        "- *shards over HTTP*: the same shards served on loopback by Python's `http.server` in a "
        "thread of the benchmark's process, read through dpt's shard cache (a fresh cache "
        "folder, room for the whole set): the first (warmup, untimed) pass downloads every "
        "shard, the timed passes find them cached. *cache < set*: the same with a cache of half "
        "the set: read in order, every shard is evicted before its next turn, so every pass "
        "downloads the whole set again (and the server's thread serves it, on the same 2 cores). "
        "Each pass opens every shard again (there are more than the 3 a reader keeps open), as "
        "an epoch over a large set does.\n"
        "- *decoder alone*: the same decoder on the file's bytes, without the data set around "
        "it. *train_transform after a whole decode*: the sample dpt's decoder replaced, "
        "`decode_jpeg` of the whole image, then `train_transform(S)` (`RandomResizedCrop`, "
        "flip, float32, normalize). *crop+flip, uint8 out*: that without the float conversion "
        "and normalization. *PIL train transform*: the classic recipe, crop and flip on the PIL "
        "image, then to a normalized tensor.\n\n"
        "*vs decode-only* divides by the decode-only row of the variant's decoder (decode_jpeg's "
        "for dpt's decoder), *vs dpt train sample (files)* by dpt's sample from files at the "
        "same size, round by round. The ranges are min-max over all rounds: on a shared 2-core "
        "VM a single pass now and then runs up to ~30 % slow or fast, the next one not, so the "
        "ranges are wide; the medians are the measurement."
    )


def _cache_table(results: Results) -> str:
    rows = [r for r in results["pipeline"] if "cache" in r]
    if not rows:
        return ""
    lines = [
        (
            r["what"],
            _px(r),
            f"{r['cache']['limit_bytes'] / 1e6:.1f} MB",
            _counts(r["cache"]["first_pass"]),
            f"{r['cache']['timed_passes']}: " + _counts(r["cache"]["timed"]),
            f"{r['cache']['hit_rate']:.2f}",
        )
        for r in rows
    ]
    return (
        "The shard cache's counters (`CacheStats` of the reading process): the first pass, on a "
        "fresh cache (the untimed warmup), and the timed passes together.\n\n"
        + md_table(
            "variant | output | cache limit | first pass | timed passes | hit rate, timed passes",
            lines,
        )
    )


def _counts(counts: dict[str, int]) -> str:
    return (
        f"{counts['hits']} hits, {counts['misses']} misses, "
        f"{counts['bytes_downloaded'] / 1e6:.1f} MB downloaded, {counts['evictions']} evictions"
    )


def _verdicts(rows: list[dict[str, Any]]) -> str:
    """What met its target and what did not, in words, with the numbers."""
    lines = [line for r in rows if (line := _verdict_line(r))]
    if not lines:
        return ""
    return (
        "**Against the targets** (the median decides, as in the targets table).\n\n"
        + "\n".join(lines)
        + "\n\nWhat holds the whole sample at 224 px near decoding alone on 640x480 images: "
        "about 9 crops in 10 are smaller than 448 px on a side, so they decode at full size; "
        "the entropy (Huffman) decoding of every row down to the crop's last, which no decoder "
        "can skip in a JPEG without restart markers, is more than half of a whole decode; and "
        "resampling the crop (about 0.25 ms), torchvision's draws (0.05-0.1 ms) and the "
        "normalized float32 (0.03-0.05 ms in one pass; 0.11-0.14 ms in torch's flip, converting "
        "copy and two passes, which held this ratio at 0.84-0.89 side by side) come on top "
        "(dpt/data/crop_decode.py's docstring). At 128 px 3 crops in 4 decode at half "
        "the size (none at a quarter: that needs 512 px on both sides), so the sample costs "
        "less than decoding alone (the 128 px rows: dpt's sample against the whole-decode "
        "recipe)."
    )


def _verdict_line(row: dict[str, Any]) -> str | None:
    what, px = row["what"], _px(row)
    if what == SAMPLE:
        name = f"dpt's whole sample from files, {px}, against decode-only"
        return _verdict(name, row["vs_decode"], SAMPLE_TARGET)
    if "vs_sample" not in row:
        return None
    if what == LOCAL_SHARDS:
        name = f"Local shards, {px}, against files"
        return _verdict(name, row["vs_sample"], SHARDS_TARGET)
    if what in REMOTE_LABELS:
        cache = row["cache"]
        return (
            f"- {REMOTE_LABELS[what]}, {px}, against files: {fmt_ratio(row['vs_sample'])} (no "
            f"target; hit rate {cache['hit_rate']:.2f} over the timed passes, "
            f"{cache['timed']['bytes_downloaded'] / 1e6:.1f} MB downloaded in them)."
        )
    return None


def _verdict(what: str, stat: Stat, goal: float) -> str:
    _, measured, verdict = target(what, stat, lambda v: v >= goal)
    return f"- {what}: {measured}, target {goal}: {verdict}."


def _plot_pipeline(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    labels = [f"{r['decoder']}: {r['what']}" + (f", {r['size']} px" if r.get("size") else "")
              for r in rows][::-1]  # fmt: skip
    stats = [r["images_s"] for r in rows][::-1]
    colors = [_color(r) for r in rows][::-1]
    y = range(len(rows))
    ax.barh(y, [s.median for s in stats], xerr=error_bars(stats), color=colors, capsize=3)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.set_xlabel(
        "images/s per worker (one thread)\n"
        "grey: decode-only ceiling; green: dpt's sample from shards"
    )
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


def _color(row: dict[str, Any]) -> str:
    if row["what"] == "decode only":
        return "#9a9a9a"
    return "#3a9a5b" if row["what"] in SHARD_ROWS else "#2f6db5"
