"""Reports of kernels.bench results: the target verdicts, the plain-text table the command prints
last, and the markdown report written beside the JSON. Pure functions of the result dict."""

from __future__ import annotations

import math
import statistics

KINDS = ("decode", "extend", "lora", "verify")  # what kernels.bench measures, in its order (decode first)
LONG_CONTEXT = 16384  # decode target (>= 70% of copy bandwidth) is judged at contexts >= this
# decode_attention.MANY_REQUESTS (a test keeps them equal): from this batch sm_90's default decode tiles change,
# so a candidate is weighed below it and from it apart
MANY_REQUESTS = 16
# bf16 against SDPA in bf16 lands near 3e-3; a wrong mask, a missing tile or an unwritten output is
# far above this (or NaN: outputs are poisoned before each run)
MAX_REL_ERR = 2e-2
# decode candidates kernels.bench times beside the default (DecodeConfig: fused_merge, pdl, prefetch,
# prefetch with pdl, prefetch_slots, prefetch_slots with pdl, decode_attention.PIPELINED_TILES), each row's
# triton_<name>_graph_*: single replays, then these per layer of the stack
STACKED = ("pdl", "prefetch", "prefetch_pdl", "slots", "slots_pdl", "pipelined")
# the LoRA candidates kernels.bench times beside the default: name -> (its report column, its LoraConfig
# change): the default (sm_90: 256-column expand blocks, programmatic dependents) launched plainly, with
# 128-column blocks, with both (the default before Hopper), and with the expand's partials several splits
# a load
LORA_CANDIDATES = {"no_pdl": ("without PDL", {"pdl": False}), "narrow": ("128-column", {"block_n": 128}),
                   "former": ("128-column without PDL", {"block_n": 128, "pdl": False}),
                   "batched": ("batched partials", {"batched_partials": True})}  # fmt: skip
DECODE_CANDIDATES = ("fused", *STACKED, *(f"{name}_stack" for name in STACKED))
# the decode table's candidate columns (triton_<name>_graph_gbs), in its header's order
DECODE_COLUMNS = ("pdl", "pdl_stack", "fused", "prefetch", "prefetch_stack", "prefetch_pdl", "prefetch_pdl_stack",
                  "slots", "slots_stack", "slots_pdl", "slots_pdl_stack", "pipelined", "pipelined_stack")  # fmt: skip
# decode over an fp8 pool: what kernels.bench.fp8_candidates may replay beside the default, by name
FP8_CANDIDATES = ("flip_f16", "short_tiles", "pdl", "slots")


def decode_rates(row: dict) -> tuple[float, float | None]:
    """(Triton GB/s, SDPA GB/s or None) of a decode row as judged: CUDA-graph replays, how the worker
    runs decode steps, when the row has them (the SDPA baseline then replayed too), else eager calls."""
    if "triton_graph_gbs" in row:
        return row["triton_graph_gbs"], row.get("sdpa_graph_gbs")
    return row["triton_gbs"], row.get("sdpa_gbs")


def _worst_error(row: dict, keys: tuple[str, ...]) -> float | None:
    """The largest of ``row``'s errors under ``keys``, NaN when any is NaN (an unwritten output); None
    when none was measured."""
    errors = [row[k] for k in keys if row.get(k) is not None]
    return max(errors, key=lambda e: (math.isnan(e), e), default=None)


def decode_error(row: dict) -> float | None:
    """The worst of the eager, replayed, layer-stack and candidates' (DECODE_CANDIDATES) outputs' errors
    against SDPA."""
    return _worst_error(row, ("rel_err_vs_sdpa", "rel_err_graph_vs_sdpa", "rel_err_stack_vs_sdpa",
                              *(f"rel_err_{name}_vs_sdpa" for name in DECODE_CANDIDATES)))  # fmt: skip


def extend_error(row: dict) -> float | None:
    """The worst of the extend outputs' errors against SDPA: the worker's tiles, and the prefix-blind
    default's and the prefix split's when the row timed them."""
    return _worst_error(
        row, ("rel_err_vs_sdpa", "rel_err_blind_vs_sdpa", "rel_err_split_vs_sdpa", "rel_err_unsplit_vs_sdpa")
    )


def lora_error(row: dict) -> float | None:
    """The worst of the LoRA deltas' errors against torch's: the default launch and the candidates'
    (LORA_CANDIDATES)."""
    return _worst_error(row, ("rel_err_vs_torch", *(f"rel_err_{name}_vs_torch" for name in LORA_CANDIDATES)))


# kernels.bench.bench_verify's candidates beside the short extend's default
VERIFY_CANDIDATES = ("pdl", "slots", "narrow", "wide")


def verify_error(row: dict) -> float | None:
    """The worst of the short-extend outputs' errors against the extend kernel: the default launch, and
    the candidates' (VERIFY_CANDIDATES)."""
    return _worst_error(row, ("rel_err_vs_extend", *(f"rel_err_{n}_vs_extend" for n in VERIFY_CANDIDATES)))


def tiles(config: dict | None) -> str:
    """'64x32/4w/2s' for an ExtendConfig as a dict; '-' for None."""
    if not config:
        return "-"
    return f"{config['block_m']}x{config['block_n']}/{config['num_warps']}w/{config['num_stages']}s"


def inaccurate(error: float | None) -> bool:
    """An error past MAX_REL_ERR, or NaN; an unmeasured one (no SDPA baseline) is not judged."""
    return error is not None and not error <= MAX_REL_ERR


