"""A worker's load in the router: our own requests and prefill counted live, plus what the last
health report showed beyond them (other router replicas' work)."""

import pytest

from router.circuit_breaker import CircuitBreaker
from router.workers import PendingPrefill, WorkerRegistry


def worker(prefill_tokens_per_load: float = 100.0):
    return WorkerRegistry(CircuitBreaker, prefill_tokens_per_load).add("http://w:1")


def test_a_report_adds_only_what_exceeds_our_own_count():
    w = worker()
    w.in_flight = 2
    w.apply_report(5, 0)
    assert (w.others_queue, w.load) == (3.0, 5.0)
    w.apply_report(1, 0)  # the worker has not seen all of ours yet: nobody else's work
    assert (w.others_queue, w.load) == (0.0, 2.0)


def test_our_own_sends_raise_the_load_between_reports():
    w = worker()
    w.apply_report(10, 0)  # other routers keep 10 requests there
    loads = []
    for _ in range(3):
        w.in_flight += 1
        loads.append(w.load)
    assert loads == [11.0, 12.0, 13.0]  # max(ours, reported) would have stayed at 10 all along
    w.in_flight -= 3
    assert w.load == 10.0  # others' part stays until the next report
    w.apply_report(0, 0)
    assert w.load == 0.0


def test_reported_prefill_backlog_beyond_our_pending_counts_in_request_units():
    w = worker(prefill_tokens_per_load=100)
    w.in_flight = 1
    pending = PendingPrefill(w, 250)
    w.apply_report(1, 1250)  # another router sent 1,000 prompt tokens to prefill here
    assert w.others_prefill == 1000.0
    assert w.load == pytest.approx(1 + (250 + 1000) / 100)
    w.apply_report(1, 100)  # less than ours at report time: only our own part remains
    assert w.others_prefill == 0.0 and w.load == pytest.approx(1 + 250 / 100)
    w.apply_report(1, 1250)
    pending.release()  # our request's first byte: its prefill leaves the load, others' stays
    assert w.load == pytest.approx(1 + 1000 / 100)


def test_without_a_prefill_weight_reported_backlog_adds_nothing():
    w = worker(prefill_tokens_per_load=0)
    w.apply_report(3, 50_000)
    assert w.load == 3.0 and w.reported_prefill == 50_000


@pytest.mark.parametrize(
    ("value", "read"),
    [(3, 3.0), (2.5, 2.5), (None, 0.0), ("7", 0.0), (True, 0.0), (-4, 0.0), ([1], 0.0), (float("nan"), 0.0)],
)
def test_a_health_report_value_that_is_not_a_count_reads_as_zero(value, read):
    from router.health import _number

    assert _number(value) == read


@pytest.mark.parametrize(
    ("body", "chat", "sequences"),
    [
        (b'{"prompt": "a"}', False, 1),
        (b'{"prompt": "a", "n": 4}', False, 4),
        (b'{"prompt": ["a", "b", "c"], "n": 2}', False, 6),
        (b'{"prompt": [[1, 2], [3]]}', False, 2),
        (b'{"prompt": [1, 2, 3], "n": 2}', False, 2),  # one prompt of token ids
        (b'{"prompt": "a", "n": "many"}', False, 1),  # the worker answers 400; counted as one
        (b'{"messages": [{"role": "user", "content": "a"}], "n": 3}', True, 3),
    ],
)
def test_a_request_counts_as_the_sequences_the_worker_will_run(body, chat, sequences):
    from router.request_parsing import parse_request
    from router.tokenization import ByteTokenizer

    assert parse_request(body, chat, ByteTokenizer()).sequences == sequences


@pytest.mark.parametrize(
    ("body", "others"),
    [(b'{"prompt": "abc"}', 0), (b'{"prompt": ["abc", "de", "\xc3\xa9"]}', 4), (b'{"prompt": [[1, 2], [3, 4, 5]]}', 3),
     (b'{"prompt": [[1, 2], 7]}', 0), (b'{"prompt": [1, 2, 3]}', 0),
     # a batch mixing strings and ids, in either order (the worker serves both; a string first was a 400)
     (b'{"prompt": ["abc", [1, 2, 3, 4]]}', 4), (b'{"prompt": [[1, 2], "abcd"]}', 4)],
)  # fmt: skip
def test_a_batch_counts_its_other_prompts_as_uncached_prefill(body, others):
    from router.request_parsing import parse_request
    from router.tokenization import ByteTokenizer

    assert parse_request(body, False, ByteTokenizer()).other_prompt_tokens == others


def test_a_worker_is_too_small_for_a_prompt_only_when_it_counts_tokens_as_the_router_does():
    registry = WorkerRegistry(CircuitBreaker)
    w = registry.add("http://w:1")
    w.max_model_len = {"m": 2048}
    assert not w.too_small("m", 5000, "bytes")  # another backend: its count is not ours
    w.cache_info = {"tokenizer": "hf:llama"}
    assert not w.too_small("m", 5000, "bytes")
    w.cache_info = {"tokenizer": "bytes"}
    assert (w.too_small("m", 2047, "bytes"), w.too_small("m", 2048, "bytes")) == (False, True)  # + 1 output
    assert w.too_small(None, 2048, "bytes") and not w.too_small("other", 5000, "bytes")
    w.max_model_len = {"m": 2048, "m-lora": 2048}
    assert not w.too_small(None, 5000, "bytes")  # which of its models is meant is unknown
    w.parents = {"m-lora": "m"}
    assert w.too_small(None, 5000, "bytes")  # its base model: the adapter is named when meant


def test_the_shortest_context_is_computed_again_after_a_change():
    registry = WorkerRegistry(CircuitBreaker)
    a, b = registry.add("http://a:1"), registry.add("http://b:1")
    assert registry.shortest_context() == float("inf")
    a.max_model_len, b.max_model_len = {"m": 4096}, {"m": 8192, "n": 1024}
    registry.served_changed()
    assert registry.shortest_context() == 1024
    registry.remove(b.url)
    assert registry.shortest_context() == 4096
