import dataclasses
import logging
import os
import re
import subprocess
import sys

import pytest

from router.config import RouterConfig, build_config, build_parser
from router.http_client import worker_base_url
from tests.support import free_port


def test_precedence_defaults_yaml_env_flags(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("router:\n  port: 9000\n  policy: least_load\n  policy_params: {seed: 3}\n")
    config = build_config(["--config", str(cfg)], environ={"RADIXGATE_PORT": "9100"})
    assert (config.port, config.policy, config.policy_params) == (9100, "least_load", {"seed": 3})
    config = build_config(["--config", str(cfg), "--port", "9200", "--policy-param", "seed=5"], environ={})
    assert config.port == 9200 and config.policy_params == {"seed": 5}
    assert config.health_interval_s == 1.0  # untouched default


def test_an_env_name_no_setting_has_is_named_in_a_warning(caplog):
    """A typo such as RADIXGATE_API_KEY (the setting is RADIXGATE_API_KEYS) would leave the key check off
    unseen; the worker's and the test suite's names are not the router's to judge."""
    environ = {"RADIXGATE_API_KEY": "k", "RADIXGATE_PORTT": "1", "RADIXGATE_WORKER_PORT": "2",
               "RADIXGATE_TEST_FORK": "0", "RADIXGATE_FULL_TESTS": "1", "RADIXGATE_PORT": "9100"}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="radixgate.router"):
        config = build_config([], environ=environ)
    assert config.port == 9100 and config.api_keys == []
    assert [r.getMessage() for r in caplog.records] == [
        "env RADIXGATE_API_KEY is not a router setting: ignored (did you mean RADIXGATE_API_KEYS?)",
        "env RADIXGATE_PORTT is not a router setting: ignored (did you mean RADIXGATE_PORT?)",
    ]


def test_a_policy_chosen_above_the_yaml_leaves_out_the_yamls_params_for_another_policy():
    """The README's example (RADIXGATE_POLICY=round_robin over configs/router.yaml) was a start-up
    error: the file's cache_aware params went with the policy the environment chose."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "router.yaml")
    config = build_config(["--config", path], environ={"RADIXGATE_POLICY": "round_robin"})
    assert config.policy == "round_robin" and config.policy_params == {}
    config = build_config(
        ["--config", path, "--policy", "prefix_hash", "--policy-param", "vnodes=64"], environ={}
    )
    assert config.policy == "prefix_hash" and config.policy_params == {
        "vnodes": 64
    }  # the flag's own are kept
    both = build_config(["--config", path, "--policy-param", "balance_abs=5"], environ={})  # onto the file's
    assert both.policy_params == {
        **build_config(["--config", path], environ={}).policy_params,
        "balance_abs": 5,
    }
    kept = build_config(["--config", path, "--policy", "cache_aware"], environ={})
    assert kept.policy_params == build_config(["--config", path], environ={}).policy_params != {}


@pytest.mark.parametrize("key", ["worker_model", "k8s_namespace", "host", "log_level"])
def test_a_list_or_mapping_for_a_text_setting_is_an_error(tmp_path, key):
    """A YAML list became the setting's text (``['tiny']``: the launched workers failed to start)."""
    cfg = tmp_path / "r.yaml"
    for value in ("[tiny]", "{a: 1}"):
        cfg.write_text(f"{key}: {value}\n")
        with pytest.raises(ValueError, match=f"bad value for {key}"):
            build_config(["--config", str(cfg)], environ={})


def test_worker_flags_both_spellings():
    config = build_config(["--workers", "http://a:1,http://b:2/", "--worker-urls", "http://c:3"], environ={})
    assert config.workers == ["http://a:1", "http://b:2", "http://c:3"]


def test_a_worker_listed_under_two_spellings_is_one_worker():
    config = build_config(
        ["--workers", "http://A:1,http://a:01/,http://b:80", "--worker-urls", "http://b"], environ={}
    )
    assert config.workers == ["http://a:1", "http://b"]


