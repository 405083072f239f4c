"""Structured outputs: request spellings, masks from llguidance against the byte and an HF
tokenizer, the masking step on logits, and real workers (tiny model, an HF checkpoint, the sim
engine) whose outputs follow the asked-for schema, regex or choice whatever they sample."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from router.tokenization import ByteTokenizer, HFTokenizer
from worker.api_params import output_guide
from worker.config import WorkerConfig
from worker.guided import (
    COMPILE_THREADS,
    COMPILES,
    CONSTRAINT_KEYS,
    THINK_GAP,
    GuideCompiler,
    allowed_mask,
    constrain,
    requested_grammar,
    thinking_first,
    unpack_on,
)
from worker.sampling import SamplingParams
from worker.sim_engine import build_sim_engine

from .test_kv_transfer import counter
from .test_server import LiveServer, poll, serve

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def check_person(obj: dict) -> None:
    assert set(obj) == {"name", "age", "role"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 150
    assert obj["role"] in ("admin", "user")


# ---------------------------------------------------------------------- request spellings
@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
            "json_schema",
        ),
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"structured_outputs": {"json": json.dumps(PERSON)}}, "json_schema"),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex"),
        ({"guided_choice": ["a", "b"]}, "choice"),
        ({"guided_grammar": 'start: "x"+'}, "grammar"),
        ({"guided_grammar": 'root ::= "x"+'}, "grammar"),  # GBNF too
        ({"regex": "[0-9]+"}, "regex"),  # SGLang's top-level spellings
        ({"json_schema": json.dumps(PERSON)}, "json_schema"),
        ({"ebnf": 'root ::= "yes" | "no"'}, "grammar"),
    ],
)
def test_every_spelling_names_its_kind(body, kind) -> None:
    assert requested_grammar(body)[0] == kind


@pytest.mark.parametrize(
    "body",
    [
        {"response_format": {"type": "yaml"}},
        {"response_format": "json"},
        {"response_format": {"type": "json_schema"}},
        {"guided_regex": "a", "guided_choice": ["a"]},
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        {"guided_choice": []},
        {"guided_choice": ["a", 3]},
        {"guided_json": "{not json"},
        {"guided_regex": ""},
        {"regex": "a", "guided_regex": "a"},
        {"ebnf": "root ::= (("},
        {"guided_json": False},  # matches nothing
        {"structured_outputs": {"structural_tag": "{}"}},  # not served: refused, not ignored
        {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
        {"structured_outputs": {"structural_tag": 0}},  # 0 is a value, not False
        {"guided_regex": "a", "guided_whitespace_pattern": " "},
    ],
)
def test_malformed_or_ambiguous_constraints_are_refused(body) -> None:
    with pytest.raises(ValueError):
        requested_grammar(body)


def test_a_json_schema_without_a_schema_takes_any_json_value() -> None:
    """OpenAI's json_schema with its schema left out (or ``true``): any JSON value, as for JSON
    Schema itself; a flag that keeps the constraint on is no change."""
    compiler = GuideCompiler(ByteTokenizer(), 257)
    for body in (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
        {"guided_json": True},
        {"structured_outputs": {"json": True, "disable_fallback": True}},
    ):
        for text in ('[1,"a"]', '{"a":1}', "3"):
            m = compiler.compile(*requested_grammar(body)).matcher()
            assert all(m.consume_token(b) for b in text.encode()) and m.is_accepting(), (body, text)


def test_free_text_has_no_grammar() -> None:
    assert requested_grammar({}) is None
    assert requested_grammar({"response_format": {"type": "text"}}) is None


def test_a_body_without_any_constraint_key_is_free_text_without_asking() -> None:
    """output_guide answers "free text" on the event loop for a body holding none of CONSTRAINT_KEYS:
    those must be every key requested_grammar reads."""

    class Reads(dict):
        read: set = set()

        def get(self, key, default=None):
            self.read.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            self.read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            self.read.add(key)
            return super().__contains__(key)

    assert requested_grammar(Reads()) is None
    assert Reads.read and Reads.read <= CONSTRAINT_KEYS, Reads.read - CONSTRAINT_KEYS


# ---------------------------------------------------------------------- masks
def allowed_ids(matcher, vocab: int) -> set[int]:
    return set(allowed_mask([matcher], vocab)[0].nonzero().flatten().tolist())


def test_byte_masks_allow_exactly_the_grammar_and_eos_only_at_the_end() -> None:
    compiler = GuideCompiler(ByteTokenizer(), 257)
    guide = compiler.compile(*requested_grammar({"guided_regex": "ab|cd"}))
    m = guide.matcher()
    assert allowed_ids(m, 257) == {ord("a"), ord("c")}
    assert m.consume_token(ord("c"))
    assert allowed_ids(m, 257) == {ord("d")}
    assert m.consume_token(ord("d"))
    assert allowed_ids(m, 257) == {ByteTokenizer.EOS}
    # each request gets its own state: a fresh matcher starts over
    assert allowed_ids(guide.matcher(), 257) == {ord("a"), ord("c")}
    # compiled once per grammar text
    assert compiler.compile(*requested_grammar({"guided_regex": "ab|cd"})) is guide


def test_invalid_grammars_name_the_problem() -> None:
    compiler = GuideCompiler(ByteTokenizer(), 257)
    with pytest.raises(ValueError, match="invalid regex"):
        compiler.compile(*requested_grammar({"guided_regex": "[a-"}))
    with pytest.raises(ValueError, match="invalid json schema"):
        compiler.compile(*requested_grammar({"guided_json": {"type": "nonsense"}}))


def walks(guide, text: str) -> bool:
    """Does ``guide`` take ``text`` (bytes of the byte tokenizer) whole, with EOS allowed after it?"""
    m = guide.matcher()
    return m.consume_tokens(list(text.encode())) and ByteTokenizer.EOS in allowed_ids(m, 257)


def test_a_choice_of_thousands_of_options_and_any_characters_is_one_of_them() -> None:
    """A rule of alternatives stopped at llguidance's 2,000 items a row, mid-request."""
    compiler = GuideCompiler(ByteTokenizer(), 257)
    many = compiler.compile(*requested_grammar({"guided_choice": [f"item{i}" for i in range(3000)]}))
    assert walks(many, "item2999") and walks(many, "item0") and not walks(many, "item3000")
    odd = ["a/b", "x|y", "(.*)", "line\nbreak", 'quote"s', "ça\\", "a", "ab"]
    guide = compiler.compile(*requested_grammar({"guided_choice": odd}))
    assert all(walks(guide, c) for c in odd)
    assert not walks(guide, "xy") and not walks(guide, "anything") and not walks(guide, "a/")


