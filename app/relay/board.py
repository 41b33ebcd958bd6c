"""The admission board: how many requests each relay has at which engine, in a small file the relays share.

The relays forward at most an engine's capacity (``max_num_seqs + engine_backlog``) between them. Splitting
it evenly in advance does not work: the kernel hands connections to relays unevenly (measured on the H200: a
128-stream level through two relays whose halves were 80 each ran with requests waiting in one relay while
the engine had free slots; TTFT p50 1.24 s against 0.12 s). So each relay writes its own count into its slot
of this board (the active engine's id and how many requests it has there; one writer per slot, one aligned
8-byte store), and admits a request when the board's sum for the engine is under its capacity. Reading the
sum and raising one's count happen under an exclusive ``flock`` of the board, so two relays that admit at the
same moment cannot both take the last place (without it they did: the engine got one request per relay beyond
its capacity, and a request counted as waiting in the relays was in the engine instead). Lowering a count
needs no lock; a look that finds the board full takes none either.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from pathlib import Path

_SLOT = struct.Struct("<II")  # engine id, requests there


class AdmissionBoard:
    def __init__(self, path: Path, index: int) -> None:
        """The board at ``path``, written at slot ``index`` (this relay's)."""
        self._fd = os.open(path, os.O_RDWR)  # kept open: its lock is this relay's (one per open file)
        self._map = mmap.mmap(self._fd, os.fstat(self._fd).st_size)
        self._slots = len(self._map) // _SLOT.size
        if not 0 <= index < self._slots:
            raise ValueError(f"relay index {index} has no slot on a board of {self._slots}")
        self._offset = index * _SLOT.size
        self.post(0, 0)  # a relay started again under this index holds nothing yet

    @staticmethod
    def size(slots: int) -> int:
        """Bytes of a board of ``slots`` slots."""
        return slots * _SLOT.size

    @staticmethod
    def create(path: Path, slots: int) -> None:
        """A board of ``slots`` slots (the supervisor makes it before it starts relays), every slot empty. A
        new file: relays of an earlier board keep theirs."""
        temporary = path.with_suffix(".tmp")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, bytes(slots * _SLOT.size))
            os.replace(temporary, path)
        finally:
            os.close(fd)

    def post(self, engine: int, count: int) -> None:
        """This relay has ``count`` requests at ``engine``."""
        _SLOT.pack_into(self._map, self._offset, engine, count)

    def take(self, engine: int, count: int, capacity: int) -> bool:
        """Raise this relay's count at ``engine`` from ``count`` to ``count + 1`` if all relays have fewer than
        ``capacity`` requests there, as one step no other relay's take can come between."""
        if self.total(engine) >= capacity:
            return False
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if self.total(engine) >= capacity:
                return False
            self.post(engine, count + 1)
            return True
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def total(self, engine: int) -> int:
        """Requests all relays have at ``engine``."""
        return sum(count for slot, count in _SLOT.iter_unpack(self._map) if slot == engine)

    @staticmethod
    def clear(path: Path, index: int) -> None:
        """Empty a relay's slot (the supervisor, when the relay died: its requests went with it)."""
        with open(path, "r+b") as board:
            board.seek(index * _SLOT.size)
            board.write(_SLOT.pack(0, 0))

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
