#!/usr/bin/env bash
# The GPU checks, in one script, for a session lent the H200 (issue 27): tests/gpu and
# benchmarks/gpu_check.py --quick, with every log written under $OUT.
#
# The device machine has torch 2.11, Python 3.12 and no network.  Before the call, here (with
# network): `bash benchmarks/fetch_device_wheels.sh` (transformers 5.25 and what it needs, into
# .whl/).  Then one call of the device tool, from the repo root:
#     run(command="bash benchmarks/device_check.sh", carry=[".whl"], timeout_s=600)
# What it does there: installs the wheels into /tmp/site (first on PYTHONPATH), installs this
# project editable without its dependencies (torch 2.11 stays; `autopar.passes` and
# `autopar.cost` need the install's package mapping), then runs
#   1. pytest tests/gpu                                 -> $OUT/pytest_gpu.log
#   2. benchmarks/gpu_check.py --quick --json gpu.json  -> $OUT/gpu_check.log, $OUT/gpu.json
# and writes $OUT/env.log (GPU, versions), $OUT/install.log and $OUT/summary.txt.  Expected wall
# time: about 1-2 minutes of tests and under 3 of the check; each step has its own timeout so the
# other still runs.  Exit status: 0 when both passed.  Outside the device tool $OUT defaults to
# ./device-check-out.  Neighbours: tests/gpu/test_gpu.py, benchmarks/gpu_check.py,
# benchmarks/fetch_device_wheels.sh, docs/performance.md ("GPU check: how to run it").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

{
  date -u
  nvidia-smi || true
  "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
} >"$OUT/env.log" 2>&1

if ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "autopar: device_check: no wheels in .whl/; run benchmarks/fetch_device_wheels.sh here first and carry .whl" | tee "$OUT/summary.txt"
  exit 2
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
{
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . &&
    "$PY" -c "import transformers, huggingface_hub, autopar.passes, autopar.cost; print('transformers', transformers.__version__, 'huggingface_hub', huggingface_hub.__version__, 'autopar', autopar.__file__)"
} >"$OUT/install.log" 2>&1
rc_install=$?
cat "$OUT/install.log"
if [ "$rc_install" -ne 0 ]; then
  echo "autopar: device_check: installing the wheels or the project failed (rc $rc_install); see install.log" | tee "$OUT/summary.txt"
  exit 3
fi

timeout 300 "$PY" -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log"
rc_tests=${PIPESTATUS[0]}

timeout 270 "$PY" benchmarks/gpu_check.py --quick --json "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu_check.log"
rc_check=${PIPESTATUS[0]}

{
  echo "tests/gpu: rc $rc_tests$([ "$rc_tests" -eq 124 ] && echo ' (timed out)')"
  echo "gpu_check --quick: rc $rc_check$([ "$rc_check" -eq 124 ] && echo ' (timed out)')"
  tail -n 1 "$OUT/pytest_gpu.log"
} | tee "$OUT/summary.txt"
[ "$rc_tests" -eq 0 ] && [ "$rc_check" -eq 0 ]
