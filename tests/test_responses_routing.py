"""/v1/responses through the router, real processes on loopback (simulated workers): a new
conversation is routed by its prompt; previous_response_id goes to the worker that holds the
conversation, known by its registered or advertised URL, with no shared state between routers;
stream usage reaches the hit-rate metrics; retrieve and delete reach the same worker."""

from __future__ import annotations

import httpx
import pytest

from tests.support import REDIS, wait_until
from tests.test_router_integration import metric_values

INSTRUCTIONS = "You are the radixgate routing test assistant. Keep answers short. " * 12


def _alias(url: str) -> str:
    """The same worker under another name than it advertises."""
    return url.replace("127.0.0.1", "localhost")


def _create(router_url: str, **body) -> httpx.Response:
    return httpx.post(
        router_url + "/v1/responses", json={"model": "sim-8b", "max_output_tokens": 4, **body}, timeout=30
    )


def test_follow_ups_reach_the_worker_holding_the_conversation_through_any_router(launch) -> None:
    workers = [launch.sim_worker() for _ in range(3)]
    urls = [_alias(w.url) for w in workers]  # NOTE: tags must also resolve through advertised URLs
    routers = [launch.router(urls, "--policy", "round_robin") for _ in range(2)]
    first = _create(routers[0].url, instructions=INSTRUCTIONS, input="Turn one.")
    assert first.status_code == 200
    holder = first.headers["x-radixgate-worker"]
    previous = first.json()["id"]
    # /debug/route reads a Responses body as routing does: a follow-up goes to its holder
    follow_up = {"model": "sim-8b", "input": "Turn two.", "previous_response_id": previous}
    explained = httpx.post(routers[1].url + "/debug/route", json=follow_up, timeout=10)
    assert explained.status_code == 200, explained.text
    assert explained.json()["worker"] == holder
    assert explained.json()["reason"] == "holds the conversation of previous_response_id"
    fresh = {"model": "sim-8b", "instructions": INSTRUCTIONS, "input": "Another conversation."}
    assert httpx.post(routers[1].url + "/debug/route", json=fresh, timeout=10).json()["prompt_tokens"] > 0
    for turn in range(4):  # round robin would spread these; each must land on the holder
        router = routers[turn % 2]
        r = _create(router.url, input=f"Turn {turn + 2}.", previous_response_id=previous)
        assert r.status_code == 200, r.text
        assert r.headers["x-radixgate-worker"] == holder
        assert r.json()["previous_response_id"] == previous
        previous = r.json()["id"]
    got = httpx.get(f"{routers[1].url}/v1/responses/{previous}", timeout=10)
    assert (
        got.status_code == 200
        and got.json()["id"] == previous
        and got.headers["x-radixgate-worker"] == holder
    )
    # its input items too, the query passed on
    items = httpx.get(f"{routers[0].url}/v1/responses/{previous}/input_items?limit=1&order=asc", timeout=10)
    assert items.status_code == 200 and items.headers["x-radixgate-worker"] == holder, items.text
    (item,) = items.json()["data"]
    assert item["role"] == "user" and item["content"] == [{"type": "input_text", "text": "Turn 5."}]
    assert httpx.delete(f"{routers[0].url}/v1/responses/{previous}", timeout=10).json()["deleted"] is True
    gone = _create(routers[0].url, input="More.", previous_response_id=previous)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"


def test_a_new_conversation_is_routed_by_its_prompt_and_streams_report_usage(launch) -> None:
    workers = [launch.sim_worker() for _ in range(2)]
    router = launch.router([w.url for w in workers])  # cache_aware
    served = set()
    for i in range(4):
        with httpx.stream("POST", router.url + "/v1/responses", timeout=30,
                          json={"model": "sim-8b", "instructions": INSTRUCTIONS, "input": f"Question {i}",
                                "max_output_tokens": 4, "stream": True}) as r:  # fmt: skip
            assert r.status_code == 200
            served.add(r.headers["x-radixgate-worker"])
            kinds = [line[len("event: ") :] for line in r.iter_lines() if line.startswith("event: ")]
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert len(served) == 1  # one shared instructions prefix: one worker holds it
    text = httpx.get(router.url + "/metrics").text
    cached = sum(metric_values(text, "radixgate_upstream_cached_tokens_total").values())
    prompt = sum(metric_values(text, "radixgate_upstream_usage_prompt_tokens_total").values())
    assert (
        prompt > 4 * len(INSTRUCTIONS) // 2 and cached > len(INSTRUCTIONS) // 2
    )  # read from response.completed
    assert (
        sum(metric_values(text, 'radixgate_requests_total{endpoint="responses",status="200"}').values()) == 4
    )


