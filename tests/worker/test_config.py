"""Worker settings as ``python -m worker`` reads them: values the worker could not run with (a port
it cannot bind, a Redis URL its event publisher cannot use, a log level) stop it at start-up with
a usage error naming the flag, instead of a worker that advertises a wrong URL or loses events."""

from __future__ import annotations

import os

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


def test_a_refused_redis_url_is_shown_without_its_password(capsys):
    message = refused(capsys, ["--redis-url", "redis://:hunter2@h:notaport/0"])
    assert "redis://***@h:notaport/0" in message and "hunter2" not in message


@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused_not_every_interface(capsys, host):
    assert "--host must not be empty" in refused(capsys, ["--host", host])


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


def test_kv_cache_dtype_sets_the_pools_dtype_apart_from_the_models(capsys, monkeypatch):
    import torch

    from worker.assembly import build_engine
    from worker.config import WorkerConfig
    from worker.kv_pool import kv_cache_dtype

    assert "--kv-cache-dtype" in refused(capsys, ["--kv-cache-dtype", "int8"])
    assert parse_args([]).kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        WorkerConfig(kv_cache_dtype="int8").validate()
    assert parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    for name, dtype in (
        ("fp8", torch.float8_e4m3fn),
        ("fp8_e4m3", torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float8_e5m2),
    ):
        engine = build_engine(
            WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=256, kv_cache_dtype=name)
        )
        assert engine.executor.model.dtype == torch.float32  # type: ignore[attr-defined]
        assert {c.dtype for c in (*engine.executor.kv_pool.k_cache, *engine.executor.kv_pool.v_cache)} == {
            dtype
        }
    assert kv_cache_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    # NOTE: Triton converts e4m3 on CUDA from compute capability 8.9; an A100 (8.0) is told to take e5m2
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"fp8_e4m3 needs compute capability 8\.9.*fp8_e5m2 runs on it"):
        kv_cache_dtype("fp8_e4m3", torch.bfloat16, "cuda")
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16, "cuda") == torch.float8_e5m2
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16, "cuda") == torch.float8_e4m3fn


@pytest.mark.parametrize("name", ["API_KEY", "ADMIN_TOKEN"])
def test_a_key_set_empty_is_refused_not_the_guard_off(capsys, monkeypatch, name):
    """An empty Secret behind RADIXGATE_WORKER_API_KEY would otherwise leave the worker open to anyone."""
    flag = "--" + name.lower().replace("_", "-")
    assert flag in refused(capsys, [flag, ""])
    monkeypatch.setenv("RADIXGATE_WORKER_" + name, " ")
    assert f"RADIXGATE_WORKER_{name}" in refused(capsys, [])
    monkeypatch.setenv("RADIXGATE_WORKER_" + name, "s3cret")
    assert getattr(parse_args([]), name.lower()) == "s3cret"
    monkeypatch.setenv(
        "RADIXGATE_WORKER_" + name, "s3cret\n"
    )  # a Secret file's newline: no header carries it
    assert getattr(parse_args([]), name.lower()) == "s3cret"


@pytest.mark.parametrize(
    ("argv", "env", "flag"),
    [
        (
            [],
            {"RADIXGATE_WORKER_OVERLAP_SCHEDULE": "On"},
            "--overlap-schedule",
        ),  # env is not argparse-checked
        (["--stream-maxlen", "-1"], {}, "--stream-maxlen"),
        (["--stream-maxlen", "0"], {}, "--stream-maxlen"),
        (["--max-wait-s", "nan"], {}, "--max-wait-s"),
        (["--kv-transfer-max-wait-ms", "nan"], {}, "--kv-transfer-max-wait-ms"),
        (["--sim-decode-base-ms", "nan"], {}, "--sim-decode-base-ms"),
        (["--sim-prefill-ms-per-token", "-1"], {}, "--sim-prefill-ms-per-token"),
        (["--sim-context-tokens", "0"], {}, "--sim-context-tokens"),
        (["--host-cache-tokens", "15", "--block-size", "16"], {}, "--host-cache-tokens"),  # no whole page
        (["--api-key", "k\u20acy"], {}, "--api-key"),  # no header carries it as written
        ([], {"RADIXGATE_WORKER_ADMIN_TOKEN": "two words"}, "--admin-token"),
    ],
)
def test_settings_the_worker_cannot_run_by_are_refused_by_name(capsys, monkeypatch, argv, env, flag):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert flag in refused(capsys, argv)


