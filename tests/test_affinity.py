"""Affinity groups: validation, matching, rendezvous member placement, exclusivity and overflow."""

from __future__ import annotations

import os

import pytest

from router.affinity import IN_GROUP, OVERFLOW, UNGROUPED, AffinityGroups
from router.config import build_config
from router.policies import Candidate

FLEET = tuple(f"http://w{i}:8000" for i in range(8))
# A fleet whose every worker serves every model the groups below match (FLEET's URLs alone: models not known)
SHARED = tuple((url, frozenset("abcdmopsx")) for url in FLEET)
MODEL_OF = {None: "m", "g": "m", "spare": "s", "x": "x"}  # a model each group's requests may name
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")


def groups(*raw: dict) -> AffinityGroups:
    return AffinityGroups.from_config(list(raw))


def idle(urls, load: float = 0.0) -> list[Candidate]:
    return [Candidate(u, load) for u in urls]


def urls(cands: list[Candidate]) -> set[str]:
    return {c.url for c in cands}


def chat(system: object = None, user: str = "hi", model: str = "llama-3-8b") -> dict:
    messages = [] if system is None else [{"role": "system", "content": system}]
    return {"model": model, "messages": [*messages, {"role": "user", "content": user}]}


# ---------------------------------------------------------------------- validation
GOOD = {"name": "g", "match": {"model": "m*"}, "size": 1}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([{**GOOD, "wokers": ["http://a"]}], r"'g': unknown key\(s\) \['wokers'\]"),
        ([{**GOOD, "match": {}}], r"'g': match: required"),
        ([{**GOOD, "match": {"modle": "x"}}], r"'g': match: unknown key\(s\) \['modle'\]"),
        ([{"name": "g", "size": 1}], r"'g': match: required"),
        ([{**GOOD, "share": 0.5}], r"'g': give exactly one of workers, size, share"),
        ([{**GOOD, "workers": ["http://a"]}], r"'g': give exactly one"),
        ([{"name": "g", "match": {"model": "m"}}], r"'g': give exactly one"),
        ([{**GOOD, "overflow": "nowhere"}], r"'g': overflow names no group: 'nowhere'"),
        ([{**GOOD, "overflow": "g"}], r"'g': overflow cannot name the group itself"),
        ([GOOD, {**GOOD, "size": 2}], r"'g': name is used by another group"),
        ([{**GOOD, "name": "fleet"}], r"'fleet': name: 'fleet' is reserved"),
        ([{**GOOD, "name": ""}], r"affinity_groups\[0\]: name: required"),
        ([{**GOOD, "size": 0}], r"'g': size: expected a whole number >= 1"),
        ([{**GOOD, "size": "2"}], r"'g': size:"),
        ([{**GOOD, "size": True}], r"'g': size:"),
        ([{**GOOD, "size": None, "share": 1.5}], r"'g': share: expected a number in \(0, 1\]"),
        ([{**GOOD, "size": None, "share": "0.5"}], r"'g': share:"),
        ([{**GOOD, "size": None, "workers": "http://a"}], r"'g': workers: expected a non-empty list"),
        ([{**GOOD, "size": None, "workers": ["10.0.0.1:8000"]}], r"'g': workers: .*http://.*'10.0.0.1:8000'"),
        (
            [{**GOOD, "size": None, "workers": ["http://a b"]}],
            r"'g': workers: worker URL 'http://a b' needs a host",
        ),
        (
            [{**GOOD, "size": None, "workers": ["http://a/", "http://a"]}],
            r"'g': workers: a worker is listed twice",
        ),
        ([{**GOOD, "exclusive": "yes"}], r"'g': exclusive: expected true or false"),
        ([{**GOOD, "overflow_load": -1}], r"'g': overflow_load: expected a number > 0"),
        ([{**GOOD, "overflow": "none", "overflow_load": 4}], r"'g': overflow_load: has no effect"),
        ([{**GOOD, "match": {"model": 3}}], r"'g': match.model"),
        ([{**GOOD, "match": {"header": {"x-tier": 1}}}], r"'g': match.header: 'x-tier'"),
        ([{**GOOD, "match": {"header": "x-tier"}}], r"'g': match.header: expected a mapping"),
        (
            [{**GOOD, "match": {"header": {"x tier": "a"}}}],
            r"'g': match.header: 'x tier' is not an HTTP header",
        ),
        (
            [{**GOOD, "match": {"header": {"x-tier:": "a"}}}],
            r"'g': match.header: 'x-tier:' is not an HTTP header",
        ),
        ([{**GOOD, "match": {"system_prompt": ""}}], r"'g': match.system_prompt"),
        (["g"], r"affinity_groups\[0\]: expected a mapping"),
        ({"name": "g"}, r"affinity_groups must be a list"),
        (
            [
                {"name": "a", "match": {"model": "a"}, "workers": ["http://w1"], "exclusive": True},
                {"name": "b", "match": {"model": "b"}, "workers": ["http://w1/"]},
            ],
            r"'b': workers: http://w1 is also listed by group 'a'",
        ),
    ],
)
def test_bad_groups_are_errors_naming_group_and_key(raw, message) -> None:
    with pytest.raises(ValueError, match=message):
        AffinityGroups.from_config(raw)