def test_whitespace_after_the_thinking_is_bounded() -> None:
    """A model left free to write whitespace between ``</think>`` and its constrained answer could
    spend its whole budget there."""
    compiler = GuideCompiler(ByteTokenizer(), 257)
    kind, grammar = requested_grammar({"guided_regex": "ab"})
    for opened, head in ((True, "hm</think>"), (False, "<think>hm</think>")):
        guide = compiler.compile(kind, thinking_first(grammar, opened))
        assert walks(guide, head + "ab") and walks(guide, head + "\n\n ab")
        assert walks(guide, head + " \t\r\n" * (THINK_GAP // 4) + "ab")
        assert not walks(guide, head + " " * (THINK_GAP + 1) + "ab")
    assert walks(compiler.compile(kind, thinking_first(grammar)), "ab")  # no thinking written


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"guided_regex": "ab\\"}, "lone backslash"),
        ({"guided_json": {"type": "string", "pattern": "a\\"}}, "lone backslash"),
        ({"guided_json": {"type": "object", "patternProperties": {"k\\": {}}}}, "lone backslash"),
        ({"guided_json": {"type": "integer", "minimum": 2**53 + 1}}, "beyond 2\\*\\*53"),
        ({"guided_json": {"enum": [1, -(2**60)]}}, "beyond 2\\*\\*53"),
        ({"guided_json": {"type": "array", "items": {"const": 2**53 + 1}}}, "beyond 2\\*\\*53"),
        ({"guided_json": {"properties": {"default": {"type": "integer", "minimum": 2**53 + 1}}}}, "beyond"),
    ],
)
def test_what_the_constraint_would_silently_change_is_refused(body, message) -> None:
    """A trailing backslash was dropped (``ab\\`` allowed ``ab``); an integer past 2**53 allowed its
    float64 neighbour (minimum 2**53 + 1 let 2**53 through)."""
    with pytest.raises(ValueError, match=message):
        GuideCompiler(ByteTokenizer(), 257).compile(*requested_grammar(body))


