"""Mooncake trace replay: shared hash ids become shared text prefixes; limits and scaling hold."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from loadtest.responses_client import responses_body
from loadtest.trace import TraceRecord, block_text, load_trace, read_trace, trace_requests
from loadtest.workloads import prompt_text

REAL_TRACE = Path("/work/shared/traces/mooncake_synthetic.jsonl")
ROWS = [
    {"timestamp": 1000, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1100, "output_length": 300, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [4, 5]},
    {"timestamp": 4000, "input_length": 2048, "output_length": 7, "hash_ids": [0, 6, 7, 8]},
]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in ROWS) + b"\n\n")
    return path


def test_shared_leading_ids_are_shared_text_prefixes(trace_file):
    reqs = load_trace(trace_file, block_chars=64)
    texts = [prompt_text(r.body) for r in reqs]
    n = len("<user>")
    assert [len(t) - n for t in texts] == [
        1500 * 64 // 512,
        1100 * 64 // 512,
        600 * 64 // 512,
        2048 * 64 // 512,
    ]
    assert _common_prefix(texts[0], texts[1]) - n == pytest.approx(2 * 64, abs=2)  # ids 0, 1
    assert _common_prefix(texts[0], texts[3]) - n == pytest.approx(64, abs=2)  # id 0
    assert _common_prefix(texts[0], texts[2]) - n < 10  # nothing shared
    assert reqs[0].body["messages"][0]["content"].startswith(block_text(0, 64) + block_text(1, 64))


def test_replay_is_deterministic_and_seeded(trace_file):
    assert load_trace(trace_file, block_chars=32) == load_trace(trace_file, block_chars=32)
    assert load_trace(trace_file, block_chars=32, seed=1) != load_trace(trace_file, block_chars=32)


def test_a_responses_replay_sends_the_chat_replay_prompts(trace_file):
    """--api responses: the same bodies as chat, which the driver sends as a Responses input."""
    chat = load_trace(trace_file, block_chars=32)
    responses = load_trace(trace_file, block_chars=32, api="responses")
    assert [r.body for r in responses] == [r.body for r in chat]
    sent = responses_body(responses[0].body, responses[0].body, None)
    assert sent["input"] == chat[0].body["messages"] and sent["max_output_tokens"] == 20


def test_time_scale_limit_and_output_lengths(trace_file):
    reqs = load_trace(trace_file, time_scale=0.5, limit=3, max_tokens=100, block_chars=16)
    assert len(reqs) == 3
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 1.0]  # (ms - first ms) / 1000 * 0.5
    assert [r.body["max_tokens"] for r in reqs] == [20, 100, 5]


def test_a_trace_out_of_time_order_keeps_its_gaps():
    records = [TraceRecord(t, 512, 4, [k]) for k, t in enumerate((5000.0, 3000.0, 7000.0))]
    assert [r.arrival_s for r in trace_requests(records, time_scale=0.5)] == [1.0, 0.0, 2.0]


@pytest.mark.parametrize("scale", [-1.0, float("nan"), float("inf")])
def test_a_time_scale_that_gives_no_arrival_times_is_refused(trace_file, scale):
    with pytest.raises(ValueError, match="time_scale >= 0 and finite"):
        load_trace(trace_file, time_scale=scale)


def test_max_input_tokens_truncates_and_keeps_prefix(trace_file):
    full = load_trace(trace_file, block_chars=64, api="completions")
    cut = load_trace(trace_file, block_chars=64, api="completions", max_input_tokens=700)
    assert [len(r.body["prompt"]) for r in cut] == [700 * 64 // 512, 700 * 64 // 512, 600 * 64 // 512, 87]
    assert all(f.body["prompt"].startswith(c.body["prompt"]) for f, c in zip(full, cut, strict=True))


def test_bad_line_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n'
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_trace(path)


def test_record_longer_than_its_ids_gets_a_private_tail():
    recs = [TraceRecord(0.0, 100, 1, [9]), TraceRecord(5.0, 100, 1, [9])]
    a, b = (r.body["messages"][0]["content"] for r in trace_requests(recs, block_tokens=50))
    assert len(a) == len(b) == 100 and a[:50] == b[:50] and a[50:] != b[50:]


@pytest.mark.skipif(not REAL_TRACE.exists(), reason="development trace not present")
def test_real_trace_prefix_sharing_follows_hash_ids():
    recs = read_trace(REAL_TRACE, limit=300)
    reqs = trace_requests(recs, block_chars=8)
    seen: dict[int, str] = {}
    for rec, req in zip(recs, reqs, strict=True):
        text = req.body["messages"][0]["content"]
        assert len(text) == max(1, rec.input_length * 8 // 512)  # never an empty prompt
        if rec.hash_ids[0] in seen and len(text) >= 8:
            assert seen[rec.hash_ids[0]][:8] == text[:8]
        seen.setdefault(rec.hash_ids[0], text)
    assert reqs[-1].arrival_s == (recs[-1].timestamp_ms - recs[0].timestamp_ms) / 1000.0
