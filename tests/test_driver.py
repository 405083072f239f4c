"""Load driver against a real OpenAI-shaped HTTP server on loopback (aiohttp.web, SSE streaming)."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections import Counter
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from loadtest import driver, report
from loadtest.driver import LoadConfig, run_load
from loadtest.driver import main as driver_main
from loadtest.workloads import prompt_text
from tests.support import free_port


class FakeOpenAI:
    """Tiny OpenAI-compatible server that remembers what it was sent and what it answered.

    Request n (1-based arrival order) fails with the first status whose divisor divides n.
    ``hang_after``: later requests wait until shutdown. ``barrier``: each request waits until
    that many are in flight at once (503 after ``barrier_timeout_s``). ``stream_usage``: False
    answers a stream without its usage chunk, as servers that ignore ``include_usage`` do.
    """

    def __init__(self, *, fail_every=None, workers=("w0", "w1", "w2"), hang_after=None, barrier=None,
                 barrier_timeout_s=5.0, fail_marker=None, stream_usage=True):  # fmt: skip
        self.fail_every = fail_every or {}
        self.workers = workers
        self.hang_after, self.barrier, self.barrier_timeout_s = hang_after, barrier, barrier_timeout_s
        self.fail_marker = fail_marker
        self.stream_usage = stream_usage
        self.arrivals = 0
        self.inflight = 0
        self.max_inflight = 0
        self.status_counts: Counter = Counter()
        self.worker_counts: Counter = Counter()
        self.prompt_total = 0
        self.cached_total = 0
        self.bodies: list[dict] = []
        self.replies: dict[str, str] = {}  # messages JSON -> the reply sent for it
        self.seen_prefixes: set[str] = set()
        self.release = asyncio.Event()
        self.crowd = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        self.release.set()
        self.crowd.set()
        await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.arrivals += 1
        n = self.arrivals
        self.bodies.append(body)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self._answer(request, body, n)
        finally:
            self.inflight -= 1

    async def _answer(self, request: web.Request, body: dict, n: int) -> web.StreamResponse:
        if self.barrier is not None:
            if self.inflight >= self.barrier:
                self.crowd.set()
            try:
                await asyncio.wait_for(self.crowd.wait(), self.barrier_timeout_s)
            except asyncio.TimeoutError:
                return self._error(503)
        if self.hang_after is not None and n > self.hang_after:
            await self.release.wait()
        text = prompt_text(body)
        if self.fail_marker and self.fail_marker in text:
            return self._error(500)
        for status, every in self.fail_every.items():
            if n % every == 0:
                return self._error(status)
        prompt_tokens = len(text.encode())
        cached = prompt_tokens // 2 if text[:48] in self.seen_prefixes else 0
        self.seen_prefixes.add(text[:48])
        self.prompt_total += prompt_tokens
        self.cached_total += cached
        self.status_counts[200] += 1
        worker = self.workers[n % len(self.workers)] if self.workers else None
        headers = {"x-radixgate-worker": worker} if worker else {}
        self.worker_counts[worker or "direct"] += 1
        pieces = [f"answer-{n} ", "is ", "here"]
        self.replies[json.dumps(body.get("messages"))] = "".join(pieces)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces),
                 "total_tokens": prompt_tokens + len(pieces),
                 "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        chat = "messages" in body
        if not body.get("stream"):
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": "".join(pieces)}} if chat
                          else {"text": "".join(pieces)})  # fmt: skip
            return web.json_response({"choices": [choice], "usage": usage}, headers=headers)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", **headers})
        await resp.prepare(request)
        for piece in pieces:
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
        if self.stream_usage and (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _error(self, status: int) -> web.Response:
        self.status_counts[status] += 1
        err = {"error": {"message": "injected", "type": "server_error", "code": status}}
        return web.json_response(err, status=status)


@pytest.fixture
async def server_factory():
    servers: list[FakeOpenAI] = []

    async def make(**kw) -> FakeOpenAI:
        s = FakeOpenAI(**kw)
        await s.start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        await s.stop()


def _config(server: FakeOpenAI, **kw) -> LoadConfig:
    base = dict(url=server.url, workload="tenants", requests=40, max_tokens=3,
                options={"num_tenants": 3, "system_tokens": 200, "question_tokens": 20})  # fmt: skip
    return LoadConfig(**{**base, **kw})


async def test_closed_loop_stream_counts_errors_workers_and_hit_rate(server_factory):
    server = await server_factory(fail_every={429: 5, 500: 7})
    results = await run_load(_config(server, mode="closed", concurrency=4, stream=True, label="rr"))
    s = results.summary()
    assert s["sent"] == 40 and server.arrivals == 40
    assert s["ok"] == server.status_counts[200]
    assert s["errors_by_kind"] == {
        "http_429": server.status_counts[429],
        "http_500": server.status_counts[500],
    }
    assert s["errors"] == 40 - s["ok"] > 0
    assert s["prompt_tokens"] == server.prompt_total
    assert s["cached_tokens"] == server.cached_total > 0
    assert s["hit_rate"] == round(server.cached_total / server.prompt_total, 4)
    assert s["per_worker"] == dict(server.worker_counts)
    assert s["load_spread"] == pytest.approx(max(server.worker_counts.values()) / (s["ok"] / 3), abs=1e-3)
    assert server.max_inflight <= 4
    assert all(b["model"] == "fake-model" and b["stream_options"]["include_usage"] for b in server.bodies)
    ok = [r for r in results.records if r.ok]
    assert all(r.ttft_s is not None and r.ttft_s <= r.latency_s for r in ok)
    assert all(r.completion_tokens == 3 for r in ok)


async def test_a_stream_without_usage_gives_no_output_rate_or_hit_rate_rather_than_zero(server_factory):
    server = await server_factory(stream_usage=False)
    results = await run_load(_config(server, requests=6, concurrency=2, stream=True))
    s = results.summary()
    assert s["ok"] == 6 and all(r.ttft_s is not None for r in results.records)  # text did stream
    assert s["output_tokens_per_s"] is None and s["hit_rate"] is None
    assert "| output tokens/s | n/a |" in report.markdown_table([s])


async def test_non_stream_completions_without_worker_header_is_direct(server_factory):
    server = await server_factory(workers=())
    results = await run_load(_config(server, api="completions", requests=6, concurrency=2, model="m"))
    s = results.summary()
    assert s["ok"] == 6 and s["per_worker"] == {"direct": 6}
    # two URLs with no router header: two workers, each its URL (both were "direct", one worker used)
    other = await server_factory(workers=())
    both = f"{server.url},{other.url}"
    s = (
        await run_load(_config(server, api="completions", requests=6, concurrency=2, model="m", url=both))
    ).summary()
    assert s["per_worker"] == {server.url: 3, other.url: 3}
    assert all("prompt" in b and b["model"] == "m" and "stream" not in b for b in server.bodies)
    assert all(r.ttft_s is not None and r.ttft_s <= r.latency_s for r in results.records)


def test_a_run_that_did_not_stream_reports_no_ttft_only_latency():
    """Without --stream a request's first byte is its whole response: the summary's TTFT is null and
    the table says n/a, so a page cannot quote a whole-response time as TTFT."""
    records = [report.RequestRecord(i, "g", 0.0, 10, ttft_s=0.1 * i, latency_s=0.1 * i) for i in range(1, 6)]

    def summary(stream: bool | None) -> dict:
        config = {} if stream is None else {"stream": stream}
        return report.Results("x", config, 0.0, 1.0, records).summary()

    plain, streamed, unknown = summary(False), summary(True), summary(None)
    assert plain["ttft_p50_ms"] is plain["ttft_p90_ms"] is plain["ttft_p99_ms"] is None
    assert plain["latency_p50_ms"] == streamed["ttft_p50_ms"] == unknown["ttft_p50_ms"] == 300.0
    assert "| TTFT p50 (ms) | n/a |" in report.markdown_table([plain])


def test_the_ttft_chart_draws_only_the_runs_that_streamed():
    """The chart follows the summary: a non-streamed run's whole-response times are no TTFT curve."""
    records = [report.RequestRecord(i, "g", 0.0, 10, ttft_s=0.1 * i, latency_s=0.1 * i) for i in range(1, 6)]
    runs = [
        report.Results(label, {"stream": stream}, 0.0, 1.0, records)
        for label, stream in (("s", True), ("p", False))
    ]
    fig = report.figure(runs)
    ax_cdf = fig.axes[0]
    assert [line.get_label() for line in ax_cdf.get_lines()] == ["s"]
    assert list(ax_cdf.get_lines()[0].get_xdata()) == pytest.approx([100.0, 200.0, 300.0, 400.0, 500.0])


