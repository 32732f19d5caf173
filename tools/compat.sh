#!/usr/bin/env bash
# Run the quick test tier against the versions setup.cfg declares, not only the pinned ones.
#
#   tools/compat.sh floor  [pytest args]   Python 3.9 with every dependency at its floor
#                                          (constraints-floor.txt, the floors in setup.cfg)
#   tools/compat.sh newest [pytest args]   Python 3.13 with what pip resolves with no caps
#   tools/compat.sh floor --venv-only      build (or find) the venv and print its path
#
# Venvs are cached under $PF_COMPAT_CACHE (default ~/.cache/packed_formats/compat), keyed by
# the interpreter, the pins and setup.cfg's requirements; the newest venv is also keyed by
# the month, so it re-resolves at most monthly.  torch is a download of several GB the first
# time.  The checkout is tested from its own directory (PYTHONPATH), so one cached venv
# serves every checkout.  PF_FLOOR_PYTHON / PF_NEWEST_PYTHON choose other interpreters.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

which=${1:?usage: tools/compat.sh floor|newest [--venv-only | pytest args]}
shift
case $which in
    floor)  want=${PF_FLOOR_PYTHON:-python3.9};   pins=constraints-floor.txt ;;
    newest) want=${PF_NEWEST_PYTHON:-python3.13}; pins= ;;
    *) echo "tools/compat.sh: unknown venv '$which' (floor or newest)" >&2; exit 2 ;;
esac

# The interpreter: on PATH, else one that pyenv installed but does not put on PATH.
python=
for candidate in "$want" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/*/bin/"$want"; do
    if "$candidate" -c "" >/dev/null 2>&1; then python=$candidate; break; fi
done
if [ -z "$python" ]; then
    echo "tools/compat.sh: no $want found; install it (e.g. pyenv install ${want#python}) or set" \
         "PF_$(echo "$which" | tr a-z A-Z)_PYTHON" >&2
    exit 2
fi

# The venv is keyed by the interpreter and the pins (and, for the newest, the month); a change of
# setup.cfg's requirements only installs what is new into it.
key=$({ "$python" -VV; echo "$which"; [ -z "$pins" ] || cat "$pins"; [ -n "$pins" ] || date +%Y-%m; } \
      | sha256sum | cut -c1-16)
venv=${PF_COMPAT_CACHE:-$HOME/.cache/packed_formats/compat}/$which-$key
requirements=$(sed -n '/^install_requires/,/^\[options.entry_points\]/p' setup.cfg | sha256sum | cut -c1-16)

if [ -n "$pins" ]; then
    pip=("$venv/bin/python" -m pip install --quiet -c "$pins")
else
    # A machine-wide pip configuration may cap torch; the newest venv must see the registry as is.
    cert=/etc/ssl/certs/ca-certificates.crt
    pip=(env PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install --quiet)
    [ ! -f "$cert" ] || pip+=(--cert "$cert")
fi
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }

if [ ! -f "$venv/.ready" ]; then
    echo "tools/compat.sh: building the $which venv in $venv (a large download the first time)" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
    quiet "${pip[@]}" --upgrade pip "setuptools>=64"
    touch "$venv/.ready"
fi
if [ "$(cat "$venv/.requirements" 2>/dev/null)" != "$requirements" ]; then
    # the project's dependencies and test tools, without the project itself (tested in place)
    quiet "${pip[@]}" ".[test]"
    "$venv/bin/python" -m pip uninstall --quiet --yes packed_formats
    echo "$requirements" > "$venv/.requirements"
fi

if [ "${1:-}" = --venv-only ]; then
    echo "$venv"
    exit 0
fi

export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
"$venv/bin/python" - <<'EOF'
import sys, importlib.metadata as m
names = ["torch", "torchvision", "numpy", "pillow", "simplejpeg", "h5py", "lmdb", "tqdm"]
print("compat:", sys.version.split()[0], " ".join(f"{n}={m.version(n)}" for n in names))
EOF
# the quick tier in make test's three streams (tools/run_tests.py), on this venv's Python
exec "$venv/bin/python" tools/run_tests.py --fast --label "tools/compat.sh $which" -- -p no:cacheprovider "$@"