def test_empty_config_is_falsy_and_leaves_candidates_alone() -> None:
    none = AffinityGroups.from_config([])
    assert not none and not AffinityGroups.from_config(None)
    assert none.match(chat("sys"), True, {}) is None
    assert none.filter(None, idle(FLEET), FLEET, "m") == (idle(FLEET), UNGROUPED)
    assert groups(GOOD)


def test_config_validates_affinity_groups(tmp_path) -> None:
    cfg = tmp_path / "r.yaml"
    cfg.write_text("router:\n  affinity_groups:\n    - {name: g, match: {model: m}, size: 1, overflow: x}\n")
    with pytest.raises(ValueError, match="overflow names no group"):
        build_config(["--config", str(cfg)], environ={})
    cfg.write_text("router:\n  affinity_groups: {name: g}\n")
    with pytest.raises(ValueError, match="bad value for affinity_groups"):
        build_config(["--config", str(cfg)], environ={})


def test_shipped_affinity_example_loads_and_places_members() -> None:
    config = build_config(["--config", os.path.join(CONFIGS, "affinity-groups.yaml")], environ={})
    affinity = AffinityGroups.from_config(config.affinity_groups)
    served = frozenset({"llama-3.1-70b", "qwen"})
    described = {d["name"]: d["members"] for d in affinity.describe([(u, served) for u in config.workers])}
    assert list(described) == ["acme", "support-agent", "llama-3"]
    assert described["llama-3"].keys() == {"llama-3.1-70b"}  # its model glob fails qwen: no members there
    for model in served:
        acme = set(described["acme"][model])
        assert len(acme) == 2 and len(described["support-agent"][model]) == 2  # ceil(0.25 x 8)
        assert not acme & set(described["support-agent"][model])
    assert len(described["llama-3"]["llama-3.1-70b"]) == 3 and not acme & set(
        described["llama-3"]["llama-3.1-70b"]
    )
    assert affinity.match(chat(model="llama-3.1-70b"), True, {}) == "llama-3"
    assert affinity.match(chat(model="llama-3.1-70b"), True, {"x-tenant": "acme"}) == "acme"
    body = chat("You are the support assistant for Initech.", model="qwen")
    assert affinity.match(body, True, {}) == "support-agent"


# ---------------------------------------------------------------------- matching
def test_match_by_each_condition_and_all_together() -> None:
    affinity = groups(
        {
            "name": "all",
            "match": {"model": "llama-*", "header": {"X-Tenant": "acme"}, "system_prompt": "You are Acme"},
            "size": 1,
        },
        {"name": "model", "match": {"model": "llama-3-?b"}, "size": 1},
        {"name": "header", "match": {"header": {"x-tenant": "acme", "x-tier": "gold*"}}, "size": 1},
        {"name": "prompt", "match": {"system_prompt": "You are Acme"}, "size": 1},
    )
    acme = {"x-tenant": "acme"}
    assert affinity.match(chat("You are Acme's bot", model="llama-2"), True, acme) == "all"
    assert affinity.match(chat("You are Acme's bot", model="llama-3-8b"), True, {}) == "model"
    assert affinity.match(chat("You are Acme's bot", model="llama-3-70b"), True, {}) == "prompt"
    assert affinity.match(chat(model="qwen"), True, {**acme, "x-tier": "gold-plus"}) == "header"
    assert affinity.match(chat(model="qwen"), True, {**acme, "x-tier": "silver"}) is None
    assert affinity.match(chat(model="qwen"), True, acme) is None  # one header of two is not enough
    assert affinity.match(chat("You are Initech", model="qwen"), True, {}) is None
    assert affinity.match({"messages": []}, True, {}) is None  # no model: model globs fail


