"""Load driver: sends a workload to an OpenAI-compatible URL in open or closed loop and records it.

`python -m loadtest.driver --url URL --workload tenants --mode closed --concurrency 32 ...`, or
`await run_load(LoadConfig(...))` in-process. Bounded by request count and wall time; never retries.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from tqdm import tqdm

from loadtest import report
from loadtest.answers import read_completion, read_response
from loadtest.report import RequestRecord, Results
from loadtest.responses_client import responses_body
from loadtest.trace import load_trace
from loadtest.workloads import (
    API_PATHS,
    GENERATORS,
    Request,
    continue_body,
    generate,
    poisson_arrivals,
    prompt_text,
)

WORKER_HEADER = "x-radixgate-worker"
_DURATION_ONLY_CLOSED_REQUESTS = 100_000  # request list size when only --duration bounds a closed run


@dataclass
class LoadConfig:
    url: str = "http://127.0.0.1:8000"  # or several, comma-separated: request i goes to url i mod n
    workload: str = "tenants"  # a loadtest.workloads generator name, or "trace"
    trace: str | None = None  # Mooncake JSONL path (workload "trace")
    mode: str = "closed"  # closed: at most `concurrency` in flight; open: send at arrival times
    concurrency: int = 32
    rate: float | None = None  # open loop, requests/s (Poisson); None: trace timestamps, or 10
    requests: int | None = None  # how many to send; None: 200 unless duration_s bounds the run
    duration_s: float | None = None  # wall-clock bound; in-flight requests are cancelled at it
    max_tokens: int | None = None  # per request; None: workload default (trace: its output_length)
    stream: bool = False
    seed: int = 0
    model: str | None = None  # None: first id from GET /v1/models, else "default"
    api: str = "chat"  # chat | completions | responses
    api_key: str | None = None  # sent as "Authorization: Bearer <key>"; never written to results
    label: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # workload generator knobs
    block_tokens: int = 512  # trace: tokens per hash id
    block_chars: int | None = None  # trace: characters per hash id (default block_tokens)
    time_scale: float = 1.0  # trace: multiplies arrival times
    max_input_tokens: int | None = None  # trace: cut prompts to this many trace tokens
    ignore_eos: bool = False  # adds "ignore_eos": true (SGLang / vLLM / radixgate extension)
    request_timeout_s: float = 300.0
    max_inflight: int = 4096  # open loop: arrivals beyond this are recorded as "client_overload"
    progress: bool = False  # tqdm bar on stderr


def build_requests(config: LoadConfig) -> list[Request]:
    """The workload's request list, sized from requests / duration / rate."""
    n = config.requests
    if n is None:
        if config.duration_s is None:
            n = 200
        elif config.mode == "open" and config.rate:
            n = math.ceil(config.rate * config.duration_s * 1.2) + 10
        else:
            n = _DURATION_ONLY_CLOSED_REQUESTS
    model = config.model or "default"
    if config.workload == "trace":
        if not config.trace:
            raise ValueError("workload 'trace' needs a trace path")
        reqs = load_trace(
            config.trace,
            limit=n,
            block_tokens=config.block_tokens,
            block_chars=config.block_chars,
            time_scale=config.time_scale,
            max_input_tokens=config.max_input_tokens,
            max_tokens=config.max_tokens,
            api=config.api,
            model=model,
            seed=config.seed,
        )
        if config.rate:  # NOTE: an explicit rate replaces the trace's timestamps with Poisson ones
            for r, t in zip(reqs, poisson_arrivals(len(reqs), config.rate, config.seed), strict=True):
                r.arrival_s = t
        return reqs
    if config.workload not in GENERATORS:
        raise ValueError(f"unknown workload {config.workload!r}; choose from {[*GENERATORS, 'trace']}")
    return generate(
        config.workload,
        n,
        seed=config.seed,
        rate=config.rate or 10.0,
        api=config.api,
        model=model,
        max_tokens=64 if config.max_tokens is None else config.max_tokens,
        **config.options,
    )


