"""Worker settings as ``python -m worker`` reads them: values the worker could not run with (a port
it cannot bind, a Redis URL its event publisher cannot use, a log level) stop it at start-up with
a usage error naming the flag, instead of a worker that advertises a wrong URL or loses events."""

from __future__ import annotations

import pytest

from worker.config import parse_args


def refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("port", ["83957", "65536", "0", "-1"])
def test_a_port_outside_1_to_65535_is_refused(capsys, port):
    assert "--port must be in 1..65535" in refused(capsys, ["--port", port])


def test_ports_at_the_edges_are_fine():
    assert parse_args(["--port", "65535"]).port == 65535 and parse_args(["--port", "1"]).port == 1


@pytest.mark.parametrize("url", ["127.0.0.1:6379", "http://127.0.0.1:6379", "redis://h:abc"])
def test_a_redis_url_redis_cannot_use_is_refused(capsys, url):
    assert "--redis-url" in refused(capsys, ["--redis-url", url])


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://cache:6380", "unix:///tmp/redis.sock"])
def test_redis_urls_of_each_scheme_are_accepted(url):
    assert parse_args(["--redis-url", url]).redis_url == url


def test_an_unknown_log_level_is_refused(capsys):
    assert "--log-level" in refused(capsys, ["--log-level", "bogus"])
    assert parse_args(["--log-level", "DEBUG"]).log_level == "debug"


def test_dtype_picks_the_models_dtype_and_an_unknown_one_is_refused(capsys):
    import torch

    from worker.assembly import build_engine
    from worker.config import WorkerConfig

    assert "--dtype" in refused(capsys, ["--dtype", "int8"])
    assert parse_args([]).dtype == "auto" and parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(ValueError, match="--dtype"):
        WorkerConfig(dtype="fp8").validate()
    engine = build_engine(WorkerConfig(model="tiny", device="cpu", dtype="bfloat16", kv_cache_tokens=256))
    model = engine.executor.model  # type: ignore[attr-defined]
    assert model.dtype == torch.bfloat16 and engine.executor.kv_pool.k_cache[0].dtype == torch.bfloat16
    auto = build_engine(WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=256))
    assert auto.executor.model.dtype == torch.float32  # type: ignore[attr-defined]  # CPU's default