def test_first_matching_group_wins_in_file_order() -> None:
    affinity = groups(
        {"name": "first", "match": {"model": "llama-*"}, "size": 1},
        {"name": "second", "match": {"model": "llama-3-8b"}, "size": 1},
    )
    assert affinity.match(chat(model="llama-3-8b"), True, {}) == "first"
    swapped = groups(
        {"name": "second", "match": {"model": "llama-3-8b"}, "size": 1},
        {"name": "first", "match": {"model": "llama-*"}, "size": 1},
    )
    assert swapped.match(chat(model="llama-3-8b"), True, {}) == "second"


def test_header_names_any_case_values_case_sensitive() -> None:
    from starlette.datastructures import Headers

    affinity = groups({"name": "t", "match": {"header": {"X-TENANT": "acme"}}, "size": 1})
    assert affinity.match(chat(), True, {"x-tenant": "acme"}) == "t"
    assert affinity.match(chat(), True, Headers({"X-Tenant": "acme"})) == "t"  # starlette, as the app has
    assert affinity.match(chat(), True, {"x-tenant": "ACME"}) is None
    assert affinity.match(chat(), True, {"x-tenant": "acme-corp"}) is None  # globs match the whole value


def test_system_prompt_from_content_parts_and_completions() -> None:
    affinity = groups({"name": "p", "match": {"system_prompt": "You are Acme.\nBe brief"}, "size": 1})
    parts = [{"type": "text", "text": "You are Acme."}, {"type": "text", "text": "Be brief."}]
    assert affinity.match(chat(parts), True, {}) == "p"
    assert affinity.match(chat("You are Acme.\nBe brief, always."), True, {}) == "p"
    assert affinity.match(chat([{"type": "text", "text": "You are Acme."}]), True, {}) is None
    user_first = {"messages": [{"role": "user", "content": "You are Acme.\nBe brief"}]}
    assert affinity.match(user_first, True, {}) is None  # only a leading system message counts
    assert affinity.match({"prompt": "You are Acme.\nBe brief. Q:"}, False, {}) == "p"
    assert affinity.match({"prompt": ["You are Acme.\nBe brief. Q:", "x"]}, False, {}) == "p"
    assert affinity.match({"prompt": [1, 2, 3]}, False, {}) is None
    assert affinity.match({"prompt": "You are Acme.\nBe brief"}, True, {}) is None  # chat reads messages
    assert affinity.match({"messages": "junk"}, True, {}) is None  # odd shapes never raise


# ---------------------------------------------------------------------- placement
def test_members_are_the_same_on_every_replica_whatever_the_fleet_order() -> None:
    raw = [{"name": "g", "match": {"model": "m"}, "size": 3}]
    a, b = AffinityGroups.from_config(raw), AffinityGroups.from_config(raw)
    members = a.members("g", FLEET, "m")
    assert len(members) == 3 and members <= set(FLEET)
    assert b.members("g", tuple(reversed(FLEET)), "m") == members
    assert b.members("g", [u + "/" for u in FLEET], "m") == members  # trailing slashes ignored
    other = groups({"name": "h", "match": {"model": "m"}, "size": 3})
    assert any(
        other.members("h", FLEET[:n], "m") != groups(*raw).members("g", FLEET[:n], "m") for n in range(3, 9)
    )


def test_adding_or_removing_a_worker_moves_at_most_one_member() -> None:
    affinity = groups({"name": "g", "match": {"model": "m"}, "size": 4})
    fleet = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(64)]
    moved_total = 0
    for n in range(8, 64):
        before = affinity.members("g", fleet[:n], "m")
        after = affinity.members("g", fleet[: n + 1], "m")
        assert len(before) == len(after) == 4
        moved = len(before - after)
        assert moved <= 1 and (moved == 0 or after - before == {fleet[n]})
        moved_total += moved
    assert 0 < moved_total < 56 // 2  # the new worker wins a seat about 4/n of the time
    members = affinity.members("g", fleet, "m")
    for gone in fleet:
        after = affinity.members("g", [u for u in fleet if u != gone], "m")
        if gone in members:
            assert len(after - members) == 1 and members - after == {gone}
        else:
            assert after == members


