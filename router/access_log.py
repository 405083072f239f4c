"""``--access-log``: one JSON line per completion request on the ``radixgate.access`` logger, with
what explains its routing (worker, attempts, policy reason, affinity group, predicted against actual
cached tokens) and its timings. Filled on the request's task through a context variable, so the hot
path pays one lookup when it is off. Never raises into the request."""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import asdict, dataclass

import orjson

log = logging.getLogger("radixgate.access")


@dataclass(slots=True)
class AccessRecord:
    endpoint: str
    ts: float  # unix seconds at arrival
    request_id: str | None = None  # the client's x-request-id
    api_key: str | None = None  # the name of the client's API key (never the key itself)
    model: str | None = None
    stream: bool = False
    status: int = 0
    error: str | None = None  # the error code the client got (in a stream's error event after a 200)
    worker: str | None = None  # the worker that answered (or was tried last)
    attempts: int = 0  # workers tried
    reason: str | None = None  # the policy's explanation of its pick
    affinity_group: str | None = None
    prompt_tokens: int = 0  # the router's count
    predicted_cached_tokens: int = 0  # what the prefix index predicted for the chosen worker
    usage_prompt_tokens: int | None = None  # the worker's usage, when it reported one
    cached_tokens: int | None = None
    kv_source: str | None = None  # the worker named for a KV fetch (--kv-fetch-min-tokens), if one was
    ttft_ms: float | None = None
    duration_ms: float | None = None


CURRENT: ContextVar[AccessRecord | None] = ContextVar("radixgate_access_record", default=None)


def start(enabled: bool, endpoint: str) -> AccessRecord | None:
    """The record of the request running on this task (None when the access log is off)."""
    if not enabled:
        return None  # NOTE: a request's task starts with the default, None: nothing to set
    rec = AccessRecord(endpoint, time.time())
    CURRENT.set(rec)
    return rec


def note(**fields: object) -> None:
    """Set fields of this task's record, if there is one."""
    rec = CURRENT.get()
    if rec is not None:
        for name, value in fields.items():
            setattr(rec, name, value)


def emit(rec: AccessRecord, started: float) -> None:
    """Log ``rec``; ``started`` is the request's perf_counter start."""
    rec.duration_ms = round((time.perf_counter() - started) * 1e3, 3)
    try:
        log.info(orjson.dumps(asdict(rec)).decode())
    except Exception:  # NOTE: a log line must never fail a request
        logging.getLogger("radixgate.router").exception("access log line failed")
