"""Chat prompt encoding with a model's tokenizer: what the router (and a worker) spends per request.

``python -m loadtest.bench_tokenizer`` times ``HFTokenizer.encode_chat`` (template rendering plus
encoding) with its cache of prefix ids (``router.tokenization.PrefixIds``) and without it, on two
workloads, checks the ids equal the whole text's, prints a table and writes JSON:

- ``new conversations``: each request a new conversation on one system prompt and 24 tool schemas
  (~12k tokens), with its own question (agents, assistants behind one system prompt);
- ``growing conversation``: one conversation of 100 turns (~1k characters a message), each turn a
  request carrying the whole conversation so far.

The tokenizer: ``--tokenizer DIR`` (a model's tokenizer.json + chat template), else a 32k byte-level
BPE trained on this repository's own text with a ChatML template that writes the tools into the
system turn, as Qwen 2.5's does. One process on this machine's CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtest.stats import percentile
from router.tokenization import HFTokenizer

ROOT = Path(__file__).resolve().parent.parent
CHATML_TOOLS = (
    "{%- if tools %}<|im_start|>system\n"
    "{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}"
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}{%- for m in messages %}{%- if not (m['role'] == 'system' and loop.first) %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def train_tokenizer(directory: Path) -> Path:
    """A 32k byte-level BPE trained on the repository's Python and Markdown, with CHATML_TOOLS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [
        p.read_text(errors="ignore") for p in sorted(ROOT.glob("**/*.py")) + sorted(ROOT.glob("docs/*.md"))
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"chat_template": CHATML_TOOLS, "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def tools(count: int = 24) -> list[dict]:
    about = "Looks up the records of a customer account by several keys and returns them sorted. " * 4
    fields = {
        f"field_{j}": {"type": "string", "description": f"Key {j} of the lookup, as written"}
        for j in range(12)
    }
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": about,
                "parameters": {"type": "object", "properties": fields, "required": ["field_0"]},
            },
        }
        for i in range(count)
    ]


SYSTEM = {"role": "system", "content": "You are the support agent of a large shop. Answer briefly. " * 10}


def new_conversations(count: int) -> list[tuple[list[dict], list[dict] | None]]:
    asked = "Where is my order number {}? It was due last week and the tracking page shows nothing."
    return [([SYSTEM, {"role": "user", "content": asked.format(i * 7919)}], tools()) for i in range(count)]


def growing_conversation(turns: int) -> list[tuple[list[dict], list[dict] | None]]:
    messages, requests = [SYSTEM], []
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": f"Turn {turn}: " + "please go on with the plan, step by step. " * 24}
        )
        requests.append((list(messages), None))
        messages.append(
            {"role": "assistant", "content": f"Step {turn}: " + "the next part of the plan is here. " * 28}
        )
    return requests


def run(tok: HFTokenizer, requests: list[tuple[list[dict], list[dict] | None]]) -> dict[str, Any]:
    times, tokens = [], 0
    for messages, tool_list in requests:
        start = time.perf_counter()
        ids = tok.encode_chat(messages, tool_list)
        times.append(time.perf_counter() - start)
        tokens = len(ids)
    times_ms = sorted(t * 1e3 for t in times)
    return {
        "requests": len(times),
        "last_prompt_tokens": tokens,
        "total_ms": round(sum(times_ms), 1),
        "median_ms": round(statistics.median(times_ms), 2),
        "p90_ms": round(percentile(times_ms, 90) or 0.0, 2),
        "last_ms": round(times[-1] * 1e3, 2),
    }


def check(tok: HFTokenizer, requests: list[tuple[list[dict], list[dict] | None]]) -> int:
    """Requests whose ids differ from the whole rendered text's (must be 0)."""
    return sum(tok.encode_chat(m, t) != tok.encode_text(tok.render_chat(m, t)) for m, t in requests)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="a model directory (tokenizer.json + chat template)")
    parser.add_argument("--conversations", type=int, default=60)
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--out", default="tokenizer.json")  # NOTE: docs/benchmarks' only when named
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.tokenizer or str(train_tokenizer(Path(tmp) / "tokenizer"))
        workloads: dict[str, Callable[[int], list]] = {
            "new conversations": lambda: new_conversations(args.conversations),
            "growing conversation": lambda: growing_conversation(args.turns),
        }
        rows = []
        for name, make in workloads.items():
            for cached in (False, True):
                tok = HFTokenizer(directory)
                if not cached:
                    tok.prefix_ids.cut_tokens = []  # NOTE: no cut: every prompt encoded whole
                requests = make()
                result = run(tok, requests)
                result.update(workload=name, prefix_ids=cached, cache=tok.prefix_ids.describe())
                result["mismatches"] = check(tok, requests[-3:])
                rows.append(result)
    report = {
        "machine": platform.processor() or platform.machine(),
        "tokenizer": args.tokenizer or "trained",
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'workload':22} {'prefix ids':>10} {'requests':>8} {'tokens':>7} {'median ms':>9} {'p90 ms':>7} {'last ms':>8} {'total ms':>9} {'held KiB':>8} {'wrong':>5}")  # fmt: skip
    for r in rows:
        print(
            f"{r['workload']:22} {'on' if r['prefix_ids'] else 'off':>10} {r['requests']:>8} {r['last_prompt_tokens']:>7}"
            f" {r['median_ms']:>9} {r['p90_ms']:>7} {r['last_ms']:>8} {r['total_ms']:>9}"
            f" {r['cache']['bytes'] >> 10:>8} {r['mismatches']:>5}"
        )
    return 1 if any(r["mismatches"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
