"""Compare mode: real echo-backend workers and a real router per policy, on loopback, torn down by PID."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import orjson
import pytest

from loadtest import compare as compare_mod
from loadtest.compare import Backend, CompareConfig, compare, main
from loadtest.driver import LoadConfig
from tests.support import free_port

STARTED: list = []


class RecordingFleet(compare_mod._Fleet):
    """The real fleet, remembering its processes so the test can check they are gone."""

    def start(self, cmd, name):
        super().start(cmd, name)
        STARTED.append(self.procs[-1])


@pytest.fixture(autouse=True)
def recording_fleet(monkeypatch):
    STARTED.clear()
    monkeypatch.setattr(compare_mod, "_Fleet", RecordingFleet)
    monkeypatch.setattr(compare_mod, "free_port", free_port)  # this test process's own ports
    yield
    assert all(p.poll() is not None for p in STARTED), "a started process is still running"


def rag_load() -> LoadConfig:
    options = {"num_docs": 8, "doc_tokens": 2048, "zipf_s": 0.5}
    return LoadConfig(workload="rag", mode="closed", concurrency=4, requests=40, max_tokens=8,
                      stream=True, duration_s=60.0, options=options)  # fmt: skip


def test_side_by_side_table_json_and_plot_for_each_policy(tmp_path):
    backend = Backend("echo", cache_tokens=10240, decode_ms_per_token=1.0)
    runs = [("round_robin", "round_robin", {}), ("wide", "cache_aware", {"balance_abs": 3})]
    result = compare(CompareConfig(runs, rag_load(), workers=2, backend=backend, out_dir=str(tmp_path)))
    assert "loadtest.echo_backend" in result["table"]
    assert "| metric | round_robin | wide |" in result["table"]
    assert "| ok / sent | 40 / 40 | 40 / 40 |" in result["table"]
    doc = orjson.loads((tmp_path / "compare.json").read_bytes())
    assert doc["backend"] == "echo" and [r["label"] for r in doc["runs"]] == ["round_robin", "wide"]
    rr, ca = (r["summary"] for r in doc["runs"])
    assert sorted(rr["per_worker"].values()) == [20, 20]  # round robin alternates the 2 workers
    assert sum(ca["per_worker"].values()) == 40
    # hit rates come from the workers' own usage reports (which policy wins is the simulator's job:
    # on two real processes it depends on timing)
    assert 0.0 < rr["hit_rate"] < 1.0 and 0.0 < ca["hit_rate"] < 1.0
    assert len(STARTED) == 6  # 2 workers + 1 router per run
    for name in ("round_robin.json", "wide.json", "compare.md", "compare.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_a_run_none_of_whose_requests_succeeded_exits_1_after_the_table(tmp_path, capsys):
    """The echo backend has no Responses API: every request fails, as against a broken fleet; the table and
    the JSON are written, and the exit status says it was no measurement (it was 0)."""
    argv = ["--backend", "echo", "--requests", "3", "--api", "responses", "--policies", "round_robin",
            "--workers", "1", "--out-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "| ok / sent | 0 / 3 |" in captured.out
    assert captured.err.strip().endswith("error: no request of round_robin succeeded (see the errors)")
    assert (tmp_path / "compare.json").exists()


def test_several_router_processes_per_run_share_the_requests(tmp_path):
    backend = Backend("echo", cache_tokens=10240, decode_ms_per_token=1.0)
    config = CompareConfig([("ca", "cache_aware", {})], rag_load(), 2, backend, str(tmp_path), routers=2)
    result = compare(config)
    assert "2 router processes per run" in result["table"]
    assert "| ok / sent | 40 / 40 |" in result["table"]
    assert len(STARTED) == 4  # 2 workers + 2 routers
    routers = [p for p in STARTED if "router" in p.args]
    assert len(routers) == 2
    doc = orjson.loads((tmp_path / "compare.json").read_bytes())
    assert doc["routers"] == 2 and doc["runs"][0]["fleet"]["router_cpu_s"] > 0


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_a_redis_per_run_reaches_the_routers_and_external_commands(tmp_path):
    backend = Backend("echo", cache_tokens=10240, decode_ms_per_token=1.0)
    external = [("nosync", "{python} -m router --port {port} --workers {workers} --redis-url {redis_url} "
                           "--replica-sync off --kv-events off")]  # fmt: skip
    config = CompareConfig([("ca", "cache_aware", {})], rag_load(), 2, backend, str(tmp_path), external=external,
                           routers=2, redis=True)  # fmt: skip
    result = compare(config)
    assert "a redis-server per run" in result["table"]
    assert "| ok / sent | 40 / 40 | 40 / 40 |" in result["table"]
    redis_runs = [p for p in STARTED if p.args[0].endswith("redis-server")]
    assert len(redis_runs) == 2  # one per run, stopped with it (checked by the fixture)
    routers = [p.args for p in STARTED if "router" in p.args]
    assert len(routers) == 4 and all("--redis-url" in args for args in routers)
    assert all(args[args.index("--redis-url") + 1].startswith("redis://127.0.0.1:") for args in routers)


def test_a_router_that_cannot_start_stops_the_workers_and_reports(tmp_path, capsys):
    argv = ["--backend", "echo", "--workers", "2", "--requests", "5", "--policies", "",
            "--external", "broken={python} -c 'raise SystemExit(3)' {port}", "--out-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 2
    assert "a process exited during start-up" in capsys.readouterr().err
    assert len(STARTED) == 3  # two workers and the router, all stopped (checked by the fixture)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "bogus"], "unknown policy 'bogus'"),
        (["--policies", "round_robin,sticky"], "unknown policy 'sticky'"),  # the simulator's only
        (["--run", "broken=cache_aware:no_such_param=1"], "unknown parameter(s) ['no_such_param']"),
        (["--run", "f=cache_aware:kv_fetch_min_tokens=-1"], "kv_fetch_min_tokens must be"),
        (["--option", "foo"], "--option expects KEY=VALUE, got 'foo'"),
        (["--workload", "rag", "--option", "num_docs=abc"], "num_docs must be a whole number"),
        (["--mode", "open", "--rate", "0"], "rate must be > 0"),
        # a cache of no block crashed every request, a NaN cost broke every stream: all tabled, exit 0
        (["--cache-tokens", "-5"], "--cache-tokens must hold a block (16 tokens) at least, got -5"),
        (["--decode-ms-per-token", "nan"], "--decode-ms-per-token must be a finite number >= 0, got nan"),
        (["--prefill-ms-per-token", "-1"], "--prefill-ms-per-token must be a finite number >= 0"),
    ],
)
def test_bad_runs_and_settings_are_refused_before_anything_starts(argv, message, tmp_path, capsys):
    assert main(["--backend", "echo", "--requests", "5", "--out-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert not STARTED and not (tmp_path / "out").exists()


def test_bounds_on_runs_and_workers(tmp_path):
    with pytest.raises(ValueError):
        compare(CompareConfig([("a", "round_robin", {})], workers=64, out_dir=str(tmp_path)))
    with pytest.raises(ValueError):
        compare(CompareConfig([("a", "round_robin", {}), ("a", "cache_aware", {})], out_dir=str(tmp_path)))
    with pytest.raises(ValueError):
        compare(CompareConfig([("a", "round_robin", {})], out_dir=str(tmp_path), routers=5))
    assert not STARTED  # refused before starting anything


def test_external_command_placeholders():
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    argv = compare_mod.external_command(
        "{python} -m x --port {port} --worker-urls {worker_urls} --workers={workers} --bs {block_size}",
        7,
        urls,
        16,
    )
    assert argv[1:] == ["-m", "x", "--port", "7", "--worker-urls", *urls,
                        f"--workers={urls[0]},{urls[1]}", "--bs", "16"]  # fmt: skip
    assert argv[0] == sys.executable
    with pytest.raises(ValueError, match="port"):
        compare_mod.external_command("other-router --workers {workers}", 7, urls, 16)


def test_bad_external_runs_are_refused_before_anything_starts(tmp_path, capsys):
    assert main(["--policies", "", "--external", "no-command", "--out-dir", str(tmp_path)]) == 2
    assert "LABEL=COMMAND" in capsys.readouterr().err
    assert main(["--policies", "", "--external", "x=router --no-port", "--out-dir", str(tmp_path)]) == 2
    assert "{port}" in capsys.readouterr().err
    assert not STARTED


def test_external_router_and_the_workers_counts(tmp_path):
    """A run of a router started from a command line (here radixgate's own, so the test needs nothing
    else) beside a radixgate run, on simulated radixgate workers: both are judged by what the workers
    counted, and the router process's CPU time is read before it stops."""
    backend = Backend("sim", cache_tokens=8192, prefill_ms_per_token=0.01, decode_ms_per_token=1.0)
    load = LoadConfig(workload="tenants", mode="closed", concurrency=4, requests=24, max_tokens=4,
                      stream=True, duration_s=60.0, options={"num_tenants": 3, "system_tokens": 256})  # fmt: skip
    command = "{python} -m router --port {port} --workers {workers} --policy round_robin --kv-events off"
    config = CompareConfig([("ours", "cache_aware", {})], load, workers=2, backend=backend,
                           out_dir=str(tmp_path), external=[("other", command)])  # fmt: skip
    result = compare(config)
    assert len(STARTED) == 6
    ours, other = result["runs"]
    assert other["command"] == command and ours["policy"] == "cache_aware"
    for run in (ours, other):
        assert run["summary"]["ok"] == 24
        fleet = run["fleet"]
        assert sum(fleet["worker_requests"]) == 24
        # the workers' own counts agree with the usage the responses carried
        assert fleet["worker_hit_rate"] == pytest.approx(run["summary"]["hit_rate"], abs=1e-3)
        assert fleet["router_cpu_s"] > 0
    assert other["fleet"]["worker_requests"] == [12, 12]  # round robin over two workers
    assert other["summary"]["load_spread"] == 1.0 and other["summary"]["per_worker"] == {"w0": 12, "w1": 12}
    assert "| requests per worker (workers' counts) | " in result["table"]
    assert "| ok / sent | 24 / 24 | 24 / 24 |" in result["table"]


