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
    [["--workers", "a:1"], ["--block-size", "0"], ["--kv-events", "redis"], ["--policy-param", "novalue"]],
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
