"""LoRA adapters beside their base model: an adapter answers exactly as its weights merged into the
base would; base and adapter requests share batches without touching each other; their cached
prefixes stay apart and their KV events hash in the adapter's namespace; a router routes by
adapter like any model."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from router.block_hash import block_hashes, root_hash, salted
from router.kv_events import decode
from tests.support import wait_until
from worker.assembly import build_engine
from worker.config import WorkerConfig
from worker.kv_pool import PageAllocator
from worker.model import load_model
from worker.model.lora import load_adapter
from worker.radix_cache import RadixCache
from worker.radix_node import adapter_keys

from .test_server import LiveServer

TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"),  # qkv_proj, gate_up_proj: Phi-3's
    "mlp": ("gate_proj", "up_proj", "down_proj", "gate_up_proj"),
}
RANK, ALPHA = 4, 8.0
PROMPT = "Cache-aware routing sends shared prefixes to the worker that already holds them."


def write_adapter(base: Path, out: Path, seed: int = 0, rank: int = RANK) -> dict[str, torch.Tensor]:
    """A PEFT LoRA directory for every projection of the checkpoint at ``base``; returns the delta
    (scale * B @ A) per HF weight name."""
    weights = load_file(str(next(base.glob("*.safetensors"))))
    gen = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for name, w in weights.items():
        parts = name.split(".")  # model.layers.{i}.{self_attn|mlp}.{proj}.weight
        if len(parts) != 6 or parts[5] != "weight" or parts[4] not in TARGETS.get(parts[3], ()):
            continue
        a = torch.randn(rank, w.shape[1], generator=gen) * 0.3
        b = torch.randn(w.shape[0], rank, generator=gen) * 0.3
        prefix = "base_model.model." + ".".join(parts[:5])
        tensors[prefix + ".lora_A.weight"], tensors[prefix + ".lora_B.weight"] = a, b
        deltas[name] = ALPHA / rank * b @ a
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": ALPHA, "bias": "none",
              "target_modules": sorted({name.split(".")[4] for name in deltas})}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return deltas


def merged_checkpoint(base: Path, deltas: dict[str, torch.Tensor], out: Path) -> Path:
    shutil.copytree(base, out)
    path = next(out.glob("*.safetensors"))
    weights = load_file(str(path))
    save_file(
        {n: w + deltas[n] if n in deltas else w for n, w in weights.items()},
        str(path),
        metadata={"format": "pt"},
    )
    return out


@pytest.fixture(scope="module")
def lora_setup(llama_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    deltas = write_adapter(llama_checkpoint, root / "ad")
    merged = merged_checkpoint(llama_checkpoint, deltas, root / "merged")

    def serve(model: Path, **extra) -> LiveServer:
        cfg = WorkerConfig(model=str(model), device="cpu", kv_cache_tokens=4096, warmup_tokens=0, **extra)
        return LiveServer(build_engine(cfg))

    with (
        # NOTE: with speculative decoding too: every answer below also goes through verify steps
        serve(
            llama_checkpoint,
            lora_adapters=[f"ad={root / 'ad'}"],
            speculative_tokens=3,
            speculative_ngram_min=1,
        ) as both,
        serve(merged) as merged_worker,
        serve(llama_checkpoint) as base,
    ):
        yield both, merged_worker, base, root


def complete(url: str, model: str | None, prompt: str = PROMPT, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1, **extra}
    if model is not None:
        body["model"] = model
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_an_adapter_answers_like_its_weights_merged_into_the_base(lora_setup, llama_checkpoint):
    both, merged, base, _ = lora_setup
    name = llama_checkpoint.name
    for prompt in (PROMPT, "The quick brown fox", "Paged attention stores keys"):
        got, want = complete(both.url, "ad", prompt), complete(merged.url, None, prompt)
        assert got["model"] == "ad"
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        lp_got, lp_want = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
        assert lp_got["token_logprobs"] == pytest.approx(lp_want["token_logprobs"], abs=1e-4)
        # the base model, served beside the adapter, is untouched
        plain, same = complete(base.url, None, prompt), complete(both.url, name, prompt)
        assert same["choices"][0]["text"] == plain["choices"][0]["text"]
        assert same["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            plain["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4
        )
    assert got["choices"][0]["text"] != same["choices"][0]["text"]  # the adapter does change answers
    spec = [
        line
        for line in httpx.get(both.url + "/metrics").text.splitlines()
        if line.startswith("radixgate_worker_spec_verify")
    ]
    assert float(spec[0].split()[1]) > 0


@pytest.mark.parametrize("checkpoint", ["phi3_checkpoint", "granite_checkpoint", "qwen3_moe_checkpoint"])
def test_adapters_of_other_layouts_answer_like_their_weights_merged(checkpoint, request, tmp_path):
    """Phi-3 stores q/k/v and gate/up fused, and so do its adapters (qkv_proj, gate_up_proj); Granite
    scales each layer's output (its o_proj / down_proj, and so their adapters' deltas); a mixture of
    experts takes adapters on its attention: such adapters answer as their weights merged into the base do."""
    base_dir = request.getfixturevalue(checkpoint)
    deltas = write_adapter(base_dir, tmp_path / "ad", seed=3)
    fused = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert ({name.split(".")[4] for name in deltas} == fused) == (checkpoint == "phi3_checkpoint")
    merged = merged_checkpoint(base_dir, deltas, tmp_path / "merged")
    cfg = WorkerConfig(model=str(base_dir), device="cpu", kv_cache_tokens=4096, warmup_tokens=0,
                       lora_adapters=[f"ad={tmp_path / 'ad'}"])  # fmt: skip
    with LiveServer(build_engine(cfg)) as both, LiveServer(build_engine(WorkerConfig(
            model=str(merged), device="cpu", kv_cache_tokens=4096, warmup_tokens=0))) as merged_worker:  # fmt: skip
        for prompt in (PROMPT, "The quick brown fox"):
            got, want = complete(both.url, "ad", prompt), complete(merged_worker.url, None, prompt)
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
                want["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4
            )
            base = complete(both.url, base_dir.name, prompt)
            assert base["choices"][0]["text"] != got["choices"][0]["text"]


def test_base_and_adapter_requests_in_one_batch_answer_as_alone(lora_setup, llama_checkpoint):
    both, _, _, _ = lora_setup
    name = llama_checkpoint.name
    prompts = [f"{PROMPT} Question {i}." for i in range(6)]
    models = [name, "ad", "ad", name, "ad", name]
    alone = [
        complete(both.url, m, p, max_tokens=8)["choices"][0]["text"]
        for m, p in zip(models, prompts, strict=True)
    ]

    async def together() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            bodies = [
                {"prompt": p, "model": m, "max_tokens": 8, "temperature": 0}
                for m, p in zip(models, prompts, strict=True)
            ]
            answers = await asyncio.gather(
                *(client.post(both.url + "/v1/completions", json=b) for b in bodies)
            )
        return [a.json()["choices"][0]["text"] for a in answers]

    assert asyncio.run(together()) == alone


def test_adapter_prefixes_are_cached_apart(lora_setup, llama_checkpoint):
    both, _, _, _ = lora_setup
    name = llama_checkpoint.name
    prompt = "Each adapter computes its own keys and values for the same tokens, so " * 3

    def cached(model: str) -> int:
        return complete(both.url, model, prompt, max_tokens=1)["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]

    assert cached(name) == 0
    assert cached("ad") == 0  # the base's pages are not the adapter's
    assert cached("ad") > 0 and cached(name) > 0


def test_models_list_adapters_and_an_unknown_model_is_404(lora_setup, llama_checkpoint):
    both, _, _, _ = lora_setup
    models = httpx.get(both.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [llama_checkpoint.name, "ad"]
    assert models[1]["parent"] == llama_checkpoint.name
    r = httpx.post(both.url + "/v1/completions", json={"prompt": "x", "model": "other"})
    assert r.status_code == 404 and "'ad'" in r.json()["error"]["message"]
    chat = httpx.post(both.url + "/v1/chat/completions", timeout=60,
                      json={"model": "ad", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert chat.status_code == 200 and chat.json()["model"] == "ad"


def test_kv_events_of_an_adapter_hash_in_its_namespace():
    ps = 4
    cache = RadixCache(PageAllocator(16), ps, namespace="base", adapters=["ad1", "ad2"])
    tokens = np.arange(1, 9, dtype=np.int32)
    for adapter in (0, 2):
        pages = cache.allocator.alloc(2)
        assert cache.insert(adapter_keys(tokens, adapter), pages) == 0  # apart: nothing shared
    stored, _, _ = cache.drain_events()
    assert [(s.parent_hash, s.token_ids) for s in stored] == [
        (root_hash("base"), tokens.tolist()),
        (root_hash("ad2"), tokens.tolist()),
    ]
    assert stored[1].block_hashes == block_hashes(tokens.tolist(), ps, namespace="ad2")
    snapshot = {(s.parent_hash, tuple(s.block_hashes), tuple(s.token_ids)) for s in cache.snapshot()}
    assert snapshot == {(s.parent_hash, tuple(s.block_hashes), tuple(s.token_ids)) for s in stored}
    cache.check_invariants()
    assert cache.match_prefix(adapter_keys(np.append(tokens, 0), 1)).num_tokens == 0


def test_adapters_on_the_mlp_of_a_mixture_of_experts_are_refused(qwen2_moe_checkpoint, tmp_path):
    deltas = write_adapter(qwen2_moe_checkpoint, tmp_path / "ad")  # layer 1 is dense: its MLP is targeted
    assert "model.layers.1.mlp.gate_proj.weight" in deltas
    cfg = WorkerConfig(model=str(qwen2_moe_checkpoint), device="cpu", kv_cache_tokens=1024,
                       lora_adapters=[f"ad={tmp_path / 'ad'}"])  # fmt: skip
    with pytest.raises(ValueError, match="LoRA on down_proj/gate_proj/up_proj of a mixture-of-experts model"):
        build_engine(cfg)


def test_bad_adapters_are_errors_at_start(llama_checkpoint, tmp_path):
    write_adapter(llama_checkpoint, tmp_path / "r4")
    wrong = tmp_path / "wrong"
    write_adapter(llama_checkpoint, wrong)
    weights = load_file(str(wrong / "adapter_model.safetensors"))
    key = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    weights[key] = weights[key][:, :-1].contiguous()  # not the base's hidden size
    save_file(weights, str(wrong / "adapter_model.safetensors"))
    no_rank, damaged = tmp_path / "no_rank", tmp_path / "damaged"
    shutil.copytree(tmp_path / "r4", no_rank)
    (no_rank / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 8}))
    shutil.copytree(tmp_path / "r4", damaged)
    (damaged / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    nan = tmp_path / "nan"  # NOTE: Python's json reads NaN: the adapter would poison every answer
    shutil.copytree(tmp_path / "r4", nan)
    (nan / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": NaN}')
    inf = tmp_path / "inf"  # NOTE: an fp16 overflow: every answer would be NaN, and its slot's next one too
    shutil.copytree(tmp_path / "r4", inf)
    weights = load_file(str(inf / "adapter_model.safetensors"))
    key = next(k for k in weights if k.endswith("lora_B.weight"))
    weights[key][0, 0] = float("inf")
    save_file(weights, str(inf / "adapter_model.safetensors"))
    f8 = tmp_path / "f8"  # an adapter stored in float8 loads (isfinite has no float8 kernel on the CPU)
    shutil.copytree(tmp_path / "r4", f8)
    weights = load_file(str(f8 / "adapter_model.safetensors"))
    save_file(
        {k: v.to(torch.float8_e4m3fn) for k, v in weights.items()}, str(f8 / "adapter_model.safetensors")
    )
    cfg = WorkerConfig(model=str(llama_checkpoint), device="cpu", kv_cache_tokens=1024, warmup_tokens=0,
                       lora_adapters=[f"f8={f8}"])  # fmt: skip
    assert build_engine(cfg).served_models()[1:] == ["f8"]
    cases = ((f"w={wrong}", "needs A"), (f"m={tmp_path / 'missing'}", "cannot read"),
             (f"n={no_rank}", "positive integer 'r'"), (f"d={damaged}", "cannot read"),
             (f"x={nan}", "finite 'lora_alpha'"), (f"i={inf}", "holds inf or NaN"))  # fmt: skip
    for spec, words in cases:
        cfg = WorkerConfig(
            model=str(llama_checkpoint), device="cpu", kv_cache_tokens=1024, lora_adapters=[spec]
        )
        with pytest.raises(ValueError, match=words):
            build_engine(cfg)
    for adapters in (["noequals"], ["a=/x", "a=/y"], [f"{llama_checkpoint.name}=/x"]):
        with pytest.raises(ValueError):
            WorkerConfig(model=str(llama_checkpoint), lora_adapters=adapters).validate()
    with pytest.raises(ValueError):
        WorkerConfig(engine="sim", lora_adapters=[f"a={tmp_path / 'r4'}"]).validate()


def test_an_adapter_with_its_own_rank_or_alpha_per_module_is_refused(llama_checkpoint, tmp_path):
    """PEFT's rank_pattern and alpha_pattern give the modules they name their own r and lora_alpha; served with
    one scale, alpha_pattern's adapter answered unlike PEFT's, so either is refused as the adapter's own.
    Patterns that repeat r and lora_alpha change nothing and load."""
    model = load_model(str(llama_checkpoint)).model
    ad = tmp_path / "ad"
    write_adapter(llama_checkpoint, ad)
    config = json.loads((ad / "adapter_config.json").read_text())
    weights = load_file(str(ad / "adapter_model.safetensors"))
    for key, value in weights.items():  # NOTE: v_proj of rank 2, as rank_pattern {"v_proj": 2} trains it
        if ".v_proj." in key:
            weights[key] = (value[:2] if key.endswith("lora_A.weight") else value[:, :2]).contiguous()
    ranked = tmp_path / "ranked"
    shutil.copytree(ad, ranked)
    save_file(weights, str(ranked / "adapter_model.safetensors"))
    (ranked / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": {"v_proj": 2}}))
    with pytest.raises(
        ValueError, match=r"adapter 'ranked': its rank_pattern \{'v_proj': 2\} is not supported"
    ):
        load_adapter("ranked", str(ranked), model)
    (ad / "adapter_config.json").write_text(json.dumps({**config, "alpha_pattern": {"q_proj": 64}}))
    with pytest.raises(
        ValueError, match=r"adapter 'ad': its alpha_pattern \{'q_proj': 64\} is not supported"
    ):
        load_adapter("ad", str(ad), model)
    same = {**config, "rank_pattern": {"v_proj": RANK}, "alpha_pattern": {"q_proj": ALPHA}}
    (ad / "adapter_config.json").write_text(json.dumps(same))
    assert load_adapter("ad", str(ad), model).scale == ALPHA / RANK


@pytest.mark.parametrize(
    ("key", "value"),
    [("alora_invocation_tokens", [141, 344]), ("use_bdlora", {"lora_a_is_blockdiagonal": True}),
     ("layer_replication", [[0, 2], [1, 2]]), ("lora_bias", True), ("modules_to_save", ["lm_head"]),
     ("trainable_token_indices", [3, 5]), ("target_parameters", ["mlp.experts.gate_up_proj"]),
     ("arrow_config", {"top_k": 2}), ("kasa_config", {"k": 1}), ("monteclora_config", {"n": 2})],
)  # fmt: skip
def test_a_setting_that_changes_what_peft_computes_is_refused_by_name(llama_checkpoint, tmp_path, key, value):
    """Served as a plain LoRA, an activated LoRA applied to every token (4 nats from PEFT's logprobs): each
    PEFT setting beyond LoRA's own product is refused, naming it; its default values load."""
    model = load_model(str(llama_checkpoint)).model
    ad = tmp_path / "ad"
    write_adapter(llama_checkpoint, ad)
    config = json.loads((ad / "adapter_config.json").read_text())
    (ad / "adapter_config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=rf"adapter 'ad': {key} \(.+\) is not supported"):
        load_adapter("ad", str(ad), model)
    default = False if key == "lora_bias" else None  # PEFT's LoraConfig defaults
    (ad / "adapter_config.json").write_text(json.dumps({**config, key: default}))
    assert load_adapter("ad", str(ad), model).scale == ALPHA / RANK


def test_a_config_without_lora_alpha_scales_by_pefts_default(llama_checkpoint, tmp_path):
    """PEFT's LoraConfig reads a missing lora_alpha as 8 (scale 8 / r); taken as r, the adapter's delta was
    half PEFT's at r 4 (1.9 nats from its logprobs)."""
    model = load_model(str(llama_checkpoint)).model
    ad = tmp_path / "ad"
    write_adapter(llama_checkpoint, ad, rank=2)
    config = json.loads((ad / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (ad / "adapter_config.json").write_text(json.dumps(config))
    assert load_adapter("ad", str(ad), model).scale == 8 / 2
    (ad / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    assert load_adapter("ad", str(ad), model).scale == pytest.approx(8 / 2**0.5)


def test_adapters_load_and_unload_at_runtime(lora_setup, llama_checkpoint, tmp_path):
    """POST /v1/load_lora_adapter serves a new adapter between steps (answers as merged); unload
    refuses while it has requests in flight, then stops serving it; bad input is an error and
    the worker keeps serving."""
    both, merged, _, root = lora_setup
    name = llama_checkpoint.name
    url = both.url

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(url + path, json=body, timeout=60)

    assert (
        post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(root / "ad")}).status_code == 200
    )
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [name, "ad", "late"]
    assert httpx.get(url + "/health").json()["models"] == [name, "ad", "late"]
    got, want = complete(url, "late"), complete(merged.url, None)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]  # the same weights as "ad"
    for bad, status in (
        ({"lora_name": "late", "lora_path": str(root / "ad")}, 400),  # already served
        ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, 400),  # no adapter there
        ({"lora_name": "x"}, 400),
    ):
        r = post("/v1/load_lora_adapter", bad)
        assert r.status_code == status and r.json()["error"]["message"], r.text

    # a request of "late" in flight: unloading waits for it. NOTE: as long as the model's context allows, so
    # that it is still decoding when the unload arrives (40 tokens were done first on a loaded CI machine)
    room = 256 - got["usage"]["prompt_tokens"] - 1  # the checkpoint's max_position_embeddings
    body = {"model": "late", "prompt": PROMPT, "max_tokens": room, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        busy = post("/v1/unload_lora_adapter", {"lora_name": "late"})
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "adapter_in_use"
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    complete(url, "late", cache_salt="t")  # a salt's prefixes of the adapter go with it too
    assert complete(url, "late", cache_salt="t")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    def roots() -> set[int]:
        return {
            run.parent_hash
            for run in decode(httpx.get(url + "/v1/cache/snapshot", timeout=10).content).stored
        }

    assert {root_hash("late"), root_hash(salted("late", "t"))} <= roots()
    cached_before = metric(url, "radixgate_worker_kv_cached_pages")
    unloaded = post("/v1/unload_lora_adapter", {"lora_name": "late"})
    assert unloaded.status_code == 200 and unloaded.json()["freed_tokens"] > 0  # its prefixes went too
    assert not {root_hash("late"), root_hash(salted("late", "t"))} & roots()  # the salted ones too
    left = (
        cached_before - unloaded.json()["freed_tokens"] // 16
    )  # NOTE: metrics refresh after the engine's turn
    wait_until(
        lambda: metric(url, "radixgate_worker_kv_cached_pages") == left, 10, what="pages freed in metrics"
    )
    assert complete_status(url, "late") == 404
    assert post("/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    # loaded again under the same name: a fresh id, nothing cached for it
    assert (
        post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(root / "ad")}).status_code == 200
    )
    assert complete(url, "late")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(url, "late", cache_salt="t")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(url, "ad")["choices"][0]["text"] == want["choices"][0]["text"]  # the others serve on


def test_two_loads_of_one_name_at_once_serve_it_once(lora_setup):
    """Both pass the API's check before either is added (loading runs off the engine thread): the
    engine thread checks the name again, so the second is a 400, not a second adapter of that name."""
    from concurrent.futures import ThreadPoolExecutor

    from worker.model.lora import add_adapter, load_adapter

    both, _, _, root = lora_setup
    body = {"lora_name": "twin", "lora_path": str(root / "ad")}
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: httpx.post(both.url + "/v1/load_lora_adapter", json=body, timeout=60),
                                range(2)))  # fmt: skip
    assert sorted(r.status_code for r in answers) == [200, 400]
    late = load_adapter("twin", str(root / "ad"), both.engine.executor.model)  # as the second one's was
    with pytest.raises(ValueError, match="already served"):
        both.engine.post(lambda: add_adapter(both.engine, late)).result(30)
    assert both.engine.served_models().count("twin") == 1
    unload = httpx.post(both.url + "/v1/unload_lora_adapter", json={"lora_name": "twin"}, timeout=60)
    assert unload.status_code == 200 and "twin" not in both.engine.served_models()