@pytest.mark.parametrize(
    ("share", "fleet_size", "members"),
    [(0.07, 100, 7), (0.14, 50, 7), (0.25, 8, 2), (0.3, 8, 3), (0.01, 8, 1), (1, 5, 5)],
)
def test_share_rounds_up_with_at_least_one_member(share, fleet_size, members) -> None:
    affinity = groups({"name": "g", "match": {"model": "m"}, "share": share})
    fleet = [f"http://w{i}" for i in range(fleet_size)]
    assert len(affinity.members("g", fleet, "m")) == members


def test_size_larger_than_the_fleet_takes_what_there_is() -> None:
    affinity = groups({"name": "g", "match": {"model": "m"}, "size": 5})
    assert affinity.members("g", FLEET[:2], "m") == set(FLEET[:2])
    assert affinity.members("g", [], "m") == frozenset()


def test_explicit_members_only_count_when_registered() -> None:
    affinity = groups({"name": "g", "match": {"model": "m"}, "workers": [FLEET[0] + "/", "http://gone:1"]})
    assert affinity.members("g", FLEET, "m") == {FLEET[0]}
    assert affinity.describe(FLEET)[0]["sized_by"] == {"workers": [FLEET[0], "http://gone:1"]}


def test_sized_groups_never_pick_exclusive_members() -> None:
    pinned = {"name": "pinned", "match": {"model": "p"}, "workers": list(FLEET[:6]), "exclusive": True}
    for shared in ({"size": 2}, {"share": 1.0}):
        affinity = groups(pinned, {"name": "shared", "match": {"model": "s"}, **shared})
        assert affinity.members("shared", FLEET, "s") == set(FLEET[6:])


def test_exclusive_sized_groups_do_not_overlap_any_group() -> None:
    affinity = groups(
        {"name": "plain", "match": {"model": "a"}, "share": 1.0},  # before the exclusive ones in the file
        {"name": "listed", "match": {"model": "b"}, "workers": [FLEET[0], FLEET[1]]},
        {"name": "x1", "match": {"model": "c"}, "size": 3, "exclusive": True},
        {"name": "x2", "match": {"model": "d"}, "size": 3, "exclusive": True},
    )
    x1, x2 = affinity.members("x1", SHARED, "c"), affinity.members("x2", SHARED, "d")
    assert len(x1) == len(x2) == 3 and not x1 & x2
    assert not (x1 | x2) & {FLEET[0], FLEET[1]}  # explicitly listed workers are never taken
    assert affinity.members("plain", SHARED, "a") == set(FLEET) - x1 - x2


def test_a_group_takes_members_only_among_the_workers_of_the_models_it_matches() -> None:
    """Two models on their own workers: a's exclusive group keeps a's traffic off its member, and
    none of b's workers (no request of the group can go there)."""
    affinity = groups({"name": "a-tenant", "match": {"model": "a"}, "size": 1, "exclusive": True})
    split = [(u, frozenset({"a"})) for u in FLEET[:4]] + [(u, frozenset({"b"})) for u in FLEET[4:]]
    member = affinity.members("a-tenant", split, "a")
    assert len(member) == 1 and member <= set(FLEET[:4])
    assert affinity.members("a-tenant", split, "b") == frozenset()
    chosen, _ = affinity.filter(None, idle(FLEET[4:]), split, "b")
    assert urls(chosen) == set(FLEET[4:])
    chosen, _ = affinity.filter(None, idle(FLEET[:4]), split, "a")
    assert urls(chosen) == set(FLEET[:4]) - member
    # the same workers serving both models: the member is kept from b's traffic too
    both = [(u, frozenset({"a", "b"})) for u in FLEET]
    (member,) = affinity.members("a-tenant", both, "a")
    chosen, _ = affinity.filter(None, idle(FLEET), both, "b")
    assert urls(chosen) == set(FLEET) - {member}
    assert affinity.describe(both)[0]["members"] == {"a": [member]}