@pytest.mark.parametrize(
    "given, base",
    [
        ("http://W1.Example:08000/", "http://w1.example:8000"),
        ("HTTPS://H:443", "https://h"),  # a scheme is case-insensitive too
        ("http://w1.example:8000", "http://w1.example:8000"),
        ("http://h:80/", "http://h"),
        ("https://h:443/v1/", "https://h/v1"),
        ("https://h:80", "https://h:80"),
        ("http://[::1]:09000", "http://[::1]:9000"),
        ("http://h:/", "http://h"),
    ],
)
def test_a_worker_url_has_one_spelling(given, base):
    assert worker_base_url(given) == base


@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_a_port_out_of_range_is_named_so_whichever_end(port):
    with pytest.raises(ValueError, match=r"port is out of range 1-65535$"):
        worker_base_url(f"http://h:{port}")


@pytest.mark.parametrize(
    "argv",
    [
        ["--workers", "a:1"],
        ["--workers", "http://a:99999"],
        ["--workers", "http://a:0"],
        ["--workers", "http://a:1?"],
        ["--workers", "http://a..b:80"],
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


# ------------------------------------------------------------------ start-up errors, from the real CLI
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_router(*args: str) -> subprocess.CompletedProcess:
    """``python -m router ARGS`` as an operator runs it (no RADIXGATE_* from the test's environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXGATE_")}
    env["PYTHONPATH"] = ROOT
    argv = [sys.executable, "-m", "router", "--port", str(free_port()), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)


@pytest.mark.parametrize(
    ("yaml_text", "args", "words"),
    [
        ("router:\n  port: [8000\n", [], "not valid YAML"),
        (None, ["--policy-param", "bogus=1"], "bogus"),
        (None, ["--policy-param", "balance_abs=abc"], "balance_abs"),
        (None, ["--policy", "prefix_hash", "--policy-param", "vnodes=many"], "vnodes"),
        ("policy_params: {balance_abs: abc}\n", [], "balance_abs"),
        (None, ["--tokenizer", "/nonexistent"], "tokenizer"),
        (None, ["--log-level", "bogus"], "log_level"),
        ("router:\n", [], "router: section"),
        ("router:\n  - port: 9000\n", [], "router: section"),
        (None, ["--port", "70000"], "port"),
    ],
)
def test_bad_start_up_settings_exit_2_with_a_message_not_a_traceback(tmp_path, yaml_text, args, words):
    if yaml_text is not None:
        cfg = tmp_path / "router.yaml"
        cfg.write_text(yaml_text)
        args = [*args, "--config", str(cfg)]
    done = run_router(*args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error:") and "Traceback" not in done.stderr, done.stderr
    assert words in done.stderr


def test_a_tokenizer_directory_without_a_loadable_tokenizer_is_refused(tmp_path):
    assert run_router("--tokenizer", str(tmp_path)).stderr.startswith("error: tokenizer")  # no tokenizer.json
    (tmp_path / "tokenizer.json").write_text("{not json")
    done = run_router("--tokenizer", str(tmp_path))
    assert done.returncode == 2 and done.stderr.startswith("error: tokenizer"), done.stderr
    assert "Traceback" not in done.stderr


def test_a_secret_set_empty_in_the_environment_is_an_error_not_the_guard_off(tmp_path):
    """An empty Secret behind RADIXGATE_API_KEYS or RADIXGATE_ADMIN_TOKEN would otherwise replace the
    YAML's keys or token with none: a router open to anyone."""
    cfg = tmp_path / "r.yaml"
    cfg.write_text(
        "router:\n  api_keys: [secret-key-1]\n  admin_token: admin-secret\n  workers: [http://a:1]\n"
    )
    assert build_config(["--config", str(cfg)], environ={}).api_keys == ["secret-key-1"]
    for name in ("api_keys", "admin_token", "worker_api_key"):
        for empty in ("", "  ", ","):
            with pytest.raises(ValueError, match=f"{name} is given but empty"):
                build_config(["--config", str(cfg)], environ={f"RADIXGATE_{name.upper()}": empty})
    assert build_config(["--config", str(cfg)], environ={"RADIXGATE_ADMIN_TOKEN": "t"}).admin_token == "t"
    # a Secret file's newline: a header cannot carry it (nor send it to the workers)
    secrets = {"RADIXGATE_ADMIN_TOKEN": "t\n", "RADIXGATE_WORKER_API_KEY": "w\n"}
    read = build_config(["--config", str(cfg)], environ=secrets)
    assert (read.admin_token, read.worker_api_key) == ("t", "w")
    for argv in (["--admin-token", ""], ["--worker-api-key", " "], ["--api-key", ""]):  # flags, e.g. $(VAR)
        with pytest.raises(ValueError, match="empty"):
            build_config(argv, environ={})
    cfg.write_text("admin_token: ''\n")
    with pytest.raises(ValueError, match="admin_token is given but empty"):
        build_config(["--config", str(cfg)], environ={})


@pytest.mark.parametrize("value", ["2.9", "yes", "true"])
def test_an_int_setting_takes_whole_numbers_only_in_yaml_too(tmp_path, value):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"max_retries: {value}\n")
    with pytest.raises(ValueError, match="max_retries"):
        build_config(["--config", str(cfg)], environ={})
    cfg.write_text("max_retries: 3.0\n")  # a whole number written as a float is that number
    assert build_config(["--config", str(cfg)], environ={}).max_retries == 3


def test_top_level_keys_beside_a_router_section_are_errors(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("router:\n  port: 9000\nworkers:\n  - http://a:1\n")  # workers indented wrongly
    with pytest.raises(ValueError, match=r"'workers'.*under router:"):
        build_config(["--config", str(cfg)], environ={})


@pytest.mark.parametrize("name", ["router.yaml", "affinity-groups.yaml"])
def test_every_shipped_config_loads(name):
    config = build_config(["--config", os.path.join(ROOT, "configs", name)], environ={})
    assert config.workers and config.policy == "cache_aware"


def test_unquoted_on_and_off_are_read_as_modes(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("router:\n  kv_events: off\n  replica_sync: off\n  redis_url: unix:///tmp/r.sock\n")
    config = build_config(["--config", str(cfg)], environ={})
    assert (config.kv_events, config.replica_sync) == ("off", "off")
    cfg.write_text("replica_sync: on\nredis_url: redis://r:6379/0\n")
    assert build_config(["--config", str(cfg)], environ={}).replica_sync == "on"
    cfg.write_text("kv_events: on\n")
    with pytest.raises(ValueError, match=r"kv_events.*quote"):
        build_config(["--config", str(cfg)], environ={})


@pytest.mark.parametrize(
    ("argv", "environ", "name"),
    [
        (["--health-interval-s", "0"], {}, "health_interval_s"),
        (["--request-timeout-s", "0"], {}, "request_timeout_s"),
        (["--request-timeout-s", "-5"], {}, "request_timeout_s"),
        ([], {"RADIXGATE_CONNECT_TIMEOUT_S": "0"}, "connect_timeout_s"),
        ([], {"RADIXGATE_FIRST_BYTE_TIMEOUT_S": "-1"}, "first_byte_timeout_s"),
        ([], {"RADIXGATE_HEALTH_TIMEOUT_S": "0"}, "health_timeout_s"),
        ([], {"RADIXGATE_HEALTH_TIMEOUT_S": "nan"}, "health_timeout_s"),
        ([], {"RADIXGATE_BREAKER_FAILURE_THRESHOLD": "0"}, "breaker_failure_threshold"),
        ([], {"RADIXGATE_BREAKER_OPEN_S": "0"}, "breaker_open_s"),
        ([], {"RADIXGATE_MAX_BODY_BYTES": "0"}, "max_body_bytes"),
        ([], {"RADIXGATE_REPLICA_SYNC_HEARTBEAT_S": "0"}, "replica_sync_heartbeat_s"),
        (["--port", "65536"], {}, "port"),
        (["--port", "0"], {}, "port"),
        # infinity: health checks never ran again; a drain's timer thread died of an overflow
        (["--health-interval-s", "inf"], {}, "health_interval_s"),
        ([], {"RADIXGATE_SHUTDOWN_DELAY_S": "inf"}, "shutdown_delay_s"),
        (["--request-timeout-s", "1e12"], {}, "request_timeout_s"),
    ],
)
def test_settings_that_would_break_the_router_are_refused(argv, environ, name):
    with pytest.raises(ValueError, match=name):
        build_config(argv, environ=environ)
    assert build_config(["--port", "65535"], environ={}).port == 65535


def test_the_settings_doc_names_exactly_the_fields_without_a_flag():
    dests = {action.dest for action in build_parser()._actions} | {"policy_params"}  # --policy-param
    flagless = {f.name for f in dataclasses.fields(RouterConfig)} - dests
    with open(os.path.join(ROOT, "docs", "router.md"), encoding="utf-8") as f:
        settings = f.read().partition("## Settings")[2].partition("\n## ")[0]
    listed = settings.partition("No flag, YAML and env only:")[2].partition(".")[0]
    assert set(re.findall(r"`(\w+)`", listed)) == flagless


def test_trace_logging_gets_the_router_as_far_as_binding_its_port():
    """uvicorn's ``trace`` is no level ``logging`` knows by name: the router starts with it, here up to
    its port, taken, which exits 3 as uvicorn does (a crash on the level would be exit 1)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = [sys.executable, "-m", "router", "--workers", "http://127.0.0.1:1", "--port", port,
                "--log-level", "trace"]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and "address already in use" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize(
    ("yaml_text", "argv", "words"),
    [
        ("admin_token: 0777\n", [], "quote it"),  # YAML reads 511
        ("api_keys: [0x1F]\n", [], "quote it"),  # YAML reads 31
        ("worker_api_key: yes\n", [], "quote it"),  # YAML reads true
        ("", ["--worker-api-key", "k\u20acy"], "printable ASCII"),  # no header carries it as written
        ("", ["--admin-token", "two words"], "printable ASCII"),
        ("api_keys: ['team:k\u00e9y']\n", [], "printable ASCII"),
        ("api_keys: ['team:Sup3rS3cret', 0x1F]\n", [], "^api_keys: a value is not text"),  # names no key
    ],
)
def test_a_key_no_client_could_send_as_written_is_refused_at_start(tmp_path, yaml_text, argv, words):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(yaml_text or "policy: cache_aware\n", encoding="utf-8")
    with pytest.raises(ValueError, match=words):
        build_config(["--config", str(cfg), *argv], environ={})
    quoted = tmp_path / "q.yaml"
    quoted.write_text("admin_token: '0777'\napi_keys: ['0x1F']\n")
    config = build_config(["--config", str(quoted)], environ={})
    assert config.admin_token == "0777" and config.api_keys == ["0x1F"]
    spaced = build_config(
        ["--api-key", "team: s3cret", "--api-key", " other "], environ={}
    )  # as headers carry them
    assert spaced.api_keys == ["team: s3cret", " other "]


@pytest.mark.parametrize(
    ("argv", "environ", "words"),
    [
        # uvicorn listened on every interface, IPv4 and IPv6
        (["--host", ""], {}, "host must not be empty"),
        ([], {"RADIXGATE_HOST": " "}, "host must not be empty"),
        # read only by the event reader with replica sync off: a traceback at start, exit 3, the password shown
        ([], {"RADIXGATE_KV_EVENTS": "redis", "RADIXGATE_REPLICA_SYNC": "off",
              "RADIXGATE_REDIS_URL": "http://:hunter2@localhost:6379/0"}, "redis_url 'http://***@localhost:6379/0'"),
        (["--redis-url", "unix://:hunter2@/tmp/r.sock", "--replica-sync", "on"], {}, "unix://***@/tmp/r.sock"),
        (["--workers", "http://u:hunter2@w:99999"], {}, "'http://***@w:99999': its port is out of range"),
        # a request sent there came back in, forwarding itself again: 12,203 descriptors, then 504
        (["--port", "18500", "--workers", "http://127.0.0.1:18500"], {}, "is this router's own address"),
        (["--port", "18500", "--workers", "http://localhost:18500/"], {}, "is this router's own address"),
        # other spellings of a loopback or unspecified address reach it too
        (["--port", "18500", "--workers", "http://127.1:18500"], {}, "is this router's own address"),
        (["--port", "18500", "--workers", "http://[::ffff:127.0.0.1]:18500"], {}, "is this router's own address"),
        (["--port", "18500", "--workers", "http://0:18500"], {}, "is this router's own address"),
        (["--port", "18500", "--workers", "http://127.8.9.10:18500"], {}, "is this router's own address"),
    ],
)  # fmt: skip
def test_an_open_or_self_routing_address_is_refused_and_no_password_is_shown(argv, environ, words):
    with pytest.raises(ValueError) as caught:
        build_config(argv, environ=environ)
    assert words in str(caught.value) and "hunter2" not in str(caught.value)
    assert build_config(["--port", "18500", "--workers", "http://127.0.0.1:18501"], environ={}).workers


@pytest.mark.parametrize(
    ("yaml_text", "words"),
    [
        ("shutdown_delay_s: on", "shutdown_delay_s: True (expected a number)"),  # was 1.0
        ("prefill_tokens_per_load: no", "prefill_tokens_per_load: False (expected a number)"),  # was 0.0
        ("log_level: off", "expected text: quote it"),  # was "not 'false'"
    ],
)
def test_yaml_booleans_are_not_numbers_or_text(tmp_path, yaml_text, words):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("router:\n  " + yaml_text + "\n")
    with pytest.raises(ValueError, match=re.escape(words)):
        build_config(["--config", str(cfg)], environ={})


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--api-key=K"], "--api-key (the router's --worker-api-key)"),  # every request 401, the key logged
        (["--api=K"], "--api-key (the router's --worker-api-key)"),  # argparse takes the abbreviation
        (["--port=18299"], "--port (a free port the router polls)"),
        (["--redis-url", "redis://h:6379/0"], "--redis-url (the router's --redis-url)"),
        (["--max-running=0"], "the workers refuse these flags"),  # the worker exited 2: 503 for good
        (["--max-running 4"], "the workers refuse these flags"),  # one argument, not two
    ],
)
def test_worker_args_a_launched_worker_would_refuse_or_that_the_launcher_sets_are_refused(args, words):
    from router.launcher import check_worker_args

    with pytest.raises(ValueError, match=re.escape(words)):
        check_worker_args("tiny", args)
    check_worker_args("tiny", ["--engine=sim", "--max-running", "4"])  # the rest pass


@pytest.mark.parametrize("missing", [("numpy",), ("torch", "llguidance")])
def test_a_python_without_the_worker_extra_launches_no_workers_and_says_what_to_install(
    monkeypatch, caplog, missing
):
    """A router-only install (`pip install radixgate`): a launched worker would die on its first import, be
    started again forever, and the router serve 503 for good; the router refuses at start instead, and
    `python -m worker` exits 2 (no restart) naming what to install."""
    from router.launcher import check_worker_args
    from worker.__main__ import main as worker_main

    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: find_spec finds nothing
    with pytest.raises(
        ValueError, match=re.escape(f'{", ".join(missing)}, not installed: pip install "radixgate[worker]"')
    ):
        check_worker_args("tiny", [])
    assert worker_main(["--port", "1"]) == 2
    assert f"cannot start: {', '.join(missing)} not installed" in caplog.text
