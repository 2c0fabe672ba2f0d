"""The decoded cache (`--pipeline cache`, or `auto` where the local disk has room): an image
folder's split decoded once per machine into one .npy file (N x S x S x 3 uint8) that every rank of
the machine and its DataLoader workers memory-map, as its images.Decode says: the evaluation split
at the training size (its --crop_pct crop), a training split for RandomResizedCrop as whole images
at 1.5x the training size (crops.py; their aspect ratios beside it). An epoch is then a read of the
mapped rows, no JPEG decoding.

The file lives in ~/.cache/accel_train/decoded/ ($XDG_CACHE_HOME), named after the folder and size
and a key of the file list, each file's size and modification time, and the image size: a changed
folder gets a new file (the old one of the same folder and size is removed when the new one is
written), never a stale one. It is written by the machine's local main process into a temporary
file, renamed when complete; the other local ranks map it after the start-up's next collective
(on_every_rank's gather in setup), which the writer reaches only once it is written."""

from __future__ import annotations

import fcntl
import glob
import hashlib
import io
import json
import os
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import torch

from ..errors import Preempted
from ..files import cache_dir
from ..hang import PROGRESS
from .images import Decode, as_decode, channel_stats, check_images, decode_all, never, squash_kernel

VERSION = 4  # of the decode (decode_image) and the file's layout (H x W x 3 rows): a
# new one re-caches under a new name, never over a file a rank may map
CHUNK = 512  # most images decoded (a thread pool) per write
PIECE_S = 0.5  # seconds of decoding per write: a stop is answered within about a second
ROOM = 1.1, 2**30  # auto takes the cache where the free disk holds 1.1 x its size + 1 GiB
STATS = ".stats.json"  # beside a cache: its images' mean/std (cache_stats)
ASPECTS = ".aspects"  # beside a cache of whole images: their aspect ratios (cache_aspects)


def cache_path(
    files: list[Path], size: int | Decode, samples: int | None = None, part: str | None = None
) -> Path | None:
    """Where the decoded `files` at `size` px (a Decode: its crop or the whole image) are cached on
    this machine (None: no home for caches). `samples`: the --train_samples/--test_samples that
    chose `files` from a larger folder, part of the name (not only of the key): a subset's cache and
    the whole folder's are not stale versions of each other (write_cache's removal by name). `part`:
    which part of the folder `files` are (--val_split's training or held-out files), in the name for
    the same reason: two parts of one train/ and the whole are three caches. The key holds Pillow's
    version (an upgrade may decode differently), and each file's inode and change time besides its
    size and mtime: a file replaced by one of the same size and mtime (cp -p, rsync -a, tar x,
    touch -r keep the mtime) has a new ctime, which none of them can set."""
    root = cache_dir("decoded")
    if root is None or not files:
        return None
    from PIL import __version__ as pillow

    spec = as_decode(size)
    # (Pillow's and torch's kernels decode and resize the stored images: images.squash)
    key = hashlib.sha256(
        f"{VERSION} {pillow} {squash_kernel()} {spec.name()} {len(files)}\n".encode()
    )
    for f in files:
        st = os.stat(f)
        stamp = f"{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_ctime_ns}"
        key.update(f"{os.path.abspath(f)}\0{stamp}\n".encode())
    folder = os.path.abspath(os.path.commonpath([str(f) for f in files]))
    # (not "-": the whole folder's name would be its prefix)
    part = ("" if samples is None else f"_{samples}of") + ("" if part is None else f"_{part}")
    name = (
        f"{Path(folder).name[:40]}-{hashlib.sha256(folder.encode()).hexdigest()[:8]}-"
        f"{spec.name()}{part}"
    )
    return root / f"{name}-{key.hexdigest()[:20]}.npy"


def no_room(nbytes: int, mounts: str = "/proc/mounts") -> str | None:
    """Why auto does not take the cache (None: it does): the disk that holds the caches lacks room
    for the `nbytes` of caches still to write (1.1x + 1 GiB; 0: they are all there, whatever the
    free space), or it is not local (a network file system, /proc/mounts: a shared home would be
    read over the network by every epoch, and machines with their own copies of a folder would
    remove each other's caches)."""
    root = cache_dir("decoded")
    while root is not None and not root.exists() and root.parent != root:
        root = root.parent
    if root is None:
        return "no home directory for ~/.cache"
    kind = file_system(root, mounts)
    if kind.startswith(NETWORK_FS):
        return f"the cache's disk ({root}) is {kind}, not local: set XDG_CACHE_HOME to a local disk"
    try:
        free = shutil.disk_usage(root).free
    except OSError as e:
        return f"the cache's disk ({root}): {e.strerror or e}"
    if nbytes == 0 or free >= ROOM[0] * nbytes + ROOM[1]:
        return None
    return f"nor the local disk ({free / 2**30:.1f} GiB free in {root})"