def test_lora_adapters_are_placed_with_their_base_model():
    """Every worker serves the base, and each one adapter of its own: one fleet, the base's, where an
    exclusive group of size 1 keeps one worker. A request naming an adapter gets the group's member
    among the workers serving it (those its candidates can be), not a 503."""
    affinity = groups(
        {
            "name": "acme",
            "match": {"header": {"x-tenant": "acme"}},
            "size": 1,
            "exclusive": True,
            "overflow": "none",
        }
    )
    served = tuple(
        (u, frozenset({"base", f"lora-{i}"}), ((f"lora-{i}", "base"),)) for i, u in enumerate(FLEET)
    )
    (member,) = affinity.members("acme", served, "base")
    chosen, _ = affinity.filter(None, idle(FLEET), served, "base")
    assert urls(chosen) == set(FLEET) - {member}  # one worker kept, not one an adapter
    for i, url in enumerate(FLEET):
        assert affinity.filter("acme", idle([url]), served, f"lora-{i}") == (idle([url]), IN_GROUP)
    other = FLEET.index(min(set(FLEET) - {member}))
    described = affinity.describe(served)[0]["members"]
    assert described["base"] == [member] and described[f"lora-{other}"] == [FLEET[other]]
    # the adapter on the member too: the member, not another worker serving it
    both = (
        (member, frozenset({"base", "x"}), (("x", "base"),)),
        (FLEET[other], frozenset({"base", "x"}), (("x", "base"),)),
    )
    served_x = both + tuple((u, frozenset({"base"}), ()) for u in FLEET if u not in (member, FLEET[other]))
    assert affinity.members("acme", served_x, "x") == {member}


def test_exclusive_members_are_kept_whatever_the_request_names_while_models_are_not_known():
    """Before the workers say what they serve, every group is placed in one fleet of them all, as one
    would be: a model's exclusive member is kept from other models' requests, and shown."""
    affinity = groups({"name": "a-tenant", "match": {"model": "a"}, "size": 1, "exclusive": True})
    (member,) = affinity.members("a-tenant", FLEET[:4], "a")
    for model in ("b", None):
        chosen, _ = affinity.filter(None, idle(FLEET[:4]), FLEET[:4], model)
        assert urls(chosen) == set(FLEET[:4]) - {member}
    assert affinity.describe(FLEET[:4])[0]["members"] == {"": [member]}
    # some workers known, some not: the members kept do not depend on the model a request names
    mixed = [(u, frozenset({"a"})) for u in FLEET[:4]] + list(FLEET[4:])
    kept = {model: set(FLEET) - urls(affinity.filter(None, idle(FLEET), mixed, model)[0]) for model in "abz"}
    assert kept["a"] == kept["b"] == kept["z"] != set()


# ---------------------------------------------------------------------- filter
def test_grouped_requests_stay_on_members() -> None:
    affinity = groups({"name": "g", "match": {"model": "m"}, "size": 2})
    members = affinity.members("g", FLEET, "m")
    chosen, outcome = affinity.filter("g", idle(FLEET, 5.0), FLEET, "m")
    assert (urls(chosen), outcome) == (members, IN_GROUP)
    chosen, outcome = affinity.filter(None, idle(FLEET), FLEET, "m")  # not exclusive: others may use them
    assert (urls(chosen), outcome) == (set(FLEET), UNGROUPED)


def test_exclusive_members_are_kept_from_other_traffic_while_others_are_available() -> None:
    affinity = groups(
        {"name": "acme", "match": {"model": "a"}, "workers": list(FLEET[:2]), "exclusive": True},
        {"name": "other", "match": {"model": "o"}, "size": 1, "overflow_load": 1},
    )
    chosen, outcome = affinity.filter(None, idle(FLEET), SHARED, "m")
    assert (urls(chosen), outcome) == (set(FLEET[2:]), UNGROUPED)
    chosen, outcome = affinity.filter("other", idle(FLEET, 3.0), SHARED, "o")  # spills, but not onto acme
    assert (urls(chosen), outcome) == (set(FLEET[2:]), OVERFLOW)
    chosen, _ = affinity.filter(None, idle(FLEET[:2]), SHARED, "m")  # only acme's workers are up
    assert urls(chosen) == set(FLEET[:2])
    chosen, outcome = affinity.filter("acme", idle(FLEET), SHARED, "a")
    assert (urls(chosen), outcome) == (set(FLEET[:2]), IN_GROUP)


def test_overflow_fleet_by_unavailability_and_by_load() -> None:
    affinity = groups({"name": "g", "match": {"model": "m"}, "size": 2, "overflow_load": 4})
    members = affinity.members("g", FLEET, "m")
    others = [u for u in FLEET if u not in members]
    chosen, outcome = affinity.filter("g", idle(others), FLEET, "m")  # every member is down
    assert (urls(chosen), outcome) == (set(others), OVERFLOW)
    busy = [Candidate(u, 4.0 if u in members else 0.0) for u in FLEET]
    chosen, outcome = affinity.filter("g", busy, FLEET, "m")
    assert (urls(chosen), outcome) == (set(FLEET), OVERFLOW)  # the members stay eligible
    one_free = [Candidate(u, 3.0 if u == min(members) else 9.0) for u in FLEET]
    chosen, outcome = affinity.filter("g", one_free, FLEET, "m")
    assert (urls(chosen), outcome) == (members, IN_GROUP)


