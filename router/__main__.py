"""`python -m router --workers URL[,URL...]`: run the radixgate router."""

from __future__ import annotations

import logging
import secrets
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn
from uvicorn.main import STARTUP_FAILURE

from router import access_log
from router.app import build_app
from router.config import build_config, check_tokenizer
from router.discovery import target_from_config
from router.http_server import LimitedHttpToolsProtocol, exit_by_sigint, run_server
from router.launcher import WorkerLauncher, check_worker_args
from router.log_level import logging_level


class RouterServer(uvicorn.Server):
    """uvicorn's server that takes the first SIGTERM / SIGINT as a notice: it calls ``start_draining``
    (/ready answers 503), serves on for ``delay_s`` so that load balancers take it out of rotation
    first, and then shuts down as uvicorn does, letting requests in flight finish. A second signal,
    either kind, ends it at once (uvicorn itself does so on a second SIGINT only), after ``on_force``
    (launched workers get SIGTERM: no shutdown hook runs on that path). ``on_signal`` runs at the
    first signal (launched workers are no longer restarted)."""

    def __init__(
        self, config: uvicorn.Config, delay_s: float, start_draining: Callable[[], None],
        on_force: Callable[[], None] | None = None, on_signal: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config)
        self._delay_s = delay_s
        self._start_draining = start_draining
        self._on_force = on_force
        self._on_signal = on_signal
        self._notice: threading.Timer | None = None
        self._signalled = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled:  # a second signal: at once
            if self._notice is not None:
                self._notice.cancel()
            if self._on_force is not None:
                self._on_force()
            super().handle_exit(sig, frame)  # NOTE: it notes the signal, to raise it again at the end
            self.force_exit = True
            return
        self._signalled = True
        if self._on_signal is not None:
            self._on_signal()
        if self._delay_s > 0:
            self._start_draining()
            logging.getLogger("radixgate.router").info(
                "%s: /ready answers 503; shutting down in %.1f s", signal.Signals(sig).name, self._delay_s
            )
            self._notice = threading.Timer(self._delay_s, super().handle_exit, (sig, None))
            self._notice.daemon = True
            self._notice.start()
            return
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> int:
    try:
        config = build_config(argv)
        check_tokenizer(config.tokenizer)  # NOTE: a bad one fails here, clearly (the app reuses it)
        if config.k8s_worker_service:
            target_from_config(config)  # NOTE: fail here, with a clear message, not in the app
        if config.launch_workers:
            check_worker_args(config.worker_model, config.worker_args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging_level(config.log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if config.access_log:  # NOTE: asked for, so written whatever --log-level quiets (its lines are INFO)
        logging.getLogger(access_log.log.name).setLevel(logging.INFO)
    launcher = None
    if config.launch_workers:
        if config.worker_api_key is None:
            # NOTE: loopback is every local user's: a key made here keeps the workers, and whose KV
            # hints they take (--kv-hints keyed), to this router
            config.worker_api_key = secrets.token_urlsafe(32)
        launcher = WorkerLauncher(
            config.launch_workers,
            config.worker_model,
            config.worker_args,
            config.redis_url,
            config.worker_api_key,
        )
        config.workers = config.workers + launcher.start()
    if not config.workers and not config.k8s_worker_service:
        logging.getLogger("radixgate.router").warning(
            "no workers configured: add some with --workers, --launch-workers or POST /workers"
        )
    # NOTE: uvicorn re-raises SIGTERM/SIGINT after shutdown, so launched workers are stopped by
    # the app's shutdown hook; the finally and atexit cover start-up failures.
    try:
        app = build_app(config, on_shutdown=[launcher.stop] if launcher else None)
        server_config = uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=False,
            timeout_keep_alive=30,
            proxy_headers=False,  # the router never reads client addresses; skip the middleware
            http=LimitedHttpToolsProtocol,  # limits on a request's head (size and time)
        )

        def start_draining() -> None:
            app.router.draining = True

        server = RouterServer(
            server_config,
            config.shutdown_delay_s,
            start_draining,
            launcher.terminate if launcher else None,
            launcher.shutting_down if launcher else None,
        )
        interrupted = run_server(server)
    finally:
        if launcher is not None:
            launcher.stop()
    if interrupted:
        exit_by_sigint()
    return 0 if server.started else STARTUP_FAILURE  # as uvicorn.run exits (e.g. its port taken)


if __name__ == "__main__":
    sys.exit(main())
