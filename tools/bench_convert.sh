#!/usr/bin/env bash
# Conversion side by side: packed_formats' convert, FFCV's DatasetWriter.from_indexed_dataset and litdata's
# optimize pack the same Python datasets (torchvision's ImageFolder over photographs, in-memory uint8 arrays;
# encoded and raw) at 2 workers, in one process, rotated rounds; the peer's seconds over ours per cell
# (packed_formats/bench/convert_peers.py says how each is driven).
#
#   tools/bench_convert.sh OUT [convert_peers options]     e.g. tools/bench_convert.sh bench_results/convert --rounds 5
#
# Runs in FFCV's virtual environment, FFCV_VENV (default ~/.cache/packed_formats/ffcv-venv), which
# tools/bench_ffcv.sh builds (once, about ten minutes); litdata is added to it here the first time.
# packed_formats runs from this checkout (PYTHONPATH).  Writes OUT/convert.json and prints the table;
# the photographs go to OUT/work/photos and are reused by the next run with the same OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/peer_venv.sh
out=${1:?usage: tools/bench_convert.sh OUT [convert_peers options]}
shift
peer_venv_ready tools/bench_convert.sh

mkdir -p "$out"
PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} PYTHONSAFEPATH=1 "$venv/bin/python" -m packed_formats.bench.convert_peers \
    --work "$out/work" --json "$out/convert.json" "$@"
