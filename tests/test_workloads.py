"""Workload generators: deterministic per seed, and prefixes shared exactly as each workload says."""

from __future__ import annotations

import random

import pytest

from loadtest.workloads import GENERATORS, generate, materialize, poisson_arrivals, prompt_text, random_text

SMALL = {
    "tenants": {"num_tenants": 4, "system_tokens": 300, "question_tokens": 30},
    "multi_turn": {"turns": 4, "system_tokens": 100, "user_tokens": 30},
    "rag": {"num_docs": 5, "doc_tokens": 400, "question_tokens": 30},
    "few_shot": {"num_tasks": 3, "examples": 4, "example_tokens": 60, "question_tokens": 30},
    "unique": {"prompt_tokens": 200},
    "seed": {"system_tokens": 300, "question_tokens": 30},
    "agents": {"num_agents": 3, "tools_per_agent": 4, "tool_tokens": 150, "question_tokens": 30},
}


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_same_seed_same_requests_and_different_seed_differs(name):
    a = generate(name, 40, seed=7, **SMALL[name])
    b = generate(name, 40, seed=7, **SMALL[name])
    c = generate(name, 40, seed=8, **SMALL[name])
    assert a == b
    assert [r.body for r in a] != [r.body for r in c]
    assert [r.id for r in a] == list(range(40))
    arrivals = [r.arrival_s for r in a if r.after is None]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_rate_changes_arrivals_but_not_prompts(name):
    slow = generate(name, 30, seed=1, rate=1.0, **SMALL[name])
    fast = generate(name, 30, seed=1, rate=100.0, **SMALL[name])
    assert [r.body for r in slow] == [r.body for r in fast]
    assert fast[-1].arrival_s < slow[-1].arrival_s


def test_sizes_are_in_characters():
    assert len(random_text(random.Random(0), 1234)) == 1234
    reqs = generate("unique", 5, prompt_tokens=333)
    assert all(len(r.body["messages"][0]["content"]) == 333 for r in reqs)
    assert all(prompt_text(r.body).isascii() for r in reqs)


def test_tenants_share_exact_system_prompts_and_zipf_skews_popularity():
    reqs = generate("tenants", 400, seed=3, **SMALL["tenants"])
    by_group: dict[str, set[str]] = {}
    for r in reqs:
        by_group.setdefault(r.group, set()).add(r.body["messages"][0]["content"])
    assert all(len(systems) == 1 for systems in by_group.values())  # one system prompt per tenant
    assert len({next(iter(s)) for s in by_group.values()}) == len(by_group)  # tenants differ
    counts = sorted((sum(r.group == g for r in reqs) for g in by_group), reverse=True)
    assert counts[0] > 2 * counts[-1]
    questions = [r.body["messages"][1]["content"] for r in reqs]
    assert len(set(questions)) == len(questions)


def test_multi_turn_each_turn_extends_the_previous_prompt():
    reqs = generate("multi_turn", 20, seed=2, think_time_s=0.5, **{**SMALL["multi_turn"], "turns": 4})
    bodies = materialize(reqs, reply=lambda r: f"reply to {r.id}")
    for r, body in zip(reqs, bodies, strict=True):
        if r.after is None:
            continue
        prev = bodies[r.after]
        assert reqs[r.after].group == r.group and r.think_time_s > 0
        assert body["messages"][: len(prev["messages"])] == prev["messages"]
        assert body["messages"][len(prev["messages"])] == {
            "role": "assistant",
            "content": f"reply to {r.after}",
        }
        assert prompt_text(body).startswith(prompt_text(prev))
    assert sum(r.after is None for r in reqs) == 5  # 20 requests = 5 conversations of 4 turns


def test_multi_turn_completions_api_extends_prompt_text():
    reqs = generate("multi_turn", 6, seed=2, api="completions", turns=3, system_tokens=50, user_tokens=20)
    bodies = materialize(reqs, reply=lambda r: "R")
    assert bodies[1]["prompt"].startswith(bodies[0]["prompt"] + "R")
    assert bodies[2]["prompt"].startswith(bodies[1]["prompt"] + "R")


def test_rag_requests_for_the_same_document_share_it_as_prefix():
    reqs = generate("rag", 100, seed=5, **SMALL["rag"])
    first: dict[str, str] = {}
    for r in reqs:
        text = prompt_text(r.body)
        if r.group in first:
            assert _common_prefix(first[r.group], text) > 400
        first.setdefault(r.group, text)
    other_groups = [t for g, t in first.items() if g != reqs[0].group]
    assert all(_common_prefix(prompt_text(reqs[0].body), t) < 100 for t in other_groups)


