# Sourced by the peer benchmarks that run in FFCV's virtual environment (tools/bench_convert.sh,
# tools/bench_mixture.sh), from the repository root: peer_venv_ready sets root and venv (FFCV_VENV,
# default ~/.cache/packed_formats/ffcv-venv, which tools/bench_ffcv.sh builds once) and adds litdata to
# that venv the first time.
peer_venv_ready() {  # $1: the calling script, named when the venv is missing
    root=$(pwd)
    venv=${FFCV_VENV:-$HOME/.cache/packed_formats/ffcv-venv}
    if [ ! -f "$venv/.ffcv-installed" ]; then
        echo "$1: FFCV's venv is not built: run tools/bench_ffcv.sh OUT first (once)" >&2
        exit 2
    fi
    if [ ! -f "$venv/.litdata-installed" ]; then
        "$venv/bin/python" -m pip install --quiet -c "$root/constraints.txt" litdata
        touch "$venv/.litdata-installed"
    fi
}
