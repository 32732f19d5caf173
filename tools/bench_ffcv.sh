#!/usr/bin/env bash
# packed_formats beside FFCV on the CPU: the same photographs, the same cells (JPEG RandomResizedCrop +
# flip in uint8 and float, centre crop float, raw 256x256 untransformed; NCHW and channels-last),
# alternated rounds, ours/FFCV per cell (packed_formats/bench/ffcv_peer.py says how each is driven).
#
#   tools/bench_ffcv.sh OUT [ffcv_peer options]     e.g. tools/bench_ffcv.sh bench_results/ffcv --rounds 3
#
# Writes OUT/ffcv.json and OUT/ffcv.txt (the table, also printed); the photographs and archives go
# to OUT/data and are reused by the next run with the same OUT.
#
# FFCV lives in its own virtual environment, FFCV_VENV (default ~/.cache/packed_formats/ffcv-venv),
# built here the first time (about ten minutes: FFCV compiles a C extension): the system's OpenCV and
# libjpeg-turbo headers (apt-get, when they are missing and this runs as root; otherwise it says what
# to install), torch and torchvision from constraints.txt, numba and the headless OpenCV, FFCV itself
# (FFCV_SRC, a source checkout, or else ffcv==1.0.2 from the package index, built without its
# opencv-python requirement) and packed_formats' own requirements.  packed_formats is run from this
# checkout (PYTHONPATH), never installed there, and FFCV is never installed into the project's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=${1:?usage: tools/bench_ffcv.sh OUT [ffcv_peer options]}
shift
venv=${FFCV_VENV:-$HOME/.cache/packed_formats/ffcv-venv}
pip=("$venv/bin/python" -m pip install --quiet -c "$root/constraints.txt")
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }

if [ ! -f "$venv/.ffcv-installed" ]; then
    echo "tools/bench_ffcv.sh: building FFCV's venv in $venv (once; about ten minutes)" >&2
    if ! pkg-config --exists libturbojpeg || ! { pkg-config --exists opencv4 || pkg-config --exists opencv; }; then
        packages="libopencv-dev libturbojpeg0-dev pkg-config"
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages >/dev/null
        else
            echo "tools/bench_ffcv.sh: FFCV needs OpenCV and libjpeg-turbo headers: apt-get install $packages" >&2
            exit 2
        fi
    fi
    rm -rf "$venv"
    python3 -m venv "$venv"
    quiet "${pip[@]}" --upgrade pip setuptools wheel
    quiet "${pip[@]}" torch torchvision numba opencv-python-headless matplotlib \
        terminaltables pytorch_pfn_extras fastargs assertpy tqdm psutil
    # packed_formats' requirements, without packed_formats itself (run from this checkout)
    quiet "${pip[@]}" "$root"
    "$venv/bin/python" -m pip uninstall --quiet --yes packed_formats
    # --no-deps: FFCV asks for opencv-python (the GUI build); the headless one above serves
    quiet "${pip[@]}" --no-build-isolation --no-deps "${FFCV_SRC:-ffcv==1.0.2}"
    "$venv/bin/python" -c "import ffcv.loader, ffcv.fields.rgb_image"
    touch "$venv/.ffcv-installed"
fi

mkdir -p "$out"
PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} PYTHONSAFEPATH=1 "$venv/bin/python" -m packed_formats.bench.ffcv_peer \
    --work "$out/data" --json "$out/ffcv.json" --table "$out/ffcv.txt" "$@"
