"""The degradation level across processes: each moe_decoder instance writes its own, vision_encoder and
mm_qa_bls read the highest. (`gpu_turn` uses the same slots the other way round: vision_encoder
instances write, moe_decoder reads the highest, in a segment of another `kind`.)

Each Triton Python model instance runs in a stub process of its own, so the level (`serving.load`)
crosses through shared memory: a file under /dev/shm (tmpfs, memory only) that each process maps. Its
name comes from the model repository's path (every model's args["model_repository"] is its own folder
in it), so the models of one server find one segment and two servers two. Two servers on one host
must therefore not serve the same repository path, or they share their levels; `zipmoe serve`
renders a fresh copy of the repository for each server it starts.

**Several decoders (data parallel).** With `instance_group [{ kind: KIND_GPU, gpus: [0, 1] }]` there
is one moe_decoder instance, with its own engine and load, per GPU. The segment holds SLOTS slots of
(pid, level), 8 bytes apiece; each instance claims one at load and writes only its own, and a reader
takes the highest level of all slots. Why the highest, and not one level per GPU or a mean: Triton
chooses each model's instance for a request on its own, so the vision_encoder instance (or
mm_qa_bls) that picks the keep ratio cannot know which decoder will prefill the request, nor pair
itself with one. Nor does Triton spread by load: moe_decoder is decoupled and returns from execute()
at once, so its instances take requests about in turn whatever their queues. The next request is
then as likely to land on the most loaded decoder as on any other, and the highest level is the one
that keeps every decoder under its TTFT target; a mean would leave the loaded one over it. What it
costs: while one GPU alone is overloaded, requests bound for the others are degraded too. With one
instance it is the single level, as before.

Not `multiprocessing.shared_memory`: before Python 3.13 a process that only attaches to a segment
registers it with its resource tracker, which removes it when that process exits (CPython issue
82300), and a reader must never remove the writers' segment.

Claims and releases hold an exclusive flock on the file. A writer creates the file (zeroed), or
opens the one its sibling instances or a killed server left on the same path: it zeroes the slots of
processes that are gone (a killed server's levels stop counting) and claims a free one. It writes
its level at each change; at finalize it writes 0, frees its slot, and the last one out removes the
file. A reader attaches lazily and reads level 0 while there is nothing to attach to; every
RECHECK_S it checks that the path still names the file it mapped, and maps the new one when the
decoders were loaded again.
"""
from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
import tempfile
import time
from pathlib import Path

from ..supervisor import dead

SLOT = struct.Struct("<QQ")  # (pid of the writer, 0 = free; its level): aligned 8-byte stores, never half-read
SLOTS = 64  # moe_decoder instances one server may run (GPUs x count); 1 KiB
SIZE = SLOT.size * SLOTS
EVERY_SLOT = struct.Struct(f"<{2 * SLOTS}Q")
LEVEL_OFFSET = 8  # of the level inside a slot
RECHECK_S = 1.0


def segment_path(model_folder: str | Path, kind: str = "level") -> Path:
    """args["model_repository"] of any model of a server (that model's folder) -> its server's segment
    of that kind."""
    return _segment_root() / f"zipmoe-{kind}-{_digest(Path(model_folder).resolve().parent)}"


def server_segments(repository: str | Path) -> list[Path]:
    """Every segment (of any kind) of the server on `repository`: what serve.py removes once it is gone."""
    return sorted(_segment_root().glob(f"zipmoe-*-{_digest(Path(repository).resolve())}"))


def _digest(repository: Path) -> str:
    return hashlib.sha256(str(repository).encode()).hexdigest()[:16]


def _segment_root() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def file_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd` (the last writer out removes it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == file_id(fd)


def slots(segment) -> list[tuple[int, int]]:
    """Every slot's (pid, level); a free slot is (0, 0)."""
    values = EVERY_SLOT.unpack_from(segment)
    return list(zip(values[0::2], values[1::2]))


class LevelWriter:
    """One moe_decoder instance's end: claims a slot of the segment (created if need be) at level 0."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                # The last writer out may have removed this file between our open and our lock: a slot
                # in it would be seen by nobody, so open the path again.
                if names(self.path, fd):
                    self.slot = self._claim(fd)
                    return
            finally:
                # Unlocked explicitly: the mapping keeps a dup of fd, which would hold the lock on.
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def _claim(self, fd: int) -> int:
        if os.fstat(fd).st_size != SIZE:  # new (or of another layout): all slots free
            os.ftruncate(fd, 0)
            os.ftruncate(fd, SIZE)
        self._map, self._file = mmap.mmap(fd, SIZE), file_id(fd)
        for i, (pid, _) in enumerate(slots(self._map)):
            if pid and dead(pid):  # left by a killed instance: its level no longer counts
                SLOT.pack_into(self._map, i * SLOT.size, 0, 0)
        free = [i for i, (pid, _) in enumerate(slots(self._map)) if not pid]
        if not free:
            self._map.close()
            raise RuntimeError(f"{self.path}: all {SLOTS} slots are taken by live writers")
        SLOT.pack_into(self._map, free[0] * SLOT.size, os.getpid(), 0)
        return free[0]

    def write(self, level: int) -> None:
        struct.pack_into("<Q", self._map, self.slot * SLOT.size + LEVEL_OFFSET, level)

    def close(self) -> None:
        """Level 0 first (a reader still mapping the file stops degrading for this instance), then the
        slot freed; the last instance out removes the file."""
        self.write(0)
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:  # removed by hand: nothing to lock or remove
            fd = None
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            SLOT.pack_into(self._map, self.slot * SLOT.size, 0, 0)
            ours = fd is not None and file_id(fd) == self._file  # the path still names our file
            if ours and not any(pid for pid, _ in slots(self._map)):
                self.path.unlink()
        finally:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            self._map.close()


class LevelReader:
    """vision_encoder's and mm_qa_bls's end: read() per request (SLOTS memory reads, and a stat per RECHECK_S)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map: mmap.mmap | None = None
        self._file: tuple[int, int] | None = None  # (device, inode) of the file mapped
        self._check_at = 0.0

    def read(self) -> int:
        """The highest level of the decoder instances (0 when there is no segment)."""
        now = time.monotonic()
        if now >= self._check_at:
            self._check_at = now + RECHECK_S
            self._follow()
        return 0 if self._map is None else max(level for _, level in slots(self._map))

    def live_levels(self) -> list[int]:
        """Every slot's level whose writer is alive (a killed one's stays until a writer claims a slot)."""
        self.read()  # follows the file as read() does
        return [] if self._map is None else [level for pid, level in slots(self._map) if pid and not dead(pid)]

    def close(self) -> None:
        self._unmap()

    def _follow(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:  # not created yet, or removed at shutdown
            self._unmap()
            return
        try:
            if file_id(fd) == self._file:
                return
            self._unmap()
            if os.fstat(fd).st_size >= SIZE:  # else moe_decoder is creating it: next time
                self._map = mmap.mmap(fd, SIZE, access=mmap.ACCESS_READ)
                self._file = file_id(fd)
        finally:
            os.close(fd)

    def _unmap(self) -> None:
        if self._map is not None:
            self._map.close()
        self._map, self._file = None, None
