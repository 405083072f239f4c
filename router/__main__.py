"""`python -m router --workers URL[,URL...]`: run the radixgate router."""

from __future__ import annotations

import logging
import sys

import uvicorn

from router.app import build_app
from router.config import build_config, check_tokenizer
from router.discovery import target_from_config
from router.launcher import WorkerLauncher


def main(argv: list[str] | None = None) -> int:
    try:
        config = build_config(argv)
        check_tokenizer(config.tokenizer)  # NOTE: a bad one fails here, clearly (the app reuses it)
        if config.k8s_worker_service:
            target_from_config(config)  # NOTE: fail here, with a clear message, not in the app
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    launcher = None
    if config.launch_workers:
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
        uvicorn.run(
            build_app(config, on_shutdown=[launcher.stop] if launcher else None),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=False,
            timeout_keep_alive=30,
            proxy_headers=False,  # the router never reads client addresses; skip the middleware
        )
    finally:
        if launcher is not None:
            launcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