def candidate_speedups(rows: list[dict]) -> dict[str, dict]:
    """Each decode candidate against the default on the rows that timed both: the default's time over
    the candidate's (single replays against the default's, per layer of the stack against the default's
    stack), at batch 1 x LONG_CONTEXT (the row the target turns on), and the least over every other row,
    with that row: where the candidate would cost most as a default. Then per regime of the default's
    tiles: the least over the other rows below MANY_REQUESTS, and the least and the most from it (None
    where a regime has no such row)."""
    speedups = {}
    for name in DECODE_CANDIDATES:
        default = "triton_stack_graph_ms" if name.endswith("_stack") else "triton_graph_ms"
        timed = {(r["batch"], r["context"]): r[default] / r[f"triton_{name}_graph_ms"]
                 for r in rows if default in r and f"triton_{name}_graph_ms" in r}  # fmt: skip
        if not timed:
            continue
        others = {shape: x for shape, x in timed.items() if shape != (1, LONG_CONTEXT)}
        least = min(others, key=others.__getitem__, default=None)
        below = [x for (batch, _), x in others.items() if batch < MANY_REQUESTS]
        many = [x for (batch, _), x in others.items() if batch >= MANY_REQUESTS]
        speedups[name] = {
            "at_batch_1_long_context": timed.get((1, LONG_CONTEXT)),
            "min_elsewhere": None if least is None else others[least],
            "min_elsewhere_shape": None if least is None else f"b={least[0]} ctx={least[1]}",
            "min_elsewhere_below_many_requests": min(below, default=None),
            "min_from_many_requests": min(many, default=None),
            "max_from_many_requests": max(many, default=None),
        }
    return speedups


def candidates_table(speedups: dict[str, dict]) -> list[str]:
    """Markdown lines: candidate_speedups as a table; none when no candidate was timed."""
    if not speedups:
        return []
    return [
        "",
        "### Decode candidates against the default",
        "",
        "The default's time over the candidate's on the same row (above 1: the candidate is faster): single"
        " replays against the default's single replay, the stacked candidates per layer against the"
        f" default's stack. At batch 1 x {LONG_CONTEXT}, the row the target turns on, and the least over every"
        " other row (where the candidate would cost most as the default); then apart for the default's two"
        f" tile regimes: the least over the other rows below {MANY_REQUESTS} requests, and the least and the"
        f" most from {MANY_REQUESTS}.",
        "",
        f"| candidate | at 1 x {LONG_CONTEXT} | least elsewhere | on | least elsewhere below {MANY_REQUESTS} "
        f"| least from {MANY_REQUESTS} | most from {MANY_REQUESTS} |",
        "|---|---:|---:|---|---:|---:|---:|",
        *(
            f"| {name} | {_fmt(x['at_batch_1_long_context'], '.3f')} | {_fmt(x['min_elsewhere'], '.3f')} "
            f"| {x['min_elsewhere_shape'] or '-'} | {_fmt(x['min_elsewhere_below_many_requests'], '.3f')} "
            f"| {_fmt(x['min_from_many_requests'], '.3f')} | {_fmt(x['max_from_many_requests'], '.3f')} |"
            for name, x in speedups.items()
        ),
    ]


def split_speedup(row: dict) -> float:
    """An extend row's prefix split (ExtendConfig.split_prefix) over the worker's tiles unsplit; the row
    timed the split (``triton_split_tflops``). Rows from before eager calls split have no
    triton_unsplit_tflops: their default was unsplit."""
    return row["triton_split_tflops"] / row.get("triton_unsplit_tflops", row["triton_tflops"])


