#!/usr/bin/env bash
# The GPU benchmark: what feeds a GPU, cell by cell (packed_formats/bench/gpu.py says which), as
# OUT/gpu.json.  It makes its own data under OUT/data (2,000 photographic JPEGs of ImageNet-like
# sizes, packed raw at 256x256 and encoded), then times each cell: an untimed warm-up epoch, then
# the median of 3, batches of 256.  About 5 minutes on a 16-CPU H200 node.
#
#   tools/bench_gpu.sh OUT [--cpu] [--quick] [--workers N] [--images N] [--batch-size N] [--data DIR]
#
# --cpu runs every cell on the CPU; --quick uses 64 small images in batches of 16 (what the test runs).
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: tools/bench_gpu.sh OUT [--cpu] [--quick] [--workers N] [--images N] [--batch-size N]" >&2
    exit 2
fi
exec "${PYTHON:-python3}" -m packed_formats.bench.gpu "$@"
