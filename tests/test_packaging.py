"""What users install: the wheel and the sdist that ``python -m build`` makes from this checkout.

The wheel carries ``py.typed`` (so users' type checkers see our annotations) and the
license; the sdist carries everything the tests, the tools and the notebooks need, so
that its tests run where it is unpacked.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from .test_pixels import can_build_c

ROOT = Path(__file__).resolve().parent.parent
# a part of the quick tier that needs the test helpers, the tools and the notebooks' neighbours
SDIST_TESTS = ["tests/test_pixels.py", "tests/test_registry.py", "tests/test_cli.py", "tests/test_manifest_text.py"]


def build(kind: str, source: Path, outdir: Path) -> Path:
    """Build a ``kind`` ("sdist" or "wheel") of the project at ``source`` with this interpreter's setuptools."""
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", f"--{kind}", "--outdir", str(outdir), str(source)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = outdir.glob("*.tar.gz" if kind == "sdist" else "*.whl")
    return built


def clean_copy(destination: Path) -> Path:
    """A copy of the checkout without what builds and runs leave in it: setuptools would take an
    old ``*.egg-info``'s file list for the sdist's, hiding what MANIFEST.in lacks."""
    left_behind = shutil.ignore_patterns(".git", ".venv", "*.egg-info", "build", "dist", "__pycache__", "*.so",
                                         ".*_cache", "demo_data", "bench_data", "bench_results")
    return Path(shutil.copytree(ROOT, destination, ignore=left_behind))


@pytest.fixture(scope="module")
def unpacked_sdist(tmp_path_factory) -> Path:
    """The sdist of this checkout, unpacked in a temporary directory."""
    tmp = tmp_path_factory.mktemp("sdist")
    sdist = build("sdist", clean_copy(tmp / "checkout"), tmp / "dist")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp / "unpacked")
    (top,) = (tmp / "unpacked").iterdir()
    return top


def tracked(*folders: str) -> list:
    """The files git tracks under ``folders`` (none outside a git checkout)."""
    done = subprocess.run(["git", "ls-files", *folders], cwd=ROOT, capture_output=True, text=True)
    return [name for name in done.stdout.split() if (ROOT / name).is_file()] if done.returncode == 0 else []


@pytest.mark.slow
def test_the_sdist_holds_the_tests_tools_notebooks_and_docs(unpacked_sdist):
    wanted = ["LICENSE", "README.rst", "CHANGELOG.rst", "Makefile", "constraints.txt", "constraints-floor.txt",
              "pyproject.toml", "setup.cfg", "setup.py", "ruff.toml", "packed_formats/py.typed",
              "tests/conftest.py", "tests/tiny_format.py"]
    wanted += tracked("tests", "tools", "notebooks", "docs")
    missing = [name for name in wanted if not (unpacked_sdist / name).is_file()]
    assert not missing, f"the sdist lacks {missing}: add them to MANIFEST.in"


@pytest.mark.slow
def test_the_wheel_built_from_the_sdist_carries_py_typed_and_the_license(unpacked_sdist, tmp_path):
    wheel = build("wheel", unpacked_sdist, tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "packed_formats/py.typed" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") or name.endswith(".dist-info/LICENSE")
               for name in names), names
    assert not any(name.startswith("tests/") for name in names)
    if can_build_c():  # the C module that parts channels, built from the sdist's source
        assert any(name.startswith("packed_formats/_pixels.") and name.endswith((".so", ".pyd")) for name in names)


@pytest.mark.slow
def test_the_unpacked_sdist_passes_its_tests(unpacked_sdist):
    env = dict(os.environ, PYTHONPATH=str(unpacked_sdist))
    where = subprocess.run([sys.executable, "-c", "import packed_formats; print(packed_formats.__file__)"],
                           cwd=unpacked_sdist, env=env, capture_output=True, text=True)
    assert Path(where.stdout.strip()).parent == unpacked_sdist / "packed_formats", where.stderr
    pytest_command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    # every test module imports (its helper modules are there) ...
    collected = subprocess.run([*pytest_command, "--collect-only", "tests"], cwd=unpacked_sdist, env=env,
                               capture_output=True, text=True, timeout=600)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    # ... and a part of the quick tier passes there
    ran = subprocess.run([*pytest_command, "-m", "not slow", *SDIST_TESTS], cwd=unpacked_sdist, env=env,
                         capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]


SMOKE = r'''
import os, sys, subprocess, tempfile
import torch
import packed_formats as pf
from packed_formats.synthetic import make_image_folder

assert os.path.dirname(pf.__file__).startswith(sys.prefix), pf.__file__  # the installed wheel, not a checkout
assert pf.native.planar_copy() == os.environ["EXPECT_PLANAR_COPY"], pf.native.planar_copy()
work = tempfile.mkdtemp()
src = make_image_folder(os.path.join(work, "src"), images_per_class=4, classes=("a", "b"), sizes=(20, 30), seed=0)
cli = [os.path.join(os.path.dirname(sys.executable), "packed-formats")]
for fmt, ext in [("zip", "zip"), ("hdf5", "h5"), ("lmdb", "lmdb"), ("memmap", "memmap")]:
    for mode in ("raw", "encoded"):
        out = os.path.join(work, f"{mode}.{ext}")
        for command in (["convert", src, out, "--mode", mode, "--size", "16", "--quiet"], ["info", out],
                        ["verify", out]):
            done = subprocess.run(cli + command, capture_output=True, text=True)
            assert done.returncode == 0, (fmt, mode, command, done.stdout, done.stderr)
        for method in ("fork", "spawn"):
            loader = torch.utils.data.DataLoader(pf.PackedDataset(out, output="tensor"), batch_size=4,
                                                 num_workers=2, multiprocessing_context=method)
            assert sum(len(labels) for _, labels in loader) == 8, (fmt, mode, method)
        images, labels = next(iter(pf.make_loader(out, batch_size=4, num_workers=0,
                                                  transform=pf.transforms.train(12))))
        assert tuple(images.shape) == (4, 3, 12, 12), (fmt, mode, images.shape)
print("smoke ok")
'''