# (prefixes: nfs4, smb3, fuse.sshfs, ...; autofs: an automount point, whose target is a network one
# nearly always)
NETWORK_FS = (
    "nfs",
    "cifs",
    "smb",
    "lustre",
    "gpfs",
    "beegfs",
    "ceph",
    "glusterfs",
    "fuse",
    "9p",
    "afs",
    "autofs",
    "virtiofs",
    "wekafs",
    "ocfs2",
    "gfs2",
    "orangefs",
    "pvfs2",
    "panfs",
    "quobyte",
    "davfs",
    "ncpfs",
    "coda",
)


def file_system(path: Path, mounts: str = "/proc/mounts") -> str:
    """The type of the file system that holds `path`: the longest mount point above it in `mounts`
    ('' if unknown), the last of equal ones (the top of a stack: an automount's autofs, then the NFS
    mounted over it)."""
    try:
        with open(mounts) as f:
            table = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return ""
    path = os.path.realpath(path)
    above = [
        (point, kind)
        for point, kind in table
        if path == point or path.startswith(point.rstrip("/") + "/")
    ]
    return max(enumerate(above), key=lambda m: (len(m[1][0]), m[0]))[1][1] if above else ""


def open_cache(path: Path, n: int, size: int | Decode) -> np.ndarray | None:
    """The cache at `path`, memory-mapped read-only, if it is complete and of this shape; else None.
    Its rows are images as decoded, H x W x 3 (N, side, side, 3: a cache of N x 3 x side x side rows
    is written again): a crop of a row is channels-last, the layout torch's uint8 resize is fastest
    on (crops.resized_crop_each)."""
    try:
        images = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return None
    side = as_decode(size).size
    return images if images.shape == (n, side, side, 3) and images.dtype == np.uint8 else None


def as_images(rows: np.ndarray) -> torch.Tensor:
    """Rows read from a cache (N, side, side, 3) -> uint8 N x 3 x side x side (channels-last), no
    copy."""
    return torch.from_numpy(rows).permute(0, 3, 1, 2)


def _same_folder_and_size(path: Path) -> str:
    """The start of the names of every cache of `path`'s folder at its size, whatever the key
    (cache_path)."""
    return path.name.rsplit("-", 1)[0] + "-"


def remove_abandoned(path: Path, mine: Path | None = None) -> bool:
    """The temporary files of this folder's caches at this size left by a writer of this machine
    that no longer runs (killed mid-write: hundreds of GB for a large folder) are removed, but one
    of `path`'s own key that this boot wrote becomes `mine` (renamed; True), so that a decode
    stopped by a signal or killed continues where it stopped. A writer runs while it holds its
    file's lock (flock: also one in another PID namespace of this host, a container sharing
    ~/.cache, whose pid means nothing here) or, for a writer without one, while its pid runs."""
    prefix = _same_folder_and_size(path)
    # exactly write_cache's name with this host: a glob's `*` would take "gpu1.cluster"'s files (a
    # shared home) for "gpu1"'s, whose pids do not run here
    host = re.escape(socket.gethostname())
    ours = re.compile(re.escape(f".{prefix}") + rf"[0-9a-f]+\.npy\.{host}\.(\d{{1,9}})\.tmp")
    adopted = False
    for tmp in sorted(path.parent.glob(f".{glob.escape(prefix)}*.tmp")):
        if (match := ours.fullmatch(tmp.name)) is None or _runs(tmp, int(match[1])):
            continue
        if (
            not adopted
            and mine is not None
            and tmp.name.startswith(f".{path.name}.")
            and _this_boot(tmp)
        ):
            try:
                os.rename(tmp, mine)
                adopted = True
            except OSError:  # (another writer took it first)
                pass
            continue
        tmp.unlink(missing_ok=True)
    return adopted


def _runs(tmp: Path, pid: int) -> bool:
    """Whether the writer of `tmp` runs: it holds the file's lock, or (a writer without one) its pid
    runs here."""
    try:
        fd = os.open(tmp, os.O_RDONLY)
    except OSError:  # (gone, or not ours to read: left alone)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # (BlockingIOError: locked)
        return True
    finally:
        os.close(fd)
    # (this process's own, stopped earlier: an in-process restart, train() called again)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it runs (as another user)
        pass
    return True


def _this_boot(tmp: Path) -> bool:
    """Whether `tmp` was written since this machine booted: what a killed process wrote is in the
    page cache, all of it, but rows written before a crash of the machine may not have reached the
    disk (holes of zeros)."""
    try:
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return tmp.stat().st_mtime > boot
    except (OSError, StopIteration, ValueError):
        return False


def _header(n: int, size: int) -> bytes:  # (size: the side in px; rows H x W x 3: open_cache)
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        out, {"descr": "|u1", "fortran_order": False, "shape": (n, size, size, 3)}
    )
    return out.getvalue()


