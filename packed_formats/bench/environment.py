"""What the benchmark ran on: machine, library versions, file systems, sizes on disk."""

from __future__ import annotations

import os
import platform
from typing import Dict, List, Optional, Tuple

from .. import native
from ..space import archive_files
from ..writing.parallel import available_cores


def cpu_count() -> Dict[str, Optional[int]]:
    """Logical CPUs of the machine and those this process may run on."""
    return {"logical": os.cpu_count(), "usable": available_cores()}


def jpeg_support() -> Dict[str, object]:
    """Whether Pillow uses libjpeg-turbo, and which JPEG library torchvision bundles."""
    from PIL import features

    info: Dict[str, object] = {"pillow_libjpeg_turbo": bool(features.check_feature("libjpeg_turbo"))}
    try:
        info["pillow_libjpeg_version"] = features.version("jpg")
    except Exception:  # older Pillow
        info["pillow_libjpeg_version"] = None
    info["torchvision_jpeg_libraries"] = _torchvision_jpeg_libraries()
    return info


def _torchvision_jpeg_libraries() -> Optional[List[str]]:
    """JPEG shared libraries shipped with torchvision (names say libjpeg or turbojpeg)."""
    try:
        import torchvision
    except ImportError:
        return None
    package = os.path.dirname(torchvision.__file__)
    found = []
    for directory in (package, package + ".libs", os.path.join(package, "lib")):
        if os.path.isdir(directory):
            found += [n for n in os.listdir(directory) if "jpeg" in n.lower()]
    return sorted(found)


def versions() -> Dict[str, Optional[str]]:
    import numpy
    import PIL
    import torch

    from .. import __version__

    out = {
        "python": platform.python_version(),
        "packed_formats": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "pillow": PIL.__version__,
    }
    try:
        import torchvision

        out["torchvision"] = torchvision.__version__
    except ImportError:
        out["torchvision"] = None
    return out


def _mounts() -> List[Tuple[str, str]]:
    try:
        with open("/proc/mounts") as file:
            rows = [line.split() for line in file]
    except OSError:
        return []
    return [(row[1].replace("\\040", " "), row[2]) for row in rows if len(row) >= 3]


def filesystem_type(path: str) -> Optional[str]:
    """The file system type of ``path`` from /proc/mounts (longest mount point prefix), or None."""
    real = os.path.realpath(path)
    best: Tuple[int, Optional[str]] = (-1, None)
    for mount_point, fs_type in _mounts():
        prefix = mount_point.rstrip("/") + "/"
        if (real == mount_point or real.startswith(prefix) or mount_point == "/") and len(mount_point) > best[0]:
            best = (len(mount_point), fs_type)
    return best[1]


def archive_paths(path: str) -> List[str]:
    """The paths of the regular files that make up an archive or folder (every file below a directory)."""
    return [os.path.join(path, name) if name else path for name, _size in archive_files(path, follow_links=True)]


def size_on_disk(path: str) -> Dict[str, int]:
    """Allocated bytes (like ``du``), apparent bytes and file count of a file or directory tree."""
    allocated = apparent = 0
    files = archive_paths(path)
    for name in files:
        st = os.stat(name)
        apparent += st.st_size
        allocated += getattr(st, "st_blocks", 0) * 512 or st.st_size
    return {"bytes_on_disk": allocated, "apparent_bytes": apparent, "files": len(files)}


def gpu(device: str = "cpu") -> Optional[Dict[str, object]]:
    """Name, memory and CUDA version of the GPU a benchmark on ``device`` uses, or None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    return {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda}


def describe_environment(device: str = "cpu") -> Dict[str, object]:
    """Everything about the machine that a reader of the results needs."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": cpu_count(),
        "versions": versions(),
        "jpeg": jpeg_support(),
        "channels_parted_by": native.planar_copy(),  # the C module, or numpy where it did not build
        "device": device,
        "gpu": gpu(device),
    }


def machine_line(device: str = "cpu") -> str:
    """One line naming what a measurement ran on, printed next to ratios so a reader can weigh them."""
    import torch

    cpus = cpu_count()
    usable = f"{cpus['usable']} of {cpus['logical']}" if cpus["usable"] != cpus["logical"] else f"{cpus['logical']}"
    where = "no GPU" if not device.startswith("cuda") else str((gpu(device) or {}).get("name", device))
    return (f"measured on {usable} CPUs ({platform.system()} {platform.machine()}), Python "
            f"{platform.python_version()}, torch {torch.__version__.split('+')[0]}, {where}")
