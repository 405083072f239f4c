"""Affinity groups: pin classes of traffic (a tenant, a system prompt, a model) to a subset of workers.

Pure and synchronous: no I/O, no clocks. Narrows the candidates a policy may choose from; never
picks a worker itself, and never leaves a request with no candidate unless told to (``overflow: none``).

Schema (``affinity_groups:`` in the router YAML; checked at start-up, unknown keys are errors)::

    - name: acme                      # required, unique; not "fleet" or "none"
      match:                          # required; at least one condition; all given must hold
        model: "llama-3-*"            # glob on the request's "model"
        header: {x-tenant: acme}      # header name (any case) -> glob on its value; absent = no match
        system_prompt: "You are Acme" # the leading prompt text starts with this
      workers: [http://10.0.0.5:8000] # exactly one of: explicit member URLs,
      size: 2                         #   a member count,
      share: 0.25                     #   or a fraction of the fleet: ceil(share x workers), >= 1
      exclusive: false                # true: other traffic never goes to the members (default false)
      overflow: fleet                 # fleet (default) | none | another group's name
      overflow_load: 8                # spill when every available member's load >= this (default: only
                                      #   when no member is available)

Globs are fnmatch patterns (``*``, ``?``, ``[...]``), case-sensitive, matched against the whole
value. The leading prompt text is, for chat, the first message's content when its role is
``system`` (a list of text parts is joined with newlines, as the tokenizer renders it); for
completions, the ``prompt`` string or the first string of a list. Token-id prompts have none.

Semantics:

- Groups are tried in file order; the first whose conditions all hold takes the request.
- Members (``size`` / ``share``) are picked by rendezvous hashing of (group name, worker URL) in
  each model's fleet (the registered workers serving a base model or its LoRA adapters), so every
  router replica picks the same members and adding or removing one worker moves at most one
  member of each group. A group with ``match.model`` is placed only in the fleets of the models it
  can match. Health never moves members: a member that is down is simply not available.
- ``exclusive``: requests outside the group are kept off its members while any other candidate
  is available. Exclusive members are reserved in this order: explicit ``workers`` of exclusive
  groups, then exclusive ``size`` / ``share`` groups in file order (picking among workers no
  group lists explicitly); non-exclusive ``size`` / ``share`` groups pick among the rest.
- A matched request goes to the group's available members. It spills (outcome ``overflow``)
  when none is available, or when ``overflow_load`` is set and every available member is at or
  over it. Spilling widens the choice, the group's own members stay eligible: ``fleet`` adds
  every candidate except other groups' exclusive members; a group name adds that group's members
  (one hop, even if it is exclusive), or the fleet if none of them is available. ``none`` never
  spills: with no member available the request gets no candidate (the router answers 503).
"""

from __future__ import annotations

import fnmatch
import heapq
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mmh3

from router.http_client import worker_base_url

if TYPE_CHECKING:
    from router.policies import Candidate

UNGROUPED, IN_GROUP, OVERFLOW = "ungrouped", "in_group", "overflow"
NO_WORKER = "no_worker"  # the request got no worker (the router answered 503): for the metrics

_GROUP_KEYS = {"name", "match", "workers", "size", "share", "exclusive", "overflow", "overflow_load"}
_MATCH_KEYS = {"model", "header", "system_prompt"}
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110's token
_RESERVED_NAMES = ("fleet", "none")
_MASK64 = (1 << 64) - 1
_UNREAD = object()
_PLACEMENT_CACHE = 16  # registries remembered (workers and what they serve); cleared when full
# A registered worker as placement reads it: its URL, the models it serves (empty: not known, any) and
# optionally its LoRA adapters' (adapter, base model) pairs; a URL alone: models not known.
Registered = tuple[str, frozenset[str]] | tuple[str, frozenset[str], tuple[tuple[str, str], ...]]


