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
- Members (``size`` / ``share``) are picked by rendezvous hashing of (group name, worker URL) over
  each model's fleet (the registered workers serving it), so every router replica picks the same
  members and adding or removing one worker moves at most one member of each group. A group with
  ``match.model`` is placed only in the fleets of the models it matches. Health never moves
  members: a member that is down is simply not available.
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
_RESERVED_NAMES = ("fleet", "none")
_MASK64 = (1 << 64) - 1
_UNREAD = object()
_PLACEMENT_CACHE = 64  # (registry, model) pairs remembered (one per model a fleet serves); cleared when full
# A registered worker as placement reads it: its URL and the models it serves (empty: not known, any).
Registered = tuple[str, frozenset[str]]


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
    """Members of every group over the registered workers, seen from one model's requests.
    Invariant: an exclusive member is in one group only."""

    by_model: dict[tuple[str, str | None], frozenset[str]]  # (group, model) -> members serving model
    members: dict[str, frozenset[str]]  # per group: its members for this model's requests
    anywhere: dict[str, frozenset[str]]  # per group: its members for any model (overflow targets)
    reserved: frozenset[str]  # members of exclusive groups, for any model
    barred: dict[str, frozenset[str]]  # per group: other groups' exclusive members


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
    """The configured groups, in file order, with member placement cached per fleet."""

    def __init__(self, groups: Sequence[AffinityGroup]) -> None:
        self._groups = tuple(groups)
        self._by_name = {g.name: g for g in self._groups}
        self._placements: dict[tuple[str, ...], _Placement] = {}

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
        workers (available or not) that members are picked from, as (URL, models served) or a
        URL alone (models not known: any); ``model`` the model the request is served as (None:
        not known). The result is empty only when ``candidates`` is, or for ``overflow: none``
        with no member available.
        """
        if group is None:
            if not candidates:
                return [], UNGROUPED
            placement = self._placement(registry, model)
            if not placement.reserved:
                return list(candidates), UNGROUPED
            kept = [c for c in candidates if c.url not in placement.reserved]
            return (kept or list(candidates)), UNGROUPED
        g = self._by_name.get(group)
        if g is None:
            raise ValueError(f"unknown affinity group {group!r}")
        if not candidates:
            return [], IN_GROUP
        placement = self._placement(registry, model)
        members = placement.members[group]
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
        return self._placement(registry, model).members[group]

    def describe(self, registry: Sequence[Registered | str]) -> list[dict[str, Any]]:
        """Each group as configured, with its members now for each model the registered workers
        serve (for /workers and logs)."""
        by_model = self._placement(registry, None).by_model
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
                        "" if model is None else model: sorted(urls)
                        for (name, model), urls in sorted(by_model.items(), key=lambda kv: kv[0][1] or "")
                        if name == g.name
                    },
                    "exclusive": g.exclusive,
                    "overflow": g.overflow,
                    "overflow_load": g.overflow_load,
                }
            )
        return out

    # ------------------------------------------------------------------ placement
    def _placement(self, registry: Sequence[Registered | str], model: str | None) -> _Placement:
        workers = tuple(
            (w.rstrip("/"), frozenset()) if isinstance(w, str) else (w[0].rstrip("/"), w[1]) for w in registry
        )
        key = (workers, model)
        placement = self._placements.get(key)
        if placement is None:
            if len(self._placements) >= _PLACEMENT_CACHE:
                self._placements.clear()
            placement = self._placements[key] = self._place(workers, model)
        return placement

    def _place(self, workers: tuple[Registered, ...], model: str | None) -> _Placement:
        """Members of every group, deterministic and independent of the registry's order.

        A group is placed among the workers of each model it can match (that model's fleet), so its
        requests find members among the workers that serve them. It takes no members in the fleet of
        a model its ``match.model`` fails: none of its requests go there. Its exclusive members are
        kept from every other request, so a worker serving several models is reserved for all."""
        served = {m for _, ms in workers for m in ms}
        if model is not None:
            served.add(model)
        models: list[str | None] = sorted(served) if served else [None]
        fleets = {m: sorted({url for url, ms in workers if not ms or m in ms}) for m in models}

        def models_of(g: AffinityGroup) -> list[str | None]:
            return [m for m in models if g.model is None or (m is not None and g.model.match(m))]

        by_model: dict[tuple[str, str | None], frozenset[str]] = {}
        reserved: set[str] = set()
        explicit = {url for g in self._groups for url in g.workers}
        registered = {url for url, _ in workers}
        for g in self._groups:
            if g.workers:
                for m in models_of(g):
                    by_model[g.name, m] = frozenset(u for u in fleets[m] if u in g.workers)
                if g.exclusive:  # NOTE: machines the operator named: kept from every other request
                    reserved.update(u for u in g.workers if u in registered)
        # NOTE: exclusive groups first (file order), so non-exclusive groups never pick their members;
        # a group picks for every model before reserving, so a fleet shared by models gets one choice
        for g in sorted((g for g in self._groups if not g.workers), key=lambda g: not g.exclusive):
            for m in models_of(g):
                pool = [u for u in fleets[m] if u not in reserved and not (g.exclusive and u in explicit)]
                by_model[g.name, m] = _pick(g.name, pool, min(g.wanted(len(fleets[m])), len(pool)))
            if g.exclusive:
                reserved.update(*(by_model[g.name, m] for m in models_of(g)))
        none: frozenset[str] = frozenset()
        anywhere = {g.name: none.union(*(by_model[g.name, m] for m in models_of(g))) for g in self._groups}
        mine = (
            {g.name: by_model.get((g.name, model), none) for g in self._groups}
            if model is not None
            else anywhere
        )
        frozen = frozenset(reserved)
        barred = {name: frozen - picked for name, picked in anywhere.items()}
        return _Placement(by_model, mine, anywhere, frozen, barred)


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
