"""``--log-level`` names as ``logging`` levels, for the router and the worker alike."""

from __future__ import annotations

from uvicorn.config import TRACE_LOG_LEVEL


def logging_level(name: str) -> int | str:
    """The ``logging`` level of a ``--log-level`` name: uvicorn's ``trace`` is its own level (5), which
    ``logging`` does not know by name."""
    return TRACE_LOG_LEVEL if name == "trace" else name.upper()
