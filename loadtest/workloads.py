"""Seeded workload generators: OpenAI request bodies with open-loop arrival times and turn links.

Same name, arguments and seed -> the identical request list. Never reads files or the network;
text comes from a seeded pseudo-word generator, sized in characters (~ tokens for a UTF-8
bytes tokenizer).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# NOTE: "responses" bodies are built as chat ones; the driver turns them into Responses requests
API_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}
_SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["qu", "th", "sh", "ch"]


def _build_vocabulary(size: int = 2048) -> list[str]:
    rng = random.Random("radixgate-vocabulary")  # NOTE: fixed forever: changing it changes every prompt
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
    return sorted(words)


VOCABULARY = _build_vocabulary()


def random_text(rng: random.Random, n_chars: int) -> str:
    """Exactly ``n_chars`` ASCII characters of space-separated pseudo-words drawn from ``rng``."""
    if n_chars <= 0:
        return ""
    parts: list[str] = []
    length = 0
    while length < n_chars:
        chunk = rng.choices(VOCABULARY, k=n_chars // 5 + 4)  # mean word + space ~ 6 chars
        parts.extend(chunk)
        length += sum(len(w) + 1 for w in chunk)
    return " ".join(parts)[:n_chars]


@dataclass(slots=True)
class Request:
    """One request of a workload.

    For a later turn of a conversation (``after`` set) ``body`` holds only what this turn adds;
    the full body is the previous turn's full body + its actual reply + this (``continue_body``).
    """

    id: int  # position in the workload; a turn's ``after`` is always a smaller id
    arrival_s: float  # open-loop send time, seconds after the run starts (first turns only)
    api: str  # "chat" | "completions" | "responses" (a chat body, sent as a Responses request)
    body: dict[str, Any]  # OpenAI request body (model, messages | prompt, max_tokens, ...)
    group: str  # what shares this request's prefix: "tenant-3", "doc-7", "conv-12", "unique", ...
    after: int | None = None  # id of the previous turn of the same conversation
    think_time_s: float = 0.0  # wait after ``after`` completes before sending (seconds)


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as one string (chat messages tagged by role): for prefix checks and sizes."""
    if "prompt" in body:
        return str(body["prompt"])
    tools = f"<tools>{json.dumps(body['tools'])}" if body.get("tools") else ""
    return tools + "".join(f"<{m['role']}>{m['content']}" for m in body.get("messages", []))


def continue_body(previous_full: dict[str, Any], reply: str, turn: Request) -> dict[str, Any]:
    """Full body of a later turn: the previous turn's full body, its reply, then this turn's part."""
    body = dict(turn.body)
    if turn.api in ("chat", "responses"):
        body["messages"] = [
            *previous_full["messages"],
            {"role": "assistant", "content": reply},
            *turn.body["messages"],
        ]
    else:
        body["prompt"] = previous_full["prompt"] + reply + turn.body["prompt"]
    return body