def test_unloading_waits_for_a_request_of_the_adapter_that_waits_for_a_salt_namespace(lora_setup):
    """A salted request waits in the engine while every salt namespace is held: it is queued too, so
    its adapter's unload is refused (409) until it has run, not granted under it."""
    from concurrent.futures import ThreadPoolExecutor

    from worker.cache_salt import SaltSpaces

    both, _, _, root = lora_setup
    url, engine = both.url, both.engine
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "parked", "lora_path": str(root / "ad")},
                      timeout=60).status_code == 200  # fmt: skip
    before = engine.salts
    engine.post(lambda: setattr(engine, "salts", SaltSpaces(engine.cache, spaces=1))).result(10)
    try:
        # NOTE: the holder runs as long as the context lets it
        room = 256 - complete(url, None)["usage"]["prompt_tokens"] - 1
        hold = {"prompt": PROMPT, "max_tokens": room, "ignore_eos": True, "stream": True, "cache_salt": "x"}
        with ThreadPoolExecutor(1) as pool, httpx.stream("POST", url + "/v1/completions", json=hold,
                                                         timeout=60) as running:  # fmt: skip
            lines = running.iter_lines()  # NOTE: kept: a dropped iterator closes the stream
            next(lines)
            waiting = pool.submit(complete, url, "parked", cache_salt="y")
            wait_until(
                lambda: httpx.get(url + "/health").json()["waiting"] == 1, 20, what="the request waits"
            )
            busy = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "parked"}, timeout=60)
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "adapter_in_use", busy.text
            assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
        assert waiting.result(60)["choices"][0]["text"]  # it ran, with its adapter
    finally:
        engine.post(lambda: setattr(engine, "salts", before)).result(10)
    assert (
        httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "parked"}, timeout=60).status_code
        == 200
    )


