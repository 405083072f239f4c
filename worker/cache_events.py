"""The radix cache's KV events between two drains (contract 3): stored runs, removed hashes and a
cleared flag, in a bounded buffer. It never loses a store that follows a removal of the same hash.

Event rule (``drain``): a drain returns (stored, removed, cleared) meant to be applied as cleared,
then stored, then removed. A hash is in ``removed`` only if its last event before the drain was a
removal: storing a hash drops it from the pending removals, so a store that follows a removal is
never lost; a hash stored then removed may appear in both lists, which the application order
resolves to "removed", its true final state.
"""

from __future__ import annotations

from collections.abc import Callable

from router.kv_events import StoredBlocks


class CacheEventLog:
    """Pending block events of one cache. When more than ``max_pending_blocks`` pile up undrained,
    they are dropped and the next drain is (snapshot(), [], cleared=True): always correct, bounded."""

    def __init__(self, max_pending_blocks: int = 1 << 18) -> None:
        self.max_pending_blocks = max_pending_blocks
        self._stored: list[StoredBlocks] = []
        self._removed: dict[int, None] = {}  # ordered set of hashes
        self._cleared = False
        self._blocks = 0
        self._overflowed = False

    def stored(self, run: StoredBlocks) -> None:
        if self._overflowed:
            return
        if self._removed:
            for h in run.block_hashes:
                self._removed.pop(h, None)
        self._stored.append(run)
        self._count(len(run.block_hashes))

    def removed(self, hashes: list[int]) -> None:
        """``hashes`` of one run, parent first; recorded deepest block first."""
        if self._overflowed:
            return
        for h in reversed(hashes):
            self._removed[h] = None
        self._count(len(hashes))

    def cleared(self) -> None:
        """The cache is empty now: what is pending collapses into one ``cleared``."""
        self._stored.clear()
        self._removed.clear()
        self._blocks = 0
        self._cleared = True
        self._overflowed = False

    def _count(self, n: int) -> None:
        self._blocks += n
        if self._blocks > self.max_pending_blocks:
            self._overflowed = True
            self._stored.clear()
            self._removed.clear()

    def drain(self, snapshot: Callable[[], list[StoredBlocks]]) -> tuple[list[StoredBlocks], list[int], bool]:
        """(stored runs, removed hashes, cleared) since the last drain; after an overflow, the
        cache's ``snapshot()`` with cleared=True."""
        if self._overflowed:
            out = (snapshot(), [], True)
        else:
            out = (self._stored, list(self._removed), self._cleared)
        self._stored = []
        self._removed = {}
        self._cleared = False
        self._blocks = 0
        self._overflowed = False
        return out