def test_a_run_with_kv_fetch_hints_has_sim_workers_fetch_prefixes_from_each_other(tmp_path):
    """kv_fetch_min_tokens in a run's spec is the router's --kv-fetch-min-tokens: round robin sends
    a tenant's requests to both workers, and with hints the second fetches the prefix the first holds."""
    backend = Backend("sim", cache_tokens=8192, prefill_ms_per_token=0.01, decode_ms_per_token=1.0,
                      kv_fetch_ms_per_token=0.001)  # fmt: skip
    load = LoadConfig(workload="tenants", mode="closed", concurrency=1, requests=12, max_tokens=4,
                      stream=True, duration_s=60.0, options={"num_tenants": 2, "system_tokens": 512})  # fmt: skip
    runs = [("rr", "round_robin", {}), ("rr_fetch", "round_robin", {"kv_fetch_min_tokens": 64})]
    result = compare(CompareConfig(runs, load, workers=2, backend=backend, out_dir=str(tmp_path)))
    plain, fetch = (run["fleet"] for run in result["runs"])
    assert plain["fetched_share"] == 0 and fetch["fetched_share"] > 0.05  # each tenant's prefix, once
    assert fetch["worker_hit_rate"] > plain["worker_hit_rate"]
    assert "| KV fetched from other workers (% of prompt) | 0.0% |" in result["table"]


def test_cpu_time_counts_threads_that_have_ended():
    """A router's CPU time must hold threads that ran and ended (a resolver or worker thread), not
    only the live ones."""
    code = ("import threading, time\n"
            "def burn():\n"
            "    end = time.process_time() + 0.6\n"
            "    while time.process_time() < end: pass\n"
            "t = threading.Thread(target=burn); t.start(); t.join()\n"
            "print('done', flush=True); time.sleep(30)\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "done"
        time.sleep(0.05)
        used = compare_mod.process_cpu_s(proc.pid)
        assert used is not None and used >= 0.5, used
    finally:
        proc.kill()
        proc.wait()