def test_follow_ups_stay_out_of_both_hit_rates(launch) -> None:
    """A follow-up's prompt is the conversation its worker holds: the router counts none of it
    (prompt tokens, predicted), so the worker's usage of it stays out of the actual hit rate too;
    the two rates cover the same requests (the actual one read 0.82 against 0.02 predicted)."""
    router = launch.router([launch.sim_worker().url])
    names = ["radixgate_upstream_prompt_tokens_total", "radixgate_upstream_predicted_cached_tokens_total",
             "radixgate_upstream_usage_prompt_tokens_total", "radixgate_upstream_cached_tokens_total"]  # fmt: skip

    def counters() -> list[float]:
        text = httpx.get(router.url + "/metrics", timeout=10).text
        return [sum(metric_values(text, name).values()) for name in names]

    first = _create(router.url, instructions=INSTRUCTIONS, input="Turn one.")
    assert first.status_code == 200
    before = counters()
    assert before[0] > len(INSTRUCTIONS) // 2 and before[2] > len(INSTRUCTIONS) // 2
    previous = first.json()["id"]
    for stream in (False, True):
        r = _create(router.url, input="Next.", previous_response_id=previous, stream=stream)
        assert r.status_code == 200
        if not stream:
            assert r.json()["usage"]["input_tokens"] > 0  # the worker reports its usage all the same
            previous = r.json()["id"]
    assert counters() == before


BAD_BODIES = [  # (body, status, error code)
    # ids naming no registered worker go to one chosen by load, which does not hold them
    ({"input": "x", "previous_response_id": "resp_notours"}, 404, "response_not_found"),
    ({"input": "x", "previous_response_id": "resp_00000000001234"}, 404, "response_not_found"),
    ({"input": "x", "previous_response_id": 7}, 400, "invalid_type"),
    ({"input": [{"type": "function_call_output"}]}, 400, "invalid_request"),
    ({"input": ""}, 400, "invalid_request"),
]


def test_bad_follow_ups_and_inputs_get_clear_errors(launch) -> None:
    """Each bad body gets its status and error code, and the router serves the next good one."""
    router = launch.router([launch.sim_worker().url])
    for body, status, code in BAD_BODIES:
        r = _create(router.url, **body)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), body
        assert _create(router.url, input="fine").status_code == 200, body