@pytest.mark.slow
def test_the_wheel_installed_in_a_fresh_venv_passes_the_smoke(unpacked_sdist, tmp_path):
    """The wheel in a new venv, run from outside any checkout: the package, its entry point and its data
    are the wheel's.  The venv reaches this one's packages through a .pth file (torch is a download of
    several GB), but not this checkout."""
    wheel = build("wheel", unpacked_sdist, tmp_path / "dist")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    Path(site, "dependencies.pth").write_text("\n".join(ours) + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site,
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    # the console script: pip --target does not write one for the venv, so make what pip would
    script = venv / "bin" / "packed-formats"
    script.write_text(f"#!{python}\nimport sys\nfrom packed_formats.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["EXPECT_PLANAR_COPY"] = "native" if can_build_c() else "numpy"
    done = subprocess.run([str(python), "-c", SMOKE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and "smoke ok" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


README = ROOT / "README.rst"


def readme_install_commands() -> list:
    """The ``pip install`` lines of the README's Install section, as a user pastes them (comments left out)."""
    text = README.read_text(encoding="utf-8")
    start = text.index("\nInstall\n-------")
    end = text.index("\n-------", start + len("\nInstall\n-------"))  # the next section's underline
    lines = [line.split("#")[0].strip() for line in text[start:end].splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("pip install")]


def test_the_readme_installs_from_the_clone_not_from_the_public_index():
    commands = readme_install_commands()
    assert ["pip", "install", "."] in commands and ["pip", "install", ".[remote]"] in commands, commands
    assert not [c for c in commands if any(arg.startswith("packed_formats") for arg in c[2:])], commands


def test_the_install_step_says_what_it_installs_and_shows_pips_progress(tmp_path):
    """``make``'s first step takes minutes: each pip step is announced and pip is not silenced."""
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "-n", "-B", f"VENV={venv}", f"{venv}/.installed"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    installs = [n for n, line in enumerate(lines) if " -m pip install " in line]
    assert len(installs) >= 2, done.stdout
    assert not [lines[n] for n in installs if re.search(r"\s(--quiet|-q+)\b", lines[n])], done.stdout
    assert all(lines[n - 1].startswith("echo ") for n in installs), done.stdout


def dependencies_of_this_environment(folder: Path) -> Path:
    """``folder`` filled with links to every distribution this venv holds except packed_formats and pip."""
    folder.mkdir()
    own = ("packed_formats", "__editable__", "pip")  # the project, and the venv's own pip
    for site in {Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()}:
        for entry in site.iterdir():
            if entry.name.startswith(own) or entry.suffix == ".pth" or (folder / entry.name).exists():
                continue
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.slow
def test_the_readme_install_command_installs_the_clone_into_an_existing_environment(tmp_path):
    """``pip install .`` as the README's Install section gives it, run in a fresh venv from a clean copy of the
    checkout; then the installed package and its command work from outside any checkout.

    The fresh venv is a user's environment that already has torch: it sees this venv's third-party packages
    (torch, torchvision, numpy, ...) through a .pth file, so pip finds them installed instead of unpacking a
    5.5 GB torch build for a minute and a half, while packed_formats itself (left out of that view) is
    built and installed by the README's command, through pip's own build isolation, as a user's would be.
    (``venv --system-site-packages`` would show the base interpreter's packages, not this venv's, when the
    tests run from a venv, as ``make test`` runs them.)
    """
    command = next(c for c in readme_install_commands() if c == ["pip", "install", "."])
    checkout = clean_copy(tmp_path / "checkout")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([str(venv / "bin" / "python"), "-c", purelib], capture_output=True, text=True,
                          check=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(f"{dependencies_of_this_environment(tmp_path / 'deps')}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # as if the venv were activated
    program = venv / "bin" / command[0]  # the fresh venv's pip, never the one running these tests
    install = subprocess.run([str(program), *command[1:]], cwd=checkout, env=env, capture_output=True, text=True,
                             timeout=900)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert "Successfully installed packed_formats" in install.stdout.replace("-", "_"), install.stdout[-3000:]
    probe = ("import sys, packed_formats as pf; assert pf.__file__.startswith(sys.prefix), pf.__file__; "
             "print(pf.PackedDataset.__name__, pf.make_loader.__name__)")
    imported = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0 and "PackedDataset make_loader" in imported.stdout, imported.stderr[-3000:]
    version = subprocess.run([str(venv / "bin" / "packed-formats"), "--version"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
    assert version.returncode == 0, version.stderr[-3000:]
