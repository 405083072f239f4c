import pytest

from router.config import build_config


def test_precedence_defaults_yaml_env_flags(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("router:\n  port: 9000\n  policy: round_robin\n  policy_params: {balance_abs: 3}\n")
    config = build_config(["--config", str(cfg)], environ={"RADIXGATE_PORT": "9100"})
    assert (config.port, config.policy, config.policy_params) == (9100, "round_robin", {"balance_abs": 3})
    config = build_config(
        ["--config", str(cfg), "--port", "9200", "--policy-param", "balance_abs=5"], environ={}
    )
    assert config.port == 9200 and config.policy_params == {"balance_abs": 5}
    assert config.health_interval_s == 1.0  # untouched default


def test_worker_flags_both_spellings():
    config = build_config(["--workers", "http://a:1,http://b:2/", "--worker-urls", "http://c:3"], environ={})
    assert config.workers == ["http://a:1", "http://b:2", "http://c:3"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--workers", "a:1"],
        ["--block-size", "0"],
        ["--kv-events", "redis"],
        ["--policy-param", "novalue"],
        ["--prefill-tokens-per-load", "-1"],
        ["--prefill-tokens-per-load", "nan"],
        ["--kv-fetch-min-tokens", "-1"],
    ],
)
def test_bad_settings_are_errors(argv):
    with pytest.raises(ValueError):
        build_config(argv, environ={})


def test_unknown_yaml_key_is_an_error(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("polcy: cache_aware\n")
    with pytest.raises(ValueError, match="unknown setting"):
        build_config(["--config", str(cfg)], environ={})


def test_shipped_example_config_loads():
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "router.yaml")
    config = build_config(["--config", path], environ={})
    assert config.policy == "cache_aware" and len(config.workers) == 2


def test_prefill_weight_reaches_every_worker_load():
    from router.circuit_breaker import CircuitBreaker
    from router.workers import WorkerRegistry

    config = build_config(["--prefill-tokens-per-load", "100"], environ={})
    assert config.prefill_tokens_per_load == 100.0
    assert build_config([], environ={}).prefill_tokens_per_load == 256.0
    registry = WorkerRegistry(CircuitBreaker, config.prefill_tokens_per_load)
    w = registry.add("http://a:1")
    w.in_flight, w.pending_prefill = 2, 250
    assert w.load == pytest.approx(4.5)  # 2 requests + 250 unanswered prefill tokens / 100
    w.apply_report(5.0, 250.0)  # 3 more requests than ours there: other routers'
    assert w.load == pytest.approx(7.5)
    off = WorkerRegistry(CircuitBreaker, 0.0).add("http://b:1")
    off.in_flight, off.pending_prefill = 2, 250
    assert off.load == 2.0
    with pytest.raises(ValueError):
        WorkerRegistry(CircuitBreaker, -1.0)


def test_replica_sync_settings_are_checked():
    assert build_config(["--redis-url", "redis://r:6379/0"], environ={}).replica_sync == "auto"
    with pytest.raises(ValueError, match="needs redis_url"):
        build_config(["--replica-sync", "on"], environ={})
    with pytest.raises(ValueError, match="TCP Redis URL"):
        build_config(["--redis-url", "unix:///tmp/redis.sock"], environ={})
    off = build_config(["--redis-url", "unix:///tmp/redis.sock", "--replica-sync", "off"], environ={})
    assert off.replica_sync == "off"
    with pytest.raises(ValueError):
        build_config([], environ={"RADIXGATE_REPLICA_SYNC_HEARTBEAT_S": "0"})


def test_stream_usage_reads_from_flags_env_and_yaml(tmp_path):
    assert build_config([], environ={}).stream_usage is True
    assert build_config(["--no-stream-usage"], environ={}).stream_usage is False
    assert build_config([], environ={"RADIXGATE_STREAM_USAGE": "off"}).stream_usage is False
    cfg = tmp_path / "r.yaml"
    cfg.write_text("stream_usage: false\n")
    assert build_config(["--config", str(cfg), "--stream-usage"], environ={}).stream_usage is True
    assert build_config(["--config", str(cfg)], environ={}).stream_usage is False
    with pytest.raises(ValueError):
        build_config([], environ={"RADIXGATE_STREAM_USAGE": "maybe"})