def test_escaped_backslashes_and_integers_up_to_2_53_still_compile() -> None:
    compiler = GuideCompiler(ByteTokenizer(), 257)
    assert walks(compiler.compile(*requested_grammar({"guided_regex": "ab\\\\"})), "ab\\")
    exact = compiler.compile(*requested_grammar({"guided_json": {"type": "integer", "minimum": 2**53}}))
    assert walks(exact, str(2**53)) and not walks(exact, str(2**53 - 1))
    named = {"type": "object", "properties": {"enum": {"type": "integer", "examples": [2**60]}}}  # a name
    assert walks(compiler.compile(*requested_grammar({"guided_json": named})), '{"enum":1}')


def random_walk(compiler: GuideCompiler, body: dict, vocab: int, eos: set[int], seed: int, limit: int = 400):
    """Sample uniformly among allowed tokens until EOS: the tokens of one constrained output."""
    rng = random.Random(seed)
    m = compiler.compile(*requested_grammar(body)).matcher()
    out = []
    for _ in range(limit):
        token = rng.choice(sorted(allowed_ids(m, vocab)))
        if token in eos:
            return out
        assert m.consume_token(token)
        out.append(token)
    raise AssertionError(f"no EOS allowed after {limit} tokens")


@pytest.mark.parametrize("seed", range(5))
def test_hf_tokenizer_walks_give_schema_valid_json(llama_checkpoint, seed) -> None:
    tok = HFTokenizer(str(llama_checkpoint))
    compiler = GuideCompiler(tok, tok.vocab_size)
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    ids = random_walk(compiler, schema, tok.vocab_size, set(tok.eos_token_ids), seed)
    check_person(json.loads(tok.decode(ids)))


def test_forced_text_that_spells_a_special_token_is_written_as_text(llama_checkpoint) -> None:
    """Text a grammar forces is text even where a special token has the same spelling: the special
    token (which no grammar text can be) is never offered, so the output is not cut off there."""
    tok = HFTokenizer(str(llama_checkpoint))
    compiler = GuideCompiler(tok, tok.vocab_size)
    im_start = tok._tok.token_to_id("<|im_start|>")
    for seed in range(3):
        ids = random_walk(
            compiler, {"guided_choice": ["<|im_start|>x"]}, tok.vocab_size, set(tok.eos_token_ids), seed
        )
        assert im_start not in ids and tok.decode(ids) == "<|im_start|>x"


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_both_unpackings_agree_bit_for_bit(device) -> None:
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=gen)
    vocab = 5 * 32 - 7  # a vocabulary that ends inside the last word
    expected = torch.tensor(
        [[(int(w) >> b) & 1 == 1 for w in row for b in range(32)][:vocab] for row in packed]
    )
    unpacked = np.unpackbits(packed.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    assert torch.equal(torch.from_numpy(unpacked.view(np.bool_)), expected)
    assert torch.equal(unpack_on(packed.to(device), vocab).cpu(), expected)


def test_constrain_masks_only_guided_rows_and_leaves_the_input_alone() -> None:
    compiler = GuideCompiler(ByteTokenizer(), 257)
    guide = compiler.compile(*requested_grammar({"guided_choice": ["yes", "no"]}))

    class State:
        def __init__(self, params):
            self.params, self.memo = params, {}

    states = [State(SamplingParams()), State(SamplingParams(guide=guide))]
    logits = torch.randn(2, 257)
    before = logits.clone()
    out = constrain(logits, states)
    assert torch.equal(logits, before)
    assert torch.equal(out[0], logits[0])
    finite = set(torch.isfinite(out[1]).nonzero().flatten().tolist())
    assert finite == {ord("y"), ord("n")}
    assert torch.equal(out[1][list(finite)], logits[1][list(finite)])
    assert constrain(logits, states[:1]) is logits
    # only the rows asked for (a row whose request has ended is left alone)
    assert constrain(logits, states, rows=[]) is logits
    three = torch.randn(3, 257)
    picked = constrain(three, [states[1], states[1], states[1]], rows=[2])
    assert torch.equal(picked[:2], three[:2])
    assert set(torch.isfinite(picked[2]).nonzero().flatten().tolist()) == {ord("y"), ord("n")}


# ---------------------------------------------------------------------- real workers
@pytest.fixture(scope="module")
def tiny():
    with serve() as live:
        yield httpx.Client(base_url=live.url, timeout=120)


def chat(client: httpx.Client, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": "Describe a user."}], "max_tokens": 80, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_json_schema_outputs_follow_the_schema_for_every_choice(tiny) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    body = chat(tiny, response_format=fmt, n=4, temperature=1.0, seed=7)
    assert len(body["choices"]) == 4
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop"
        check_person(json.loads(choice["message"]["content"]))


def test_streamed_json_object_is_one_json_object(tiny) -> None:
    body = {"prompt": "{", "max_tokens": 120, "response_format": {"type": "json_object"}, "stream": True,
            "temperature": 0.8, "seed": 3}  # fmt: skip
    text, finish = "", None
    with tiny.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)


def test_regex_choice_and_grammar_constraints(tiny) -> None:
    pattern = r"[a-z]{3}-[0-9]{2,4}"
    for seed in range(3):
        r = tiny.post("/v1/completions", json={"prompt": "id:", "max_tokens": 20, "guided_regex": pattern,
                                               "temperature": 1.0, "seed": seed})  # fmt: skip
        assert re.fullmatch(pattern, r.json()["choices"][0]["text"]), r.text
    r = tiny.post("/v1/completions", json={"prompt": "ok?", "max_tokens": 20, "n": 6, "temperature": 1.5,
                                           "structured_outputs": {"choice": ["yes", "no", "ça dépend"]}})  # fmt: skip
    assert {c["text"] for c in r.json()["choices"]} <= {"yes", "no", "ça dépend"}
    lark = 'start: "(" item ("," item)* ")"\nitem: /[0-9]/'
    gbnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9]'
    for spelling in ({"guided_grammar": lark}, {"guided_grammar": gbnf}, {"ebnf": gbnf}):
        r = tiny.post(
            "/v1/completions", json={"prompt": "t", "max_tokens": 30, "temperature": 1.0, **spelling}
        )
        assert re.fullmatch(r"\([0-9](,[0-9])*\)", r.json()["choices"][0]["text"]), (spelling, r.text)
    r = tiny.post("/v1/completions", json={"prompt": "id:", "max_tokens": 20, "regex": pattern, "seed": 1})
    assert re.fullmatch(pattern, r.json()["choices"][0]["text"]), r.text


