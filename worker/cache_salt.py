"""vLLM's ``cache_salt``: requests that carry a salt share cached prefixes only with requests that
carry the same salt (and model), so a tenant cannot tell from its own latency what another tenant's
prompts hold in the cache.

Each (model, salt) pair in use gets a namespace of the radix cache: an id in the key space that
LoRA adapters use too (worker.radix_node.adapter_keys), taken from the top of the range, so a salt's
prefixes form their own subtrees; their KV events hash from ``router.block_hash.salted(model, salt)``
as a router hashes the same request. The ids are few (SALT_SPACES); when all are taken, the least
recently used pair that no queued or running request needs gives its id up, and its cached pages go
first (with their removal events); when every pair is in use, a request of a new salt waits in the
engine until one is free (worker.engine). Engine thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from router.block_hash import salted
from worker.radix_node import ADAPTER_SHIFT

SALT_SPACES = 256  # namespaces for salts: the top of the 2**(31 - ADAPTER_SHIFT) ids that keep keys int32
FIRST_SALT_SPACE = (1 << (31 - ADAPTER_SHIFT)) - SALT_SPACES  # below it: the base model and LoRA adapters


class SaltSpaces:
    def __init__(self, cache: object, spaces: int = SALT_SPACES) -> None:
        self.cache = cache  # a worker.radix_cache.RadixCache
        self._held: OrderedDict[tuple[int, str], int] = OrderedDict()  # (adapter, salt) -> id, LRU first
        top = FIRST_SALT_SPACE + SALT_SPACES
        self._free = list(range(top - spaces, top))

    def space(self, adapter: int, model: str, salt: str, in_use: Callable[[], set[int]]) -> int | None:
        """The namespace id of ``salt`` on ``adapter`` (served as ``model``); None when every one is
        held by queued or running requests (``in_use``, asked only when one must be freed)."""
        key = (adapter, salt)
        space = self._held.get(key)
        if space is not None:
            self._held.move_to_end(key)
            return space
        if self._free:
            space = self._free.pop()
        else:
            used = in_use()
            old = next((k for k, s in self._held.items() if s not in used), None)
            if old is None:
                return None
            space = self._held.pop(old)
            self.cache.drop_namespace(space)  # type: ignore[attr-defined]
        self.cache.set_namespace(space, salted(model, salt))  # type: ignore[attr-defined]
        self._held[key] = space
        return space

    def holds(self, adapter: int, salt: str) -> bool:
        """Has ``salt`` on ``adapter`` a namespace now?"""
        return (adapter, salt) in self._held

    def drop_adapter(self, adapter: int) -> int:
        """Free the namespaces of ``adapter``'s salts (the adapter unloaded: none of its requests is
        queued or running) and drop their pages; returns device pages freed."""
        freed = 0
        for key in [k for k in self._held if k[0] == adapter]:
            space = self._held.pop(key)
            freed += self.cache.drop_namespace(space)  # type: ignore[attr-defined]
            self._free.append(space)
        return freed

    def __len__(self) -> int:
        return len(self._held)