async def test_several_urls_take_the_requests_in_turn(server_factory):
    a, b = await server_factory(), await server_factory()
    results = await run_load(_config(a, url=f"{a.url},{b.url}/", requests=10, concurrency=3))
    assert results.summary()["ok"] == 10
    assert (a.arrivals, b.arrivals) == (5, 5)


async def test_open_loop_does_not_wait_for_responses(server_factory):
    # Every response waits until 8 requests are in flight at once: only an open loop gets there.
    server = await server_factory(barrier=8)
    results = await run_load(_config(server, mode="open", rate=500.0, requests=8))
    assert results.summary()["ok"] == 8 and server.max_inflight == 8


async def test_closed_loop_caps_in_flight(server_factory):
    server = await server_factory(barrier=8, barrier_timeout_s=0.3)
    results = await run_load(_config(server, mode="closed", concurrency=2, requests=4))
    assert results.summary()["errors_by_kind"] == {"http_503": 4}
    assert server.max_inflight == 2


async def test_duration_bound_cancels_in_flight_closed(server_factory):
    server = await server_factory(hang_after=3)
    results = await run_load(_config(server, mode="closed", concurrency=4, requests=100, duration_s=1.0))
    s = results.summary()
    assert s["ok"] == 3 and s["cancelled"] == 4 and s["sent"] == 7 and s["errors"] == 0