def test_without_overflow_load_busy_members_keep_the_traffic() -> None:
    affinity = groups({"name": "g", "match": {"model": "m"}, "size": 2})
    chosen, outcome = affinity.filter("g", idle(FLEET, 1000.0), FLEET, "m")
    assert (urls(chosen), outcome) == (affinity.members("g", FLEET, "m"), IN_GROUP)


def test_overflow_none_stays_in_group_even_when_empty() -> None:
    affinity = groups({"name": "g", "match": {"model": "m"}, "workers": [FLEET[0]], "overflow": "none"})
    assert affinity.filter("g", idle(FLEET[1:]), FLEET, "m") == ([], IN_GROUP)
    chosen, outcome = affinity.filter("g", idle(FLEET, 50.0), FLEET, "m")
    assert (urls(chosen), outcome) == ({FLEET[0]}, IN_GROUP)


def test_overflow_to_another_group_then_to_the_fleet() -> None:
    affinity = groups(
        {
            "name": "g",
            "match": {"model": "m"},
            "workers": [FLEET[0]],
            "overflow": "spare",
            "overflow_load": 2,
        },
        {"name": "spare", "match": {"model": "s"}, "workers": list(FLEET[1:3]), "exclusive": True},
    )
    # member down: to spare, exclusive or not
    chosen, outcome = affinity.filter("g", idle(FLEET[1:]), SHARED, "m")
    assert (urls(chosen), outcome) == (set(FLEET[1:3]), OVERFLOW)
    chosen, outcome = affinity.filter("g", idle(FLEET, 2.0), SHARED, "m")  # member busy: member + spare
    assert (urls(chosen), outcome) == (set(FLEET[:3]), OVERFLOW)
    chosen, outcome = affinity.filter("g", idle(FLEET[3:]), SHARED, "m")  # spare down too: the fleet
    assert (urls(chosen), outcome) == (set(FLEET[3:]), OVERFLOW)
    chosen, outcome = affinity.filter("g", idle(FLEET[1:2] + FLEET[5:]), SHARED, "m")
    assert (urls(chosen), outcome) == ({FLEET[1]}, OVERFLOW)


@pytest.mark.parametrize("overflow", ["fleet", "spare"])
def test_filter_never_empties_a_non_empty_candidate_list(overflow) -> None:
    affinity = groups(
        {"name": "g", "match": {"model": "m"}, "size": 2, "overflow": overflow, "overflow_load": 1},
        {"name": "spare", "match": {"model": "s"}, "size": 1, "exclusive": True},
        {"name": "x", "match": {"model": "x"}, "workers": list(FLEET[:3]), "exclusive": True},
    )
    subsets = [FLEET[i:j] for i in range(len(FLEET)) for j in range(i + 1, len(FLEET) + 1)]
    subsets += [FLEET[::2], FLEET[1::2], FLEET[:3]]
    for subset in subsets:
        for load in (0.0, 5.0):
            for group in (None, "g", "spare", "x"):
                chosen, outcome = affinity.filter(group, idle(subset, load), SHARED, MODEL_OF[group])
                assert chosen and urls(chosen) <= set(subset), (group, subset, load)
                assert outcome in (UNGROUPED, IN_GROUP, OVERFLOW)
    for group in (None, "g"):
        assert affinity.filter(group, [], SHARED, MODEL_OF[group])[0] == []


def test_unknown_group_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown affinity group"):
        groups(GOOD).filter("nope", idle(FLEET), FLEET, "m")


def test_describe_reports_members_now() -> None:
    affinity = groups({"name": "g", "match": {"header": {"x-tenant": "a"}}, "share": 0.5, "overflow": "none"})
    (entry,) = affinity.describe(FLEET[:4])  # models not known: members for any model, under ""
    assert entry["name"] == "g" and entry["match"] == {"header": {"x-tenant": "a"}}
    assert entry["sized_by"] == {"share": 0.5} and entry["overflow"] == "none"
    assert entry["exclusive"] is False and entry["overflow_load"] is None
    assert entry["members"].keys() == {""} and len(entry["members"][""]) == 2
    assert set(entry["members"][""]) == affinity.members("g", FLEET[:4], None)