def summarize(result: dict) -> dict:
    """Target checks: decode >= 70% of copy bandwidth at long contexts; extend >= 80% of flash SDPA.
    A kind with an inaccurate row (kernels.bench_report.inaccurate) misses its target, however fast."""
    copy = result["device"]["copy_gbs"]
    long_rows = [r for r in result["decode"] if r["context"] >= LONG_CONTEXT]
    decode_frac = min((decode_rates(r)[0] / copy for r in long_rows), default=None)

    def worst(key: str) -> float | None:  # NOTE: information beside the verdict, from rows that have ``key``
        return min((r[key] / copy for r in long_rows if key in r), default=None)

    ratios = [r["ratio_vs_sdpa"] for r in result["extend"] if "ratio_vs_sdpa" in r]
    extend_ratio = statistics.geometric_mean(ratios) if ratios else None
    split = [split_speedup(r) for r in result["extend"] if "triton_split_tflops" in r]
    wrong = [
        f"decode b={r['batch']} ctx={r['context']}" for r in result["decode"] if inaccurate(decode_error(r))
    ]
    wrong_extend = [f"extend b={r['batch']} prefix={r['prefix']} new={r['new']}" for r in result["extend"]
                    if inaccurate(extend_error(r))]  # fmt: skip
    wrong_fp8 = [f"decode fp8 b={r['batch']} ctx={r['context']}" for r in result["decode"]
                 if "rel_err_fp8_vs_sdpa" in r and inaccurate(r["rel_err_fp8_vs_sdpa"])]  # fmt: skip
    wrong_fp8 += [f"decode fp8 {name} b={r['batch']} ctx={r['context']}" for r in result["decode"]
                  for name in FP8_CANDIDATES
                  if f"rel_err_fp8_{name}_vs_sdpa" in r and inaccurate(r[f"rel_err_fp8_{name}_vs_sdpa"])]  # fmt: skip
    wrong_fp8 += [f"extend fp8 b={r['batch']} prefix={r['prefix']} new={r['new']}" for r in result["extend"]
                  if "rel_err_fp8_vs_sdpa" in r and inaccurate(r["rel_err_fp8_vs_sdpa"])]  # fmt: skip
    extend_fp8 = [r["fp8_speedup"] for r in result["extend"] if "fp8_speedup" in r]
    wrong_verify = [f"verify b={r['batch']} prefix={r['prefix']} new={r['new']}" for r in result.get("verify", [])
                    if inaccurate(verify_error(r))]  # fmt: skip
    rows_speedups = {name: [r[f"short_{name}_graph_ms"] / r["short_graph_ms"] for r in result.get("verify", [])
                            if f"short_{name}_graph_ms" in r] for name in ("slots", "narrow", "wide")}  # fmt: skip
    return {
        "decode_min_fraction_of_copy_bw_at_long_context": decode_frac,
        "decode_target_met": None if decode_frac is None else decode_frac >= 0.70 and not wrong,
        # NOTE: information, not the verdict: per layer when layers replay back to back in one graph, and each
        # stacked candidate (STACKED: PDL, the prefetch, the slots a tile ahead), single and stacked
        "decode_min_fraction_in_layer_stack_at_long_context": worst("triton_stack_graph_gbs"),
        **{
            key: worst(f"triton_{name}{stacked}_graph_gbs")
            for name in STACKED
            for stacked, key in (
                ("", f"decode_min_fraction_with_{name}_at_long_context"),
                ("_stack", f"decode_min_fraction_in_layer_stack_with_{name}_at_long_context"),
            )
        },
        "decode_candidate_speedups": candidate_speedups(result["decode"]),
        # an fp8 pool (--kv-cache-dtype): its bandwidth over the bytes it reads, and its time against the
        # 16-bit pool's on the same rows (no target; an inaccurate fp8 row is listed below)
        "decode_fp8_min_fraction_of_copy_bw_at_long_context": worst("triton_fp8_graph_gbs"),
        "decode_fp8_min_fraction_in_layer_stack_at_long_context": worst("triton_fp8_stack_graph_gbs"),
        "decode_fp8_speedup_min_at_long_context": min(
            (r["fp8_speedup"] for r in long_rows if "fp8_speedup" in r), default=None
        ),
        # kernels.bench.fp8_candidates: the default's speed-up over each (its time over the default's), the
        # least over every row that timed it
        **{
            f"decode_fp8_default_over_{name}_min": min(
                (r[f"fp8_default_over_{name}"] for r in result["decode"] if f"fp8_default_over_{name}" in r),
                default=None,
            )
            for name in FP8_CANDIDATES
        },
        "extend_geomean_ratio_vs_sdpa_flash": extend_ratio,
        "extend_min_ratio_vs_sdpa_flash": min(ratios, default=None),
        "extend_target_met": None if extend_ratio is None else extend_ratio >= 0.80 and not wrong_extend,
        "extend_split_speedup_geomean": statistics.geometric_mean(split) if split else None,
        "extend_split_speedup_min": min(split, default=None),
        # the same prefixes in an fp8 pool: the worker's extend call's speed-up over the 16-bit pool's
        "extend_fp8_speedup_geomean": statistics.geometric_mean(extend_fp8) if extend_fp8 else None,
        "extend_fp8_speedup_min": min(extend_fp8, default=None),
        # the short extend against its slots a tile ahead ("slots") and its rows a program (extend_short.block_rows)
        # at 16 ("narrow") and 64 ("wide"): the candidate's time over the default's, the least and the most over
        # the verify rows that timed it
        **{
            f"verify_default_over_{name}_{end.__name__}": end(speedups, default=None)
            for name, speedups in rows_speedups.items()
            for end in (min, max)
        },
        "inaccurate": wrong_extend + wrong + wrong_verify + wrong_fp8,
    }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def times(x: float | None) -> str:
    """A speed-up or ratio as '1.23x'; '-' when not measured."""
    return "-" if x is None else f"{x:.2f}x"


def _us(ms: float | None) -> str:
    """A time in ms shown in us ('-' when not measured)."""
    return _fmt(None if ms is None else ms * 1e3, ".1f")


def format_table(result: dict) -> str:
    """Plain-text table of every measured shape (the last thing the command prints)."""
    copy, mm = result["device"]["copy_gbs"], result["device"]["matmul_tflops"]

    lines = [f"{'kind':<7}{'shape':<28}{'triton':>12}{'sdpa':>12}{'vs sdpa':>9}{'of peak':>9}{'err':>10}"]
    for r in result["extend"]:
        shape = f"b={r['batch']} prefix={r['prefix']} new={r['new']}"
        lines.append(
            f"{'extend':<7}{shape:<28}{_fmt(r['triton_tflops'], '.1f') + ' TF/s':>12}"
            f"{_fmt(r.get('sdpa_tflops'), '.1f') + ' TF/s':>12}{_fmt(r.get('ratio_vs_sdpa'), '.2f'):>9}"
            f"{_fmt(r['triton_tflops'] / mm, '.0%'):>9}{_fmt(r.get('rel_err_vs_sdpa'), '.1e'):>10}"
        )
    for r in result["decode"]:
        shape = f"b={r['batch']} ctx={r['context']}"
        triton, sdpa = decode_rates(r)
        vs_sdpa = None if sdpa is None else triton / sdpa
        lines.append(
            f"{'decode':<7}{shape:<28}{_fmt(triton, '.0f') + ' GB/s':>12}"
            f"{_fmt(sdpa, '.0f') + ' GB/s':>12}{_fmt(vs_sdpa, '.2f'):>9}"
            f"{_fmt(triton / copy, '.0%'):>9}{_fmt(decode_error(r), '.1e'):>10}"
            f"{'  eager ' + format(r['triton_gbs'], '.0f') + ' GB/s' if 'triton_graph_gbs' in r else ''}"
            f"{'  stacked ' + format(r['triton_stack_graph_gbs'], '.0f') + ' GB/s' if 'triton_stack_graph_gbs' in r else ''}"
        )
    s = result["summary"]
    lines.append(
        f"device {result['device']['name']}: copy {copy:.0f} GB/s, matmul {mm:.0f} TF/s | "
        f"decode >= {_fmt(s['decode_min_fraction_of_copy_bw_at_long_context'], '.0%')} of copy bw at "
        f"ctx >= {LONG_CONTEXT} (target 70%) | "
        f"extend {_fmt(s['extend_geomean_ratio_vs_sdpa_flash'], '.2f')}x flash SDPA, geomean (target 0.80)"
        + (f" | INACCURATE: {'; '.join(s['inaccurate'])}" if s.get("inaccurate") else "")
    )
    return "\n".join(lines)


