#!/usr/bin/env bash
# Download, here (with network), the wheels the GPU machine needs, into .whl/ at the repo root.
#
# The lent GPU machine (nvidia-h200: Python 3.12, torch 2.11, transformers 5.17, huggingface_hub
# 1.x, no network; see /work/.library/device/KINDS.md) lacks the transformers this project pins
# (5.25.0) and what it needs that the image has only in older versions.  benchmarks/device_check.sh
# installs these wheels there with `pip install --no-index --no-deps --target /tmp/site`; the
# device tool's `run` takes them along with carry [".whl"].  The versions are those of the
# development virtualenv (.venv), which CI uses too.  Neighbours: benchmarks/device_check.sh,
# docs/performance.md ("GPU check: how to run it").
#
# Usage: bash benchmarks/fetch_device_wheels.sh   (from anywhere; PYTHON=... to pick the pip)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# .whl/ must not be committed, and the device tool sends ignored paths only when carried.
exclude="$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"

WHEELS=(
  transformers==5.25.0
  huggingface_hub==2.4.0   # transformers 5.25 needs >=2.4 (the image has 1.x)
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5   # huggingface_hub 2.x's HTTP client
  anyio==4.16.0 idna==3.20                                # httpx2 needs anyio>=4.10, idna>=3.18
  click==8.5.1             # huggingface_hub 2.x needs >=8.4.2
  hf-xet==1.8.0
  kernels==0.19.1 tomlkit==0.15.3                         # transformers 5.25 needs kernels 0.19
  regex==2026.11.19        # transformers needs >=2025.10.22
  safetensors==0.8.0
)

mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
echo "fetch_device_wheels: $(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (the device tool carries 64 MiB in all)"
