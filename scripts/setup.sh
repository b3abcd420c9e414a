#!/usr/bin/env bash
# Create ./.venv and install dpt with its test tools, the docs' tools and the optional trackers
# (MLflow, W&B: logger=[...]), from nothing.
#
# torch and torchvision are installed first as a known-good matching pair (torchvision's compiled
# ops must match torch's build); pyproject.toml itself only asks for ranges, so an existing
# environment with e.g. torch 2.11 / torchvision 0.26 works too. Override with DPT_TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
torch_spec=${DPT_TORCH_SPEC:-"torch==2.14.1 torchvision==0.29.1"}
[ -x .venv/bin/python ] || "$python" -m venv .venv
# dpt's JPEG box decoder (setup.py) compiles against libjpeg-turbo's headers. It is optional:
# where they cannot be had, the install goes on and dpt decodes whole JPEGs (same pixels, slower).
if [ ! -e /usr/include/jpeglib.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq libjpeg62-turbo-dev || { apt-get update -qq &&
    apt-get install -y -qq libjpeg62-turbo-dev; }; } >/dev/null 2>&1 ||
    echo "libjpeg62-turbo-dev could not be installed: dpt will decode whole JPEGs"
fi
pip=(.venv/bin/pip install --quiet --disable-pip-version-check)
# uv installs what pip would, resolving and unpacking in parallel: minutes sooner (torch's
# wheels are gigabytes; pip's resolver spent 2 minutes of a core on dpt's extras). It is taken
# from the same place as every package (the machine's pip settings passed on to it:
# scripts/uv_pip_args.py); where it cannot be had, or fails, pip installs.
install=("${pip[@]}")
if "${pip[@]}" "uv>=0.5,<1" >/dev/null 2>&1; then
  mapfile -t uv_args < <(.venv/bin/python scripts/uv_pip_args.py)
  export SSL_CERT_FILE=${SSL_CERT_FILE:-${PIP_CERT:-}}  # pip's certificates for a mirror
  [ -n "$SSL_CERT_FILE" ] || unset SSL_CERT_FILE
  # --compile-bytecode: the .pyc files pip writes at install; where PYTHONDONTWRITEBYTECODE is
  # set, no process would write them later, and each would compile torch's modules anew.
  install=(.venv/bin/uv pip install --quiet --compile-bytecode --python .venv/bin/python
    "${uv_args[@]}")
fi
# shellcheck disable=SC2086  # the spec is a list of requirements
"${install[@]}" $torch_spec || "${pip[@]}" $torch_spec
"${install[@]}" -e ".[dev,docs,mlflow,wandb,ray]" || "${pip[@]}" -e ".[dev,docs,mlflow,wandb,ray]"
# dpt is installed editable: its modules are imported from this checkout, and so are the tests'
# helpers and examples. Their .pyc files are written once here, as an install writes a package's:
# where PYTHONDONTWRITEBYTECODE is set no process writes them, and every process (a run, its
# ranks' fork server, a test worker) would compile what it imports of them anew.
.venv/bin/python -m compileall -q -j 0 dpt tests benchmarks scripts examples hydra_plugins >/dev/null
decoder=$(.venv/bin/python -c "from dpt.data.crop_decode import BOX_DECODER; print(BOX_DECODER)")
echo "dpt installed in $(pwd)/.venv (JPEG box decoder built: $decoder)"