@dataclass(frozen=True, slots=True)
class AffinityGroup:
    name: str
    match: dict[str, Any]  # as configured, for describe()
    model: re.Pattern[str] | None
    headers: tuple[tuple[str, re.Pattern[str]], ...]  # (lower-case header name, value glob)
    system_prompt: str | None
    workers: tuple[str, ...]  # explicit members, normalised (no trailing slash); empty if sized
    size: int | None
    share: float | None
    exclusive: bool
    overflow: str  # "fleet", "none" or a group name
    overflow_load: float | None

    def wanted(self, fleet_size: int) -> int:
        """Members a ``size`` / ``share`` group asks for in a fleet of ``fleet_size`` workers."""
        if self.size is not None:
            return self.size
        assert self.share is not None
        # NOTE: the epsilon keeps 0.07 x 100 (= 7.000000000000001 in floats) at 7, not 8.
        return max(1, math.ceil(self.share * fleet_size - 1e-9))


@dataclass(frozen=True, slots=True)
class _Placement:
    """Members of every group over the registered workers (see AffinityGroups._place). Invariant: an
    exclusive member is in one group only."""

    # (group, base model) -> its members in that model's fleet; (group, adapter) -> its members among
    # the workers serving that LoRA adapter, where not all of its base's do; (group, "") -> its members
    # while no worker has said what it serves
    by_fleet: dict[tuple[str, str], frozenset[str]]
    fleet_of: dict[str, str]  # a model (base or adapter) served -> its base model
    anywhere: dict[str, frozenset[str]]  # per group: its members in every fleet
    reserved: frozenset[str]  # members of exclusive groups, in every fleet
    barred: dict[str, frozenset[str]]  # per group: other groups' exclusive members

    def members(self, group: str, model: str | None) -> frozenset[str]:
        """``group``'s members for a request served as ``model`` (None: not known, so all of them)."""
        if model is None:
            return self.anywhere[group]
        own = self.by_fleet.get((group, model))
        return (
            own if own is not None else self.by_fleet.get((group, self.fleet_of.get(model, "")), frozenset())
        )


def _glob(pattern: str) -> re.Pattern[str]:
    return re.compile(fnmatch.translate(pattern))


def _score(group: str, url: str) -> int:
    """Rendezvous weight of ``url`` for ``group``; the same on every replica."""
    return mmh3.hash128(f"{group}\0{url}".encode(), 0, True, False) & _MASK64


def _pick(group: str, pool: Sequence[str], count: int) -> frozenset[str]:
    """The ``count`` highest-weight workers of ``pool`` (ties, vanishingly rare, go to the URL)."""
    return frozenset(heapq.nlargest(count, pool, key=lambda url: (_score(group, url), url)))


