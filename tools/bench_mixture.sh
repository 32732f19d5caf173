#!/usr/bin/env bash
# A mixture of two archives measured (packed_formats/bench/mixture.py says how): its proportions against
# the weights, its images/s against the weighted harmonic mean of its sources' (raw and encoded, 2 workers),
# and beside mosaic's Stream(proportion=...) + StreamingDataset and litdata's CombinedStreamingDataset(weights=...)
# over the same two sets, each written by its own writer, in one run.
#
#   tools/bench_mixture.sh OUT [mixture options]     e.g. tools/bench_mixture.sh bench_results/mixture --rounds 5
#
# Runs in FFCV's virtual environment, FFCV_VENV (default ~/.cache/packed_formats/ffcv-venv), which
# tools/bench_ffcv.sh builds (once); litdata is added to it the first time.  mosaic's streaming pins an
# older numpy than FFCV's, so it goes beside the venv, not into it: MOSAIC_SITE (default
# ~/.cache/packed_formats/mosaic-site), installed there without its dependencies but those it imports,
# and put on PYTHONPATH for this run only.  packed_formats runs from this checkout.  Writes OUT/mixture.json
# and prints the table; the images and every contender's sets stay under OUT/work for the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/peer_venv.sh
out=${1:?usage: tools/bench_mixture.sh OUT [mixture options]}
shift
site=${MOSAIC_SITE:-$HOME/.cache/packed_formats/mosaic-site}
peer_venv_ready tools/bench_mixture.sh
if [ ! -f "$site/.mosaic-installed" ]; then  # streaming and what it imports (transformers, for a type), no numpy
    "$venv/bin/python" -m pip install --quiet --target "$site" --no-deps -c "$root/constraints.txt" \
        mosaicml-streaming transformers huggingface_hub tokenizers safetensors regex pyyaml hf-xet catalogue \
        xxhash zstd python-snappy cramjam brotli
    touch "$site/.mosaic-installed"
fi

mkdir -p "$out"
PYTHONPATH=$root:$site${PYTHONPATH:+:$PYTHONPATH} PYTHONSAFEPATH=1 "$venv/bin/python" -m packed_formats.bench.mixture \
    --work "$out/work" --json "$out/mixture.json" "$@"