class _Run:
    """One run's scheduling state. All methods run on the event loop (no locks needed)."""

    def __init__(self, config: LoadConfig, session: aiohttp.ClientSession, requests: list[Request]):
        self.config, self.session = config, session
        # NOTE: several URLs (router replicas) take requests in turn, as a client-side balancer would
        self.urls = base_urls(config.url)
        self.loop = asyncio.get_running_loop()
        self.by_id = {r.id: r for r in requests}
        self.dependents: dict[int, list[Request]] = {}
        for r in requests:
            if r.after is not None:
                self.dependents.setdefault(r.after, []).append(r)
        self.first_turns = [r for r in requests if r.after is None]
        self.full_bodies: dict[int, dict[str, Any]] = {}  # sent bodies that a later turn extends
        self.response_ids: dict[int, str] = {}  # Responses API: a turn's id, for the next turn
        self.records: list[RequestRecord] = []
        self.skipped = 0
        self.remaining = len(requests)  # not yet recorded or skipped
        self.all_done = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.ready: list[int] = []  # closed loop: heap of ready request ids
        self.ready_event = asyncio.Event()
        self.inflight = 0
        self.bar = tqdm(total=len(requests), file=sys.stderr, disable=not config.progress, unit="req")
        self.t0 = self.loop.time()
        if not requests:
            self.all_done.set()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def execute(self) -> None:
        if self.config.mode == "closed":
            self.ready = [r.id for r in self.first_turns]
            heapq.heapify(self.ready)
            for _ in range(max(1, self.config.concurrency)):
                self._spawn(self._closed_slot())
        else:
            self._spawn(self._open_dispatch())
        # NOTE: at the deadline, what is still in flight is cancelled below and recorded as such.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.all_done.wait(), self.config.duration_s)
        while self.tasks:
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self.bar.close()

    async def _closed_slot(self) -> None:
        while self.remaining > 0:
            if not self.ready:
                self.ready_event.clear()
                await self.ready_event.wait()
                continue
            self.inflight += 1
            await self._send(self.by_id[heapq.heappop(self.ready)])

    async def _open_dispatch(self) -> None:
        for req in sorted(self.first_turns, key=lambda r: r.arrival_s):
            delay = self.t0 + req.arrival_s - self.loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self._launch_open(req)

    def _launch_open(self, req: Request) -> None:
        if self.inflight >= self.config.max_inflight:
            if req.after is not None:
                self.full_bodies.pop(req.after, None)
            self._record(req, RequestRecord(req.id, req.group, self._now(), 0, error="client_overload"))
        else:
            self.inflight += 1  # NOTE: counted at launch, so a burst of arrivals cannot overshoot
            self._spawn(self._send(req))

    async def _release_after_think(self, req: Request) -> None:
        await asyncio.sleep(req.think_time_s)
        self._release(req)

    def _release(self, req: Request) -> None:
        """A later turn is ready to go: queued for a closed-loop slot, or sent now in open loop."""
        if self.config.mode == "closed":
            heapq.heappush(self.ready, req.id)
            self.ready_event.set()
        else:
            self._launch_open(req)

    def _now(self) -> float:
        return self.loop.time() - self.t0

    def _body(self, req: Request) -> tuple[dict[str, Any], int]:
        """The body to send and its prompt's characters: the whole conversation so far, measured
        before a Responses body replaces it with this turn's part and the previous answer's id."""
        body = req.body
        if req.after is not None:
            prev = self.full_bodies.pop(req.after)
            body = continue_body(prev["body"], prev["reply"], req)
        if req.id in self.dependents:
            self.full_bodies[req.id] = {"body": body, "reply": ""}
        body = dict(body, model=self.config.model or body.get("model", "default"))
        if self.config.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        prompt_chars = len(prompt_text(body))
        if req.api == "responses":
            previous = self.response_ids.pop(req.after) if req.after is not None else None
            body = responses_body(body, req.body, previous)
        return body, prompt_chars

    async def _send(self, req: Request) -> None:
        rec = RequestRecord(req.id, req.group, self._now(), 0)
        started = self.loop.time()
        reply: list[str] = []
        try:
            # NOTE: inside the try: a request that is never recorded would keep the run from ending
            body, rec.prompt_chars = self._body(req)
            rid = await self._post(self.urls[req.id % len(self.urls)], req.api, body, rec, started, reply)
            if rid is not None and req.id in self.dependents:
                self.response_ids[req.id] = rid
            if rec.error is None:
                rec.latency_s = self.loop.time() - started
        except asyncio.CancelledError:
            rec.error = "cancelled"
            raise
        except asyncio.TimeoutError:
            rec.error = "timeout"
        except aiohttp.ClientConnectorError:
            rec.error = "connect"
        except aiohttp.ClientError:
            rec.error = "disconnected"
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            # NOTE: no status yet: the driver failed before anything came back, not the server
            rec.error = "bad_response" if rec.status is not None else "client_error"
        except Exception:  # a failure of the driver's own fails this request, never the whole run
            rec.error = "client_error"
        finally:
            self.inflight -= 1
            if req.id in self.full_bodies:
                self.full_bodies[req.id]["reply"] = "".join(reply)
            self._record(req, rec)

    async def _post(
        self, url: str, api: str, body: dict[str, Any], rec: RequestRecord, started: float, reply: list[str]
    ) -> str | None:
        """Send one request and record it; returns a Responses API answer's id (else None)."""
        data = orjson.dumps(body)
        headers = {"content-type": "application/json"}
        async with self.session.post(url + API_PATHS[api], data=data, headers=headers) as resp:
            rec.status = resp.status
            # NOTE: no router header: the URL itself answered; several are told apart by URL
            rec.worker = resp.headers.get(WORKER_HEADER) or ("direct" if len(self.urls) == 1 else url)
            if resp.status >= 400:
                await resp.read()
                rec.error = f"http_{resp.status}"
                return None
            clock = self.loop.time
            if api == "responses":
                return await read_response(resp, bool(body.get("stream")), rec, started, clock, reply)
            await read_completion(resp, bool(body.get("stream")), rec, started, clock, reply)
            return None

    def _record(self, req: Request, rec: RequestRecord) -> None:
        self.records.append(rec)
        self.bar.update(1)
        self._finish_one()
        for dep in self.dependents.get(req.id, []):
            if rec.error == "cancelled":  # NOTE: the deadline, not a failure: later turns just go unsent
                continue
            if rec.error is not None:
                self._skip(dep)
            elif dep.think_time_s > 0:
                self._spawn(self._release_after_think(dep))
            else:
                # NOTE: released before the slot that sent this turn takes its next request, so the
                # smallest ready id (this conversation's next turn) goes before a new conversation
                self._release(dep)

    def _skip(self, req: Request) -> None:
        self.full_bodies.pop(req.after, None)
        self.skipped += 1
        self.bar.update(1)
        self._finish_one()
        for dep in self.dependents.get(req.id, []):
            self._skip(dep)

    def _finish_one(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.all_done.set()
            self.ready_event.set()  # wake idle closed-loop slots so they exit


def base_urls(url: str) -> list[str]:
    """``LoadConfig.url``: one base URL or several, comma-separated; without trailing slashes."""
    return [u.strip().rstrip("/") for u in url.split(",") if u.strip()]


async def _discover_model(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status == 200:
                return str((await r.json())["data"][0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
        pass
    return "default"


def check_config(config: LoadConfig) -> None:
    """Raise ValueError for settings a run cannot honour, before anything is sent."""
    if config.mode not in ("closed", "open"):
        raise ValueError(f"mode must be 'closed' or 'open', got {config.mode!r}")
    urls = base_urls(config.url)
    if not urls:
        raise ValueError("url is empty")
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"url must be http://HOST:PORT or https://HOST:PORT, got {url!r}")
    # NOTE: a rate is requests/s; 0 would send nothing, NaN or infinity every request at once
    # (None is the default: trace timestamps, or 10)
    if config.rate is not None and not 0 < config.rate < math.inf:
        raise ValueError(f"rate must be > 0 requests/s and finite, got {config.rate}")
    for name, value, low in (("concurrency", config.concurrency, 1), ("requests", config.requests, 1),
                             ("max_tokens", config.max_tokens, 1), ("max_inflight", config.max_inflight, 1),
                             ("max_input_tokens", config.max_input_tokens, 1)):  # fmt: skip
        if value is not None and value < low:
            raise ValueError(f"{name} must be at least {low}, got {value}")
    for name, value in (("duration", config.duration_s), ("timeout", config.request_timeout_s)):
        # NOTE: NaN too; an infinite timeout failed every request, an infinite duration sized no run
        if value is not None and not 0 < value < math.inf:
            raise ValueError(f"{name} must be > 0 seconds and finite, got {value}")


async def run_load(config: LoadConfig) -> Results:
    """Run one load test in-process and return its results (see loadtest.report for the numbers)."""
    check_config(config)
    requests = build_requests(config)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=0 if config.mode == "open" else max(1, config.concurrency))
    started_unix = time.time()
    auth = {"authorization": f"Bearer {config.api_key}"} if config.api_key else None
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, read_bufsize=1 << 20, headers=auth
    ) as session:
        if config.model is None:
            first_url = base_urls(config.url)[0]
            config = LoadConfig(**{**asdict(config), "model": await _discover_model(session, first_url)})
        run = _Run(config, session, requests)
        await run.execute()
        duration = run._now()
    run.records.sort(key=lambda r: r.start_s)
    recorded = {**asdict(config), "api_key": "<set>" if config.api_key else None}  # NOTE: never the key
    return Results(config.label, recorded, started_unix, duration, run.records, run.skipped)


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, value


def parse_args(argv: list[str] | None = None) -> tuple[LoadConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m loadtest.driver", description=__doc__)
    p.add_argument(
        "--url", default=LoadConfig.url, help="base URL, or several comma-separated (taken in turn)"
    )
    p.add_argument("--workload", default="tenants", choices=[*GENERATORS, "trace"])
    p.add_argument("--trace", help="Mooncake-format JSONL (with --workload trace)")
    p.add_argument("--mode", default="closed", choices=["closed", "open"])
    p.add_argument("--concurrency", type=int, default=32, help="closed loop: requests in flight")
    p.add_argument("--rate", type=float, help="open loop: requests/s, Poisson (trace: default timestamps)")
    p.add_argument("--requests", type=int, help="requests to send (default 200 without --duration)")
    p.add_argument("--duration", type=float, help="stop after this many seconds, cancelling in-flight")
    p.add_argument("--max-tokens", type=int, help="output tokens per request (default 64; trace: its own)")
    p.add_argument("--stream", action="store_true", help="SSE streaming; TTFT = first output chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="model name (default: first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("RADIXGATE_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: env RADIXGATE_API_KEY)")  # fmt: skip
    p.add_argument("--api", default="chat", choices=sorted(API_PATHS))
    p.add_argument("--label", default="")
    p.add_argument("--option", action="append", type=_option, default=[], metavar="KEY=VALUE",
                   help="workload knob, e.g. num_tenants=16 system_tokens=2048 (repeatable)")  # fmt: skip
    p.add_argument("--block-tokens", type=int, default=512, help="trace: tokens per hash id")
    p.add_argument("--block-chars", type=int, help="trace: characters of text per hash id")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival times")
    p.add_argument("--max-input-tokens", type=int, help="trace: cut prompts at this many trace tokens")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument("--out", help="results JSON path")
    p.add_argument("--md", help="markdown table path")
    p.add_argument("--plot", help="PNG path: TTFT CDF + hit rate over time")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    config = LoadConfig(
        url=a.url, workload=a.workload, trace=a.trace, mode=a.mode, concurrency=a.concurrency,
        rate=a.rate, requests=a.requests, duration_s=a.duration, max_tokens=a.max_tokens,
        stream=a.stream, seed=a.seed, model=a.model, api=a.api, label=a.label, options=dict(a.option),
        block_tokens=a.block_tokens, block_chars=a.block_chars, time_scale=a.time_scale,
        max_input_tokens=a.max_input_tokens, ignore_eos=a.ignore_eos, request_timeout_s=a.timeout,
        progress=not a.no_progress, api_key=a.api_key,
    )  # fmt: skip
    return config, a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        return report.main(argv)
    config, args = parse_args(argv)
    try:
        if args.plot:
            report.check_plotting()
        for path in (args.out, args.md, args.plot):  # NOTE: before the run, not after it
            if path:
                report.prepare_output(path)
        results = asyncio.run(run_load(config))
    except (ValueError, OSError) as e:  # bad settings or knobs, unreadable trace, unwritable output
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = report.markdown_table([results.summary()])
    sys.stdout.write(table)
    try:  # NOTE: checked before the run, but a disk may fill or a folder go meanwhile
        if args.out:
            report.write_json(results, args.out)
        if args.md:
            report.prepare_output(args.md).write_text(table)
        if args.plot:
            report.plot([results], args.plot)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if results.records and not any(r.ok for r in results.records):  # NOTE: a dead target is no measurement
        print(
            f"error: none of the {len(results.records)} requests succeeded (see the errors)", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