async def test_duration_bound_open_loop_stops_sending(server_factory):
    server = await server_factory(hang_after=0)
    results = await run_load(_config(server, mode="open", rate=40.0, requests=1000, duration_s=0.5))
    s = results.summary()
    assert 0 < s["sent"] < 1000 and s["cancelled"] == s["sent"] and s["ok"] == 0
    assert server.arrivals <= s["sent"]


async def test_multi_turn_resends_history_with_actual_replies(server_factory):
    server = await server_factory()
    cfg = _config(server, workload="multi_turn", requests=9, concurrency=3, stream=True,
                  options={"turns": 3, "think_time_s": 0.0, "system_tokens": 64, "user_tokens": 16})  # fmt: skip
    results = await run_load(cfg)
    assert results.summary()["ok"] == 9
    later = [b for b in server.bodies if len(b["messages"]) > 2]
    assert len(later) == 6
    for b in later:
        prefix, assistant = b["messages"][:-2], b["messages"][-2]
        assert assistant["role"] == "assistant"
        assert assistant["content"] == server.replies[json.dumps(prefix)]


async def test_closed_loop_sends_a_conversations_next_turn_before_a_new_conversation(server_factory):
    """Without think time, a free slot takes the finished turn's follow-up (the smallest ready id)."""
    server = await server_factory()
    cfg = _config(server, workload="multi_turn", requests=9, concurrency=1,
                  options={"turns": 3, "think_time_s": 0.0, "system_tokens": 64, "user_tokens": 16})  # fmt: skip
    assert (await run_load(cfg)).summary()["ok"] == 9
    sent = [b["messages"][-1]["content"].split()[0] for b in server.bodies]  # "[conversation.turn]"
    assert sent == ["[0.0]", "[0.1]", "[0.2]", "[1.0]", "[1.1]", "[1.2]", "[2.0]", "[2.1]", "[2.2]"]