def test_a_follow_up_whose_worker_is_down_is_503_not_sent_elsewhere(launch) -> None:
    a, b = launch.sim_worker(), launch.sim_worker()
    router = launch.router([a.url, b.url], "--policy", "round_robin", "--health-interval-s", "0.2")
    first = _create(router.url, input="Hello.")
    holder = a if first.headers["x-radixgate-worker"] == a.url else b
    holder.stop()
    wait_until(lambda: not next(w for w in httpx.get(router.url + "/workers").json()["workers"]
                                if w["url"] == holder.url)["healthy"], 15, what="holder marked down")  # fmt: skip
    r = _create(router.url, input="Still there?", previous_response_id=first.json()["id"])
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable"
    for method in ("GET", "DELETE"):  # retrieve and delete: the same answer, not sent elsewhere
        r = httpx.request(method, f"{router.url}/v1/responses/{first.json()['id']}", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text


def test_a_follow_up_whose_worker_just_died_is_503_before_a_health_check_tells(launch) -> None:
    """The holder stopped; no health check has run since (one a minute). The follow-up, and the
    stored response's GET / DELETE, fail to reach it: the same 503 as once a check has told (they
    were 502 connect, and 504 unresponsive for a hung holder, by when the client asked)."""
    a, b = launch.sim_worker(), launch.sim_worker()
    router = launch.router([a.url, b.url], "--policy", "round_robin", "--health-interval-s", "60")
    first = _create(router.url, input="Hello.")
    holder = a if first.headers["x-radixgate-worker"] == a.url else b
    holder.stop()
    r = _create(router.url, input="Still there?", previous_response_id=first.json()["id"])
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{router.url}/v1/responses/{first.json()['id']}", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text
    assert _create(router.url, input="A new conversation.").status_code == 200


def test_a_client_key_reaches_workers_that_check_it_on_every_endpoint(launch) -> None:
    """No --worker-api-key: the client's key is passed on (as to vLLM's --api-key), also on
    retrieve / delete and /tokenize, which go to one worker without being routed."""
    worker = launch.sim_worker("--api-key", "shared")
    router = launch.router([worker.url], "--api-key", "shared")
    key = {"authorization": "Bearer shared"}
    created = httpx.post(router.url + "/v1/responses", headers=key, timeout=30,
                         json={"model": "sim-8b", "max_output_tokens": 4, "input": "Keyed."})  # fmt: skip
    assert created.status_code == 200, created.text
    rid = created.json()["id"]
    got = httpx.get(f"{router.url}/v1/responses/{rid}", headers=key, timeout=10)
    assert got.status_code == 200 and got.json()["id"] == rid
    tokens = httpx.post(router.url + "/tokenize", json={"prompt": "four"}, headers=key, timeout=10)
    assert tokens.status_code == 200 and tokens.json()["count"] == 4
    assert httpx.delete(f"{router.url}/v1/responses/{rid}", headers=key, timeout=10).json()["deleted"] is True
    # with keys but no admin token, nobody may add a worker (it would be sent the clients' prompts)
    for headers in ({}, key):
        added = httpx.post(router.url + "/workers", params={"url": "http://127.0.0.1:9"}, headers=headers)
        assert added.status_code == 403 and added.json()["error"]["code"] == "admin_token_required"
        assert added.json()["error"]["type"] == "invalid_request_error"  # a client's error, not the server's
    assert [w["url"] for w in httpx.get(router.url + "/workers", headers=key).json()["workers"]] == [
        worker.url
    ]
    assert httpx.get(router.url + "/workers").status_code == 401  # no key: no view of the fleet


@pytest.mark.redis
def test_kv_events_of_a_worker_known_by_another_name_reach_the_index(launch) -> None:
    if REDIS is None:
        pytest.skip("redis-server not installed")
    redis_url = launch.redis()
    worker = launch.sim_worker("--redis-url", redis_url)
    alias = _alias(worker.url)
    router = launch.router([alias], "--kv-events", "redis", "--redis-url", redis_url)
    body = {
        "model": "sim-8b",
        "messages": [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "q"}],
    }

    def matched() -> int:
        decision = httpx.post(router.url + "/debug/route", json=body, timeout=10).json()
        return next(c["matched_tokens"] for c in decision["candidates"] if c["url"] == alias)

    wait_until(lambda: "radixgate_upstream_kv_resyncs_total" in httpx.get(router.url + "/metrics").text
               and matched() == 0, 15, what="router subscribed")  # fmt: skip
    assert (
        httpx.post(
            worker.url + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=30
        ).status_code
        == 200
    )
    wait_until(lambda: matched() >= len(INSTRUCTIONS) // 2, 15, what="stored event applied under the alias")
    batches = metric_values(
        httpx.get(router.url + "/metrics").text, "radixgate_upstream_kv_event_batches_total"
    )
    assert batches[f'{{worker="{alias}"}}'] >= 1


def test_a_follow_up_naming_a_model_its_holder_does_not_serve_is_404_not_503(launch) -> None:
    """The holder is up; it serves another model than the follow-up names: the client's error (a
    503 would be retried for good)."""
    holder = launch.module("worker", "--engine", "sim", "--model", "sim-8b")
    other = launch.module("worker", "--engine", "sim", "--model", "sim-70b")
    router = launch.router([holder.url, other.url])
    first = _create(router.url, model="sim-8b", input="Hello.")
    assert first.status_code == 200 and first.headers["x-radixgate-worker"] == holder.url
    r = _create(router.url, model="sim-70b", input="And?", previous_response_id=first.json()["id"])
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_a_stored_response_is_asked_for_by_the_id_the_client_sent(launch) -> None:
    """Retrieve and delete pass the id on as it is: an id of '..' or one with a '%' in it names
    that id at the worker (404 response_not_found), not another path or another id."""
    worker = launch.sim_worker()
    router = launch.router([worker.url])
    for sent, named in (("%2e%2e", ".."), ("resp_%2541", "resp_%41"), ("resp_a%3Fb", "resp_a?b")):
        for method in ("GET", "DELETE"):
            r = httpx.request(method, f"{router.url}/v1/responses/{sent}", timeout=10)
            assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", (sent, r.text)
            assert repr(named) in r.json()["error"]["message"], (sent, r.text)
