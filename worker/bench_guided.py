"""What structured outputs cost the engine per step: compiling a grammar, computing each guided
request's token mask (llguidance, on the CPU) and applying the masks to a step's logits.

``python -m worker.bench_guided [--vocab 32000] [--batch 1,16,64] [--out results.json]``

The tokenizer is a byte-level BPE trained here on seeded text to ``--vocab`` tokens (no download);
masks are timed with every matcher inside a JSON string (the widest state: most tokens allowed) and
at an object's start. Applying (packed masks to masked logits on ``--device``, the engine's path)
is timed at the vocabulary's width and at Llama 3's (128,256).
Prints a table last; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections.abc import Callable

import numpy as np
import torch

from router.tokenization import HFTokenizer
from worker.guided import GuideCompiler, allowed_mask, packed_masks, requested_grammar, unpack
from worker.tool_calls import ToolRequest, auto_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}


def _tokenizer(vocab: int, directory: str) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from loadtest.workloads import random_text

    rng = random.Random(0)
    corpus = [random_text(rng, 2000) for _ in range(2000)]
    corpus += ["".join(chr(rng.randrange(33, 0x3000)) for _ in range(400)) for _ in range(3000)]
    corpus += [json.dumps({"name": random_text(rng, 12), "age": rng.randrange(99)}) for _ in range(500)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    tok.save(f"{directory}/tokenizer.json")
    with open(f"{directory}/tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<eos>"}, f)
    return HFTokenizer(directory)


def _ms(fn: Callable[[], object], reps: int, device: torch.device | None = None) -> float:
    cuda = device is not None and device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / reps * 1e3


def _apply_ms(batch: int, width: int, device: torch.device, reps: int) -> float:
    """The engine's path from packed masks (random bits) to masked logits on ``device``."""
    gen = np.random.default_rng(0)
    bits = gen.integers(-(2**31), 2**31 - 1, size=(batch, (width + 31) // 32), dtype=np.int32)
    logits = torch.randn(batch, width, device=device)
    ninf = torch.tensor(float("-inf"), device=device)
    return _ms(lambda: torch.where(unpack(bits, width, device), logits, ninf), reps, device)


def main(argv: list[str] | None = None) -> None:
    import tempfile

    p = argparse.ArgumentParser(prog="python -m worker.bench_guided", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cpu", help="where masks are applied: cpu or cuda")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch.split(",")]
    with tempfile.TemporaryDirectory() as d:
        tok = _tokenizer(args.vocab, d)
    compiler = GuideCompiler(tok, tok.vocab_size)
    start = time.perf_counter()
    compiler.compile(*requested_grammar({"guided_regex": "[0-9]+"}))  # builds llguidance's tokenizer
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    guide = compiler.compile(*requested_grammar({"guided_json": SCHEMA}))
    compile_ms = (time.perf_counter() - start) * 1e3
    in_string = tok.encode_prompt('{"name":"ab')
    tool = {"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}
    auto = compiler.compile(*auto_grammar(ToolRequest([tool], "auto"), trigger_is_special=False))
    in_text = tok.encode_prompt("Let me think about it ")
    rows = []
    for batch in batches:
        at_start = [guide.matcher() for _ in range(batch)]
        inside = [guide.matcher() for _ in range(batch)]
        for m in inside:
            assert m.consume_tokens(in_string), m.get_error()
        allowed = int(allowed_mask(inside[:1], tok.vocab_size)[0].sum())
        free_text = [auto.matcher() for _ in range(batch)]  # tool_choice auto, between calls
        for m in free_text:
            assert m.consume_tokens(in_text), m.get_error()
        row = {
            "batch": batch,
            "mask_ms_object_start": _ms(lambda ms=at_start: packed_masks(ms, tok.vocab_size), args.reps),
            "mask_ms_in_string": _ms(lambda ms=inside: packed_masks(ms, tok.vocab_size), args.reps),
            "mask_ms_auto_tools_text": _ms(lambda ms=free_text: packed_masks(ms, tok.vocab_size), args.reps),
            "allowed_in_string": allowed,
        }
        for width in (tok.vocab_size, 128256):
            row[f"apply_ms_vocab_{width}"] = _apply_ms(batch, width, device, args.reps)
        rows.append(row)
    machine = f"{platform.machine()}, {torch.get_num_threads()} torch threads"
    if device.type == "cuda":
        machine += ", " + torch.cuda.get_device_name(device)
    result = {
        "machine": machine,
        "device": str(device),
        "vocab": tok.vocab_size,
        "tokenizer_build_ms": tokenizer_ms,
        "schema_compile_ms": compile_ms,
        "rows": rows,
        "command": "python -m worker.bench_guided " + " ".join(argv or []),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(f"vocab {tok.vocab_size}; llguidance tokenizer built in {tokenizer_ms:.0f} ms (once per worker); "
          f"schema compiled in {compile_ms:.1f} ms (once per schema, then cached)")  # fmt: skip
    print("| batch | masks, object start (ms) | masks, in a string (ms) | masks, auto tools text (ms) |"
          f" tokens allowed in a string | apply at {tok.vocab_size} (ms) | apply at 128256 (ms) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['mask_ms_object_start']:.3f} | {r['mask_ms_in_string']:.3f} | "
              f"{r['mask_ms_auto_tools_text']:.3f} | {r['allowed_in_string']} | "
              f"{r[f'apply_ms_vocab_{tok.vocab_size}']:.2f} | {r['apply_ms_vocab_128256']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
