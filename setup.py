"""The compiled parts of a training sample (dpt.data.crop_decode): dpt/data/_jpeg_box.c, a JPEG box
decoder on the system's libjpeg-turbo, and dpt/data/_normalize.c, the resampled crop to normalized
float32 in one vectorized pass.

Both optional: where there is no compiler or no libjpeg-turbo headers (Debian: libjpeg62-turbo-dev,
which scripts/setup.sh installs when run as root), the build goes on without them and dpt decodes
whole images and normalizes with torch instead (the same samples, more slowly). Everything else is
in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dpt.data._jpeg_box",
            ["dpt/data/_jpeg_box.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "dpt.data._normalize",
            ["dpt/data/_normalize.c"],
            # -O3 vectorizes its loops; no contraction into fused multiply-adds, which would
            # round once where torch's mul_ and add_ round twice.
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
    ]
)
