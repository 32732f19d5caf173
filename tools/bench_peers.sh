#!/usr/bin/env bash
# Streaming readers side by side: packed_formats, litdata and mosaic streaming read the same photos from the same
# local S3 server (moto), with a cache of a quarter of the set: images/s of a cold first epoch
# and of the second, and bytes downloaded per epoch over the set's size
# (packed_formats/bench/peers.py says how each peer is driven and measured).
#
#   tools/bench_peers.sh [IMAGES_DIR [OUT_DIR]]     e.g. tools/bench_peers.sh bench_data/photos bench_results/peers
#
# The peers live in their own virtual environment, PEERS_VENV (default ../peers-venv), made here
# once (torch from constraints.txt, then litdata, mosaicml-streaming, moto[server], s3fs); they
# are never installed into the project's environment.  Without IMAGES_DIR, 3,000 small
# photographic JPEGs are drawn into OUT_DIR/photos with the project's Python (PYTHON, default
# .venv/bin/python, which also runs packed_formats' reader).  Writes OUT_DIR/<reader>.json and prints them.
# EPOCHS, BATCH_SIZE, WORKERS and CACHE_FRACTION (default 2, 64, 2, 0.25) tune the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=${2:-bench_results/peers}
images=${1:-$out/photos}
venv=${PEERS_VENV:-$root/../peers-venv}
python=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$out"

if [ ! -f "$venv/.peers-installed" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -c "$root/constraints.txt" torch torchvision
    "$venv/bin/pip" install -q -c "$root/constraints.txt" litdata mosaicml-streaming 'moto[server]' s3fs
    touch "$venv/.peers-installed"
fi

if [ ! -d "$images" ]; then
    "$python" -c "from packed_formats.synthetic import make_photo_folder as m; m('$images', 750, sizes=(160, 320))"
fi

port=$("$venv/bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
endpoint=http://127.0.0.1:$port
"$venv/bin/python" -m moto.server -H 127.0.0.1 -p "$port" >"$out/moto.log" 2>&1 &
moto=$!
trap 'kill $moto 2>/dev/null || true' EXIT
for _ in $(seq 100); do
    if "$venv/bin/python" -c "import urllib.request; urllib.request.urlopen('$endpoint/')" 2>/dev/null; then break; fi
    sleep 0.2
done

status=0
for peer in packed_formats litdata mosaic; do
    runner=$venv/bin/python
    [ "$peer" != packed_formats ] || runner=$python  # ours runs in the project's environment
    PYTHONSAFEPATH=1 "$runner" "$root/packed_formats/bench/peers.py" --peer "$peer" --images "$images" \
        --remote "s3://peers-bench/$peer" --endpoint "$endpoint" --cache-fraction "${CACHE_FRACTION:-0.25}" \
        --epochs "${EPOCHS:-2}" --batch-size "${BATCH_SIZE:-64}" --workers "${WORKERS:-2}" \
        --json "$out/$peer.json" >"$out/$peer.log" 2>&1 || status=1
    echo "== $peer (log: $out/$peer.log)"
    cat "$out/$peer.json"
done
exit $status
