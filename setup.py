"""The one compiled part: dpt/data/_jpeg_box.c, a JPEG box decoder on the system's libjpeg-turbo.

Optional: where there is no compiler or no libjpeg-turbo headers (Debian: libjpeg62-turbo-dev,
which scripts/setup.sh installs when run as root), the build goes on without it and dpt decodes
whole images instead (the same samples, more slowly: dpt.data.crop_decode). Everything else is in
pyproject.toml.
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
        )
    ]
)
