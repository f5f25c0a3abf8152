#!/usr/bin/env bash
# The GPU check: ROSE's GPU parts on a real GPU (CUDA tests, the CUDA interference bench, the
# interference profiles of a rollout process beside serving, the pause latency, weight copies,
# the NVML agent), each on its own, JSON under OUT_DIR.
# Needs Python 3 with torch and this repository; no Kafka, Redis, Java or package registry.
# Missing pure-Python or binary packages: carry their wheels in a folder, pass --wheels DIR
# (docs/paper-check.md "The GPU check" says which and how to download them).
#
#   deploy/gpu-check.sh OUT_DIR [--full] [--wheels DIR] [--only PART,...] [--dry-run]
#
# Exit status: 0 if something was measured and no part failed; 1 if a part failed; 3, with one
# line saying so, if nothing was measured (every part skipped, e.g. on a machine without a GPU).
#
# Then: rose simulate --interference-bench OUT_DIR/interference.json ...
#   or: rose simulate --interference-profile OUT_DIR/interference-profile-8b-separate_process.json ...
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 OUT_DIR [--full] [--wheels DIR] [--only PART,...] [--dry-run]" >&2
  exit 2
fi
repo="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m rose.bench._gpu_check "$@"