def test_two_unloads_of_one_adapter_at_once_give_one_unload_and_one_404(lora_setup):
    """Both pass the API's check while the engine thread is busy (a long step): the second to reach the
    engine finds the adapter gone, a 404 as if it came later."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    both, _, _, root = lora_setup
    load = {"lora_name": "twice", "lora_path": str(root / "ad")}
    assert httpx.post(both.url + "/v1/load_lora_adapter", json=load, timeout=60).status_code == 200
    gate, held = threading.Event(), threading.Event()
    both.engine.post(lambda: (held.set(), gate.wait(30)))  # the engine thread held till both unloads wait
    assert held.wait(20)
    inbox = both.engine._inbox
    with ThreadPoolExecutor(2) as pool:
        unloads = [
            pool.submit(
                httpx.post, both.url + "/v1/unload_lora_adapter", json={"lora_name": "twice"}, timeout=60
            )
            for _ in range(2)
        ]
        wait_until(lambda: inbox.qsize() >= 2, 20, what="both unloads are queued for the engine")
        gate.set()
        answers = sorted((f.result().status_code, f.result().json()) for f in unloads)
    assert [status for status, _ in answers] == [200, 404], answers
    assert answers[1][1]["error"]["code"] == "model_not_found" and "twice" not in both.engine.served_models()


def test_a_request_reaching_the_engine_after_its_adapter_was_unloaded_fails_alone(lora_setup):
    """The API checks the model, then the request waits its turn: an unload in between must give
    that request a 404, not the step it would join a failed forward."""
    from worker.sampling import SamplingParams

    both, merged, _, root = lora_setup
    loaded = httpx.post(
        both.url + "/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(root / "ad")}
    )
    adapter_id = loaded.json()["adapter_id"]
    assert httpx.post(both.url + "/v1/unload_lora_adapter", json={"lora_name": "gone"}).status_code == 200

    async def submit():
        handle = both.engine.submit([5, 6, 7, 8], SamplingParams(max_tokens=2, adapter=adapter_id))
        return await asyncio.wait_for(handle.outputs.get(), 30)

    errors = both.engine.snapshot().finished.get("error", 0)
    out = asyncio.run(submit())
    assert out.finish_reason == "error" and out.error_status == 404 and "unloaded" in out.error
    assert complete(both.url, "ad")["choices"][0]["text"] == complete(merged.url, None)["choices"][0]["text"]
    assert both.engine.snapshot().finished.get("error", 0) == errors + 1  # requests_finished_total counts it


def metric(url: str, name: str) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def complete_status(url: str, model: str) -> int:
    return httpx.post(
        url + "/v1/completions", json={"prompt": "x", "model": model, "max_tokens": 1}
    ).status_code


def test_adapters_come_from_flags_and_the_environment(monkeypatch, tmp_path):
    from worker.config import parse_args

    assert parse_args(["--lora-adapter", "a=/x", "--lora-adapter", "b=/y"]).lora_adapters == ["a=/x", "b=/y"]
    monkeypatch.setenv("RADIXGATE_WORKER_LORA_ADAPTERS", "a=/x,b=/y")
    assert parse_args([]).lora_adapters == ["a=/x", "b=/y"]
    with pytest.raises(SystemExit):
        parse_args(["--lora-adapter", "a"])
    cfg = parse_args(["--max-loras", "4", "--max-lora-rank", "8"])
    assert (cfg.max_loras, cfg.max_lora_rank) == (4, 8)
    monkeypatch.setenv("RADIXGATE_WORKER_MAX_LORAS", "2")
    assert parse_args([]).max_loras == 2
    for bad in (["--max-loras", "-1"], ["--max-lora-rank", "0"], ["--max-loras", "1", "--engine", "sim"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_router_routes_an_adapter_by_its_own_prefixes(launch, lora_setup, llama_checkpoint):
    """Real processes: the router learns the adapter from /v1/models and predicts its cached prefix
    from the worker's KV events (hashed in the adapter's namespace)."""
    _, _, _, root = lora_setup
    worker = launch.module("worker", "--model", str(llama_checkpoint), "--lora-adapter", f"ad={root / 'ad'}",
                           "--device", "cpu", "--kv-cache-tokens", "4096", "--warmup-tokens", "0", timeout=120)  # fmt: skip
    router = launch.module("router", "--workers", worker.url, "--kv-events", "http")
    wait_until(lambda: httpx.get(router.url + "/v1/models", timeout=2).json()["data"] and
               {m["id"] for m in httpx.get(router.url + "/v1/models", timeout=2).json()["data"]} == {llama_checkpoint.name, "ad"},
               60, what="router sees the adapter")  # fmt: skip
    listed = {
        m["id"]: m.get("parent") for m in httpx.get(router.url + "/v1/models", timeout=5).json()["data"]
    }
    assert listed == {llama_checkpoint.name: None, "ad": llama_checkpoint.name}
    body = {"model": "ad", "prompt": PROMPT * 2, "max_tokens": 1}
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "ad"

    def predicted(model: str) -> int:
        decision = httpx.post(router.url + "/debug/route", json={**body, "model": model}, timeout=10).json()
        return decision["candidates"][0]["matched_tokens"]

    wait_until(lambda: predicted("ad") > 0, 30, what="the adapter's KV events reach the router")
    assert predicted(llama_checkpoint.name) == 0  # the base has none of it

    # an adapter loaded at runtime: the router sees it on the worker's next health report
    r = httpx.post(
        worker.url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(root / "ad")}
    )
    assert r.status_code == 200, r.text

    def late_status() -> int:
        return httpx.post(
            router.url + "/v1/completions", json={**body, "model": "late"}, timeout=60
        ).status_code

    wait_until(lambda: late_status() == 200, 30, what="the router routes the new adapter")


def stack_adapter(name: str, rank: int, projs: dict[str, tuple[int, int]], seed: int) -> tuple:
    """A LoraAdapter on ``projs`` (name -> (out, in)) of both layers of a 2-layer model, and a copy
    of its (A, B) pairs (the stack empties the adapter's own)."""
    from worker.model.lora import LoraAdapter

    g = torch.Generator().manual_seed(seed)
    adapter = LoraAdapter(name, rank, 1.0)
    for layer in range(2):
        for proj, (out, inp) in projs.items():
            adapter.weights[(layer, proj)] = (
                torch.randn(rank, inp, generator=g),
                torch.randn(out, rank, generator=g),
            )
    return adapter, dict(adapter.weights)


def test_the_stack_gives_each_request_its_own_adapters_delta_as_adapters_come_and_go():
    from worker.model.lora import LoraStack, lora_batch

    dims = {"qkv": (12, 8), "o": (8, 8), "gate_up": (10, 8), "down": (8, 5)}
    stack = LoraStack(dims, 2, torch.device("cpu"), torch.float32)
    a1, w1 = stack_adapter("one", 2, {"qkv": dims["qkv"], "down": dims["down"]}, 1)
    a2, w2 = stack_adapter("two", 5, dims, 2)  # a larger rank: the stack grows, keeping "one"
    stack.add(1, a1)
    version = stack.version
    stack.add(2, a2)
    assert stack.version > version and not a1.weights and not a2.weights
    assert stack.slot_of == {1: 0, 2: 1}

    def check(per_request: list[int], weights: dict[int, dict]) -> None:
        """Each projection of both layers over 3 requests of 1, 2 and 3 rows: a request's rows gain
        its adapter's delta, nothing else."""
        indptr = torch.tensor([0, 1, 3, 6], dtype=torch.int32)
        batch = lora_batch(stack, per_request, indptr)
        owner = torch.repeat_interleave(torch.tensor(per_request), torch.tensor([1, 2, 3]))
        g = torch.Generator().manual_seed(9)
        for layer in range(2):
            for proj, (out, inp) in dims.items():
                x, base = torch.randn(6, inp, generator=g), torch.randn(6, out, generator=g)
                got = batch.apply(layer, proj, x, base.clone())
                want = base.clone()
                for row, adapter_id in enumerate(owner.tolist()):
                    pair = weights.get(adapter_id, {}).get((layer, proj))
                    if pair is not None:
                        want[row] += x[row] @ pair[0].t() @ pair[1].t()
                torch.testing.assert_close(got, want)

    check([1, 0, 2], {1: w1, 2: w2})
    check([2, 2, 1], {1: w1, 2: w2})
    stack.remove(1)
    a3, w3 = stack_adapter("three", 1, {"gate_up": dims["gate_up"]}, 3)
    version = stack.version
    stack.add(3, a3)  # NOTE: "one"'s slot, cleared: "three" has no qkv or down delta
    assert stack.slot_of == {2: 1, 3: 0} and stack.version == version
    check([3, 2, 0], {2: w2, 3: w3})
    # a slot's B is cleared too: a zero A row times a B left non-finite is NaN, not 0
    stack.b["qkv"][:, 0] = float("inf")
    stack.remove(3)
    a4, w4 = stack_adapter("four", 1, {"o": dims["o"]}, 4)
    stack.add(4, a4)
    check([4, 2, 0], {2: w2, 4: w4})


def test_room_made_at_start_up_takes_adapters_without_moving_the_stack():
    """--max-loras / --max-lora-rank: adapters within the room keep the tensors (CUDA graphs hold their
    addresses); one past it makes the stack grow."""
    from types import SimpleNamespace

    from worker.assembly import load_adapters
    from worker.model.lora import LoraStack

    dims = {"qkv": (12, 8), "o": (8, 8), "gate_up": (10, 8), "down": (8, 5)}
    stack = LoraStack(dims, 2, torch.device("cpu"), torch.float32)
    load_adapters(SimpleNamespace(max_loras=2, max_lora_rank=4, lora_adapters=[]),
                  SimpleNamespace(lora_stack=stack))  # fmt: skip
    assert (
        stack.slots == 2
        and stack.a["qkv"].shape == (2, 2, 12, 8)
        and stack.b["gate_up"].shape == (2, 2, 10, 8)
    )
    # per layer and slot: A rank x in and B out x rank for q/k/v (rank 12), o (4), gate/up (8), down (4)
    assert stack.nbytes() == 4 * 2 * 2 * (12 * 8 + 12 * 12 + 4 * 8 + 8 * 4 + 8 * 8 + 10 * 8 + 4 * 5 + 8 * 4)
    version = stack.version
    a1, w1 = stack_adapter(
        "one", 4, {"qkv": dims["qkv"], "down": dims["down"]}, 1
    )  # q/k/v stack: 12 <= 3 x 4
    a2, _ = stack_adapter("two", 2, dims, 2)
    stack.add(1, a1)
    stack.add(2, a2)
    assert stack.version == version
    x = torch.randn(1, 8)
    batch = SimpleNamespace(indptr=torch.tensor([0, 1], dtype=torch.int32), slots=torch.tensor([0], dtype=torch.int32),
                            max_rows=1, groups=None, fixed=True)  # fmt: skip
    a, b = w1[(1, "qkv")]
    torch.testing.assert_close(stack.apply(1, "qkv", x, torch.zeros(1, 12), batch), x @ a.t() @ b.t())
    a3, _ = stack_adapter("three", 1, {"o": dims["o"]}, 3)
    stack.add(3, a3)  # NOTE: a third adapter: past the room
    assert stack.version > version and stack.slots == 3
    engine = build_engine(
        WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=256, max_loras=3, max_lora_rank=2)
    )
    tiny_stack = engine.executor.model.lora_stack
    assert tiny_stack.slots == 3 and tiny_stack.a["qkv"].shape[2] == 6 and not tiny_stack.slot_of