def test_truncated_output_says_length_and_the_worker_keeps_serving(tiny) -> None:
    r = tiny.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "guided_regex": "a{10}"})
    assert r.json()["choices"][0] == {
        "index": 0,
        "text": "aaa",
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    bad = tiny.post("/v1/completions", json={"prompt": "x", "guided_json": {"type": "nope"}})
    assert bad.status_code == 400 and "invalid json schema" in bad.json()["error"]["message"]
    assert tiny.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_bans_that_leave_a_grammar_no_token_end_the_request_without_the_refused_one(tiny) -> None:
    """bad_words banning every token a grammar allows: the row samples id 0, which the grammar refuses.
    That token was sent as the stream's text (breaking the constraint) and the error named it alone;
    now no refused token is output, and the error names the bans."""
    for constraint, ban in (
        ({"guided_json": {"type": "object"}}, ["{"]),
        ({"guided_choice": ["yes", "no"]}, ["y", "n"]),
    ):
        body = {"prompt": "x", "max_tokens": 8, "bad_words": ban, **constraint}
        whole = tiny.post("/v1/completions", json=body)
        assert whole.status_code == 400 and "bad_words" in whole.json()["error"]["message"], whole.text
        with tiny.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "constraint_failed"
        assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == ""
    # the refused token the last max_tokens allowed: the same error, not a 200 "length" holding it
    short = tiny.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 2, "guided_regex": "ab", "bad_words": ["b"]}
    )
    assert short.status_code == 400 and "bad_words" in short.json()["error"]["message"], short.text


