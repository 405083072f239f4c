"""A fast OpenAI-compatible stand-in backend for router tests and router-overhead benchmarks.

It has no model: it tokenizes like the router's `bytes` mode, keeps an LRU prefix cache of block
hashes so it reports honest `cached_tokens`, optionally waits a simulated prefill/decode time, and
streams SSE chunks. Never use it to claim anything about inference speed.

    python -m loadtest.echo_backend --port 9001 [--name w1] [--cache-blocks 4096]
        [--prefill-us-per-token 0] [--decode-ms-per-token 0] [--tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time
import uuid
from collections import OrderedDict

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.block_hash import block_hashes
from router.tokenization import ByteTokenizer

DISCONNECT_POLL_S = 0.05  # a simulated prefill checks this often whether its client is still there


async def wait_unless_gone(request: Request, seconds: float) -> bool:
    """Wait ``seconds`` (a simulated prefill), unless the client disconnects first, as a real server
    aborts a request whose client left. True when the whole wait passed."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(min(left, DISCONNECT_POLL_S))
        if await request.is_disconnected():
            return False
    return True


class PrefixLRU:
    """Which block hashes are 'cached', with a block budget; leaves of a chain age out first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def match_and_insert(self, hashes: list[int]) -> int:
        matched = 0
        for h in hashes:
            if h not in self._blocks:
                break
            matched += 1
        for h in reversed(hashes):  # parents end up more recent than children
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        return matched

    def clear(self) -> None:
        self._blocks.clear()


def build_app(
    name: str,
    model: str = "echo",
    block_size: int = 16,
    cache_blocks: int = 4096,
    prefill_us_per_token: float = 0.0,
    decode_ms_per_token: float = 0.0,
    tokens: int = 4,
) -> Starlette:
    tokenizer = ByteTokenizer()
    cache = PrefixLRU(cache_blocks)
    state = {"running": 0, "requests": 0}

    def error(status: int, message: str) -> Response:
        body = {"error": {"message": message, "type": "invalid_request_error", "code": None}}
        return Response(orjson.dumps(body), status_code=status, media_type="application/json")

    async def handle(request: Request, chat: bool) -> Response:
        try:
            body = orjson.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("body must be an object")
            ids = (
                tokenizer.encode_chat(body["messages"], body.get("tools"))
                if chat
                else tokenizer.encode_prompt(body["prompt"])
            )
            max_tokens = int(body.get("max_tokens") or tokens)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return error(400, f"bad request: {exc}")
        if not ids:
            return error(400, "empty prompt")
        req_model = body.get("model", model)
        if req_model != model:
            return error(404, f"model {req_model!r} not found")
        hashes = block_hashes(ids, block_size, model)
        # NOTE: a real worker computes at least the prompt's last token (its logits give the first
        # output token), so a prompt of whole cached blocks reports its last block uncached
        cached = min(cache.match_and_insert(hashes), (len(ids) - 1) // block_size) * block_size
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": max_tokens,
            "total_tokens": len(ids) + max_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        rid = uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        state["requests"] += 1
        state["running"] += 1
        gone = False  # the client left during the prefill: no answer, and no stream to count it down
        try:
            if prefill_us_per_token:
                gone = not await wait_unless_gone(request, (len(ids) - cached) * prefill_us_per_token / 1e6)
                if gone:
                    return Response(status_code=499)
            if not body.get("stream"):
                # NOTE: the prefill makes the first token, so max_tokens - 1 decode steps, as streamed
                for _ in range(max_tokens - 1 if decode_ms_per_token else 0):
                    await asyncio.sleep(decode_ms_per_token / 1e3)
                    if await request.is_disconnected():  # like a real server: stop generating
                        return Response(status_code=499)
                text = "x" * max_tokens
                choice = {"index": 0, "finish_reason": "length"}
                choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
                out = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                }
                return Response(orjson.dumps(out), media_type="application/json", headers={"x-backend": name})
        finally:
            if gone or not body.get("stream"):
                state["running"] -= 1

        async def events():
            try:
                for i in range(max_tokens):
                    if decode_ms_per_token and i:
                        await asyncio.sleep(decode_ms_per_token / 1e3)
                    delta = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
                    delta["finish_reason"] = "length" if i == max_tokens - 1 else None
                    chunk = {"id": rid, "object": obj + ".chunk", "created": created, "model": model}
                    chunk["choices"] = [delta]
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):  # as OpenAI: only when asked
                    final = {"id": rid, "object": obj + ".chunk", "created": created, "model": model}
                    final.update({"choices": [], "usage": usage})
                    yield b"data: " + orjson.dumps(final) + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                state["running"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream", headers={"x-backend": name})

    async def chat_completions(request: Request) -> Response:
        return await handle(request, True)

    async def completions(request: Request) -> Response:
        return await handle(request, False)

    async def models(request: Request) -> Response:
        data = {"object": "list", "data": [{"id": model, "object": "model", "owned_by": name}]}
        return Response(orjson.dumps(data), media_type="application/json")

    async def health(request: Request) -> Response:
        body = {"status": "ok", "name": name, "running": state["running"], "waiting": 0}
        return Response(orjson.dumps(body), media_type="application/json")

    async def flush(request: Request) -> Response:
        cache.clear()
        return Response(orjson.dumps({"flushed": True}), media_type="application/json")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/flush", flush, methods=["POST"]),
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001)
    p.add_argument("--name", default=None)
    p.add_argument("--model", default="echo")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-blocks", type=int, default=4096)
    p.add_argument("--prefill-us-per-token", type=float, default=0.0)
    p.add_argument("--decode-ms-per-token", type=float, default=0.0)
    p.add_argument("--tokens", type=int, default=4, help="completion tokens when max_tokens is absent")
    p.add_argument(
        "--more-ports",
        default="",
        metavar="PORT,PORT,...",
        help="serve one more backend (a cache of its own, named host:port) on each of these ports, in this "
        "process: a large fleet for the router's benchmarks without a process per worker",
    )
    args = p.parse_args()
    ports = [args.port, *(int(x) for x in args.more_ports.split(",") if x)]

    def app(port: int) -> Starlette:
        name = args.name if args.name and port == args.port else f"{args.host}:{port}"
        return build_app(name, args.model, args.block_size, args.cache_blocks, args.prefill_us_per_token,
                         args.decode_ms_per_token, args.tokens)  # fmt: skip

    if len(ports) == 1:
        uvicorn.run(app(args.port), host=args.host, port=args.port, log_level="warning", access_log=False)
        return
    servers = [
        uvicorn.Server(
            uvicorn.Config(app(port), host=args.host, port=port, log_level="warning", access_log=False)
        )
        for port in ports
    ]

    async def serve_all() -> None:
        # NOTE: one handler stops them all (each server's own would replace the last one's: they
        # stopped one after another, ~0.2 s each)
        def stop() -> None:
            for server in servers:
                server.should_exit = True

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        for server in servers:
            server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        await asyncio.gather(*(server.serve() for server in servers))

    asyncio.run(serve_all())


if __name__ == "__main__":
    main()
