#!/bin/sh
# The GPU check: on a CUDA machine, the CUDA-lane tests (pytest -m cuda), then
# `bench/pipeline.py --device cuda --quick` and `bench/square_cube.py --gpu`, each under its own
# time limit, 8 minutes in all (180 + 150 + 150 s). Prints each bench's JSON object and ends with
# one JSON line summarising all three; exits 0 only if all three passed.
# Without a CUDA device it runs nothing and exits 3, saying so.
set -u

cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-check: no CUDA device here (torch.cuda.is_available() is false: no GPU, or a CPU build of torch); nothing run" >&2
    exit 3
fi
"$PY" -c 'import torch; print("gpu-check:", torch.cuda.get_device_name(0), "torch", torch.__version__, "CUDA", torch.version.cuda)'

timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs tests/model tests/stage tests/train tests/chaos tests/bench
tests=$?
echo "gpu-check: CUDA-lane tests exit $tests"

timeout 150 "$PY" bench/pipeline.py --device cuda --quick > "$OUT/pipeline.json"
pipeline=$?
echo "gpu-check: bench/pipeline.py exit $pipeline"
cat "$OUT/pipeline.json"

timeout 150 "$PY" bench/square_cube.py --gpu > "$OUT/square_cube.json"
square=$?
echo "gpu-check: bench/square_cube.py exit $square"
cat "$OUT/square_cube.json"

echo "{\"gpu_check\": {\"tests_exit\": $tests, \"pipeline_exit\": $pipeline, \"square_cube_exit\": $square}}"
[ "$tests" -eq 0 ] && [ "$pipeline" -eq 0 ] && [ "$square" -eq 0 ]