def test_a_schema_sent_as_json_text_is_bounded_in_depth_as_a_body_is(tiny) -> None:
    """A schema given as JSON text skipped the body's 128-level bound: ~1,000 levels ran Python's
    json.loads out of recursion (a 500)."""
    deep = '{"type": "array", "items": ' * 999 + '{"type": "integer"}' + "}" * 999
    for body in ({"guided_json": deep}, {"structured_outputs": {"json": deep}}):
        r = tiny.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
        assert r.status_code == 400 and "deeper than 128 levels" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(
    ("grammar", "words"),
    [("root ::= undefined_rule", "Rule 'undefined_rule' not found"),
     ('a ::= "x"', "No 'root' rule found"),
     ("root ::= " + "(" * 500 + '"a"' + ")" * 500, "nested too deeply")],
)  # fmt: skip
def test_a_gbnf_grammar_the_converter_refuses_is_a_400(tiny, grammar, words) -> None:
    """llguidance's GBNF converter also raises plain exceptions (a rule not found, no root) and runs
    out of recursion on deep nesting: each was a 500, which routers count against the worker (three
    took it out of rotation)."""
    for body in (
        {"ebnf": grammar},
        {"guided_grammar": grammar},
        {"structured_outputs": {"grammar": grammar}},
    ):
        r = tiny.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert tiny.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_constraint_that_fails_midway_is_an_error_not_a_stop(tiny) -> None:
    """llguidance builds a regex's lexer lazily and stops at its own limits: a million repetitions
    fail at the first token (and, the lexer being shared, at the first mask of every later copy).
    The request is a 400 (a stream: its error event), not an EOS-only mask's empty "stop"."""
    body = {"prompt": "x", "max_tokens": 20, "structured_outputs": {"regex": "(ab){1000000}"}}
    for n in (1, 2, 1):  # the first fails on its token, the later ones on their first mask
        r = tiny.post("/v1/completions", json={**body, "n": n})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "constraint_failed" and err["type"] == "invalid_request_error"
        assert "(regex) failed" in err["message"] and "too many expressions" in err["message"]
    with tiny.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "constraint_failed"
    health = tiny.get("/health").json()
    assert health["running"] == 0 and health["kv_pages_active"] == 0
    r = tiny.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "guided_regex": "(ab){2}"})
    assert r.json()["choices"][0]["text"] == "abab"


def test_responses_api_text_format_json_schema(tiny) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON}
    r = tiny.post("/v1/responses", json={"input": "a user", "text": {"format": fmt}, "max_output_tokens": 80})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == {"format": fmt}
    check_person(json.loads(body["output"][0]["content"][0]["text"]))


def check_sampled_people(url: str, max_tokens: int, n: int, seed: int) -> None:
    """n sampled chat choices under the PERSON schema: each complete and valid."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "response_format": fmt,
            "n": n, "temperature": 1.0, "seed": seed}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        check_person(json.loads(choice["message"]["content"]))


def test_hf_model_worker_follows_a_schema(llama_checkpoint) -> None:
    with serve(model=str(llama_checkpoint)) as live:
        check_sampled_people(live.url, max_tokens=60, n=3, seed=11)


def test_sim_worker_honours_constraints() -> None:
    cfg = WorkerConfig(engine="sim", model="sim", kv_cache_tokens=4096, sim_decode_base_ms=0.0)
    with LiveServer(build_sim_engine(cfg)) as live:
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "n:", "max_tokens": 12,
                                                           "guided_regex": "[0-9]{4}"}, timeout=30)  # fmt: skip
        body = r.json()
        assert body["simulated"] is True
        assert re.fullmatch("[0-9]{4}", body["choices"][0]["text"]), r.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_worker_follows_a_schema_with_graph_replayed_steps() -> None:
    """On CUDA the masks go to the device packed and are applied there, after eager or graph steps."""
    with serve(device="cuda") as live:
        check_sampled_people(live.url, max_tokens=80, n=4, seed=3)
        assert live.engine.executor.graph_steps > 0


# ---------------------------------------------------------------------- SentencePiece-style tokenizer
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def sentencepiece_worker(sentencepiece_checkpoint):
    """A worker whose tokenizer prepends "▁" to every encode and spells "{", '"', ":" as
    byte-fallback tokens (Llama 2 / Mistral)."""
    with serve(model=str(sentencepiece_checkpoint)) as live:
        yield httpx.Client(base_url=live.url, timeout=120)


def prefix_space_tokenizer(style: str, sentencepiece: Path, byte_level: Path, directory: Path) -> HFTokenizer:
    """A tokenizer that starts every encode with a space: the SentencePiece checkpoint's
    (``Prepend("▁")`` normalizer), it with a ``Metaspace`` pre-tokenizer instead (Mistral v0.3), and
    a ``Metaspace`` decoder too (newer conversions), or the byte-level one with ``add_prefix_space``."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    if style == "prepend":
        return HFTokenizer(str(sentencepiece))
    source = sentencepiece if style.startswith("metaspace") else byte_level
    backend = Tokenizer.from_file(str(source / "tokenizer.json"))
    if style.startswith("metaspace"):
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        # NOTE: newer conversions decode with Metaspace too (llguidance refused it)
        if style == "metaspace-decoder":
            backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    directory.mkdir()
    backend.save(str(directory / "tokenizer.json"))
    shutil.copy(source / "tokenizer_config.json", directory)
    return HFTokenizer(str(directory))


