"""Section 11 of the report, from the `gpu` section (benchmarks/gpu.py), with its own targets and
the machine it ran on: a marked section (`<!-- bench_gpu -->`), measured where a GPU is and kept
by later reports from machines without one (benchmarks/report/document.py). Where no CUDA device
was ever available, it says so and how to measure it."""

from __future__ import annotations

from benchmarks.report.common import Results, TargetRow, fmt_ratio, md_table, target


def targets(results: Results) -> list[TargetRow]:
    gpu = results.get("gpu")
    if gpu:
        syn, ratio = gpu["in_process"]["synthetic"], gpu["in_process"]["jpeg_vs_synthetic"]
        return [
            target("ResNet-18 bf16 channels_last >= 10,000 images/s (synthetic)", syn,
                   lambda v: v >= 10_000, ",.0f"),
            target("JPEG with GPU decoding >= 0.9 of synthetic", ratio, lambda v: v >= 0.9),
        ]  # fmt: skip
    if "gpu" in results:
        return [
            (name, "-", "not measured (no GPU in this run)")
            for name in ("ResNet-18 bf16 channels_last >= 10,000 images/s on one H100",
                         "JPEG with GPU decoding >= 0.9 of synthetic")
        ]  # fmt: skip
    return []


def chapters(results: Results) -> list[str]:
    return [_gpu(results)] if "gpu" in results else []


def _gpu(results: Results) -> str:
    how = (
        "To measure it, on a machine with one CUDA GPU: `python -m benchmarks --sections "
        "gpu,pipeline` (adds batched GPU decoding to section 3), or the whole benchmark. It runs "
        "ResNet-18 in bf16 with channels_last at 224 px, batch 256: dpt (`dataset=fake_images`, "
        "`trainer.precision=bf16-mixed model.channels_last=true`) against the plain loop with the "
        "same flags, and in-process the model on synthetic batches already on the GPU against "
        "the same step fed from JPEG files decoded on the GPU in batches "
        '(`torchvision.io.decode_jpeg(list_of_tensors, device="cuda")`, crop, flip and '
        "normalize on the GPU)."
    )
    gpu = results.get("gpu")
    if "gpu" not in results:
        return ""
    if gpu is None:
        return (
            "## 11. The GPU path\n\n**Not measured yet: no CUDA device was available.** "
            "No GPU numbers are given here; none were estimated.\n\n" + how
        )
    ip, loop = gpu["in_process"], gpu["loop"]
    rows = [
        ("synthetic 224 px on the GPU (model ceiling), in-process", ip["synthetic"].fmt(), "-"),
        ("JPEG decoded on the GPU, in-process", ip["jpeg_gpu_decode"].fmt(),
         fmt_ratio(ip["jpeg_vs_synthetic"]) + " of synthetic"),
        (f"plain loop, fake_images, {gpu['workers']} loader workers", loop["plain"].fmt(), "-"),
        (f"dpt, fake_images, {gpu['workers']} loader workers", loop["dpt"].fmt(),
         fmt_ratio(loop["ratio"]) + " of plain"),
    ]  # fmt: skip
    verdicts = "\n".join(f"- {name}: {measured}, {verdict}" for name, measured, verdict in
                         targets(results))  # fmt: skip
    return (
        f"## 11. The GPU path: {gpu['device']}\n\n"
        + _machine(gpu)
        + md_table(("ResNet-18, bf16, channels_last, batch 256", "images/s", "ratio"), rows)
        + "\n\n**Against the targets** (the median decides):\n\n"
        + verdicts
        + "\n\n"
        + how
    )


def _machine(gpu: dict) -> str:
    """Where and when it was measured: not the CPU machine of the report's header."""
    if "software" not in gpu:
        return ""
    return f"Measured {gpu['date']} with {gpu['software']}, {gpu['cores']} CPU cores.\n\n"
