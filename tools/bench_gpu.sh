#!/usr/bin/env bash
# The GPU benchmark behind README.rst's GPU figures: pf.make_loader(device="cuda") (pinned
# batches copied on a side stream, PREFETCH ahead, transforms on the GPU) against the same
# reads copied with a plain .to("cuda"), and against torchvision's ImageFolder pipeline;
# then photographs packed encoded, decoded in the workers and on the GPU (decode="device").
#
#   tools/bench_gpu.sh [DATA_DIR [OUT_PREFIX [WORKERS [COPIES]]]]    e.g. tools/bench_gpu.sh bench_data gpu 4,8 4
#
# The generated folder holds 3,072 JPEGs; COPIES links each file that many times, so that
# an epoch (12,288 samples by default, 48 batches of 256) is long compared with what the
# workers read ahead.  Needs a CUDA GPU and the project installed; writes OUT_PREFIX.json/.png
# and OUT_PREFIX-photos.json/.png.
set -euo pipefail
data=${1:-bench_data}
out=${2:-bench_gpu}
workers=${3:-4,8}
copies=${4:-4}
python=${PYTHON:-python3}

if [ ! -d "$data/images" ]; then
    "$python" -c "from packed_formats.synthetic import make_image_folder as m; m('$data/images-1', 512)"
    mkdir -p "$data/images"
    for class in "$data/images-1"/*/; do
        name=$(basename "$class")
        mkdir -p "$data/images/$name"
        for ((k = 0; k < copies; k++)); do
            for file in "$class"*; do ln "$file" "$data/images/$name/$k-$(basename "$file")"; done
        done
    done
fi
for target in raw.memmap raw.lmdb; do
    [ -e "$data/bench-$target" ] || "$python" -m packed_formats convert "$data/images" "$data/bench-$target" \
        --mode raw --size 256 --quiet
done
"$python" -m packed_formats bench "$data/images" "$data/bench-raw.memmap" "$data/bench-raw.lmdb" \
    --device cuda --workers "$workers" --batch-size 256 --epochs 3 --warmup 1 --pipeline none,train \
    --out "$out.json" --plot "$out.png"

if [ ! -d "$data/photos" ]; then  # 4,096 crops of real photographs, 200-480 px
    "$python" -c "from packed_formats.synthetic import make_photo_folder as m; m('$data/photos', 1024)"
fi
[ -e "$data/photos.zip" ] || "$python" -m packed_formats convert "$data/photos" "$data/photos.zip" \
    --mode encoded --quiet
"$python" -m packed_formats bench "$data/photos" "$data/photos.zip" \
    --device cuda --workers "$workers" --batch-size 256 --epochs 3 --warmup 1 --pipeline none,train \
    --out "$out-photos.json" --plot "$out-photos.png"
