"""--fp8-activations dynamic: the input of every projection served in fp8 quantized to e4m3 per token group
(the weight's blocks' columns, or the whole row) at each call, then multiplied fp8 by fp8 (W8A8), the
experts' GEMMs' inputs too: the model is the dequantized model with exactly those inputs quantized; refused where no projection is in fp8; over
two ranks splitting block-scaled projections it answers as one rank; /v1/cache/info and the start-up log
say so."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch

from kernels import reference
from tests.worker.conftest import QWEN3_MOE, save_checkpoint
from tests.worker.test_fp8_weights import fp8_pair, logits_of
from tests.worker.test_tensor_parallel import assert_two_ranks_answer_as_one
from worker.model import load_model
from worker.model.llama import DecoderLayer
from worker.model.loader import served_activations


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    ("model_type", "overrides", "method", "strategy", "group"),
    [("llama", {}, "fp8", "block", 32), ("llama", {}, "compressed-tensors", "channel", None),
     ("qwen3_moe", QWEN3_MOE, "fp8", "block", 32)],
    ids=["blocks", "rows", "moe-blocks"],
)  # fmt: skip
def test_dynamic_activations_are_the_dequantized_model_with_its_projection_inputs_quantized(
    tmp_path, monkeypatch, model_type, overrides, method, strategy, group
):
    """16 x 32 blocks: each projection's input in runs of 32 columns (a row's for per-row scales); Qwen3-MoE's
    experts' GEMMs' inputs likewise (kernels.reference.fused_moe's fp8_activations on the dequantized
    experts, its groups from the blocks)."""
    base = save_checkpoint(tmp_path / "base", model_type, **overrides)
    fp8, _ = fp8_pair(base, tmp_path, method, strategy)
    loaded = load_model(str(fp8), fp8_weights="fp8", fp8_activations="dynamic")
    assert loaded.config.fp8_projections and loaded.config.fp8_activations
    got = logits_of(fp8, fp8_weights="fp8", fp8_activations="dynamic")
    weight_only = logits_of(fp8, fp8_weights="fp8")

    project = DecoderLayer._project

    def quantized_inputs(self, x, name, bias, ops):
        k = x.shape[-1]
        codes, scales = reference.quantize_fp8_groups(x, group or k)
        return project(
            self, reference.dequantize_fp8_groups(codes, scales, group or k).to(x.dtype), name, bias, ops
        )

    monkeypatch.setattr(DecoderLayer, "_project", quantized_inputs)
    fused_moe = reference.fused_moe  # NOTE: the CPU's ops (worker.attention.kernel_ops)
    monkeypatch.setattr(reference, "fused_moe", lambda *a, **kw: fused_moe(
        *a, **{**kw, "fp8_activations": True, "fp8_block": (16, 32) if group else None}))  # fmt: skip
    want = logits_of(fp8, fp8_weights="dequantized")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert rel(got, weight_only) > 1e-3  # NOTE: the inputs were quantized (not the weight-only model)


def test_dynamic_is_refused_where_no_projection_is_served_in_fp8(tmp_path):
    base = save_checkpoint(tmp_path / "base", "llama")
    with pytest.raises(ValueError, match="--fp8-activations dynamic: no projection is served in fp8"):
        load_model(str(base), fp8_activations="dynamic")
    fp8, _ = fp8_pair(base, tmp_path, "fp8", "block")
    with pytest.raises(ValueError, match=r"auto dequantizes on the CPU"):
        load_model(str(fp8), fp8_activations="dynamic")  # --fp8-weights auto on the CPU: dequantized
    config = load_model("tiny", quantization="fp8", fp8_activations="dynamic").config
    assert config.fp8_projections and config.fp8_activations
    assert served_activations(config, "none") == config
    with pytest.raises(ValueError, match="fp8_activations must be one of none, dynamic"):
        served_activations(config, "static")
    from worker.config import WorkerConfig

    WorkerConfig(fp8_activations="dynamic").validate()
    with pytest.raises(ValueError, match="--fp8-activations must be one of none, dynamic"):
        WorkerConfig(fp8_activations="w8a8").validate()


def test_cache_info_and_the_log_say_the_inputs_are_quantized(caplog):
    from tests.worker.test_server import LiveServer
    from worker.assembly import build_engine
    from worker.config import WorkerConfig

    cfg = WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=1024, warmup_tokens=0, quantization="fp8",
                       fp8_activations="dynamic")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="worker"):
        engine = build_engine(cfg)
    assert "their inputs quantized to fp8 per token (--fp8-activations dynamic)" in caplog.text
    with LiveServer(engine) as worker:
        info = httpx.get(worker.url + "/v1/cache/info", timeout=10).json()
        reply = httpx.post(worker.url + "/v1/completions", json={"model": "tiny", "prompt": "Hello",
                                                                 "max_tokens": 4}, timeout=30)  # fmt: skip
    assert info["fp8_projections"] == {
        "source": "quantized at load",
        "scales": "row",
        "activations": "fp8 per token",
    }
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_two_ranks_with_block_scales_answer_as_one(tmp_path):
    """Each rank's o/down input is whole 32-column runs of the full one: the same scales as one rank's."""
    base = save_checkpoint(tmp_path / "base", "llama")
    fp8, _ = fp8_pair(base, tmp_path, "fp8", "block")
    assert_two_ranks_answer_as_one(
        str(fp8),
        tmp_path,
        ["--kv-cache-tokens", "2048", "--fp8-weights", "fp8", "--fp8-activations", "dynamic"],
    )


def steps_on(
    path, device: str, fp8_activations: str, tokens: list[int] | None = None, steps: int = 4
) -> tuple[list[torch.Tensor], list[int]]:  # fmt: skip
    """The logits of a prefill and ``steps`` decode steps of the checkpoint at ``path`` kept in fp8
    (float32) on ``device``, each step fed ``tokens`` (default: its own greedy choices), and the tokens."""
    from tests.worker.test_model import PROMPT, decode, extend, new_pool, scattered_slots

    loaded = load_model(str(path), device, torch.float32, fp8_weights="fp8", fp8_activations=fp8_activations)
    ids = loaded.tokenizer.encode_prompt(PROMPT)
    pool = new_pool(loaded.config, device=device)
    [slots] = scattered_slots(pool, [len(ids) + steps])
    logits, fed = [extend(loaded.model, pool, [ids], [0], [slots]).cpu()], []
    for step in range(steps):
        fed.append(tokens[step] if tokens else int(logits[step][-1].argmax()))
        logits.append(decode(loaded.model, pool, [fed[-1]], [len(ids) + step], [slots]).cpu())
    return logits, fed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("model_type", "overrides"), [("llama", {}), ("qwen3_moe", QWEN3_MOE)])
def test_dynamic_activations_on_cuda_follow_the_cpu_reference(tmp_path, model_type, overrides):
    """The compiled kernels (a decode step quantizing inside the product, a prefill first) over a prefill
    and greedy decode steps, float32: near the CPU reference path's logits, and far nearer them than the
    16-bit-input model's (as the interpreter's model test bounds it)."""
    base = save_checkpoint(tmp_path / "base", model_type, **overrides)
    fp8, _ = fp8_pair(base, tmp_path, "fp8", "block")
    want, tokens = steps_on(fp8, "cpu", "dynamic")
    got, _ = steps_on(fp8, "cuda", "dynamic", tokens)
    unquantized, _ = steps_on(fp8, "cpu", "none", tokens)
    for step, (g, w, u) in enumerate(zip(got, want, unquantized, strict=True)):
        err, apart = rel(g, w), rel(g, u)
        assert torch.isfinite(g).all() and err < 5e-2 and err < apart / 2, (
            f"step {step}: {err:.2e}, {apart:.2e}"
        )