def _coverage(result: dict) -> list[str]:
    """Lines saying what the run left out: the kinds not asked for (--only), and an interruption."""
    lines = []
    kinds = result.get("kinds")
    if kinds is not None and set(kinds) != set(KINDS):
        lines.append(f"Measured only: {', '.join(kinds)} (--only); the other tables are empty.")
    if result.get("interrupted"):
        lines.append(
            f"**Interrupted** {result['interrupted']} (a deadline): every table holds only the rows measured"
            " before it."
        )
    return lines


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "**missed**")


def format_markdown(result: dict) -> str:
    """Markdown report: device, software, command, the device's measured peaks, the two targets'
    verdicts, then every measured shape (SDPA refusals listed under their table)."""
    dev, sw, m, s = result["device"], result["software"], result["model"], result["summary"]
    copy, mm = dev["copy_gbs"], dev["matmul_tflops"]
    decode_frac, extend_ratio = (
        s["decode_min_fraction_of_copy_bw_at_long_context"],
        s["extend_geomean_ratio_vs_sdpa_flash"],
    )
    lines = [
        f"# Attention kernels on {dev['name']}",
        "",
        f"torch {sw['torch']}, triton {sw['triton']}, Python {sw['python']}; {m['num_q_heads']} query heads, "
        f"{m['num_kv_heads']} KV heads, head dim {m['head_dim']}, {m['dtype']}.",
        f"Command: `{result['command']}`. Timing: {result['timing']}.",
        *_coverage(result),
        "",
        f"Measured on this device: copy **{copy:,.0f} GB/s** (read + write), "
        f"matmul **{mm:,.0f} TF/s** ({m['dtype']}).",
        "",
        "| target | measured | goal | verdict |",
        "|---|---:|---:|---|",
        f"| decode: worst Triton bandwidth at context >= {LONG_CONTEXT}, of copy bandwidth "
        f"| {_fmt(decode_frac, '.0%')} | >= 70% | {_verdict(s['decode_target_met'])} |",
        f"| extend: Triton / flash SDPA, geomean (min {_fmt(s['extend_min_ratio_vs_sdpa_flash'], '.2f')}) "
        f"| {_fmt(extend_ratio, '.2f')} | >= 0.80 | {_verdict(s['extend_target_met'])} |",
        "",
        "The decode verdict is on single replays (one graph per call). Per layer in a stack of layers replayed"
        " as one graph, as a model step runs them, the worst row at context >= "
        f"{LONG_CONTEXT} reaches {_fmt(s.get('decode_min_fraction_in_layer_stack_at_long_context'), '.0%')}"
        " of copy bandwidth. With both kernels launched as programmatic dependents (DecodeConfig.pdl, off by"
        f" default) it reaches {_fmt(s.get('decode_min_fraction_with_pdl_at_long_context'), '.0%')} in single"
        f" replays and {_fmt(s.get('decode_min_fraction_in_layer_stack_with_pdl_at_long_context'), '.0%')}"
        " per layer of a stack. With the next tile's K/V prefetched into registers (DecodeConfig.prefetch,"
        f" off by default) it reaches {_fmt(s.get('decode_min_fraction_with_prefetch_at_long_context'), '.0%')}"
        " in single replays and"
        f" {_fmt(s.get('decode_min_fraction_in_layer_stack_with_prefetch_at_long_context'), '.0%')} per layer"
        " of a stack; with the prefetch and PDL together"
        f" {_fmt(s.get('decode_min_fraction_with_prefetch_pdl_at_long_context'), '.0%')} and"
        f" {_fmt(s.get('decode_min_fraction_in_layer_stack_with_prefetch_pdl_at_long_context'), '.0%')}."
        " With the next tile's slots loaded before each tile's K/V are waited on (DecodeConfig.prefetch_slots,"
        f" off by default) {_fmt(s.get('decode_min_fraction_with_slots_at_long_context'), '.0%')} and"
        f" {_fmt(s.get('decode_min_fraction_in_layer_stack_with_slots_at_long_context'), '.0%')}; with PDL too"
        f" {_fmt(s.get('decode_min_fraction_with_slots_pdl_at_long_context'), '.0%')} and"
        f" {_fmt(s.get('decode_min_fraction_in_layer_stack_with_slots_pdl_at_long_context'), '.0%')}; on 64-token"
        " tiles of 3 stages, their K/V copies buffered twice (decode_attention.PIPELINED_TILES),"
        f" {_fmt(s.get('decode_min_fraction_with_pipelined_at_long_context'), '.0%')} and"
        f" {_fmt(s.get('decode_min_fraction_in_layer_stack_with_pipelined_at_long_context'), '.0%')}.",
        "",
        "Where the extend grid is too small for the SMs, each request's prefix split over several programs"
        " (ExtendConfig.split_prefix; the default over a prefix of 8,192 tokens or more) runs at "
        f"{_fmt(s.get('extend_split_speedup_geomean'), '.2f')}x the unsplit kernel's TF/s (geomean; min "
        f"{_fmt(s.get('extend_split_speedup_min'), '.2f')}).",
        "",
        "## Extend (prefill over a cached prefix)",
        "",
        "Triton runs with the tiles the worker takes for the batch (its longest cached prefix picks them:"
        " kernels.extend_attention.default_config); where those differ from the tiles without the hint,"
        " the next columns time those too. Where the batch's grid is too small for the SMs (few new tokens),"
        " the last columns time the worker's tiles with each request's prefix split over several programs"
        " and merged (ExtendConfig.split_prefix; the default over a prefix of 8,192 tokens or more) and"
        " without: the most parts a prefix takes, TF/s split and unsplit (one of the two is the default's).",
        "",
        "| batch | prefix | new | Triton TF/s | SDPA flash TF/s | Triton / SDPA | of matmul peak | rel err "
        "| tiles | without the hint: tiles | TF/s | prefix split: parts | TF/s | unsplit TF/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    refused = []
    for r in result["extend"]:
        lines.append(
            f"| {r['batch']} | {r['prefix']} | {r['new']} | {r['triton_tflops']:.1f} "
            f"| {_fmt(r.get('sdpa_tflops'), '.1f')} | {_fmt(r.get('ratio_vs_sdpa'), '.2f')} "
            f"| {r['triton_tflops'] / mm:.0%} | {_fmt(extend_error(r), '.1e')} | {tiles(r.get('config'))} "
            f"| {tiles(r.get('config_blind'))} | {_fmt(r.get('triton_blind_tflops'), '.1f')} "
            f"| {_fmt(r.get('split_cap'), 'd')} | {_fmt(r.get('triton_split_tflops'), '.1f')} "
            f"| {_fmt(r.get('triton_unsplit_tflops'), '.1f')} |"
        )
        if "sdpa_error" in r:
            refused.append(f"- extend b={r['batch']} prefix={r['prefix']} new={r['new']}: {r['sdpa_error']}")
    lines += extend_fp8_table(result["extend"])
    lines += [
        "",
        "## Decode (one query token per request)",
        "",
        "Triton and SDPA timed as CUDA-graph replays (how the worker runs decode steps) where the row has"
        " them; the eager columns are single calls from Python, launch cost included. The dirty-L2 column"
        " replays Triton after a flush that writes L2 full (triton.testing.do_bench's), so the call also"
        " writes those lines back. The fused-merge column replays Triton with the merge done by each"
        " request's last split (DecodeConfig.fused_merge: one launch instead of two). The stacked column"
        " replays the call once per layer of a stack (each layer over its own copy of the K/V) in one graph"
        " and divides by the layers: the graph's launch is shared, as in a model step. The PDL columns"
        " replay both kernels launched as programmatic dependents (DecodeConfig.pdl: each may launch while"
        " the kernel before it drains), single and stacked. The prefetch columns replay a split kernel that"
        " loads the next tile's K/V into registers before it computes each tile (DecodeConfig.prefetch,"
        " decode_attention.PREFETCH_TILES), single and stacked, alone and with PDL. The slots columns replay"
        " the default's tiles loading the next tile's slots before each tile's K/V are waited on"
        " (DecodeConfig.prefetch_slots), single and stacked, alone and with PDL; the pipelined columns the same"
        " on 64-token tiles of 3 stages (decode_attention.PIPELINED_TILES: the K/V copies buffered twice), where"
        " those are not the default's.",
        "",
        "| batch | context | Triton GB/s | SDPA flash GB/s | Triton / SDPA | of copy bw "
        "| Triton, stacked GB/s (layers) | PDL GB/s | PDL, stacked GB/s | Triton, fused merge GB/s "
        "| prefetch GB/s | prefetch, stacked GB/s | prefetch + PDL GB/s | prefetch + PDL, stacked GB/s "
        "| slots GB/s | slots, stacked GB/s | slots + PDL GB/s | slots + PDL, stacked GB/s "
        "| pipelined GB/s | pipelined, stacked GB/s | Triton, dirty L2 GB/s | Triton eager GB/s | SDPA eager GB/s | rel err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
        "|---:|---:|",
    ]
    for r in result["decode"]:
        triton, sdpa = decode_rates(r)
        expanded = " (K/V expanded)" if r.get("sdpa_kv_expanded") else ""
        stack_layers = f" ({r['stack_layers']})" if "stack_layers" in r else ""
        candidates = "".join(
            f"| {_fmt(r.get(f'triton_{name}_graph_gbs'), ',.0f')} " for name in DECODE_COLUMNS
        )
        lines.append(
            f"| {r['batch']} | {r['context']} | {triton:,.0f} | {_fmt(sdpa, ',.0f')}{expanded} "
            f"| {_fmt(None if sdpa is None else triton / sdpa, '.2f')} | {triton / copy:.0%} "
            f"| {_fmt(r.get('triton_stack_graph_gbs'), ',.0f')}{stack_layers} {candidates}"
            f"| {_fmt(r.get('triton_graph_dirty_gbs'), ',.0f')} | {r['triton_gbs']:,.0f} | {_fmt(r.get('sdpa_gbs'), ',.0f')} | {_fmt(decode_error(r), '.1e')} |"
        )
        if "sdpa_error" in r:
            refused.append(f"- decode b={r['batch']} ctx={r['context']}: {r['sdpa_error']}")
        if "sdpa_graph_error" in r:
            refused.append(f"- decode b={r['batch']} ctx={r['context']}, replayed: {r['sdpa_graph_error']}")
    if refused:
        lines += ["", "Flash SDPA refused these shapes (no baseline):", "", *refused]
    lines += candidates_table(s.get("decode_candidate_speedups") or {})
    lines += timeline_table(
        result["decode"], "context", ("split", "merge"), "Batch-1 calls", dev.get("graph_floor_us")
    )
    lines += read_table(result["decode"], copy)
    lines += fp8_table(result["decode"], copy)
    if result.get("lora"):
        lines += [
            "",
            "## LoRA deltas (kernels/lora.py), one decode step's gate/up projection",
            "",
            "Llama-3-8B's gate/up shape (4096 -> 28672), rank 16 per part (32 stacked), one row per request,"
            " each adapter on an equal run of neighbouring requests (the worker orders a step so). Against the same deltas as torch ops per adapter (index_select,"
            " two matmuls, index_add: the worker's path before the kernels). Both replayed as CUDA graphs"
            " and eager; GB/s counts each distinct adapter's weights once, x, and out read and written."
            " Triton takes the worker's segments (neighbouring requests of one adapter joined, up to 16 rows:"
            " kernels.reference.lora_segments) with the default configuration (sm_90: the expand's programs"
            " taking 256 out columns each, both kernels launched as programmatic dependents); the per-request"
            " column replays one segment per request; the next ones the joined segments with the default"
            " changed: launched plainly (LoraConfig.pdl off), 128 out columns a program (LoraConfig.block_n),"
            " both (the default before Hopper), and with the expand loading the shrink's partials several"
            " splits a load, beside B and its rows of out (LoraConfig.batched_partials).",
            "",
            "| requests | adapters | segments | Triton us | Triton GB/s | of copy bw | per-request segments us "
            + "".join(f"| {label} us " for label, _ in LORA_CANDIDATES.values())
            + "| torch per adapter us | torch / Triton | Triton eager us | torch eager us | rel err |",
            "|---:" * (12 + len(LORA_CANDIDATES)) + "|",
        ]
        for r in result["lora"]:
            lines.append(
                f"| {r['batch']} | {r['adapters']} | {r.get('segments', '-')} | {r['triton_graph_ms'] * 1e3:.1f} "
                f"| {r['triton_graph_gbs']:,.0f} | {r['triton_graph_gbs'] / copy:.0%} "
                f"| {_us(r.get('triton_per_request_graph_ms'))} "
                f"| {' | '.join(_us(r.get(f'triton_{name}_graph_ms')) for name in LORA_CANDIDATES)} "
                f"| {r['torch_graph_ms'] * 1e3:.1f} "
                f"| {r['torch_graph_ms'] / r['triton_graph_ms']:.2f} | {r['triton_ms'] * 1e3:.1f} "
                f"| {r['torch_ms'] * 1e3:.1f} | {_fmt(lora_error(r), '.1e')} |"
            )
        lines += ["", lora_candidates_summary(result["lora"])]
        lines += timeline_table(
            [r | {"requests x adapters": f"{r['batch']} x {r['adapters']}"} for r in result["lora"]],
            "requests x adapters", ("shrink", "expand"), "LoRA deltas", dev.get("graph_floor_us"),
        )  # fmt: skip
    if result.get("verify"):
        lines += [
            "",
            "## Verify steps: few new tokens per request over a long prefix",
            "",
            "Speculative decoding's verify step (the new tokens' K/V already in the pool): kernels/extend_short.py"
            " (each KV head read once for its query heads and tokens, split over the SMs) against the extend"
            " kernel, both replayed as CUDA graphs. GB/s counts each request's K/V read once, q and the output."
            " Rows: (token, query head) rows a program takes (extend_short.block_rows), each such block of a"
            " request's tokens reading its KV once. The PDL column replays the short extend's kernels launched"
            " as programmatic dependents, the slots column with each tile's slots loaded a tile ahead"
            " (DecodeConfig.prefetch_slots); the 16-row and 64-row columns the same kernels at 16 rows a program"
            " and at 64 (on 64-token tiles), where those differ from the default's.",
            "",
            "| batch | prefix | new | rows | short-extend us | GB/s | of copy bw | extend kernel us | extend / short "
            "| short-extend PDL us | slots us | 16-row us | 64-row us | rel err |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["verify"]:
            candidates = "".join(f"| {_us(r.get(f'short_{name}_graph_ms'))} " for name in VERIFY_CANDIDATES)
            lines.append(
                f"| {r['batch']} | {r['prefix']} | {r['new']} | {r.get('block_rows', '-')} "
                f"| {r['short_graph_ms'] * 1e3:.1f} | {r['short_graph_gbs']:,.0f} | {r['short_graph_gbs'] / copy:.0%} "
                f"| {r['extend_graph_ms'] * 1e3:.1f} | {r['extend_graph_ms'] / r['short_graph_ms']:.2f} "
                f"{candidates}| {_fmt(verify_error(r), '.1e')} |"
            )
    if s.get("inaccurate"):
        lines += [
            "",
            f"**Inaccurate** (rel err past {MAX_REL_ERR:.0e} or NaN): " + "; ".join(s["inaccurate"]),
        ]
    if result.get("compiled"):
        lines += ["", "## Compiled kernels (as loaded on this GPU)", "", compiled_table(result["compiled"])]
    return "\n".join(lines) + "\n"


# timeline variant -> its replay time
TIMED = {
    "default": "triton_graph_ms",
    "pdl": "triton_pdl_graph_ms",
    "prefetch": "triton_prefetch_graph_ms",
    "prefetch_pdl": "triton_prefetch_pdl_graph_ms",
    "slots": "triton_slots_graph_ms",
    "slots_pdl": "triton_slots_pdl_graph_ms",
    "pipelined": "triton_pipelined_graph_ms",
    "fused": "triton_fused_graph_ms",
    **{name: f"triton_{name}_graph_ms" for name in LORA_CANDIDATES},  # LoRA's
}


def timeline_table(
    rows: list[dict],
    shape_key: str,
    kernels: tuple[str, str],
    title: str,
    graph_floor_us: float | None = None,
) -> list[str]:
    """Markdown lines: the rows' profiled kernel timelines (kernels.bench.split_merge_times over a launch
    pair, ``kernels`` naming its first and second kernel) beside each variant's event-timed replay, and
    the device's one-kernel graph replay time when measured; none when no row has a timeline."""
    first, second = kernels
    timed = [(r, name, t) for r in rows for name, t in (r.get("timeline") or {}).items() if t]
    errors = [f"- {shape_key}={r[shape_key]}: {r['timeline_error']}" for r in rows if r.get("timeline_error")]
    lines = ["", f"The CUDA profiler failed on these rows ({title.lower()}):", "", *errors] if errors else []
    if not timed:
        return lines
    return [
        "",
        f"### {title}, kernel by kernel",
        "",
        f"Medians over replays recorded by the CUDA profiler (CUPTI), L2 flushed before each: the {first} kernel,"
        f" the gap from its end to the {second}'s start (negative: the {second} started first, as PDL allows),"
        f" the {second}, and the span from the {first}'s start to the {second}'s end. The replay column is the"
        " event-timed replay from the table above; replay minus span is what the graph launch and the events"
        " add around the kernels. A variant with no gap and no second kernel launches one kernel alone (the"
        " merge fused into it). The profiler's own overhead can shift these by a little."
        + (
            ""
            if graph_floor_us is None
            else f" For scale: a graph of one kernel on one element replays in {graph_floor_us:.1f} us here."
        ),
        "",
        f"| {shape_key} | variant | replay us | {first} us | gap us | {second} us | span us | replay - span us |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
        *(_timeline_line(r[shape_key], r, name, t) for r, name, t in timed),
        *lines,
    ]


def extend_fp8_table(rows: list[dict]) -> list[str]:
    """Extend over a prefix in an fp8 pool (--kv-cache-dtype), where rows measured it (those with a prefix):
    the speed-up is against the same row's 16-bit pool call."""
    rows = [r for r in rows if "triton_fp8_ms" in r or "triton_fp8_error" in r]
    if not rows:
        return []
    lines = ["", f"### Extend over an fp8 KV pool ({rows[0].get('fp8_pool', 'fp8')})", "",
             "The worker's extend call with the same cached prefix stored in one byte a value; the error is"
             " against SDPA over the fp8 values widened back.", "",
             "| batch | prefix | new | TF/s | speed-up over the 16-bit pool | rel err |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        shape = f"| {r['batch']} | {r['prefix']} | {r['new']} "
        if "triton_fp8_error" in r:
            lines.append(f"{shape}| {r['triton_fp8_error']} |||")
            continue
        lines.append(
            f"{shape}| {r['triton_fp8_tflops']:.1f} | {_fmt(r.get('fp8_speedup'), '.2f')}x "
            f"| {_fmt(r.get('rel_err_fp8_vs_sdpa'), '.1e')} |"
        )
    return lines


def fp8_table(rows: list[dict], copy_gbs: float) -> list[str]:
    """Decode over an fp8 pool (--kv-cache-dtype), where rows measured it: its bandwidth counts the bytes
    it reads (one a K/V value), the speed-up is against the same row's 16-bit pool replay; then, for each
    of kernels.bench.fp8_candidates over the same pool, its GB/s, the default's speed-up over it and its
    error."""
    rows = [r for r in rows if "triton_fp8_graph_ms" in r or "triton_fp8_error" in r]
    if not rows:
        return []
    lines = ["", f"### fp8 KV pool ({rows[0].get('fp8_pool', 'fp8')})", "",
             "The default kernels over the same K/V stored in one byte a value (`--kv-cache-dtype`), replayed"
             " alone and per layer of a stack; the error is against SDPA over the fp8 values widened back.", "",
             "Candidates: `flip_f16` is the default with its widening to fp16 (DecodeConfig.fp8_f16) flipped,"
             " `short_tiles` decode_attention.FP8_SHORT_TILES (the fp8 default before 2026-11-29's tune), `pdl`"
             " the default with programmatic dependent launch flipped, `slots` the default with its slots loaded a"
             " tile ahead (DecodeConfig.prefetch_slots) flipped; each column pair is the candidate's GB/s and the"
             " default's speed-up over it.", "",
             "| batch | context | GB/s | of copy bw | stacked GB/s | of copy bw | speed-up over the 16-bit pool | rel err "
             "| flip_f16 GB/s | default / flip_f16 | short_tiles GB/s | default / short_tiles | pdl GB/s "
             "| default / pdl | slots GB/s | default / slots |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if "triton_fp8_error" in r:
            lines.append(f"| {r['batch']} | {r['context']} | {r['triton_fp8_error']} ||||||||||||||")
            continue
        gbs, stacked = r["triton_fp8_graph_gbs"], r["triton_fp8_stack_graph_gbs"]
        cands = "".join(
            f"| {r.get(f'triton_fp8_{n}_error') or _fmt(r.get(f'triton_fp8_{n}_graph_gbs'), ',.0f')} "
            f"| {times(r.get(f'fp8_default_over_{n}'))} "
            for n in FP8_CANDIDATES
        )
        lines.append(
            f"| {r['batch']} | {r['context']} | {gbs:,.0f} | {gbs / copy_gbs:.0%} | {stacked:,.0f} "
            f"| {stacked / copy_gbs:.0%} | {_fmt(r.get('fp8_speedup'), '.2f')}x "
            f"| {_fmt(r.get('rel_err_fp8_vs_sdpa'), '.1e')} {cands}|"
        )
    return lines


def read_table(rows: list[dict], copy_gbs: float) -> list[str]:
    """Markdown lines: each decode row measured beside one plain read of its bytes (kernels.bench's
    read_graph fields), and the rows where that yardstick failed; none when no row has it."""
    timed = [r for r in rows if "read_graph_ms" in r]
    errors = [f"- context={r['context']}: {r['read_error']}" for r in rows if r.get("read_error")]
    lines = ["", "The plain read failed on these rows:", "", *errors] if errors else []
    if not timed:
        return lines
    return [
        "",
        "### Batch-1 calls beside one plain read of the same bytes",
        "",
        "A CUDA graph of one kernel that only reads as many bytes as the row's call (kernels/stream.py: each"
        " program reads a contiguous 32 KB block), replayed and timed as the call is: what any single kernel"
        " of this size reaches in this harness, its launch, ramp and tail included. The copy bandwidth is a"
        " 1 GiB copy's, where they are negligible.",
        "",
        "| context | MB | Triton replay us | of copy bw | plain read us | of copy bw | Triton / read |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['context']} | {r['bytes'] / 1e6:.1f} | {r['triton_graph_ms'] * 1e3:.1f} "
            f"| {r['triton_graph_gbs'] / copy_gbs:.0%} | {r['read_graph_ms'] * 1e3:.1f} "
            f"| {r['read_graph_gbs'] / copy_gbs:.0%} | {r['triton_graph_ms'] / r['read_graph_ms']:.2f} |"
            for r in timed
        ),
        *lines,
    ]


def _timeline_line(shape: object, row: dict, name: str, t: dict) -> str:
    replay = row.get(TIMED.get(name, ""))
    replay_us = None if replay is None else replay * 1e3
    return (
        f"| {shape} | {name} | {_fmt(replay_us, '.1f')} | {t['split_us']:.1f} | {_fmt(t['gap_us'], '.1f')} "
        f"| {_fmt(t['merge_us'], '.1f')} | {t['span_us']:.1f} "
        f"| {_fmt(None if replay_us is None else replay_us - t['span_us'], '.1f')} |"
    )


def lora_candidates_summary(rows: list[dict]) -> str:
    """One line: on how many LoRA rows each candidate's graph replay beat the default's, and its geomean
    speedup (a default changes only where a candidate wins on every row)."""
    said = []
    for name, (label, _) in LORA_CANDIDATES.items():
        key = f"triton_{name}_graph_ms"
        pairs = [(r["triton_graph_ms"], r[key]) for r in rows if r.get("triton_graph_ms") and r.get(key)]
        if pairs:
            wins = sum(new < old for old, new in pairs)
            speedup = statistics.geometric_mean(old / new for old, new in pairs)
            said.append(f"{label} faster on {wins} of {len(pairs)} rows, {speedup:.2f}x")
    return "Against the default's replay: " + ("; ".join(said) if said else "no candidate timed") + "."


def compiled_table(rows: list[dict]) -> str:
    """Markdown table of kernels.compile_check.loaded_kernels() rows: tiles, launch shape, resources."""
    lines = [
        "| kernel | tiles | warps | stages | smem KiB | registers | spills |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tiles = " ".join(f"{k}={v}" for k, v in r["constants"].items() if k.startswith("BLOCK"))
        lines.append(
            f"| {r['kernel']} | {tiles} | {r['num_warps']} | {r['num_stages']} | {r['shared_bytes'] / 1024:.1f} "
            f"| {_fmt(r['regs'], 'd')} | {_fmt(r['spills'], 'd')} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- two runs side by side

COMPARED = (  # (kind, shape keys, the number compared, higher is better); a number neither run has is left out
    ("extend", ("batch", "prefix", "new"), "triton_tflops", True),
    ("decode", ("batch", "context"), "triton_graph_gbs", True),
    ("decode", ("batch", "context"), "triton_stack_graph_gbs", True),
    ("decode", ("batch", "context"), "triton_pdl_graph_gbs", True),
    ("lora", ("batch", "adapters"), "triton_graph_ms", False),
    *(("lora", ("batch", "adapters"), f"triton_{name}_graph_ms", False) for name in LORA_CANDIDATES),
    ("verify", ("batch", "prefix", "new"), "short_graph_ms", False),
    *(("verify", ("batch", "prefix", "new"), f"short_{name}_graph_ms", False) for name in VERIFY_CANDIDATES),
)


def compare_markdown(before: dict, after: dict) -> str:
    """Markdown: each shape both kernels.bench results measured, the compared number of each run and
    after / before (a time's ratio inverted, so above 1 is faster). The devices are named: runs on two
    machines of one kind compare those machines too."""
    lines = [
        f"# kernels.bench: {before['device']['name']} ({before.get('command', '?')}) against "
        f"{after['device']['name']} ({after.get('command', '?')})",
        "",
        f"Copy bandwidth {before['device']['copy_gbs']:,.0f} against {after['device']['copy_gbs']:,.0f} GB/s.",
    ]
    for kind, keys, metric, higher in COMPARED:
        old = {tuple(r[k] for k in keys): r for r in before.get(kind, []) if metric in r}
        pairs = [(s, old[s], r) for r in after.get(kind, []) if metric in r for s in [tuple(r[k] for k in keys)]
                 if s in old]  # fmt: skip
        if not pairs:
            continue
        lines += ["", f"## {kind}: {metric}", "", f"| {' | '.join(keys)} | before | after | speedup |",
                  "|" + "---:|" * (len(keys) + 3)]  # fmt: skip
        for shape, b, a in pairs:
            speedup = a[metric] / b[metric] if higher else b[metric] / a[metric]
            lines.append(
                f"| {' | '.join(map(str, shape))} | {b[metric]:.4g} | {a[metric]:.4g} | {speedup:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m kernels.bench_report --compare BEFORE.json AFTER.json`: compare_markdown to stdout."""
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m kernels.bench_report", description=main.__doc__)
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), required=True)
    args = ap.parse_args(argv)
    before, after = (json.loads(Path(path).read_text(encoding="utf-8")) for path in args.compare)
    print(compare_markdown(before, after), end="")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