@pytest.mark.parametrize("style", ["prepend", "metaspace", "metaspace-decoder", "byte-level"])
def test_forced_text_is_tokenized_without_the_leading_space_marker(
    style, sentencepiece_checkpoint, llama_checkpoint, tmp_path
) -> None:
    """The text a grammar forces is spelt with the tokens the model writes mid-text: no leading
    space ("▁") in front, which the grammar would refuse, leaving only EOS allowed."""
    tok = prefix_space_tokenizer(style, sentencepiece_checkpoint, llama_checkpoint, tmp_path / "tok")
    assert tok.token_bytes(tok._tok.encode("Hello", add_special_tokens=False).ids[0]).startswith(b" ")
    compiler = GuideCompiler(tok, tok.vocab_size)
    # NOTE: a Metaspace decoder reads no byte-fallback piece as its byte (its models have none; this
    # one has): text only such pieces spell cannot be written
    texts = ("Hello there",) if style == "metaspace-decoder" else ("Hello there", '{"a": 1}', "Привет мир")
    for text in texts:
        m = compiler.compile(*requested_grammar({"guided_choice": [text]})).matcher()
        forced = m.compute_ff_tokens()
        assert tok.decode(forced) == text and not m.is_error()
        # the ids of the text written after other text
        newline = tok._tok.encode("\n", add_special_tokens=False).ids
        after = tok._tok.encode("\n" + text, add_special_tokens=False).ids
        assert after[: len(newline)] == newline and forced == after[len(newline) :]


SP_MESSAGES = [{"role": "user", "content": "Describe a user."}]


def test_sentencepiece_json_object_answers_are_json_objects(sentencepiece_worker) -> None:
    body = {"messages": SP_MESSAGES, "max_tokens": 150, "n": 3, "temperature": 1.0, "seed": 2,
            "response_format": {"type": "json_object"}}  # fmt: skip
    for choice in sentencepiece_worker.post("/v1/chat/completions", json=body).json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_sentencepiece_choice_answers_are_one_of_the_choices(sentencepiece_worker) -> None:
    options = ["Hello there", "Привет мир", '{"ok": true}']  # pieces, byte fallback, both
    body = {
        "prompt": "Say:",
        "max_tokens": 20,
        "n": 6,
        "temperature": 1.5,
        "seed": 4,
        "guided_choice": options,
    }
    choices = sentencepiece_worker.post("/v1/completions", json=body).json()["choices"]
    assert len(choices) == 6 and {c["text"] for c in choices} <= set(options), choices
    streamed = [""] * 6  # streamed answers: whole characters too
    with sentencepiece_worker.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed[choice["index"]] += choice["text"]
    assert set(streamed) <= set(options), streamed


def test_sentencepiece_required_tool_choice_gives_a_call(sentencepiece_worker) -> None:
    body = {"messages": SP_MESSAGES, "tools": [WEATHER_TOOL], "tool_choice": "required", "max_tokens": 150,
            "parallel_tool_calls": False, "temperature": 1.0, "seed": 6}  # fmt: skip
    choice = sentencepiece_worker.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city", "unit"}


def test_a_schema_of_chained_refs_compiles_and_a_grammar_of_too_many_rules_is_refused(tmp_path) -> None:
    """llguidance compiles along chains of references recursively: a schema of 1,000 chained $ref
    (70 KB) overflowed a thread's default stack, a SIGSEGV that killed the worker and every request in
    it. Compiles run on deep-stack threads; a grammar past MAX_GRAMMAR_RULES is a 400. (A worker
    process of its own: a crash must not take the test process with it.)"""
    from tests.support import start_module
    from worker.guided import MAX_GRAMMAR_RULES

    worker = start_module("worker", ["--model", "tiny", "--device", "cpu", "--warmup-tokens", "0",
                                     "--cpu-threads", "1"], str(tmp_path))  # fmt: skip
    try:
        defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
                          "required": ["x"]} for i in range(1000)}  # fmt: skip
        schema = {"$defs": {**defs, "d1000": {"type": "integer"}}, "$ref": "#/$defs/d0"}
        body = {"prompt": "x", "max_tokens": 8, "guided_json": schema}
        r = httpx.post(worker.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith('{"x":'), r.text
        n = MAX_GRAMMAR_RULES + 1
        chain = "start: r0\n" + "".join(f'r{i}: "t" r{i + 1}\n' for i in range(n - 2)) + f'r{n - 2}: "end"\n'
        r = httpx.post(
            worker.url + "/v1/completions", json={"prompt": "x", "guided_grammar": chain}, timeout=120
        )
        assert r.status_code == 400 and f"at most {MAX_GRAMMAR_RULES}" in r.json()["error"]["message"]
        shorter = chain.replace(f'r{n - 3}: "t" r{n - 2}\nr{n - 2}: "end"\n', f'r{n - 3}: "end"\n')
        r = httpx.post(worker.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "guided_grammar": shorter},
                       timeout=120)  # fmt: skip
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "tttt", r.text
        assert httpx.get(worker.url + "/health", timeout=10).status_code == 200
    finally:
        worker.stop()


