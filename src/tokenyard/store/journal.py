"""Journal segments: append-only JSON-lines files that keep unflushed usage across a crash.

Each live ledger writer holds an exclusive `flock` on every segment it owns. The kernel
drops the lock when the process dies (kill -9 included), so a segment whose lock can be
taken belongs to a dead process: an orphan, to be replayed and removed. Writes use
`os.write` on an O_APPEND fd without fsync: once write() returns the bytes are in the
page cache and survive the process (not a power cut, which the database would not
survive either without its own fsync).
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path

PATTERN = "ledger-*.jsonl"
_TEMP_PATTERN = ".ledger-*.tmp"


class Segment:
    """One journal file, locked by this process while the object is open."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.lines = 0  # lines written by this process
        self.unflushed = 0  # of those, lines whose records are not committed yet

    @classmethod
    def create(cls, directory: Path) -> Segment:
        """A new, empty, locked segment named ledger-<pid>-<random>.jsonl in `directory`."""
        name = f"ledger-{os.getpid()}-{secrets.token_hex(4)}"
        temp = directory / f".{name}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        # Lock before the file gets a name that orphan scans match: otherwise another
        # process could take it for a dead writer's file in between.
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = directory / f"{name}.jsonl"
        os.rename(temp, path)
        return cls(path, fd)

    @classmethod
    def adopt(cls, path: Path) -> Segment | None:
        """Lock the segment at `path` if its writer is dead; None if it is alive or gone."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        except FileNotFoundError:
            return None  # another process adopted and removed it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return cls(path, fd)

    def write(self, line: bytes) -> None:
        """Append one line (the caller ends it with a newline); one write() call."""
        written = os.write(self.fd, line)
        if written != len(line):  # regular files do not short-write unless the disk is full
            raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
        self.lines += 1
        self.unflushed += 1

    def read_lines(self) -> list[bytes]:
        """Every complete line in the file; a torn last line (crash mid-write) is dropped."""
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        return [line for line in lines[:-1] if line.strip()]

    def remove(self) -> None:
        """Delete the file, then drop the lock (in that order, so nobody adopts it)."""
        self.path.unlink(missing_ok=True)
        os.close(self.fd)

    def close(self) -> None:
        """Drop the lock but keep the file: the next writer to start replays it."""
        os.close(self.fd)


def orphans(directory: Path) -> list[Segment]:
    """Segments in `directory` whose writers are dead, each now locked by us.

    Also removes leftover temporary files of writers that died while creating one
    (they are empty: nothing is appended before the rename).
    """
    for temp in directory.glob(_TEMP_PATTERN):
        leftover = Segment.adopt(temp)
        if leftover is not None:
            leftover.remove()
    found = (Segment.adopt(path) for path in sorted(directory.glob(PATTERN)))
    return [segment for segment in found if segment is not None]