def _rows_in(tmp: Path, header: bytes, row: int) -> int:
    """The whole images (rows of `row` bytes, written in order) after `header` in a temporary file
    (0: another header, a file of another shape)."""
    with open(tmp, "rb") as f:
        if f.read(len(header)) != header:
            return 0
        return max(0, (os.fstat(f.fileno()).st_size - len(header)) // row)


def publish(tmp: Path, path: Path, n: int, size: int) -> None:
    """The complete `tmp` becomes the cache at `path`, but never over a complete one that another
    machine sharing this home (NFS) wrote meanwhile from the same key: its ranks may have it mapped,
    and a file replaced under another client's mapping can fail its reads (ESTALE). A hard link
    fails if the name exists; without hard links, a rename."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        if open_cache(path, n, size) is None:  # (a damaged file there: ours replaces it)
            os.replace(tmp, path)
    except OSError:
        os.replace(tmp, path)


def write_cache(files: list[Path], size: int | Decode, path: Path, should_stop=never) -> str:
    """Decode `files` into the cache at `path` unless a complete one is there; the note for the
    start line. A bad image raises as check_images / decode_all name it; OSError (a full disk, a
    read-only one) leaves nothing behind. The decode answers a stop that `should_stop` names
    (decode_all's) within about a second: Preempted, its rows kept for the next start to continue
    (remove_abandoned); a complete cache of the same key that another writer (another container
    sharing ~/.cache) publishes meanwhile is taken, the rest not decoded."""
    n, side = len(files), as_decode(size).size
    mib = n * 3 * side * side / 2**20
    if open_cache(path, n, size) is not None:
        return f"decoded cache {path} ({mib:.0f} MiB), written by an earlier run: read, not decoded"
    aspects = check_images(files, size)  # every unreadable file named before the long decode
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    keep, header, row, rates, done = False, _header(n, side), 3 * side * side, [], 0
    try:
        adopted = remove_abandoned(path, tmp)
        with open(tmp, "r+b" if adopted else "wb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # (held until closed: this writer runs)
            resumed = done = min(n, _rows_in(tmp, header, row)) if adopted else 0
            f.seek(len(header) + done * row)
            f.truncate()
            f.seek(0)
            f.write(header)
            f.seek(0, os.SEEK_END)
            piece = 16
            while done < n:
                if should_stop() is not None:
                    raise Preempted("")
                if open_cache(path, n, size) is not None:
                    return (
                        f"decoded cache {path} ({mib:.0f} MiB), written meanwhile by another "
                        f"process: read, {done} of {n} images decoded here"
                    )
                images, rate = decode_all(files[done : done + piece], size, should_stop=should_stop)
                # (H x W x 3 rows: open_cache)
                f.write(images.permute(0, 2, 3, 1).numpy().tobytes())
                done += len(images)
                PROGRESS.mark("start-up: the decoded cache", detail=f"{done} of {n} images")
                rates.append(rate)
                # (a stop signal answered within about a second)
                piece = max(16, min(CHUNK, int(rate * PIECE_S)))
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path, n, size)
        if as_decode(size).whole:
            save_aspects(path, aspects)
    except Preempted:  # (between pieces, or inside one: decode_all)
        keep = True
        raise Preempted(
            f"stopped by {should_stop()} while decoding the cache {path} "
            f"({done} of {n} images); the next start continues it"
        ) from None
    finally:
        if not keep:
            tmp.unlink(missing_ok=True)
    prefix = _same_folder_and_size(path)  # a changed folder's older cache (and its statistics)
    for stale in path.parent.iterdir():
        if (
            stale.name.startswith(prefix)
            and stale.name.endswith((".npy", STATS, ASPECTS))
            and not stale.name.startswith(path.stem + ".")
        ):
            stale.unlink(missing_ok=True)
    again = f", continued from image {resumed + 1}" if resumed else ""
    return (
        f"decoded cache {path} ({mib:.0f} MiB) written once for this machine at "
        f"{np.median(rates or [0]):.0f} images/s{again} (remove it with rm; docs/speed.md)"
    )


def cache_stats(path: Path, images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean/std of the complete cache `images` at `path` (channel_stats: the device pipeline's
    numbers for the same images), kept beside it once computed: a later start reads them instead of
    the whole cache."""
    side = path.with_name(path.stem + STATS)
    try:
        mean, std = json.loads(side.read_text())
        return tuple(mean), tuple(std)
    except (OSError, ValueError, TypeError):
        pass
    stats = channel_stats(images.transpose(0, 3, 1, 2))
    tmp = side.with_name(f".{side.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(stats))
        os.replace(tmp, side)
    except OSError:  # (a full or read-only disk: computed again next time)
        tmp.unlink(missing_ok=True)
    return stats


def save_aspects(path: Path, aspects) -> None:
    """The whole images' aspect ratios beside their cache (a later start reads them instead of every
    header)."""
    side = path.with_name(path.stem + ASPECTS)
    tmp = side.with_name(f".{side.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, np.asarray(aspects, dtype=np.float64))
        os.replace(tmp, side)
    except OSError:  # (a full or read-only disk: read from the headers again next time)
        tmp.unlink(missing_ok=True)


def cache_aspects(path: Path | None, files: list[Path]):
    """The aspect ratios (width / height, upright) of `files`: kept beside their cache at `path`,
    else every header read (check_images) and kept there."""
    import torch

    if path is not None:
        try:
            kept = np.load(path.with_name(path.stem + ASPECTS))
            if kept.shape == (len(files),):
                return torch.from_numpy(kept)
        except (OSError, ValueError):
            pass
    aspects = check_images(files)
    if path is not None:
        save_aspects(path, aspects)
    return aspects