def test_lora_adapter_flags_replace_the_env_list_as_every_flag_replaces_its_env(monkeypatch):
    monkeypatch.setenv("RADIXGATE_WORKER_LORA_ADAPTERS", "a=/x,b=/y")
    assert parse_args([]).lora_adapters == ["a=/x", "b=/y"]
    assert parse_args(["--lora-adapter", "a=/z"]).lora_adapters == ["a=/z"]


def test_an_ipv6_host_is_advertised_bracketed():
    assert parse_args(["--host", "::1", "--port", "8001"]).resolved_advertise_url() == "http://[::1]:8001"


def test_trace_logging_gets_as_far_as_binding_the_port():
    """``--log-level trace`` (uvicorn's name, not logging's) starts the worker: here up to its port,
    taken, which exits 3 as uvicorn does (a crash on the level would be exit 1, as an engine death)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = [sys.executable, "-m", "worker", "--engine", "sim", "--log-level", "trace", "--port", port]
        env = {**os.environ, "RADIXGATE_WORKER_API_KYE": "k"}  # misspelt: the key guard would stay off unseen
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 3 and "address already in use" in done.stderr, done.stderr[-2000:]
    warning = "env RADIXGATE_WORKER_API_KYE is not a worker setting: ignored (did you mean RADIXGATE_WORKER_API_KEY?)"
    assert warning in done.stderr


def test_the_sim_engine_serves_max_model_len_when_it_is_shorter():
    from worker.sim_engine import build_sim_engine

    assert build_sim_engine(parse_args(["--engine", "sim", "--max-model-len", "100"])).max_total_tokens == 100
    assert build_sim_engine(parse_args(["--engine", "sim"])).max_total_tokens == 8192


def test_start_up_errors_of_its_arguments_or_model_exit_2_with_the_reason(tmp_path, caplog):
    """Exit 2 tells a launcher the worker cannot start as asked (it is left stopped); a traceback
    and exit 1 had it restarted forever."""
    import json
    import logging

    import torch

    from worker.__main__ import main

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cases = [(["--model", str(bad)], "lacks 'num_attention_heads'"),
             (["--kv-cache-tokens", str(10**13)], "allocate")]  # fmt: skip
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "no CUDA device"))
    for argv, reason in cases:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="worker"):
            assert main(["--warmup-tokens", "0", *argv]) == 2, argv
        assert any("cannot start" in r.message and reason in r.message for r in caplog.records), caplog.text


def test_a_kv_pool_torch_cannot_allocate_exits_2_naming_the_flag():
    """A pool whose page list fits but whose tensors do not (torch's allocation error is a
    RuntimeError, not a MemoryError): the process's address space is bounded to 6 GiB for it."""
    import resource
    import subprocess
    import sys

    from tests.support import free_port

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    argv = [sys.executable, "-m", "worker", "--device", "cpu", "--warmup-tokens", "0", "--kv-cache-tokens",
            str(10**8), "--port", str(free_port())]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, preexec_fn=bounded)
    assert done.returncode == 2 and "--kv-cache-tokens" in done.stderr, done.stderr[-2000:]


def test_an_env_name_no_flag_has_is_named_with_the_likeliest_one_meant():
    from worker.config import unknown_env

    environ = {
        "RADIXGATE_WORKER_API_KYE": "k",
        "RADIXGATE_WORKER_PORT": "1",
        "RADIXGATE_WORKER_ZZZ": "",
        "HOME": "/",
    }
    assert unknown_env(environ) == [("RADIXGATE_WORKER_API_KYE", "RADIXGATE_WORKER_API_KEY"),
                                    ("RADIXGATE_WORKER_ZZZ", None)]  # fmt: skip
