"""Every code block of README.rst and docs/*.rst runs as written.

The blocks are read from the files.  Each one is run here, as a user pastes it, in a scratch folder of its
own that holds first what the text before it has the user make (``Here.needs``: the demo's and the
quickstart's files, an image folder, shards, a set in an S3 server...), with ``num_workers=2``: a Python
block by the project's interpreter, a console block by bash, stopping at the first command that fails.  A
block that needs what a test machine does not have (a cluster's paths, a fresh environment, a download)
is run by the test named for it, or is listed in ``NOT_RUN`` with the reason.  A block that none of these
accounts for fails ``test_every_block_is_accounted_for``, so a new snippet comes with its run.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest

import packed_formats as pf
from packed_formats.synthetic import make_image_folder

from .conftest import CLASSES
from .test_fields import npy, png, shard_members

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.rst", *sorted((ROOT / "docs").glob("*.rst"))]
BLOCK = re.compile(r"^\.\. code-block:: (\w+)\n((?:[ \t]+:[^\n]*\n)*)\n((?:(?:[ \t]+[^\n]*)?\n)+)", flags=re.M)
SHOWN = ("text",)  # what a command prints, or a file's content: nothing to run


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository
    line: int
    language: str
    code: str  # dedented, as written

    @property
    def name(self) -> str:
        return f"{self.file}:{self.line}"


def blocks() -> List[Block]:
    """Every ``.. code-block::`` of README.rst and docs/*.rst, in order."""
    found = []
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            found.append(Block(str(path.relative_to(ROOT)), text.count("\n", 0, match.start()) + 1, match[1],
                               textwrap.dedent(match[3]).strip("\n") + "\n"))
    return found


def find(file: str, mark: str) -> Block:
    """The one block of ``file`` that holds ``mark``."""
    found = [b for b in blocks() if b.file == file and mark in b.code]
    assert len(found) == 1, f"{file}: {len(found)} code blocks hold {mark!r}, not one"
    return found[0]


# ---- what a block reads, made before it runs ------------------------------------------------------------
# Each maker fills a folder once a session; ``get(need)`` is the folder of another need, made first.
Get = Callable[[str], Path]


def make_repository(folder: Path, get: Get) -> None:
    """The clone's files that a command names from its top folder (``python tools/demo.py``)."""
    (folder / "tools").symlink_to(ROOT / "tools", target_is_directory=True)


def make_demo(folder: Path, get: Get) -> None:
    """The Install section's demo, run as written: ``demo_data/``."""
    link_into(folder, [get("repository")])
    run(find("README.rst", "python tools/demo.py"), folder)


def make_quickstart(folder: Path, get: Get) -> None:
    """The quickstart's commands, run as written after the demo: ``train.zip``, ``train-224.memmap``."""
    link_into(folder, [get("demo")])
    run(find("README.rst", "packed-formats convert demo_data/images train.zip"), folder)


def make_images(folder: Path, get: Get) -> None:
    make_image_folder(folder / "images", images_per_class=10, sizes=(48, 96))  # bench: batches past its warm-up


def make_train_and_val(folder: Path, get: Get) -> None:
    """train.zip and val.zip, encoded images of mixed sizes, as the reference pages open them."""
    for split, seed in (("train", 1), ("val", 2)):
        images = make_image_folder(folder / f"{split}-images", images_per_class=3, sizes=(48, 96), seed=seed)
        pf.convert(images, str(folder / f"{split}.zip"), mode="encoded", quiet=True)


def write_tar(path: Path, samples: Dict[str, Dict[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, members in samples.items():
            for extension, data in members.items():
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def make_seg_shards(folder: Path, get: Get) -> None:
    """``shards-000.tar`` ... ``shards-099.tar``: webdataset samples with a class, a mask, boxes and more."""
    for shard in range(100):
        write_tar(folder / f"shards-{shard:03d}.tar", {f"s{shard:03d}{i}": shard_members(i) for i in range(2)})


def make_coco_shards(folder: Path, get: Get) -> None:
    """``coco-000.tar`` ... ``coco-009.tar``: images with boxes (XYXY, in pixels) and a label per box."""
    boxes = np.array([[4, 2, 20, 12], [30, 0, 60, 40]], np.float32)
    for shard in range(10):
        image = np.full((40, 60, 3), 20 * shard, np.uint8)
        members = {"png": png(image), "cls": str(shard % 2).encode(), "boxes.npy": npy(boxes),
                   "labels.npy": npy(np.arange(2, dtype=np.int64))}
        write_tar(folder / f"coco-{shard:03d}.tar", {f"c{shard:03d}": members})


def make_coco_layout(folder: Path, get: Get) -> None:
    """``coco/``: COCO's layout, an annotation file and its image folder (docs/conversion.rst converts it)."""
    from .test_coco_source import write_coco

    write_coco(folder / "coco")


def make_hub(folder: Path, get: Get) -> None:
    """What ``hf download`` leaves for a dataset of two splits (``cifar10/``), and a ``save_to_disk`` folder of
    two splits whose columns are ``img`` and ``fine_label`` (``saved/``)."""
    pa = pytest.importorskip("pyarrow")
    from .test_hub_sources import card, image_table, sample_rows, write_hub

    rows = sample_rows(make_image_folder(folder / "hub-images", images_per_class=4, classes=CLASSES,
                                         sizes=(32, 40)))
    write_hub(folder / "cifar10", rows[:8], shards=2, split="train", with_card=False)
    write_hub(folder / "cifar10", rows[8:], shards=1, split="test", with_card=False)
    (folder / "cifar10" / "README.md").write_text(card(splits=("train", "test")))
    for split, part in (("train", rows[:8]), ("test", rows[8:])):
        table = image_table(part, image="img", label="fine_label")
        (folder / "saved" / split).mkdir(parents=True)
        name = "data-00000-of-00001.arrow"
        with pa.OSFile(str(folder / "saved" / split / name), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
        (folder / "saved" / split / "dataset_info.json").write_text(json.dumps({"features": features}))
        (folder / "saved" / split / "state.json").write_text(json.dumps(
            {"_data_files": [{"filename": name}], "_split": split}))
    (folder / "saved" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))


def make_set(folder: Path, get: Get) -> None:
    """``train.zip``: a set of parts (``shard_size=``), as the object-storage section uploads."""
    images = make_image_folder(folder / "set-images", images_per_class=4, sizes=(40, 90))
    pf.convert(images, str(folder / "train.zip"), mode="encoded", shard_size=5, quiet=True)


def make_readme_seg_zip(folder: Path, get: Get) -> None:
    """The ``seg.zip`` the README's fields section converts from shards, run as written."""
    link_into(folder, [get("seg shards")])
    run(find("README.rst", "packed-formats convert 'shards-{000..099}.tar' seg.zip"), folder)


def make_fields_seg_zip(folder: Path, get: Get) -> None:
    """The ``seg.zip`` that docs/fields.rst's writing block writes, run as written (its reading blocks read it)."""
    run(find("docs/fields.rst", 'pf.open_writer("seg.zip"'), folder, given=GIVEN["fields writing"])


MAKERS: Dict[str, Callable[[Path, Get], None]] = {
    "repository": make_repository, "demo": make_demo, "quickstart": make_quickstart, "images": make_images,
    "train and val": make_train_and_val, "seg shards": make_seg_shards, "coco shards": make_coco_shards,
    "coco layout": make_coco_layout, "hub": make_hub, "set": make_set, "readme seg.zip": make_readme_seg_zip,
    "fields seg.zip": make_fields_seg_zip,
}

# What the text before a block has defined, for the blocks that are a part of the reader's own script.
GIVEN = {
    "fields writing": textwrap.dedent("""\
        import io
        import numpy as np
        from PIL import Image
        jpeg = io.BytesIO()
        Image.new("RGB", (64, 48), "gray").save(jpeg, "JPEG")
        jpeg_bytes, mask_uint8_hw = jpeg.getvalue(), np.zeros((48, 64), np.uint8)
        """),
    "resume": textwrap.dedent("""\
        import torch
        import packed_formats as pf
        def make():
            return pf.make_loader("train.zip", batch_size=4, shuffle=True, num_workers=2, size=32, seed=0)
        model, epochs, path = torch.nn.Linear(1, 1), 2, "checkpoint.pt"
        first = make()
        batches = iter(first)
        next(batches), next(batches)
        checkpoint = {"loader": first.state_dict()}  # two batches of epoch 0 done, then the process ends
        del batches, first
        loader = make()
        """),
}


@dataclass(frozen=True)
class Here:
    """Run here: in a scratch folder holding what ``needs`` makes, after ``given`` (GIVEN's names)."""

    file: str
    mark: str
    needs: Tuple[str, ...] = ()
    given: str = ""
    s3: bool = False  # the block reads or writes s3://bucket: a local S3 server stands in for the store
    # lines starting so download or install: not run here (no network), test_the_hub_blocks_download... checks
    skip_lines: Tuple[str, ...] = ()


@dataclass(frozen=True)
class By:
    """Run as written by another test (``tests/<module>.py::<test>``)."""

    file: str
    mark: str
    test: str


HERE = [
    Here("README.rst", "python tools/demo.py", needs=("repository",)),
    Here("README.rst", "packed-formats convert demo_data/images train.zip", needs=("demo",)),
    Here("README.rst", 'pf.PackedDataset("train.zip", output="tensor")', needs=("quickstart",)),
    Here("README.rst", 'pf.make_loader("train-224.memmap"', needs=("quickstart",)),
    Here("README.rst", "packed-formats convert 'shards-{000..099}.tar' seg.zip --field seg=image",
         needs=("seg shards",)),
    Here("README.rst", 'pf.PackedDataset("seg.zip"', needs=("readme seg.zip",)),
    Here("README.rst", "hf download", needs=("hub",), skip_lines=("pip install ", "hf download ")),
    Here("README.rst", "loader.load_state_dict", needs=("train and val",), given="resume"),
    Here("README.rst", "storage.upload(", needs=("set",), s3=True),
    Here("README.rst", 'pf.make_loader("s3://bucket/train.zip"', needs=("set",), s3=True),
    Here("docs/api.rst", "pf.convert(", needs=("images",)),
    Here("docs/cli.rst", "packed-formats convert images/", needs=("images",)),
    Here("docs/conversion.rst", 'pf.convert("images/"', needs=("images",)),
    Here("docs/conversion.rst", "def make_sample("),
    Here("docs/conversion.rst", 'pf.convert("coco/"', needs=("coco layout",)),
    Here("README.rst", "class Tiles("),
    Here("docs/datasets.rst", "pf.PackedDataset(", needs=("train and val",)),
    Here("docs/errors.rst", "pf.CorruptSampleError", needs=("train and val",)),
    Here("docs/mixtures.rst", "samples_per_epoch=20", needs=("train and val",)),
    Here("docs/mixtures.rst", 'batches="per-source"', needs=("train and val",)),
    Here("docs/transforms.rst", "pf.make_loader(", needs=("train and val",)),
    Here("docs/fields.rst", 'pf.open_writer("seg.zip"', given="fields writing"),
    Here("docs/fields.rst", "torch.utils.data.DataLoader(dataset", needs=("fields seg.zip",)),
    Here("docs/fields.rst", "loader = pf.make_loader(", needs=("fields seg.zip",)),
    Here("docs/fields.rst", "packed-formats convert seg.zip seg.lmdb", needs=("seg shards",)),
    Here("docs/fields.rst", "coco-{000..009}.tar", needs=("coco shards",)),
    Here("docs/fields.rst", 'target="coco"', needs=("coco layout",)),
    Here("docs/fields.rst", 'size="own"', needs=("coco layout",)),
    Here("docs/formats.rst", "labelled=False"),
    Here("docs/storage.rst", "pf.stage(", needs=("set",), s3=True),
    Here("docs/threat-model.rst", "pf.open_archive(", needs=("set",), s3=True),
]

BY = [
    By("README.rst", "make_loader(train_archive", "test_readme_recipes.py::"
       "test_the_readme_recipe_trains_and_evaluates_with_the_reference_defaults"),
    By("README.rst", "data_loader.sampler.set_epoch(epoch)", "test_readme_recipes.py::"
       "test_the_readme_recipe_trains_and_evaluates_with_the_reference_defaults"),
]

# Blocks no test runs as written, and why; each is a gap to close, not a rule.
NOT_RUN = {
    ("README.rst", "python -m venv .venv"): "installs torch into a fresh environment (test_packaging runs its "
                                            "`pip install .` there, with this environment's torch)",
    ("README.rst", "--index-url https://download.pytorch.org/whl/cpu"): "downloads torch from PyTorch's index",
    ("README.rst", "pip install '.[remote]'\n"): "installs into the user's environment (the remote tests use the "
                                                 "extra's packages)",
    ("README.rst", "make test-fast"): "runs the test suite itself (.ci/run runs `make test`)",
    ("README.rst", "packed-formats info dataset.tar.gz"): "converts containers of every kind, each named in it: "
                                                          "test_sources runs each kind, not these lines",
    ("README.rst", "packed-formats doctor /lustre/$USER/train.zip"): "a cluster's shared file system paths",
    ("README.rst", "sbatch --array=0-19"): "a cluster's paths (test_slurm_cluster runs the script)",
    ("README.rst", "ipykernel install"): "creates .venv and installs a Jupyter kernel for the user",
    ("docs/formats.rst", "FormatSpec("): "needs a format's backend and an archive of it (test_registry runs "
                                         "tests/tiny_format.py's)",
    ("docs/test-suite.rst", "make test"): "runs the test suite itself",
    ("docs/benchmarks.rst", "bench_data/images"): "a measurement of minutes (test_bench runs the harness small)",
    ("docs/benchmarks.rst", "photos photos.zip"): "a measurement of minutes",
    ("docs/benchmarks.rst", "packed_formats.bench.segmentation"): "a measurement of minutes "
                                                                  "(test_bench_segmentation runs it small)",
    ("docs/benchmarks.rst", "packed_formats.bench.detection"): "a measurement of minutes "
                                                               "(test_bench_detection runs it small)",
    ("docs/benchmarks.rst", "tools/bench_gpu.sh"): "a GPU node (test_bench_gpu runs --cpu --quick)",
    ("docs/benchmarks.rst", "PF_BATCH_SLOTS"): "a measurement on an archive the page describes",
    ("docs/benchmarks.rst", "convert_data/images"): "a measurement of minutes",
    ("docs/benchmarks.rst", "hub_bench"): "a measurement of minutes",
    ("docs/benchmarks.rst", "packed_formats.bench.hub_convert"): "a measurement of minutes "
                                                                 "(test_bench_hub_convert runs it small)",
    ("docs/benchmarks.rst", "local_cluster.sh start"): "a measurement under the local Slurm, minutes",
    ("docs/benchmarks.rst", "tools/bench_peers.sh"): "needs FFCV (test_bench_peers runs the harness without it)",
    ("docs/benchmarks.rst", "tools/bench_ffcv.sh"): "needs FFCV",
    ("docs/benchmarks.rst", "tools/bench_mixture.sh"): "needs litdata and mosaic's streaming (test_bench_mixture runs "
                                                       "the module's own logic, tiny)",
    ("docs/benchmarks.rst", "tools/bench_convert.sh"): "needs FFCV and litdata (test_bench_convert_peers runs "
                                                       "the harness small)",
    ("docs/conversion.rst", "--python mypkg.data"): "a user's package in a Slurm array (test_python_source runs "
                                                    "--python with --part on a module of the tests)",
}


def accounted() -> Dict[str, str]:
    """{block name: how it is run} for every block that has a way; a block with two fails here."""
    ways: Dict[str, str] = {}
    entries = [(h.file, h.mark, "here") for h in HERE] + [(b.file, b.mark, f"by {b.test}") for b in BY]
    entries += [(file, mark, f"not run: {why}") for (file, mark), why in NOT_RUN.items()]
    for file, mark, how in entries:
        name = find(file, mark).name
        assert name not in ways, f"{name} is run two ways: {ways[name]}; {how}"
        ways[name] = how
    return ways


def test_every_block_is_accounted_for():
    ways = accounted()
    missing = [b.name for b in blocks() if b.language not in SHOWN and b.name not in ways]
    assert not missing, f"code blocks no test runs: {missing}: add each to HERE (or BY, NOT_RUN) in {__name__}"


def test_the_tests_named_for_blocks_exist():
    for entry in BY:
        module, test = entry.test.split("::")
        assert re.search(rf"^def {test}\(", (ROOT / "tests" / module).read_text(), flags=re.M), entry.test


def test_every_block_asks_for_two_workers():
    """Four or eight workers print torch's warning on a 2-core machine; the snippets say 2."""
    for block in blocks():
        for count in re.findall(r"num_workers=(\d+)", block.code):
            assert count in ("0", "2"), f"{block.name}: num_workers={count}"


# ---- the runner ----------------------------------------------------------------------------------------
def short_scratch() -> str:
    """A node-local scratch folder of its own for a block (``$TMPDIR``), removed after it.  Its path is short:
    Python's multiprocessing makes the AF_UNIX sockets through which DataLoader workers pass shared memory
    under $TMPDIR, a socket's path may hold at most 107 bytes, and a worker whose socket cannot be made drops
    its batch without a word (the loader then waits forever).  A pytest folder is too deep for that."""
    return tempfile.mkdtemp(prefix="pf-", dir="/tmp" if os.access("/tmp", os.W_OK) else None)


def environment(folder: Path, scratch: str, extra: Optional[dict] = None) -> dict:
    """A user's shell in ``folder``: this interpreter's ``python`` and ``packed-formats`` first on PATH, node-local
    scratch (``$TMPDIR``) in ``scratch``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{env.get('PATH', '')}", TMPDIR=scratch)
    env.update(extra or {})
    return env


def run(block: Block, folder: Path, given: str = "", env: Optional[dict] = None,
        skip_lines: Tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``block`` as written in ``folder``; fails the test, showing its output, when it fails."""
    scratch = short_scratch()
    env = environment(folder, scratch, env)
    if block.language == "python":
        script = folder / f"block-{Path(block.file).stem}-{block.line}.py"
        script.write_text(given + block.code)
        command = [sys.executable, str(script)]
    else:
        code = "\n".join(line for line in block.code.splitlines() if not line.startswith(skip_lines))
        command = ["bash", "-e", "-o", "pipefail", "-c", code]
    try:
        done = subprocess.run(command, cwd=folder, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=600)  # a user's terminal, not the test runner's pipe
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert done.returncode == 0, f"{block.name} failed as written:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


_MADE: Dict[str, Path] = {}  # each need's folder, made once a session (each xdist worker its own)


@pytest.fixture
def made(tmp_path_factory) -> Get:
    """``made(need)``: the folder MAKERS[need] filled, made on first use in this session."""

    def get(need: str) -> Path:
        if need not in _MADE:
            folder = tmp_path_factory.mktemp(re.sub(r"\W", "-", need))
            MAKERS[need](folder, get)
            _MADE[need] = folder
        return _MADE[need]

    return get


def link_into(folder: Path, sources: List[Path]) -> None:
    """Links in ``folder`` to each entry of ``sources`` (what was made for a block: its writes stay its own)."""
    for source in sources:
        for entry in source.iterdir():
            if not (folder / entry.name).exists() and not entry.name.startswith(("block-", "tmp")):
                (folder / entry.name).symlink_to(entry)


def scratch_folder(tmp_path: Path, sources: List[Path]) -> Path:
    folder = tmp_path / "scratch"
    folder.mkdir()
    link_into(folder, sources)
    return folder


def run_entry(entry: Here, tmp_path: Path, made: Get, env: Optional[dict] = None) -> None:
    folder = scratch_folder(tmp_path, [made(need) for need in entry.needs])
    block = find(entry.file, entry.mark)
    if entry.s3 and "storage.upload(" not in block.code:  # the set that the README's upload block puts there
        run(find("README.rst", "storage.upload("), folder, env=env)
    run(block, folder, given=GIVEN.get(entry.given, ""), env=env, skip_lines=entry.skip_lines)


@pytest.mark.slow
@pytest.mark.parametrize("entry", [h for h in HERE if not h.s3], ids=lambda h: f"{h.file}:{h.mark[:40]}")
def test_the_block_runs_as_written(entry, tmp_path, made):
    run_entry(entry, tmp_path, made)


@pytest.fixture
def bucket(s3_env):
    """``s3://bucket``, empty, on the session's local S3 server (the environment points at it)."""
    fs = s3_env.fs()
    if fs.exists("bucket"):
        fs.rm("bucket", recursive=True)
    s3_env.bucket("bucket")
    return s3_env


@pytest.mark.slow
@pytest.mark.parametrize("entry", [h for h in HERE if h.s3], ids=lambda h: f"{h.file}:{h.mark[:40]}")
def test_the_block_with_a_store_runs_as_written(entry, tmp_path, made, bucket):
    run_entry(entry, tmp_path, made, env=bucket.env)


def test_the_hub_blocks_download_names_the_command_huggingface_hub_installs():
    """The download line is not run here (no network): it names ``hf``, which ``huggingface_hub`` installs
    (``huggingface-cli`` is gone from it), and the same block installs that package."""
    code = find("README.rst", "hf download").code
    lines = [shlex.split(line.split("#")[0]) for line in code.splitlines()]
    assert ["hf", "download", "uoft-cs/cifar10", "--repo-type", "dataset", "--local-dir", "cifar10"] in lines, code
    assert any(line[:2] == ["pip", "install"] and "huggingface_hub" in line for line in lines), code
    assert "huggingface-cli" not in (ROOT / "README.rst").read_text(encoding="utf-8")


@pytest.mark.slow
def test_the_save_to_disk_example_of_convert_help_runs_as_written(tmp_path, made):
    """``packed-formats convert --help``'s ``save_to_disk`` example, on a folder of two splits."""
    from packed_formats.commands.convert import EXAMPLES

    (line,) = [line for line in EXAMPLES.splitlines() if line.rstrip().endswith("# save_to_disk")]
    folder = scratch_folder(tmp_path, [made("hub")])
    run(Block("packed_formats/commands/convert.py", 0, "console", line.split("#")[0].strip() + "\n"), folder)
    with pf.open_archive(str(folder / "train.zip")) as reader:
        assert len(reader) == 8