def materialize(
    requests: list[Request], reply: Callable[[Request], str] = lambda r: "ok"
) -> list[dict[str, Any]]:
    """Full bodies of all requests offline, with ``reply(previous_request)`` as each answer."""
    full: dict[int, dict[str, Any]] = {}
    by_id = {r.id: r for r in requests}
    out = []
    for r in requests:
        body = r.body if r.after is None else continue_body(full[r.after], reply(by_id[r.after]), r)
        full[r.id] = body
        out.append(body)
    return out


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` Poisson arrival times (seconds from 0) at ``rate`` requests/s."""
    rng = random.Random(f"arrivals:{seed}")
    out, clock = [], 0.0
    for _ in range(n):
        clock += rng.expovariate(rate)
        out.append(clock)
    return out


class _Builder:
    """Shared state of one generation: text rng, arrival clock and body shape."""

    def __init__(self, name: str, seed: int, rate: float, api: str, model: str, max_tokens: int):
        if api not in API_PATHS:
            raise ValueError(f"api must be one of {sorted(API_PATHS)}, got {api!r}")
        if not 0 < rate < math.inf:  # NOTE: NaN arrivals would never come due in a simulation
            raise ValueError(f"rate must be positive and finite (requests/s), got {rate}")
        # NOTE: text and arrivals use separate streams, so changing the rate keeps every prompt.
        self.rng = random.Random(f"{name}:{seed}")
        self._arrival_rng = random.Random(f"{name}:{seed}:arrivals")
        self._clock = 0.0
        self.rate, self.api, self.model, self.max_tokens = rate, api, model, max_tokens

    def text(self, n_chars: int) -> str:
        return random_text(self.rng, n_chars)

    def next_arrival(self, rate: float | None = None) -> float:
        """Poisson arrivals: exponential gaps with mean 1/rate seconds."""
        self._clock += self._arrival_rng.expovariate(rate or self.rate)
        return self._clock

    def zipf_picker(self, n: int, s: float) -> Callable[[], int]:
        """Index in [0, n) with P(k) ~ 1/(k+1)^s (s=0: uniform)."""
        cum, total = [], 0.0
        for k in range(n):
            total += 1.0 / (k + 1) ** s
            cum.append(total)
        return lambda: self.rng.choices(range(n), cum_weights=cum)[0]

    def body(self, messages: list[dict[str, str]], *, continuation: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0}
        if self.api in ("chat", "responses"):
            body["messages"] = messages
        else:
            text = "\n\n".join(m["content"] for m in messages)
            body["prompt"] = "\n\n" + text if continuation else text
        return body


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _tenants(
    b: _Builder,
    n: int,
    *,
    num_tenants: int = 8,
    system_tokens: int = 1024,
    question_tokens: int = 64,
    zipf_s: float = 1.1,
) -> list[Request]:
    systems = [f"Tenant {k} instructions: " + b.text(system_tokens) for k in range(num_tenants)]
    pick = b.zipf_picker(num_tenants, zipf_s)
    out = []
    for i in range(n):
        k = pick()
        body = b.body([_msg("system", systems[k]), _msg("user", b.text(question_tokens))])
        out.append(Request(i, b.next_arrival(), b.api, body, f"tenant-{k}"))
    return out


def _multi_turn(
    b: _Builder,
    n: int,
    *,
    turns: int = 4,
    system_tokens: int = 256,
    user_tokens: int = 64,
    think_time_s: float = 1.0,
) -> list[Request]:
    # NOTE: ids are conversation-major (conv 0 turns 0..T-1, conv 1 ...), so a closed loop that
    # takes the smallest ready id finishes started conversations before opening new ones.
    system = "Assistant instructions: " + b.text(system_tokens)
    out: list[Request] = []
    for conv in range(math.ceil(n / turns)):
        start = b.next_arrival(b.rate / turns)  # conversations/s so that requests/s ~ rate
        for t in range(turns):
            if len(out) == n:
                break
            user = _msg("user", f"[{conv}.{t}] " + b.text(user_tokens))
            if t == 0:
                body, after, think = b.body([_msg("system", system), user]), None, 0.0
            else:
                think = b.rng.expovariate(1.0 / think_time_s) if think_time_s > 0 else 0.0
                body, after = b.body([user], continuation=True), len(out) - 1
            out.append(Request(len(out), start, b.api, body, f"conv-{conv}", after, think))
    return out


def _rag(
    b: _Builder,
    n: int,
    *,
    num_docs: int = 64,
    doc_tokens: int = 2048,
    question_tokens: int = 64,
    zipf_s: float = 1.1,
) -> list[Request]:
    system = "Answer the question using only the document."
    docs = [f"Document {k}.\n" + b.text(doc_tokens) for k in range(num_docs)]
    pick = b.zipf_picker(num_docs, zipf_s)
    out = []
    for i in range(n):
        k = pick()
        user = f"{docs[k]}\n\nQuestion: {b.text(question_tokens)}"
        out.append(
            Request(
                i, b.next_arrival(), b.api, b.body([_msg("system", system), _msg("user", user)]), f"doc-{k}"
            )
        )
    return out


def _few_shot(
    b: _Builder,
    n: int,
    *,
    num_tasks: int = 4,
    examples: int = 8,
    example_tokens: int = 128,
    question_tokens: int = 64,
    zipf_s: float = 0.0,
) -> list[Request]:
    tasks = []
    for k in range(num_tasks):
        shots = [_msg("system", f"Task {k}: answer in the style of the examples.")]
        for _ in range(examples):
            shots += [
                _msg("user", b.text(example_tokens // 2)),
                _msg("assistant", b.text(example_tokens // 2)),
            ]
        tasks.append(shots)
    pick = b.zipf_picker(num_tasks, zipf_s)
    out = []
    for i in range(n):
        k = pick()
        body = b.body([*tasks[k], _msg("user", b.text(question_tokens))])
        out.append(Request(i, b.next_arrival(), b.api, body, f"task-{k}"))
    return out


def _agents(
    b: _Builder,
    n: int,
    *,
    num_agents: int = 8,
    tools_per_agent: int = 12,
    tool_tokens: int = 160,
    question_tokens: int = 64,
    zipf_s: float = 1.1,
) -> list[Request]:
    """Agent apps: each sends its own tool set (``tools_per_agent`` function schemas, each a
    description of ``tool_tokens`` - 100 characters in ~190 of JSON: ~253 byte tokens at the default 160)
    with a short instruction and a user task. The shared prefix is the tools,
    which the chat template renders into the prompt."""
    agents = []
    for k in range(num_agents):
        tools = [
            {"type": "function", "function": {
                "name": f"agent{k}_tool{j}",
                "description": b.text(tool_tokens - 100),
                "parameters": {"type": "object", "required": ["query"],
                               "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}},
            }}
            for j in range(tools_per_agent)
        ]  # fmt: skip
        agents.append((tools, f"You are agent {k}. Use the tools when they help."))
    pick = b.zipf_picker(num_agents, zipf_s)
    out = []
    for i in range(n):
        k = pick()
        tools, system = agents[k]
        # NOTE: one draw whatever the API: every API gets the same requests
        question = b.text(question_tokens)
        if b.api == "chat":
            body = b.body([_msg("system", system), _msg("user", question)])
            body["tools"] = tools
        else:  # NOTE: completions and Responses carry no tools here: the schemas go into the text
            body = b.body([_msg("system", json.dumps(tools) + "\n" + system), _msg("user", question)])
        out.append(Request(i, b.next_arrival(), b.api, body, f"agent-{k}"))
    return out


def _unique(b: _Builder, n: int, *, prompt_tokens: int = 512) -> list[Request]:
    return [
        Request(i, b.next_arrival(), b.api, b.body([_msg("user", b.text(prompt_tokens))]), "unique")
        for i in range(n)
    ]


def _seed(
    b: _Builder, n: int, *, hot_fraction: float = 0.8, system_tokens: int = 1024, question_tokens: int = 64
) -> list[Request]:
    hot = "Shared instructions: " + b.text(system_tokens)
    out = []
    for i in range(n):
        is_hot = b.rng.random() < hot_fraction
        system = hot if is_hot else "Private instructions: " + b.text(system_tokens)
        body = b.body([_msg("system", system), _msg("user", b.text(question_tokens))])
        out.append(Request(i, b.next_arrival(), b.api, body, "hot" if is_hot else "unique"))
    return out


GENERATORS: dict[str, Callable[..., list[Request]]] = {
    "tenants": _tenants,
    "multi_turn": _multi_turn,
    "rag": _rag,
    "few_shot": _few_shot,
    "agents": _agents,
    "unique": _unique,
    "seed": _seed,
}


# NOTE: knobs that count what requests share (tenants, documents, turns, ...) need at least one;
# the others are sizes, times or Zipf exponents (>= 0), and hot_fraction a fraction (<= 1)
_COUNT_KNOBS = frozenset({"num_tenants", "turns", "num_docs", "num_tasks", "num_agents"})


def _check_knob(workload: str, key: str, value: Any, default: int | float) -> None:
    """ValueError unless ``value`` suits knob ``key``: a whole number where its default is one, a
    number otherwise, and in range."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if not (whole or (isinstance(value, float) and not isinstance(default, int))):
        kind = "a whole number" if isinstance(default, int) else "a number"
        raise ValueError(f"workload {workload!r}: option {key} must be {kind}, got {value!r}")
    least = 1 if key in _COUNT_KNOBS else 0
    # NOTE: finite too: an infinite mean think time has no exponential to draw from
    if not least <= value < math.inf or (key == "hot_fraction" and value > 1):
        bound = "between 0 and 1" if key == "hot_fraction" else f">= {least} and finite"
        raise ValueError(f"workload {workload!r}: option {key} must be {bound}, got {value!r}")


def generate(
    name: str,
    num_requests: int,
    *,
    seed: int = 0,
    rate: float = 10.0,
    api: str = "chat",
    model: str = "default",
    max_tokens: int = 64,
    **options: Any,
) -> list[Request]:
    """``num_requests`` requests of workload ``name``; ``rate`` (requests/s) sets arrival times.

    ``options`` are the generator's own knobs (sizes in tokens ~ characters), e.g.
    ``num_tenants=16, system_tokens=2048`` for ``tenants``; unknown ones raise ValueError.
    """
    if name not in GENERATORS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(GENERATORS)}")
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    gen = GENERATORS[name]
    known = gen.__code__.co_varnames[2 : 2 + gen.__code__.co_kwonlyargcount]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"workload {name!r} has no option(s) {unknown}; it takes {sorted(known)}")
    for key, value in options.items():
        _check_knob(name, key, value, gen.__kwdefaults__[key])
    return gen(_Builder(name, seed, rate, api, model, max_tokens), num_requests, **options)