async def test_multi_turn_skips_turns_after_a_failed_turn(server_factory):
    server = await server_factory(fail_marker="[1.0]")
    cfg = _config(server, workload="multi_turn", requests=9, concurrency=2,
                  options={"turns": 3, "think_time_s": 0.0, "system_tokens": 64, "user_tokens": 16})  # fmt: skip
    s = (await run_load(cfg)).summary()
    assert s["ok"] == 6 and s["errors_by_kind"] == {"http_500": 1} and s["skipped"] == 2


async def test_turns_cut_off_by_the_deadline_are_cancelled_and_their_later_turns_not_skipped(server_factory):
    server = await server_factory(hang_after=2)  # both conversations' first turns, then every turn hangs
    cfg = _config(server, workload="multi_turn", requests=8, concurrency=2, duration_s=1.0,
                  options={"turns": 4, "think_time_s": 0.0, "system_tokens": 64, "user_tokens": 16})  # fmt: skip
    s = (await run_load(cfg)).summary()
    assert (s["ok"], s["cancelled"], s["errors"]) == (2, 2, 0)
    assert s["skipped"] == 0  # nothing failed: skipped counts turns after a failed one


async def test_cli_writes_json_markdown_plot_and_compare(server_factory, tmp_path):
    server = await server_factory()
    outs = []
    for label in ("a", "b"):
        out = tmp_path / f"{label}.json"
        args = ["--url", server.url, "--workload", "rag", "--requests", "10", "--concurrency", "2",
                "--stream", "--label", label, "--out", str(out), "--md", str(tmp_path / f"{label}.md"),
                "--option", "num_docs=4", "--option", "doc_tokens=100", "--no-progress"]  # fmt: skip
        if label == "a":
            args += ["--plot", str(tmp_path / "a.png")]
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "loadtest.driver", *args,
                                                    stdout=asyncio.subprocess.PIPE)  # fmt: skip
        stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0
        assert "| ok / sent | 10 / 10 |" in stdout.decode()
        outs.append(out)
    loaded = report.read_json(outs[0])
    assert loaded.summary()["ok"] == 10 and len(loaded.records) == 10
    assert (tmp_path / "a.md").read_text().startswith("| metric | a |")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    table = report.compare(outs, md=tmp_path / "cmp.md")
    assert table.splitlines()[0] == "| metric | a | b |"
    assert "| ok / sent | 10 / 10 | 10 / 10 |" in table