def leading_prompt(body: Mapping[str, Any], chat: bool) -> str | None:
    """The text ``system_prompt`` conditions test: see the module docstring. Never raises."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
            return None
        first = messages[0]
        if first.get("role") != "system":
            return None
        content = first.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            return "\n".join(p for p in parts if isinstance(p, str))
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


class AffinityGroups:
    """The configured groups, in file order, with member placement cached per registry."""

    def __init__(self, groups: Sequence[AffinityGroup]) -> None:
        self._groups = tuple(groups)
        self._by_name = {g.name: g for g in self._groups}
        self._placements: dict[tuple[tuple[str, frozenset[str], tuple], ...], _Placement] = {}
        self._last: tuple[object, _Placement | None] = (None, None)  # the registry tuple seen last

    @classmethod
    def from_config(cls, raw: Any) -> AffinityGroups:
        """Validate ``affinity_groups`` from the YAML; raises ValueError naming the group and key."""
        if raw is None:
            return cls([])
        if not isinstance(raw, list):
            raise ValueError("affinity_groups must be a list of groups")
        groups = [_parse_group(i, entry) for i, entry in enumerate(raw)]
        names: set[str] = set()
        for g in groups:
            if g.name in names:
                raise ValueError(f"affinity group {g.name!r}: name is used by another group")
            names.add(g.name)
        for g in groups:
            if g.overflow not in _RESERVED_NAMES:
                if g.overflow == g.name:
                    raise ValueError(f"affinity group {g.name!r}: overflow cannot name the group itself")
                if g.overflow not in names:
                    raise ValueError(
                        f"affinity group {g.name!r}: overflow names no group: {g.overflow!r} "
                        "(use fleet, none or a group name)"
                    )
        listed: dict[str, AffinityGroup] = {}
        for g in groups:
            for url in g.workers:
                other = listed.setdefault(url, g)
                if other is not g and (g.exclusive or other.exclusive):
                    raise ValueError(
                        f"affinity group {g.name!r}: workers: {url} is also listed by group "
                        f"{other.name!r}, and an exclusive member belongs to one group only"
                    )
        return cls(groups)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def match(self, body: Mapping[str, Any], chat: bool, headers: Mapping[str, str]) -> str | None:
        """The first group whose conditions all hold for this request, or None.

        ``headers`` is looked up by lower-case name (a starlette ``Headers`` works as is)."""
        if not self._groups:
            return None
        model = body.get("model")
        prompt: Any = _UNREAD  # read once, and only if a group gets as far as its system_prompt
        for g in self._groups:
            if g.model is not None and not (isinstance(model, str) and g.model.match(model)):
                continue
            if g.headers and not _headers_hold(g.headers, headers):
                continue
            if g.system_prompt is not None:
                if prompt is _UNREAD:
                    prompt = leading_prompt(body, chat)
                if prompt is None or not prompt.startswith(g.system_prompt):
                    continue
            return g.name
        return None

    def filter(
        self,
        group: str | None,
        candidates: Sequence[Candidate],
        registry: Sequence[Registered | str],
        model: str | None,
    ) -> tuple[list[Candidate], str]:
        """The candidates the policy may choose from for a request of ``group``, and the outcome.

        ``candidates`` are the available workers for this request; ``registry`` the registered
        workers (available or not) that members are picked from (``Registered``); ``model`` the
        model the request is served as (None: not known). The result is empty only when
        ``candidates`` is, or for ``overflow: none`` with no member available.
        """
        if group is None:
            if not candidates:
                return [], UNGROUPED
            placement = self._placement(registry)
            if not placement.reserved:
                return list(candidates), UNGROUPED
            kept = [c for c in candidates if c.url not in placement.reserved]
            return (kept or list(candidates)), UNGROUPED
        g = self._by_name.get(group)
        if g is None:
            raise ValueError(f"unknown affinity group {group!r}")
        if not candidates:
            return [], IN_GROUP
        placement = self._placement(registry)
        members = placement.members(group, model)
        inside = [c for c in candidates if c.url in members]
        if inside and (g.overflow_load is None or min(c.load for c in inside) < g.overflow_load):
            return inside, IN_GROUP
        if g.overflow == "none":
            return inside, IN_GROUP
        if g.overflow != "fleet":
            target = placement.anywhere[g.overflow]
            if any(c.url in target for c in candidates):
                return [c for c in candidates if c.url in members or c.url in target], OVERFLOW
        barred = placement.barred[group]
        wider = [c for c in candidates if c.url not in barred]
        return (wider or list(candidates)), OVERFLOW

    def members(self, group: str, registry: Sequence[Registered | str], model: str | None) -> frozenset[str]:
        """URLs of ``group``'s members for ``model``'s requests (available or not)."""
        return self._placement(registry).members(group, model)

    def describe(self, registry: Sequence[Registered | str]) -> list[dict[str, Any]]:
        """Each group as configured, with its members now in each fleet: by base model, ``""`` for
        the workers that have not said what they serve (for /workers and logs)."""
        by_fleet = self._placement(registry).by_fleet
        out = []
        for g in self._groups:
            if g.workers:
                sized_by: dict[str, Any] = {"workers": list(g.workers)}
            elif g.size is not None:
                sized_by = {"size": g.size}
            else:
                sized_by = {"share": g.share}
            out.append(
                {
                    "name": g.name,
                    "match": g.match,
                    "sized_by": sized_by,
                    "members": {
                        fleet: sorted(urls)
                        for (name, fleet), urls in sorted(by_fleet.items())
                        if name == g.name
                    },
                    "exclusive": g.exclusive,
                    "overflow": g.overflow,
                    "overflow_load": g.overflow_load,
                }
            )
        return out

    # ------------------------------------------------------------------ placement
    def _placement(self, registry: Sequence[Registered | str]) -> _Placement:
        # NOTE: the router passes one tuple per registry state: steady routing is an identity check
        if registry is self._last[0] and self._last[1] is not None:
            return self._last[1]
        key = tuple(
            (w.rstrip("/"), frozenset(), ())
            if isinstance(w, str)
            else (w[0].rstrip("/"), w[1], w[2] if len(w) > 2 else ())
            for w in registry
        )
        placement = self._placements.get(key)
        if placement is None:
            if len(self._placements) >= _PLACEMENT_CACHE:
                self._placements.clear()
            placement = self._placements[key] = self._place(key)
        if isinstance(registry, tuple):
            self._last = (registry, placement)
        return placement

    def _place(self, workers: tuple[tuple[str, frozenset[str], tuple], ...]) -> _Placement:
        """Members of every group in every fleet, deterministic and independent of the registry's order.

        A fleet is one base model's: the workers serving it or its LoRA adapters, plus those whose
        models are not known yet (they may serve it). While no worker has said what it serves, all of
        them are one fleet, ``""``. A group is placed in the fleets of the models it can match, and an
        exclusive member there is kept from every other request, whatever its model. A request naming
        an adapter that only some of its base's workers serve takes the group's members among those:
        its base members that serve it first (rendezvous order), then others not reserved."""
        base_of: dict[str, str] = {}
        for _, _, adapters in sorted(workers):  # NOTE: sorted: an adapter two bases list takes the first's
            for adapter, base in adapters:
                base_of.setdefault(adapter, base)
        fleets: dict[str, set[str]] = {}
        serving: dict[str, set[str]] = {}  # model -> the workers that list it
        for url, models, _ in workers:
            for model in models:
                fleets.setdefault(base_of.get(model, model), set()).add(url)
                serving.setdefault(model, set()).add(url)
        unknown = {url for url, models, _ in workers if not models}
        if not fleets:
            fleets[""] = unknown
        names = {base: {base} | {a for a, b in base_of.items() if b == base} for base in fleets}
        ordered = {base: sorted(urls | unknown) for base, urls in sorted(fleets.items())}

        def fleets_of(g: AffinityGroup) -> list[str]:
            return [f for f in ordered if not f or g.model is None or any(g.model.match(n) for n in names[f])]

        by_fleet: dict[tuple[str, str], frozenset[str]] = {}
        reserved: set[str] = set()
        explicit = {url for g in self._groups for url in g.workers}
        registered = {url for url, _, _ in workers}
        for g in self._groups:
            if g.workers:
                for f in fleets_of(g):
                    by_fleet[g.name, f] = frozenset(u for u in ordered[f] if u in g.workers)
                if g.exclusive:  # NOTE: machines the operator named: kept from every other request
                    reserved.update(u for u in g.workers if u in registered)
        # NOTE: exclusive groups first (file order), so non-exclusive groups never pick their members;
        # a group picks in every fleet before reserving, so fleets that share workers get one choice
        for g in sorted((g for g in self._groups if not g.workers), key=lambda g: not g.exclusive):
            for f in fleets_of(g):
                pool = [u for u in ordered[f] if u not in reserved and not (g.exclusive and u in explicit)]
                by_fleet[g.name, f] = _pick(g.name, pool, min(g.wanted(len(ordered[f])), len(pool)))
            if g.exclusive:
                reserved.update(*(by_fleet[g.name, f] for f in fleets_of(g)))
        frozen = frozenset(reserved)
        for adapter, base in base_of.items():
            within = sorted(serving.get(adapter, set()) | unknown)
            if base not in ordered or within == ordered[base]:
                continue
            for g in (g for g in self._groups if base in fleets_of(g)):
                if g.workers:
                    by_fleet[g.name, adapter] = frozenset(u for u in within if u in g.workers)
                    continue
                mine = by_fleet[g.name, base]
                pool = [
                    u
                    for u in within
                    if u in mine or (u not in frozen and not (g.exclusive and u in explicit))
                ]
                by_fleet[g.name, adapter] = _pick(g.name, pool, min(g.wanted(len(within)), len(pool)))
        none: frozenset[str] = frozenset()
        anywhere = {
            g.name: none.union(*(urls for (name, _), urls in by_fleet.items() if name == g.name))
            for g in self._groups
        }
        fleet_of = {n: base for base, served in names.items() for n in served}
        barred = {name: frozen - picked for name, picked in anywhere.items()}
        return _Placement(by_fleet, fleet_of, anywhere, frozen, barred)


def _headers_hold(conditions: tuple[tuple[str, re.Pattern[str]], ...], headers: Mapping[str, str]) -> bool:
    for name, pattern in conditions:
        value = headers.get(name)
        if value is None or not pattern.match(value):
            return False
    return True


# ---------------------------------------------------------------------- parsing
def _parse_group(index: int, raw: Any) -> AffinityGroup:
    if not isinstance(raw, dict):
        raise ValueError(f"affinity_groups[{index}]: expected a mapping, got {type(raw).__name__}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"affinity_groups[{index}]: name: required, a non-empty string")
    where = f"affinity group {name!r}"
    if name in _RESERVED_NAMES:
        raise ValueError(f"{where}: name: {name!r} is reserved (it is an overflow target)")
    unknown = sorted(set(raw) - _GROUP_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; accepts {', '.join(sorted(_GROUP_KEYS))}")

    match = raw.get("match")
    if not isinstance(match, dict) or not match:
        raise ValueError(f"{where}: match: required, a mapping with at least one of {sorted(_MATCH_KEYS)}")
    unknown = sorted(set(match) - _MATCH_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: match: unknown key(s) {unknown}; accepts {', '.join(sorted(_MATCH_KEYS))}"
        )
    model = match.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"{where}: match.model: expected a non-empty glob string")
    headers: list[tuple[str, re.Pattern[str]]] = []
    if "header" in match:
        header = match["header"]
        if not isinstance(header, dict) or not header:
            raise ValueError(f"{where}: match.header: expected a mapping of header name to glob")
        for key, glob in header.items():
            if not isinstance(key, str) or not key or not isinstance(glob, str) or not glob:
                raise ValueError(
                    f"{where}: match.header: {key!r}: expected a header name and a glob string "
                    '(quote numbers: "1")'
                )
            if not _HEADER_NAME.fullmatch(key):  # NOTE: no request carries such a name: it would never match
                raise ValueError(
                    f"{where}: match.header: {key!r} is not an HTTP header name (RFC 9110 token)"
                )
            headers.append((key.lower(), _glob(glob)))
    system_prompt = match.get("system_prompt")
    if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt):
        raise ValueError(f"{where}: match.system_prompt: expected a non-empty string")

    given = [key for key in ("workers", "size", "share") if raw.get(key) is not None]
    if len(given) != 1:
        raise ValueError(f"{where}: give exactly one of workers, size, share (got {given or 'none'})")
    workers: tuple[str, ...] = ()
    size: int | None = None
    share: float | None = None
    if given == ["workers"]:
        listed = raw["workers"]
        if not isinstance(listed, list) or not listed:
            raise ValueError(f"{where}: workers: expected a non-empty list of worker URLs")
        try:
            workers = tuple(worker_base_url(u) for u in listed)
        except ValueError as exc:
            raise ValueError(f"{where}: workers: {exc}") from None
        if len(set(workers)) != len(workers):
            raise ValueError(f"{where}: workers: a worker is listed twice")
    elif given == ["size"]:
        size = raw["size"]
        if type(size) is not int or size < 1:
            raise ValueError(f"{where}: size: expected a whole number >= 1, got {size!r}")
    else:
        share = raw["share"]
        if type(share) not in (int, float) or not 0 < share <= 1:
            raise ValueError(f"{where}: share: expected a number in (0, 1], got {share!r}")
        share = float(share)

    exclusive = raw.get("exclusive", False)
    if not isinstance(exclusive, bool):
        raise ValueError(f"{where}: exclusive: expected true or false, got {exclusive!r}")
    overflow = raw.get("overflow", "fleet")
    if not isinstance(overflow, str) or not overflow:
        raise ValueError(f"{where}: overflow: expected fleet, none or a group name, got {overflow!r}")
    overflow_load = raw.get("overflow_load")
    if overflow_load is not None:
        if type(overflow_load) not in (int, float) or not overflow_load > 0:
            raise ValueError(f"{where}: overflow_load: expected a number > 0, got {overflow_load!r}")
        if overflow == "none":
            raise ValueError(f"{where}: overflow_load: has no effect with overflow: none")
        overflow_load = float(overflow_load)

    return AffinityGroup(
        name=name,
        match=dict(match),
        model=None if model is None else _glob(model),
        headers=tuple(headers),
        system_prompt=system_prompt,
        workers=workers,
        size=size,
        share=share,
        exclusive=exclusive,
        overflow=overflow,
        overflow_load=overflow_load,
    )
