"""How much of the device's arithmetic a step uses: tokens/s and the FLOPs of a model that counts
its own (`flops_per_token`, e.g. dpt's GPT), against the device's peak at the run's precision:
MFU, model FLOPs utilisation (the PaLM paper's measure). On a CPU, or a device this table does
not know and `trainer.peak_tflops` does not give, the achieved TFLOP/s instead."""

from __future__ import annotations

from dataclasses import dataclass

# Dense peak TFLOP/s per GPU, from the makers' data sheets (SXM parts; no sparsity): the 16-bit
# tensor cores for bf16-mixed and 16-mixed, TF32 for 32 (PyTorch uses TF32 for float32 matrix
# products only where allowed: set trainer.peak_tflops where it is not).
PEAK_TFLOPS: dict[str, tuple[float, float]] = {  # (16-bit tensor cores, TF32)
    "A100": (312.0, 156.0),
    "H100": (989.4, 494.7),
    "H200": (989.4, 494.7),
}
FLOAT32 = "32"  # trainer.precision's full precision (TF32 matrix products); the others: 16-bit


def peak_tflops(device_name: str, precision: str, given: float | None) -> float | None:
    """`trainer.peak_tflops` where given, else the table's for this GPU (by the name CUDA
    reports, e.g. "NVIDIA H100 80GB HBM3"), else None."""
    if given is not None:
        return given
    for gpu, (half, tf32) in PEAK_TFLOPS.items():
        if gpu in device_name.upper():
            return tf32 if precision == FLOAT32 else half
    return None


@dataclass(frozen=True)
class Throughput:
    """What turns samples/s into tokens/s and FLOP/s: a task's tokens per sample, a model's
    training FLOPs per token, and one device's peak (FLOP/s; None where unknown)."""

    tokens_per_sample: int
    flops_per_token: float | None
    peak_flops: float | None

    def scalars(self, samples_per_s: float, devices: int = 1) -> dict[str, float]:
        """train/tokens_per_s, and perf/mfu (a fraction) or perf/tflops, of `devices` devices
        doing `samples_per_s` together."""
        tokens = samples_per_s * self.tokens_per_sample
        found = {"train/tokens_per_s": tokens}
        if self.flops_per_token is not None:
            flops = tokens * self.flops_per_token
            if self.peak_flops:
                found["perf/mfu"] = flops / (self.peak_flops * devices)
            else:
                found["perf/tflops"] = flops / 1e12
        return found