def test_few_shot_shares_examples_within_a_task():
    reqs = generate("few_shot", 30, seed=1, **SMALL["few_shot"])
    for a in reqs:
        for b in reqs:
            if a.group == b.group:
                assert a.body["messages"][:-1] == b.body["messages"][:-1]


def test_agents_share_their_tool_set_and_its_rendered_prefix():
    from router.chat_tools import compact_json
    from router.tokenization import ByteTokenizer

    reqs = generate("agents", 40, seed=2, **SMALL["agents"])
    render = ByteTokenizer().render_chat
    by_group: dict[str, list] = {}
    for r in reqs:
        by_group.setdefault(r.group, []).append(render(r.body["messages"], r.body["tools"]))
    assert len(by_group) > 1 and all(len(g) > 1 for g in list(by_group.values())[:2])
    for group, texts in by_group.items():
        tools = next(r.body["tools"] for r in reqs if r.group == group)
        assert all(_common_prefix(texts[0], t) > len(compact_json(tools)) for t in texts[1:])
    firsts = [texts[0] for texts in by_group.values()]
    assert all(_common_prefix(a, b) < 200 for i, a in enumerate(firsts) for b in firsts[i + 1 :])


@pytest.mark.parametrize("api", ["completions", "responses"])
def test_every_api_gets_the_agents_and_tasks_chat_gets(api):
    """Completions and Responses drew each task twice (once for a chat body they threw away): 160 of 200
    requests went to another agent than under chat, so the APIs' runs were not of the same requests."""
    chat, other = (generate("agents", 60, seed=5, api=a, **SMALL["agents"]) for a in ("chat", api))
    assert [r.group for r in chat] == [r.group for r in other]
    for c, o in zip(chat, other, strict=True):
        assert c.body["messages"][1]["content"] in str(o.body)  # the same task, in that API's shape


def test_seed_workload_puts_about_80_percent_on_one_system_prompt():
    reqs = generate("seed", 500, seed=4, **SMALL["seed"])
    hot = [r for r in reqs if r.group == "hot"]
    assert 0.7 < len(hot) / len(reqs) < 0.9
    assert len({r.body["messages"][0]["content"] for r in hot}) == 1
    cold_systems = [r.body["messages"][0]["content"] for r in reqs if r.group != "hot"]
    assert len(set(cold_systems)) == len(cold_systems)


def test_unique_prompts_share_no_meaningful_prefix():
    texts = [prompt_text(r.body) for r in generate("unique", 50, **SMALL["unique"])]
    assert max(_common_prefix(a, b) for i, a in enumerate(texts) for b in texts[i + 1 :]) < 40


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="unknown workload"):
        generate("nope", 1)
    with pytest.raises(ValueError, match="no option"):
        generate("tenants", 1, doc_tokens=5)
    with pytest.raises(ValueError, match="api"):
        generate("tenants", 1, api="embeddings")
    for rate in (0.0, float("nan"), float("inf")):  # NOTE: NaN or infinite gaps are no arrival times
        with pytest.raises(ValueError, match="rate must be positive and finite"):
            generate("tenants", 1, rate=rate)


@pytest.mark.parametrize(
    ("name", "knob", "value", "message"),
    [
        ("tenants", "num_tenants", "abc", "num_tenants must be a whole number, got 'abc'"),
        ("tenants", "system_tokens", 2.5, "system_tokens must be a whole number"),
        ("rag", "zipf_s", "steep", "zipf_s must be a number"),
        ("tenants", "num_tenants", 0, "num_tenants must be >= 1"),
        ("multi_turn", "turns", 0, "turns must be >= 1"),
        ("rag", "doc_tokens", -5, "doc_tokens must be >= 0"),
        ("seed", "hot_fraction", 1.5, "hot_fraction must be between 0 and 1"),
        ("multi_turn", "think_time_s", float("inf"), "think_time_s must be >= 0 and finite, got inf"),
    ],
)
def test_knobs_of_the_wrong_type_or_out_of_range_are_refused_by_name(name, knob, value, message):
    """What `--option KEY=VALUE` passes: a word, a fraction for a count, or no tenants at all
    is a ValueError naming the knob, not a TypeError or IndexError from inside a generator."""
    with pytest.raises(ValueError, match=message):
        generate(name, 5, **{knob: value})
    assert len(generate(name, 5, **{knob: 1})) == 5  # a whole number does for every numeric knob


def test_poisson_arrivals_are_seeded_and_increasing():
    a = poisson_arrivals(200, 50.0, seed=1)
    assert a == poisson_arrivals(200, 50.0, seed=1) != poisson_arrivals(200, 50.0, seed=2)
    assert a == sorted(a) and 2.0 < a[-1] < 6.0  # ~ 200 / 50 s
