"""The degradation level across processes: moe_decoder writes it, vision_encoder and mm_qa_bls read it.

Each Triton Python model runs in a stub process of its own, so the level (`serving.load`) crosses
through eight bytes of shared memory: a file under /dev/shm (tmpfs, memory only) that each process
maps. Its name comes from the model repository's path (every model's args["model_repository"] is
its own folder in it), so the models of one server find one segment and two servers two. Two
servers on one host must therefore not serve the same repository path, or they share one level;
`zipmoe serve` renders a fresh copy of the repository for each server it starts.

Not `multiprocessing.shared_memory`: before Python 3.13 a process that only attaches to a segment
registers it with its resource tracker, which removes it when that process exits (CPython issue
82300), and a reader must never remove the writer's segment.

moe_decoder creates the file, or takes over one a killed server left on the same path, rewriting it
in place (a reader attached to it sees the new levels); it writes the level at each change, and at
finalize writes 0 and removes the file. A reader attaches lazily and reads level 0 while there is
nothing to attach to; every RECHECK_S it checks that the path still names the file it mapped, and
maps the new one when moe_decoder was loaded again.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
import tempfile
import time
from pathlib import Path

FORMAT = "<Q"  # the level; an aligned 8-byte store, so a reader never sees half of one
SIZE = struct.calcsize(FORMAT)
RECHECK_S = 1.0


def segment_path(model_folder: str | Path) -> Path:
    """args["model_repository"] of any model of a server (that model's folder) -> its server's segment."""
    repository = Path(model_folder).resolve().parent
    digest = hashlib.sha256(str(repository).encode()).hexdigest()[:16]
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return root / f"zipmoe-level-{digest}"


class LevelWriter:
    """moe_decoder's end: creates (or takes over) the segment at level 0."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.write(0)

    def write(self, level: int) -> None:
        struct.pack_into(FORMAT, self._map, 0, level)

    def close(self) -> None:
        """Level 0 first: a reader still mapping the removed file then stops degrading."""
        self.write(0)
        self._map.close()
        self.path.unlink(missing_ok=True)


class LevelReader:
    """vision_encoder's and mm_qa_bls's end: read() per request (a memory read, and a stat per RECHECK_S)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map: mmap.mmap | None = None
        self._file: tuple[int, int] | None = None  # (device, inode) of the file mapped
        self._check_at = 0.0

    def read(self) -> int:
        now = time.monotonic()
        if now >= self._check_at:
            self._check_at = now + RECHECK_S
            self._follow()
        return 0 if self._map is None else struct.unpack_from(FORMAT, self._map)[0]

    def _follow(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:  # not created yet, or removed at shutdown
            self._unmap()
            return
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == self._file:
                return
            self._unmap()
            if st.st_size >= SIZE:  # else moe_decoder is creating it: next time
                self._map = mmap.mmap(fd, SIZE, access=mmap.ACCESS_READ)
                self._file = (st.st_dev, st.st_ino)
        finally:
            os.close(fd)

    def _unmap(self) -> None:
        if self._map is not None:
            self._map.close()
        self._map, self._file = None, None
