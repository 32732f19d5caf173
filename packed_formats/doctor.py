"""What matters for loading speed and safety on this machine, with advice.

``diagnose(path)`` inspects the file system holding ``path`` (from /proc/mounts),
the CPUs this process may use, JPEG decoders, /dev/shm, free memory against the
archive's size, and torch/CUDA, and returns a JSON-able report whose ``advice``
list says what to do.  ``format_report`` renders it as plain text.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import textwrap
from typing import Any, Dict, Iterator, List, Optional, Tuple

from . import native
from .errors import PackedFormatError
from .loading import temp_dir
from .space import human_bytes as _size
from .writing.parallel import available_cores

MOUNTS = "/proc/mounts"
SHM = "/dev/shm"
DEFAULT_BATCH = 256
DEFAULT_IMAGE = (224, 224, 3)
PREFETCH_FACTOR = 2  # DataLoader's default batches in flight per worker
MAX_SUGGESTED_WORKERS = 16
SHARED_KINDS = ("lustre", "gpfs", "nfs", "network")

_KINDS = {
    "lustre": "lustre",
    "gpfs": "gpfs",
    "nfs": "nfs",
    "nfs4": "nfs",
    "tmpfs": "tmpfs",
    "ramfs": "tmpfs",
    "overlay": "overlay",
    "aufs": "overlay",
    "fuse-overlayfs": "overlay",
}
_LOCAL = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "vfat", "exfat", "ntfs", "ntfs3"}
_NETWORK = {
    "beegfs", "ceph", "cephfs", "cifs", "smb3", "smbfs", "9p", "glusterfs", "wekafs", "panfs", "afs", "virtiofs",
}
_LABELS = {
    "lustre": "Lustre (a shared parallel file system)",
    "gpfs": "GPFS / Spectrum Scale (a shared parallel file system)",
    "nfs": "NFS (a network file system)",
    "network": "a network / shared file system",
    "local": "a local disk",
    "tmpfs": "a memory file system",
    "overlay": "an overlay file system (a container layer)",
    "unknown": "an unrecognised file system",
}


# ---- file systems -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Mount:
    device: str
    mount_point: str
    fstype: str


def read_mounts(mounts: str = MOUNTS) -> List[Mount]:
    """The mount table (later lines override earlier ones on the same mount point)."""
    found = []
    with open(mounts) as file:
        for line in file:
            fields = line.split()
            if len(fields) >= 3:
                device, point, fstype = (_unescape(f) for f in fields[:3])
                found.append(Mount(device, point, fstype))
    return found


def _unescape(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes (\\040...)."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def filesystem_kind(fstype: str) -> str:
    """lustre, gpfs, nfs, network, local, tmpfs, overlay or unknown."""
    if fstype in _KINDS:
        return _KINDS[fstype]
    if fstype in _LOCAL:
        return "local"
    if fstype in _NETWORK or fstype.startswith("fuse"):
        return "network"
    return "unknown"


def filesystem_of(path: str, mounts: str = MOUNTS) -> Dict[str, Any]:
    """The mount holding ``path``: the longest mount point that is a prefix of its real path."""
    real = os.path.realpath(path)
    best: Optional[Mount] = None
    for mount in read_mounts(mounts):
        point = mount.mount_point.rstrip("/") or "/"
        inside = real == point or real.startswith(point if point == "/" else point + "/")
        if inside and (best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")):
            best = mount
    if best is None:
        return {"mount_point": None, "fstype": None, "kind": "unknown", "device": None}
    return {
        "mount_point": best.mount_point,
        "fstype": best.fstype,
        "kind": filesystem_kind(best.fstype),
        "device": best.device,
    }


# ---- the machine ----------------------------------------------------------------------------
def processes_per_node() -> int:
    """Training processes sharing this node's CPUs (torchrun's LOCAL_WORLD_SIZE, Slurm tasks)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "").split("(")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def suggested_num_workers(cpus: int, processes: int = 1) -> int:
    """One core per process for its main loop, the rest as DataLoader workers (capped)."""
    return max(0, min(MAX_SUGGESTED_WORKERS, cpus // max(1, processes) - 1))


def cpu_info() -> Dict[str, Any]:
    cpus, processes = available_cores(), processes_per_node()
    return {
        "usable": cpus,
        "online": os.cpu_count(),
        "processes_per_node": processes,
        "slurm_cpus_per_task": os.environ.get("SLURM_CPUS_PER_TASK"),
        "suggested_num_workers": suggested_num_workers(cpus, processes),
    }


def jpeg_info(check_torchvision: bool = True) -> Dict[str, Any]:
    """Is Pillow built with libjpeg-turbo, and can torchvision decode JPEG itself?

    ``check_torchvision=False`` leaves torchvision unimported (it takes seconds to import) and its
    decoder unchecked (``torchvision_decode_jpeg`` None): what a raw archive, which is never
    decoded, needs to know.
    """
    import PIL
    from PIL import features

    info = {
        "pillow_version": PIL.__version__,
        "pillow_libjpeg_turbo": bool(features.check_feature("libjpeg_turbo")),
        "pillow_libjpeg_version": features.version("jpg"),
    }
    info.update(_torchvision_jpeg() if check_torchvision else _torchvision_unchecked())
    return info


def _torchvision_unchecked() -> Dict[str, Any]:
    from importlib import metadata

    try:
        version: Optional[str] = metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        version = None
    return {"torchvision_version": version, "torchvision_decode_jpeg": None, "torchvision_error": None,
            "image_decoder": None}


def _torchvision_jpeg() -> Dict[str, Any]:
    from . import image_decode

    try:
        import torchvision

        from .loading.device_decode import decoder_error
    except Exception as exc:  # torchvision missing or broken
        return {"torchvision_version": None, "torchvision_decode_jpeg": False, "torchvision_error": repr(exc),
                "image_decoder": image_decode.describe()}
    error = decoder_error()  # decodes a small JPEG with image_decoder (a build without its image extension cannot)
    return {
        "torchvision_version": torchvision.__version__,
        "torchvision_decode_jpeg": error is None,
        "torchvision_error": error,
        "image_decoder": image_decode.describe(),
    }


def shm_info(batch_bytes: int, workers: int) -> Dict[str, Any]:
    """/dev/shm size against the batches DataLoader workers keep there (make_loader's
    workers keep up to ``memory.SLOTS_PER_WORKER`` batches each, reused)."""
    from .memory import SLOTS_PER_WORKER

    per_worker = max(PREFETCH_FACTOR, SLOTS_PER_WORKER)
    needed = workers * per_worker * batch_bytes
    total: Optional[int]
    free: Optional[int]
    try:
        usage = shutil.disk_usage(SHM)
        total, free = usage.total, usage.free
    except OSError:
        total = free = None
    return {
        "path": SHM, "total_bytes": total, "free_bytes": free, "batch_bytes": batch_bytes,
        "batches_per_worker": per_worker, "needed_bytes": needed,
    }


def memory_info() -> Dict[str, Any]:
    """MemTotal and MemAvailable (/proc/meminfo) and this job's cgroup memory limit, in bytes."""
    values: Dict[str, int] = {}
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                name, _, rest = line.partition(":")
                values[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    limit = cgroup_memory_limit()
    available = values.get("MemAvailable")
    if available is not None and limit is not None:
        available = min(available, limit)
    return {"total_bytes": values.get("MemTotal"), "available_bytes": available, "cgroup_limit_bytes": limit}


def cgroup_memory_limit() -> Optional[int]:
    """The memory limit of this process's cgroup (v2 or v1), None when unlimited or unknown."""
    for candidate in _cgroup_memory_files():
        try:
            with open(candidate) as file:
                text = file.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def _cgroup_memory_files() -> Iterator[str]:
    try:
        with open("/proc/self/cgroup") as file:
            lines = file.read().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, group = line.split(":", 2)
        group = group.strip("/")
        if controllers == "":
            yield os.path.join("/sys/fs/cgroup", group, "memory.max")
        elif "memory" in controllers.split(","):
            yield os.path.join("/sys/fs/cgroup/memory", group, "memory.limit_in_bytes")


def torch_info() -> Dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "torch_version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }


# ---- the archive ----------------------------------------------------------------------------
def archive_summary(path: str) -> Optional[Dict[str, Any]]:
    """The manifest summary when ``path`` is an archive (or image folder), else None."""
    from .archives import open_archive
    from .backends import detect_format
    from .space import disk_usage

    try:
        format = detect_format(path)
    except PackedFormatError:
        return None
    summary: Dict[str, Any] = {"format": format, "bytes": disk_usage(path)}
    try:
        with open_archive(path, verify=False) as reader:
            m = reader.manifest
            summary.update(
                mode=m.mode, count=m.count, classes=len(m.classes), shape=None if m.shape is None else list(m.shape),
                encoding=m.encoding, created_with=m.created_with, created_at=m.created_at,
            )
    except PackedFormatError as exc:
        summary["error"] = str(exc)
    return summary


# ---- the report -------------------------------------------------------------------------------
def diagnose(
    path: "str | os.PathLike[str] | None" = None, batch_size: int = DEFAULT_BATCH, mounts: str = MOUNTS
) -> Dict[str, Any]:
    """A JSON-able report on loading speed and safety for ``path`` (default: the current directory).

    Keys: path, filesystem, archive (None unless path is an archive), cpu, jpeg, pixels, shm,
    memory, torch, tempdir, advice (a list of {"topic", "level", "message"}; level is ok, info
    or warning).

    Args:
        path: a directory or an archive.
        batch_size: the batch size the advice on memory (shared memory, pinned copies) assumes.
        mounts: the mount table the file system is looked up in.

    Raises:
        ArchiveNotFoundError: ``path`` does not exist.
        ArchivePermissionError: a folder on the way to ``path`` may not be searched by this user.
    """
    path = os.path.abspath(os.fspath(path if path is not None else os.getcwd()))
    if not os.path.exists(path):
        from .backends import not_found

        raise not_found(path)
    archive = archive_summary(path)
    cpu = cpu_info()
    report: Dict[str, Any] = {
        "path": path,
        "filesystem": filesystem_of(path, mounts),
        "archive": archive,
        "cpu": cpu,
        "jpeg": jpeg_info(check_torchvision=_decodes(archive)),
        "pixels": {"channels_parted_by": native.planar_copy()},
        "shm": shm_info(batch_size * _sample_bytes(archive), cpu["suggested_num_workers"]),
        "memory": memory_info(),
        "torch": torch_info(),
        "tempdir": temp_dir.describe(),
    }
    report["memory"]["archive_bytes"] = None if archive is None else archive["bytes"]
    report["advice"] = advise(report)
    return report


def _decodes(archive: Optional[Dict[str, Any]]) -> bool:
    """Whether reading ``path`` decodes images: anything but a readable raw archive."""
    return archive is None or "error" in archive or archive.get("mode") != "raw"


def _sample_bytes(archive: Optional[Dict[str, Any]]) -> int:
    shape = (archive or {}).get("shape") or DEFAULT_IMAGE
    h, w, c = shape
    return h * w * c


def format_report(report: Dict[str, Any]) -> str:
    """The report as plain text: one line per topic, then the advice."""
    lines = [f"packed-formats doctor: {report['path']}"]
    lines += [f"  {name:<12} {text}" for name, text in summary_lines(report)]
    lines += ["", "Advice:"]
    for item in report["advice"]:
        tag = {"ok": "[ok]  ", "info": "[info]", "warning": "[warn]"}[item["level"]]
        lines += textwrap.wrap(
            item["message"], width=100, initial_indent=f"  {tag} ", subsequent_indent=" " * 9,
            break_on_hyphens=False, break_long_words=False,
        )
    return "\n".join(lines)


def summary_lines(report: Dict[str, Any]) -> List[Tuple[str, str]]:
    """(topic, one-line finding) pairs for the text report."""
    fs, cpu, jpeg, shm, memory, torch = (
        report[k] for k in ("filesystem", "cpu", "jpeg", "shm", "memory", "torch")
    )
    lines = [("file system", f"{fs['fstype']} ({_LABELS[fs['kind']]}), mounted at {fs['mount_point']}")]
    if report["archive"] is not None:
        lines.append(("archive", _describe_archive(report["archive"])))
    lines.append(("CPUs", f"{cpu['usable']} usable by this process (of {cpu['online']} online), "
                          f"{cpu['processes_per_node']} training process(es) per node"))
    turbo = "with libjpeg-turbo" if jpeg["pillow_libjpeg_turbo"] else "WITHOUT libjpeg-turbo"
    vision = {True: "can decode JPEG", False: "cannot decode JPEG",
              None: "(its decoder not checked: a raw archive is never decoded)"}[jpeg["torchvision_decode_jpeg"]]
    decoder = jpeg["image_decoder"] or f"torchvision {jpeg['torchvision_version']}"  # image_decode.describe()
    lines.append(("JPEG", f"Pillow {jpeg['pillow_version']} {turbo}; {decoder} {vision}"))
    lines.append(("pixels", "channels parted (HxWxC <-> CxHxW) by "
                            + {"native": "the C module", "numpy": "numpy: the C module is not built"}[
                                report["pixels"]["channels_parted_by"]]))
    lines.append(("/dev/shm", f"{_size(shm['free_bytes'])} free of {_size(shm['total_bytes'])}"))
    limit = "" if memory["cgroup_limit_bytes"] is None else f" (job limit {_size(memory['cgroup_limit_bytes'])})"
    lines.append(("memory", f"{_size(memory['available_bytes'])} available of {_size(memory['total_bytes'])}{limit}"))
    gpus = ", ".join(torch["gpus"]) if torch["gpus"] else "no GPU visible"
    lines.append(("torch", f"{torch['torch_version']}, CUDA build {torch['cuda_build']}, {gpus}"))
    return lines


def _describe_archive(archive: Dict[str, Any]) -> str:
    if "error" in archive:
        return f"{archive['format']}, unreadable: {archive['error']}"
    layout = "x".join(map(str, archive["shape"])) if archive["mode"] == "raw" else archive["encoding"]
    return (f"{archive['format']}, {archive['mode']} {layout}, {archive['count']} samples, "
            f"{archive['classes']} classes, {_size(archive['bytes'])}")


# ---- advice ------------------------------------------------------------------------------------
Advice = Iterator[Tuple[str, str]]  # (level, message)


def advise(report: Dict[str, Any]) -> List[Dict[str, str]]:
    """Actionable advice, one item per finding: {"topic", "level", "message"}."""
    checks = (
        ("filesystem", _filesystem_advice), ("locking", _locking_advice), ("archive", _archive_advice),
        ("cpu", _cpu_advice), ("jpeg", _jpeg_advice), ("pixels", _pixels_advice), ("shm", _shm_advice),
        ("memory", _memory_advice), ("torch", _torch_advice), ("tempdir", _temp_dir_advice),
    )
    return [
        {"topic": topic, "level": level, "message": message}
        for topic, check in checks
        for level, message in check(report)
    ]


def _filesystem_advice(report: Dict[str, Any]) -> Advice:
    fs, path = report["filesystem"], report["path"]
    where = f"{path} is on {_LABELS[fs['kind']]} ({fs['fstype']}, mounted at {fs['mount_point']})"
    if fs["kind"] in SHARED_KINDS:
        yield "warning", (
            f"{where}. Shared file systems serve the many small random reads of DataLoader workers and ranks "
            "slowly, and every file open is a metadata round trip. Keep data there as one packed archive and "
            f"stage it to node-local disk once per node before training: `packed-formats stage {path} "
            "--to $TMPDIR` (or pf.stage(path, os.environ['TMPDIR']) in Python)."
        )
    elif fs["kind"] == "tmpfs":
        yield "info", (
            f"{where}: the fastest place to read from, but it uses RAM (the same pool as /dev/shm and the page "
            "cache) and is gone when the job or machine ends."
        )
    elif fs["kind"] == "overlay":
        yield "warning", (
            f"{where}: reads pass through the container's copy-on-write layer. Mount the data directory as a "
            "volume (bind mount) on a local disk instead."
        )
    elif fs["kind"] == "local":
        yield "ok", f"{where}: local storage, no staging needed."
    else:
        yield "info", f"{where}. If it is a network file system, stage archives to node-local disk."


def _locking_advice(report: Dict[str, Any]) -> Advice:
    shared = report["filesystem"]["kind"] in SHARED_KINDS
    format = (report["archive"] or {}).get("format")
    if format == "hdf5" or (shared and format is None):
        yield "info", (
            "HDF5: packed_formats reads its archives with plain positional reads, never through HDF5's library, "
            "so it takes no file lock and the file-locking errors HDF5 raises on Lustre/NFS (errno 524 or 11) "
            "cannot happen with it. For other h5py code there, set HDF5_USE_FILE_LOCKING=FALSE."
        )
    if format == "lmdb" or (shared and format is None):
        yield "info", (
            "LMDB: packed_formats opens sealed archives readonly with lock=False: no lock file and no "
            "reader-slot table to exhaust, fine on read-only and shared mounts. Never write an LMDB on a network "
            "file system."
        )


def _archive_advice(report: Dict[str, Any]) -> Advice:
    archive = report["archive"]
    if archive is None:
        return
    if "error" in archive:
        yield "warning", f"The archive cannot be opened: {archive['error']}"
    elif archive["format"] == "folder":
        yield "warning", (
            f"This is a folder of {archive['count']} image files: each sample costs a file open and a decode. "
            "Pack it once with `packed-formats convert` into one archive (raw mode for the fastest reads, encoded "
            "for the smallest file)."
        )
    else:
        yield "ok", f"A sealed {archive['format']} archive ({archive['mode']} mode, {archive['count']} samples)."


def _cpu_advice(report: Dict[str, Any]) -> Advice:
    cpu = report["cpu"]
    n = cpu["suggested_num_workers"]
    yield "info", (
        f"Use num_workers={n} per training process: {cpu['usable']} CPUs usable over "
        f"{cpu['processes_per_node']} process(es) per node, one core each left for the main loop."
    )
    if cpu["usable"] <= 2 and not _decodes(report["archive"]):
        yield "warning", (
            f"Only {cpu['usable']} CPU(s): this is a raw archive, which needs no decoding, but random augmentation "
            "runs on them. Ask Slurm for more (--cpus-per-task), or augment on the GPU (pf.make_loader(..., "
            "device='cuda'))."
        )
    elif cpu["usable"] <= 2:
        yield "warning", (
            f"Only {cpu['usable']} CPU(s): decoding will be the bottleneck. Ask Slurm for more "
            "(--cpus-per-task) or use a raw-mode archive, which needs no decoding."
        )


def _pixels_advice(report: Dict[str, Any]) -> Advice:
    if report["pixels"]["channels_parted_by"] == "numpy":
        yield "warning" if not _decodes(report["archive"]) else "info", (
            "packed_formats' C module is not built (pip found no C compiler or Python headers when it "
            "installed the package): raw batches in another layout than the archive's (NCHW from an "
            "interleaved archive, channels-last from a planar one) part each image's channels with numpy, "
            "about 3x slower. Install a compiler and the Python headers (gcc and python3-dev, or a conda "
            "compiler) and reinstall: pip install --no-deps --force-reinstall ."
        )


def _jpeg_advice(report: Dict[str, Any]) -> Advice:
    jpeg = report["jpeg"]
    if not jpeg["pillow_libjpeg_turbo"] and not _decodes(report["archive"]):
        yield "info", "Pillow is built without libjpeg-turbo; this raw archive is never decoded, so it does not matter."
    elif not jpeg["pillow_libjpeg_turbo"]:
        yield "warning", (
            "Pillow is built without libjpeg-turbo, so JPEG decoding is several times slower. Install Pillow "
            "from the PyPI wheels (they bundle libjpeg-turbo) or use a raw-mode archive."
        )
    else:
        yield "ok", "Pillow uses libjpeg-turbo for JPEG decoding."
    if jpeg["torchvision_decode_jpeg"] is False:
        yield "info", "torchvision cannot decode JPEG here (its image extension is missing); Pillow is used instead."


def _shm_advice(report: Dict[str, Any]) -> Advice:
    shm = report["shm"]
    if shm["free_bytes"] is None:
        yield "warning", f"{shm['path']} is missing: DataLoader workers need shared memory to hand batches over."
        return
    what = (
        f"{report['cpu']['suggested_num_workers']} worker(s) x {shm['batches_per_worker']} batches of "
        f"{_size(shm['batch_bytes'])} need about {_size(shm['needed_bytes'])} of {shm['path']}"
    )
    if shm["free_bytes"] < shm["needed_bytes"]:
        yield "warning", (
            f"{what}, but only {_size(shm['free_bytes'])} is free: expect 'DataLoader worker killed by signal: Bus "
            "error'. Use fewer workers or smaller batches, or enlarge it (docker run --shm-size=8g)."
        )
    else:
        yield "ok", f"{what}; {_size(shm['free_bytes'])} is free."


def _temp_dir_advice(report: Dict[str, Any]) -> Advice:
    found = report["tempdir"]
    if found["applies"] and found["socket_path_bytes"] > found["limit"]:
        yield "warning", (
            f"the temporary folder {found['path']} is too deep: DataLoader workers pass shared memory through a "
            f"socket under it, whose path would be {found['socket_path_bytes']} bytes (at most {found['limit']}), "
            "so a plain DataLoader hangs and make_loader refuses to start. Set TMPDIR to a shorter folder "
            "(export TMPDIR=/tmp)."
        )


def _memory_advice(report: Dict[str, Any]) -> Advice:
    memory = report["memory"]
    size, available = memory["archive_bytes"], memory["available_bytes"]
    if size is None or available is None:
        return
    if size <= 0.8 * available:
        yield "ok", (
            f"The archive ({_size(size)}) fits in the {_size(available)} of available memory: after the first "
            "epoch it is read from the page cache, not the disk."
        )
    else:
        yield "warning", (
            f"The archive ({_size(size)}) is larger than the memory available ({_size(available)}): every epoch "
            "reads it from storage. Stage it to a fast node-local SSD, or use encoded mode (several times smaller "
            "than raw) so more of it stays cached."
        )


def _torch_advice(report: Dict[str, Any]) -> Advice:
    torch = report["torch"]
    if torch["cuda_available"]:
        yield "ok", (
            f"{len(torch['gpus'])} GPU(s) visible. Keep CUDA out of Dataset code and workers; move whole batches "
            "to the GPU in the main process (pf.make_loader(..., device='cuda') does this with pinned memory)."
        )
    else:
        build = "a CPU-only torch build" if torch["cuda_build"] is None else "no GPU visible to this process"
        yield "info", f"torch {torch['torch_version']}: {build}; training runs on the CPU."
