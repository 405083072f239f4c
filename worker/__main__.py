"""CLI entry: ``python -m worker --model tiny|PATH [...]`` -> WorkerConfig -> engine -> uvicorn.

Only wiring: every behaviour lives in config, engine, server and the modules they use."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence

import uvicorn
from uvicorn.main import STARTUP_FAILURE

from router.http_server import LimitedHttpToolsProtocol, exit_by_sigint, run_server
from router.log_level import logging_level
from worker.config import INSTALL_HINT, WorkerConfig, missing_modules, parse_args, unknown_env


def build(cfg: WorkerConfig):  # -> starlette app; typed loosely to keep torch out of import time
    """The engine named by ``cfg`` (real model or cost model) wrapped in the HTTP app."""
    from worker.server import create_app

    if cfg.engine == "sim":
        from worker.sim_engine import build_sim_engine

        engine = build_sim_engine(cfg)
    else:
        from worker.assembly import build_engine

        engine = build_engine(cfg)
    return create_app(
        engine, admin_token=cfg.admin_token, max_stored_responses=cfg.max_stored_responses,
        max_stored_responses_mib=cfg.max_stored_responses_mib,
        tool_call_parser=cfg.tool_call_parser, reasoning_parser=cfg.reasoning_parser, api_key=cfg.api_key,
        kv_transfer_max_mib=cfg.kv_transfer_max_mib, kv_fetch_timeout_s=cfg.kv_fetch_timeout_s,
        kv_link_ms_per_token=cfg.sim_kv_fetch_ms_per_token if cfg.engine == "sim" else 0.0,
        kv_transfer_max_wait_ms=cfg.kv_transfer_max_wait_ms, kv_hints=cfg.kv_hints,
    )  # fmt: skip


# NOTE: requests still in flight are answered this long before uvicorn's graceful shutdown times out and
# cancels them (cutting the connection): the API checks every 0.5 s (server._POLL_S), then writes the 503
END_MARGIN_S = 1.0


ENGINE_DIED = 1  # exit code when the engine thread died: a supervisor starts the worker again


class WorkerServer(uvicorn.Server):
    """uvicorn's server that, as it starts shutting down, ends the worker's cache-event streams (SSE), so
    that its graceful shutdown waits only for the requests in flight (a router's event stream never ends
    by itself and would hold the worker for the whole timeout), and has the requests still in flight
    END_MARGIN_S before the timeout answered with a 503 rather than cut. It shuts down by itself when
    the engine thread dies (its requests already failed): a worker that can serve nothing more exits,
    so whatever runs it (Kubernetes, systemd, the router's --launch-workers) starts it again."""

    def __init__(
        self,
        config: uvicorn.Config,
        end_streams: Callable[[], None],
        end_requests_at: Callable[[float], None],
        engine_died: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__(config)
        self._end_streams = end_streams
        self._end_requests_at = end_requests_at
        self._engine_died = engine_died

    async def on_tick(self, counter: int) -> bool:
        if counter % 10 == 0 and not self.should_exit and self._engine_died():  # once a second
            logging.getLogger("worker").error("the engine thread died: shutting the worker down")
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._end_streams()
        timeout = self.config.timeout_graceful_shutdown
        if timeout is not None:  # NOTE: None: uvicorn waits for every request, so none is ended early
            self._end_requests_at(time.monotonic() + max(0.0, timeout - END_MARGIN_S))
        await super().shutdown(sockets)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(
        level=logging_level(cfg.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for name, near in unknown_env(os.environ):  # NOTE: a warning: the name may be another tool's
        logging.getLogger("worker").warning(
            "env %s is not a worker setting: ignored%s", name, f" (did you mean {near}?)" if near else ""
        )
    missing = missing_modules()
    if missing:  # NOTE: 2, as for a bad argument: a supervisor starting it again cannot help
        logging.getLogger("worker").error(
            "cannot start: %s not installed (%s)", ", ".join(missing), INSTALL_HINT
        )
        return 2
    try:
        app = build(cfg)
    except (ValueError, OSError, MemoryError) as exc:  # NOTE: its arguments or model: restarting won't help
        logging.getLogger("worker").error("cannot start: %s", exc or type(exc).__name__)
        return 2
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False,
                            timeout_graceful_shutdown=cfg.shutdown_timeout_s,
                            http=LimitedHttpToolsProtocol)  # fmt: skip
    engine = app.state.api.engine  # NOTE: python -m worker exits when its engine thread dies
    server = WorkerServer(config, app.state.kv_publisher.end_streams, app.state.api.end_requests_at,
                          lambda: engine.dead is not None)  # fmt: skip
    if run_server(server):
        exit_by_sigint()
    if engine.dead is not None:
        return ENGINE_DIED
    return 0 if server.started else STARTUP_FAILURE  # as uvicorn.run exits (e.g. its port taken)


if __name__ == "__main__":
    sys.exit(main())