def test_a_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, tmp_path, capsys):
    """matplotlib is the loadtest extra's, not the router's install: a run asked for a PNG it cannot draw
    is refused before it starts (it ran the whole load, then died on the import)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: a run would be all errors
    args = ["--url", url, "--requests", "2", "--no-progress", "--out", str(tmp_path / "r.json")]
    assert driver.main([*args, "--plot", str(tmp_path / "r.png")]) == 2
    assert 'error: --plot needs matplotlib: pip install "radixgate[loadtest]"' in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()  # no run
    assert report.main(["compare", str(tmp_path / "r.json"), "--plot", str(tmp_path / "c.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("stream", [False, True])
async def test_multi_turn_over_the_responses_api_continues_stored_conversations(launch, stream):
    """Against a real (simulated) worker: later turns send only their message and the previous
    response's id, and the worker's prompt still holds the whole conversation, mostly cached."""
    worker = launch.module("worker", "--engine", "sim", "--model", "sim-8b")
    cfg = LoadConfig(url=worker.url, workload="multi_turn", api="responses", requests=9, concurrency=3,
                     stream=stream, max_tokens=4,
                     options={"turns": 3, "think_time_s": 0.0, "system_tokens": 256, "user_tokens": 16})  # fmt: skip
    results = await run_load(cfg)
    assert results.summary()["ok"] == 9
    by_conv: dict[str, list] = {}
    for rec in sorted(results.records, key=lambda r: r.id):
        by_conv.setdefault(rec.group, []).append(rec)
    assert len(by_conv) == 3
    for turns in by_conv.values():
        tokens = [r.prompt_tokens for r in turns]
        assert tokens == sorted(tokens) and tokens[0] < tokens[-1]  # the history grows on the server
        chars = [r.prompt_chars for r in turns]  # the whole conversation, though a turn sends only its part
        assert chars == sorted(chars) and chars[0] > 256
        for earlier, later in itertools.pairwise(turns):
            # the previous turn's prompt (whole pages) is served from the cache
            assert later.cached_tokens >= earlier.prompt_tokens // 16 * 16 - 16


async def test_prompt_chars_are_the_same_over_chat_and_responses(launch):
    worker = launch.module("worker", "--engine", "sim", "--model", "sim-8b")
    chars = {}
    for api in ("chat", "responses"):
        cfg = LoadConfig(url=worker.url, api=api, requests=4, concurrency=2, max_tokens=2,
                         options={"system_tokens": 200, "question_tokens": 20})  # fmt: skip
        results = await run_load(cfg)
        assert results.summary()["ok"] == 4
        chars[api] = [r.prompt_chars for r in sorted(results.records, key=lambda r: r.id)]
    assert chars["responses"] == chars["chat"] and min(chars["chat"]) > 200


@pytest.mark.parametrize("mode", ["closed", "open"])
async def test_trace_replay_over_the_responses_api_is_answered(launch, tmp_path, mode):
    """Against a real (simulated) worker: every trace record is sent and answered, and records that
    share a leading hash id share a cached prefix."""
    worker = launch.module("worker", "--engine", "sim", "--model", "sim-8b")
    trace = tmp_path / "trace.jsonl"
    # NOTE: 400 ms apart, so that in open mode each is sent after the one before was cached even on a busy
    # machine (at 100 ms a loaded CI run sent one while the first still prefilled: no hit)
    rows = [{"timestamp": 400 * i, "input_length": 1024, "output_length": 2, "hash_ids": [7, 100 + i]}
            for i in range(4)]  # fmt: skip
    trace.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    cfg = LoadConfig(url=worker.url, workload="trace", trace=str(trace), api="responses", mode=mode,
                     concurrency=1, block_chars=128)  # fmt: skip
    results = await asyncio.wait_for(run_load(cfg), 60)  # NOTE: a bound, so a hung run fails the test
    assert results.summary()["ok"] == 4
    assert all(r.cached_tokens >= 64 for r in results.records[1:])  # the 128 characters of block 7


@pytest.mark.parametrize("mode", ["closed", "open"])
async def test_a_request_the_driver_fails_to_build_is_an_error_and_the_run_ends(
    server_factory, monkeypatch, mode
):
    """A bug of the driver's own while building a request fails that request (and skips the rest of
    its conversation) rather than leaving the run waiting for it forever."""

    def broken(*args):
        raise RuntimeError("cannot build this turn")

    monkeypatch.setattr(driver, "continue_body", broken)  # every later turn fails to build
    server = await server_factory()
    cfg = _config(server, workload="multi_turn", requests=9, concurrency=2, mode=mode, rate=100.0,
                  options={"turns": 3, "think_time_s": 0.0, "system_tokens": 64, "user_tokens": 16})  # fmt: skip
    s = (await asyncio.wait_for(run_load(cfg), 30)).summary()
    assert s["ok"] == 3 and s["errors_by_kind"] == {"client_error": 3} and s["skipped"] == 3
    assert server.arrivals == 3


async def test_cli_creates_missing_output_folders(server_factory, tmp_path):
    """The docs' quick start writes to results/...: a folder that does not exist yet is created,
    rather than the run ending in FileNotFoundError with its results lost."""
    server = await server_factory()
    out = tmp_path / "results" / "run"
    args = ["--url", server.url, "--requests", "4", "--concurrency", "2", "--no-progress",
            "--option", "system_tokens=50", "--out", str(out / "x.json"), "--md", str(out / "x.md"),
            "--plot", str(tmp_path / "plots" / "x.png")]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "loadtest.driver", *args,
                                                stderr=asyncio.subprocess.PIPE)  # fmt: skip
    _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()
    assert report.read_json(out / "x.json").summary()["ok"] == 4
    assert (out / "x.md").read_text().startswith("| metric |")
    assert (tmp_path / "plots" / "x.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flag", ["--out", "--md"])
async def test_cli_refuses_an_output_it_cannot_write_before_sending_anything(server_factory, tmp_path, flag):
    server = await server_factory()
    (tmp_path / "taken").write_text("a file where a folder should be")
    # a file under a file; one in /proc (no file can be made there, though os.access tells root it can)
    out = tmp_path / "taken" / "x.json" if flag == "--out" else Path("/proc/radixgate-test.md")
    args = ["--url", server.url, "--requests", "4", "--no-progress", flag, str(out)]
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "loadtest.driver", *args,
                                                stderr=asyncio.subprocess.PIPE)  # fmt: skip
    _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert stderr.decode().startswith(f"error: cannot write {out}")
    assert server.arrivals == 0  # refused before the run, not after it


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--option", "num_tenants=abc"], "option num_tenants must be a whole number, got 'abc'"),
        (["--mode", "open", "--rate", "0"], "rate must be > 0"),
        (["--mode", "open", "--rate", "-5"], "rate must be > 0"),
        (["--mode", "open", "--rate", "nan"], "rate must be > 0 requests/s and finite, got nan"),
        (["--mode", "open", "--rate", "inf", "--duration", "5"], "rate must be > 0 requests/s and finite"),
        (["--url", "localhost:18400"], "url must be http://HOST:PORT or https://HOST:PORT"),
        (["--url", "http://127.0.0.1:18400,127.0.0.1:18401"], "got '127.0.0.1:18401'"),
        (["compare", "/nonexistent/a.json"], "No such file"),
        (["--max-tokens", "0"], "max_tokens must be at least 1, got 0"),
        (["--max-tokens", "-1"], "max_tokens must be at least 1"),
        (["--concurrency", "0"], "concurrency must be at least 1"),
        (["--requests", "0"], "requests must be at least 1"),
        (["--max-input-tokens", "0"], "max_input_tokens must be at least 1, got 0"),
        (["--duration", "-1"], "duration must be > 0 seconds"),
        (["--timeout", "0"], "timeout must be > 0 seconds"),
        (["--timeout", "nan"], "timeout must be > 0 seconds"),
        (["--timeout", "inf"], "timeout must be > 0 seconds and finite, got inf"),
        (["--mode", "open", "--rate", "10", "--duration", "inf"], "duration must be > 0 seconds and finite"),
    ],
)
def test_cli_bad_settings_are_one_clear_error_line(argv, message, capsys):
    """Refused before any request is sent (nothing listens on these ports), exit status 2, no traceback."""
    assert driver_main([*argv, "--no-progress"] if argv[0] != "compare" else argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a loadtest results file"),
        (b'{"format": 1, "label": "x"}', "not a complete loadtest results file"),
    ],
)
def test_compare_refuses_a_file_that_is_not_a_results_file(tmp_path, capsys, content, message):
    path = tmp_path / "other.json"
    path.write_bytes(content)
    assert driver_main(["compare", str(path)]) == 2
    assert report.main(["compare", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count(f"error: {path}: {message}") == 2 and "Traceback" not in err


def test_a_run_none_of_whose_requests_succeeded_exits_1_after_its_table(tmp_path, capsys):
    """An unreachable endpoint gave a "0 / 3" table and exit 0: a script could not tell it from a measurement."""
    from router.launcher import free_port

    out = tmp_path / "dead.json"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    argv = ["--url", url, "--requests", "3", "--model", "m", "--no-progress", "--out", str(out)]
    assert driver_main(argv) == 1
    captured = capsys.readouterr()
    assert "0 / 3" in captured.out  # the table first (ok / requests)
    assert captured.err.strip() == "error: none of the 3 requests succeeded (see the errors)"
    assert json.loads(out.read_text())["summary"]["ok"] == 0  # the outputs are written all the same