def test_the_compiled_grammars_kept_are_bounded_by_their_text_too() -> None:
    """Kept by count (256) and by the characters of their grammars: a compiled grammar holds ~45x its
    text (a 20,000-option choice kept ~9 MB, and 256 such pinned GBs). One past the bound is compiled
    for its request and not kept; the oldest go first."""

    def choice(tag: str, n: int):
        return requested_grammar({"guided_choice": [f"{tag}{i}" for i in range(n)]})

    a, b, c = choice("a", 100), choice("b", 100), choice("c", 100)
    bound = len(a[1]) + len(b[1]) + len(c[1]) - 1  # two fit, not three
    compiler = GuideCompiler(ByteTokenizer(), ByteTokenizer().vocab_size, max_text_chars=bound)
    big = choice("big", 1000)
    assert len(big[1]) > bound and compiler.compile(*big) is not compiler.compile(*big)
    first_a, first_b = compiler.compile(*a), compiler.compile(*b)
    assert compiler.compile(*a) is first_a and compiler.compile(*b) is first_b  # both kept
    compiler.compile(*c)  # past the bound: the oldest (a) goes
    assert compiler.compile(*b) is first_b and compiler.compile(*a) is not first_a


@contextlib.contextmanager
def compile_threads_held() -> Iterator[None]:
    """Every compile thread busy (as with other requests' large schemas) until the block ends."""
    gate = threading.Event()
    held = [COMPILES.submit(gate.wait) for _ in range(COMPILE_THREADS)]
    try:
        poll(lambda: all(f.running() for f in held), "the compile threads to be held")
        yield
    finally:
        gate.set()


def test_a_kept_grammar_does_not_wait_behind_other_requests_compiles() -> None:
    compiler = GuideCompiler(ByteTokenizer(), ByteTokenizer().vocab_size)
    body = {"guided_regex": "ab|cd"}

    async def main() -> None:
        kept = await output_guide(body, compiler)
        with compile_threads_held():
            assert await asyncio.wait_for(output_guide(body, compiler), 10) is kept

    asyncio.run(main())


def test_requests_asking_for_one_new_grammar_together_share_one_compile() -> None:
    compiler = GuideCompiler(ByteTokenizer(), ByteTokenizer().vocab_size)
    body = {"guided_choice": [f"option {i}" for i in range(20000)]}  # NOTE: ~0.2 s to compile

    async def main() -> list:
        return await asyncio.gather(*(output_guide(body, compiler) for _ in range(8)))

    guides = asyncio.run(main())
    # one compile (each compile makes its own Guide), not one per free compile thread
    assert all(guide is guides[0] for guide in guides)


def test_a_client_that_leaves_while_its_grammar_waits_to_compile_is_not_served(caplog) -> None:
    metric = ("radixgate_worker_constrained_requests_total", '{kind="choice"}')
    body = {"prompt": "a", "max_tokens": 8, "guided_choice": ["left", "right", "up"]}  # a new grammar
    with serve() as live, caplog.at_level("INFO", logger="worker.server"):
        with compile_threads_held():
            with pytest.raises(httpx.TimeoutException):
                httpx.post(live.url + "/v1/completions", json=body, timeout=1.0)
            # given up while the compile threads are still busy, not compiled and generated later
            poll(lambda: "-> 499" in caplog.text, "the worker to give the request up")
        assert counter(live.url, *metric) == 0
        r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("left", "right", "up"), r.text
        assert counter(live.url, *metric) == 1
