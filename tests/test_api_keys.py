"""Client API keys with names and per-key rate limits: a key over its requests per minute gets 429
with Retry-After while other keys go on; names, never keys, reach metrics and the access log."""

from __future__ import annotations

import json

import httpx
import pytest

from router.api_keys import APIKeys, key_names
from router.config import build_config
from router.errors import RouterError

from .test_router_integration import chat, metric_values


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_keys_may_be_named_and_checks_return_the_name():
    assert key_names(["team-a:sk-1", "sk-2", "b_2:x:y"]) == [
        ("team-a", "sk-1"),
        ("key-1", "sk-2"),
        ("b_2", "x:y"),
    ]
    keys = APIKeys(["team-a:sk-1", "sk-2"])
    assert keys.check("Bearer sk-1") == "team-a" and keys.check("Bearer sk-2") == "key-1"
    # NOTE: the scheme in any case (RFC 9110), spaces around the token ignored
    assert keys.check("bearer sk-1") == "team-a" and keys.check(" BEARER  sk-2 ") == "key-1"
    for bad in (
        None,
        "",
        "Bearer",
        "Bearer ",
        "Bearer team-a:sk-1",
        "sk-1",
        "Bearer sk-3",
        "Basic sk-1",
        "Bearersk-1",
    ):
        with pytest.raises(RouterError) as err:
            keys.check(bad)
        assert err.value.status == 401
    assert APIKeys([]).check(None) is None
    assert APIKeys([" team-b:sk-4\n"]).check("Bearer sk-4") == "team-b"  # e.g. a Secret's trailing newline
    for empty in ([""], ["ok", " "]):
        with pytest.raises(ValueError, match="is empty"):
            APIKeys(empty)
    # one name for two keys (a rotation: the old and the new) is one client; a name an unnamed key
    # has by its place is a mistake (two clients counted and limited as one)
    assert key_names(["team-a:old", "team-a:new"]) == [("team-a", "old"), ("team-a", "new")]
    assert APIKeys(["team-a:old", "team-a:new"]).check("Bearer new") == "team-a"
    with pytest.raises(ValueError, match="'key-1' is given to a key"):
        key_names(["key-1:aaa", "bbb"])
    # one secret under two names: its requests would count under one only (the other's limit void)
    for keys in (["batch:sk-same", "team:sk-same"], ["batch:sk-same", "sk-same"]):
        with pytest.raises(ValueError, match="has the secret of key 0 under another name"):
            key_names(keys)
    assert key_names(["team:sk-same", "team:sk-same"]) == [("team", "sk-same")] * 2  # one name: harmless


def test_a_limit_allows_a_minutes_requests_then_refills_continuously():
    clock = Clock()
    keys = APIKeys(["a:ka", "b:kb"], {"a": {"requests_per_minute": 3}}, clock=clock)
    for _ in range(3):
        keys.admit("a")
    with pytest.raises(RouterError) as err:
        keys.admit("a")
    assert err.value.status == 429 and err.value.code == "rate_limit_exceeded" and err.value.retry_after == 20
    for _ in range(10):
        keys.admit("b")  # no limit on b
    clock.t += 19.0
    with pytest.raises(RouterError):
        keys.admit("a")  # 0.95 of a request refilled
    clock.t += 1.0
    keys.admit("a")
    clock.t += 3600.0
    for _ in range(3):  # the bucket holds at most a minute's requests
        keys.admit("a")
    with pytest.raises(RouterError):
        keys.admit("a")


def test_a_limit_below_one_a_minute_spaces_single_requests_out():
    clock = Clock()
    keys = APIKeys(["a:ka"], {"a": {"requests_per_minute": 0.5}}, clock=clock)
    keys.admit("a")  # one request at once, as for any limit
    with pytest.raises(RouterError) as err:
        keys.admit("a")
    assert err.value.status == 429 and err.value.retry_after == 120  # 0.5 a minute: one per 2 minutes
    clock.t += 119.0
    with pytest.raises(RouterError) as err:
        keys.admit("a")
    assert err.value.retry_after == 1
    clock.t += 1.0
    keys.admit("a")
    clock.t += 3600.0
    keys.admit("a")  # never more than one at once
    with pytest.raises(RouterError):
        keys.admit("a")


@pytest.mark.parametrize(
    ("limits", "words"),
    [
        ({"nobody": {"requests_per_minute": 5}}, "no API key is named 'nobody'"),
        ({"a": {"requests_per_minute": 0}}, "api_key_limits.a"),
        ({"a": {"requests_per_minute": True}}, "api_key_limits.a"),
        ({"a": {"rpm": 5}}, "api_key_limits.a"),
        ({"a": 5}, "api_key_limits.a"),
    ],
)
def test_bad_limits_are_errors_at_start(tmp_path, limits, words):
    config = tmp_path / "router.yaml"
    config.write_text(json.dumps({"api_keys": ["a:ka"], "api_key_limits": limits}))
    with pytest.raises(ValueError, match=words):
        build_config(["--workers", "http://w:1", "--config", str(config)], environ={})


def test_a_key_over_its_limit_gets_429_and_the_others_go_on(launch, tmp_path):
    backend = launch.echo_backend()
    config = tmp_path / "router.yaml"
    config.write_text(json.dumps({"api_key_limits": {"batch": {"requests_per_minute": 2}}}))
    router = launch.router([backend.url], "--config", str(config), "--api-key", "batch:sk-batch",
                           "--api-key", "sk-interactive", "--access-log")  # fmt: skip

    def ask(key: str) -> httpx.Response:
        return httpx.post(router.url + "/v1/chat/completions", json=chat("Rate me"),
                          headers={"authorization": f"Bearer {key}"}, timeout=10)  # fmt: skip

    assert [ask("sk-batch").status_code for _ in range(2)] == [200, 200]
    over = ask("sk-batch")
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(over.headers["retry-after"]) <= 30 and "'batch'" in over.json()["error"]["message"]
    assert [ask("sk-interactive").status_code for _ in range(4)] == [200] * 4
    counted = metric_values(httpx.get(router.url + "/metrics").text, "radixgate_api_key_requests_total")
    assert counted == {
        '{key="batch",outcome="admitted"}': 2,
        '{key="batch",outcome="rate_limited"}': 1,
        '{key="key-1",outcome="admitted"}': 4,
    }
    log = router.log()
    assert '"api_key":"batch"' in log and "sk-batch" not in log and "sk-interactive" not in log
