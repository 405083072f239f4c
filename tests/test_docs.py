"""What the README and docs/ promise about the code itself: the usage blocks' flags and the defaults
they show, a code map that names every module, and the fields of a real worker's health. A renamed
flag, a changed default, a new module or an undocumented field fails here, not in a reader's shell."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import httpx
import pytest

from router.config import RouterConfig
from router.config import build_parser as router_parser
from worker.config import WorkerConfig
from worker.config import build_parser as worker_parser

ROOT = Path(__file__).resolve().parent.parent


def usage_block(doc: str, program: str) -> str:
    """A doc's ``python -m <program> ...`` block, continuation lines included."""
    block = re.search(rf"```\n(python -m {program} .*?)```", (ROOT / doc).read_text(), re.S)
    assert block, f"{doc} has no usage block for python -m {program}"
    return block.group(1)


def shown_options(block: str) -> list[tuple[str, str]]:
    """Each ``[--flag VALUE]`` (``--flag=VALUE``, ``| --flag VALUE``) of a usage block, as (flag, VALUE or "")."""
    return re.findall(r"(?:\[|\| )(--[a-z0-9-]+)(?:[ =]([^\s\[\]]+))?", block)


ROUTER = (router_parser, {f.name: f.default for f in dataclasses.fields(RouterConfig)})
WORKER = (worker_parser, {f.name: f.default for f in dataclasses.fields(WorkerConfig)})


@pytest.mark.parametrize(
    ("doc", "program", "parser", "defaults"),
    [
        ("README.md", "router", *ROUTER),
        ("README.md", "worker", *WORKER),
        ("docs/worker.md", "worker", *WORKER),
    ],
    ids=["README-router", "README-worker", "worker.md"],
)
def test_usage_blocks_show_real_flags_and_their_defaults(doc, program, parser, defaults) -> None:
    """A value shown in the usage is the default: a number or address as is, of ``a|b|c`` the first."""
    actions = {o: a for a in parser()._actions for o in a.option_strings}
    shown = shown_options(usage_block(doc, program))
    assert len(shown) > 10
    for flag, value in shown:
        assert flag in actions, f"{doc} shows {flag}, which python -m {program} does not take"
        action = actions[flag]
        if "|" in value:
            default, *others = value.split("|")
        elif re.fullmatch(r"[0-9.]+", value):
            default, others = value, []
        else:
            continue  # a placeholder (N, URL, KEY) or an example (router.yaml, redis://...)
        real = defaults[action.dest]
        assert str(real) == default, f"{doc} shows {flag} {default}; its default is {real}"
        if action.choices:
            assert {default, *(v for v in others if not v.isupper())} <= set(action.choices), flag


def test_the_code_map_names_every_module_and_only_modules_that_exist() -> None:
    """docs/structure.md maps the code: each module by its path, or a folder's by its file name on
    the folder's row (``worker/model/``)."""
    rows = [
        line for line in (ROOT / "docs" / "structure.md").read_text().splitlines() if line.startswith("| `")
    ]
    named = {p for row in rows for p in re.findall(r"`([\w/.-]+\.py)`", row.split(" | ")[0])}
    missing = sorted(p for p in named if "/" in p and not (ROOT / p).is_file())
    assert missing == [], f"docs/structure.md names modules that do not exist: {missing}"
    unmapped = []
    for package in ("router", "worker", "kernels", "loadtest"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.name == "__init__.py" or str(rel) in named:
                continue
            folder_rows = [row for row in rows if f"`{rel.parent}/`" in row.split(" | ")[0]]
            if not any(f"`{rel.name}`" in row for row in folder_rows):
                unmapped.append(str(rel))
    assert unmapped == [], f"docs/structure.md does not map {unmapped}"


def test_worker_health_and_cache_info_fields_are_documented(launch) -> None:
    """Each field of a worker's /health and /v1/cache/info (a host tier on) is named in its row of
    docs/worker.md's endpoint table (``simulated`` is the sim's, documented with it)."""
    worker = launch.sim_worker("--host-cache-tokens", "4096")
    rows = (ROOT / "docs" / "worker.md").read_text().splitlines()
    for path in ("/health", "/v1/cache/info"):
        (row,) = [r for r in rows if r.startswith(f"| `GET {path}` |")]
        fields = set(httpx.get(worker.url + path, timeout=10).json()) - {"simulated"}
        assert sorted(f for f in fields if not re.search(rf"\b{f}\b", row)) == [], path
