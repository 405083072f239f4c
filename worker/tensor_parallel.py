"""Tensor parallelism across processes: ``--tensor-parallel-size N`` runs one model split over N ranks.

Rank 0 is the worker process itself: HTTP server, scheduler, radix cache, sampling and events are
exactly those of a one-rank worker. Ranks 1..N-1 are child processes that hold their part of the
weights and of the KV pool (their KV heads, the same pages and slots) and do nothing of their own:
before each forward rank 0 sends them the step's inputs, and every rank then runs the same forward,
meeting in each layer's sums and the logits gather (worker.model.shard; NCCL between GPUs
cuda:0..N-1, gloo between CPU processes). Host-tier copies are sent the same way, so every rank's
pages always hold the same tokens.

Control messages go over a gloo group (pickled, one broadcast per step: a few KiB of indices). A
decode step scheduled ahead (--overlap-schedule) has its input ids on rank 0's device only: they
follow the message as a broadcast on the model's group. KV moved to or from another worker
(worker.kv_transfer) is split or gathered by KV head the same way.
Ranks cannot go on without each other (a collective would wait forever), so rank 0 exits (status
1) when another rank dies, for its supervisor to restart the worker, and the other ranks exit
when rank 0 is gone.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import socket
import sys
import threading
from typing import Any

import numpy as np
import torch

from worker.forward_batch import ForwardBatch
from worker.host_cache import HostKVPool
from worker.kv_pages import read_kv, write_kv
from worker.kv_pool import KVPool, raw
from worker.model.shard import Shard

log = logging.getLogger("worker.tp")

_FIELDS = ("input_ids", "positions", "out_slots", "qo_indptr", "kv_indptr", "kv_indices")


class Channel:
    """Rank 0's messages to the other ranks, in order (a broadcast on the control group)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def send(self, msg: tuple) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([msg], src=0, group=self.group)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); None on the others."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * dist.get_world_size(self.group) if dist.get_rank() == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def recv(self) -> tuple:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def step_message(batch: ForwardBatch) -> tuple:
    """A ForwardBatch as host data, for the other ranks (each request's LoRA adapter id): the
    scheduled step's own arrays when it has one (no copy back from the device). Input ids
    sampled on the device by the step before (a step scheduled ahead) are not in it: they follow as
    a broadcast on the model's group (``None`` in their place)."""
    if batch.host is not None:
        arrays = {name: getattr(batch.host, name) for name in _FIELDS}
    else:
        arrays = {name: getattr(batch, name).cpu().numpy() for name in _FIELDS}
    if batch.inputs_on_device:
        arrays["input_ids"] = None
    rows = None if batch.logit_rows is None else batch.logit_rows.cpu().numpy()
    lora = None if batch.lora is None else batch.lora.adapters
    return ("step", batch.mode, arrays, batch.return_all_logits, rows, batch.max_extend_len, lora,
            batch.max_prefix_len, batch.verify)  # fmt: skip


def step_batch(msg: tuple, device: torch.device, stack: Any, group: Any = None) -> ForwardBatch:
    """``step_message``'s batch again, on ``device``, with this rank's parts of its adapters (from
    ``stack``, a worker.model.lora.LoraStack); input ids that were left out are received from rank
    0's broadcast on ``group``."""
    import torch.distributed as dist

    from worker.model.lora import lora_batch

    _, mode, arrays, all_logits, rows, max_extend, lora, max_prefix, verify = msg
    tensors = {name: torch.from_numpy(a).to(device) for name, a in arrays.items() if a is not None}
    if arrays["input_ids"] is None:
        tensors["input_ids"] = torch.empty(len(arrays["positions"]), dtype=torch.int64, device=device)
        dist.broadcast(tensors["input_ids"], src=0, group=group)
    batch = ForwardBatch(
        mode=mode,
        **tensors,
        return_all_logits=all_logits,
        verify=verify,
        logit_rows=None if rows is None else torch.from_numpy(rows).to(device),
        max_extend_len=max_extend,
        max_prefix_len=max_prefix,
    )
    if lora is not None:
        batch.lora = lora_batch(stack, lora, arrays["qo_indptr"], max_extend)
    return batch


class LeaderModel:
    """Rank 0's model: each forward is first sent to the other ranks. Everything else is the
    wrapped model's (config, dtype, lora, ...)."""

    def __init__(self, model: Any, channel: Channel, ranks: Ranks) -> None:
        self.model, self.channel, self.ranks = model, channel, ranks

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward(self, batch: ForwardBatch, kv_pool: Any) -> torch.Tensor:
        import torch.distributed as dist

        self.channel.send(step_message(batch))
        try:
            if batch.inputs_on_device:  # NOTE: queued on the device after the step that sampled them
                dist.broadcast(batch.input_ids.contiguous(), src=0, group=self.model.shard.group)
            return self.model.forward(batch, kv_pool)
        except BaseException:
            # NOTE: the other ranks are inside this forward's collectives now and no step can be
            # matched with them again: the worker cannot serve any more
            log.critical("forward failed on rank 0 with tensor parallelism; exiting", exc_info=True)
            _exit(1)
            raise

    def add_lora(self, adapter: Any) -> int:
        # NOTE: the other ranks take their parts of what this rank read, in step order (the directory
        # may have changed since, or be gone)
        self.channel.send(("lora_add", adapter.name, adapter.path, adapter.files))
        return self.model.add_lora(adapter)

    def remove_lora(self, adapter_id: int) -> None:
        self.channel.send(("lora_remove", adapter_id))
        self.model.remove_lora(adapter_id)

    def read_kv(self, pool: KVPool, slots: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Slabs ``lo`` .. ``hi`` of ``slots`` with every rank's KV heads (worker.kv_pages)."""
        self.channel.send(("kv_read", slots.numpy(), lo, hi))
        # NOTE: raw: the parts travel pickled, and torch cannot unpickle an fp8 tensor
        parts = self.channel.gather(raw(read_kv(pool, slots, lo, hi)))
        assert parts is not None
        return torch.cat(parts, dim=2).view(pool.dtype)

    def write_kv(self, pool: KVPool, slots: torch.Tensor, slabs: torch.Tensor, lo: int = 0) -> None:
        """Write slabs ``lo`` .. of every KV head into ``slots``: each rank takes its heads."""
        self.channel.send(("kv_write", slots.numpy(), raw(slabs), lo))
        write_heads(pool, slots, slabs, lo, self.model.shard)

    def close(self) -> None:
        self.ranks.close(self.channel)


class SyncedHostKVPool(HostKVPool):
    """Rank 0's host tier: each copy is first sent to the other ranks, which copy their KV heads."""

    def __init__(self, num_pages: int, device_pool: KVPool, channel: Channel) -> None:
        super().__init__(num_pages, device_pool)
        self.channel = channel

    def save(self, device_pages: np.ndarray, host_pages: np.ndarray) -> None:
        self.channel.send(("host_save", np.asarray(device_pages), np.asarray(host_pages)))
        super().save(device_pages, host_pages)

    def load(self, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        self.channel.send(("host_load", np.asarray(host_pages), np.asarray(device_pages)))
        super().load(host_pages, device_pages)


class Ranks:
    """Ranks 1..N-1 as child processes, watched: rank 0 exits when one of them does."""

    def __init__(self, cfg: Any, device_type: str) -> None:
        size = cfg.tensor_parallel_size
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        ctx = multiprocessing.get_context("spawn")
        args = (cfg, device_type, self.init_method, os.getpid())
        self.procs = [
            ctx.Process(target=follower_main, args=(rank, *args), name=f"tp-rank-{rank}", daemon=True)
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()
        self._closing = threading.Event()
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _watch(self) -> None:
        while not self._closing.wait(0.2):
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None and not self._closing.is_set():
                    log.critical("tensor-parallel rank %d exited (status %s); the worker cannot go on",
                                 rank, p.exitcode)  # fmt: skip
                    _exit(1)

    def close(self, channel: Channel | None) -> None:
        """Stop every rank (after the engine thread stopped: no step in flight)."""
        if self._closing.is_set():
            return
        self._closing.set()
        if channel is not None:
            channel.send(("stop",))
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        _leave_group()


def write_heads(pool: KVPool, slots: torch.Tensor, slabs: torch.Tensor, lo: int, shard: Shard) -> None:
    """This rank's KV heads of slabs ``lo`` .. ([m, n, all heads, dim]) written into ``slots``."""
    n = pool.k_cache[0].shape[1]
    write_kv(pool, slots, slabs[:, :, shard.rank * n : (shard.rank + 1) * n], lo)


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _exit(status: int) -> None:
    logging.shutdown()
    os._exit(status)


CONTROL_TIMEOUT = datetime.timedelta(days=365)  # the control group's: no idle time ends a worker


def init_rank(rank: int, size: int, init_method: str, device: torch.device) -> tuple[Shard, Channel]:
    """Join the ranks' process group: this rank's Shard (data collectives) and the control Channel."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    # NOTE: the other ranks wait on the control group for rank 0's next message however long the worker
    # idles: with torch's default timeout (30 min) an idle worker's ranks gave up, and it died. A rank
    # that dies, or hangs in a step, is told otherwise (its watch, --stall-timeout-s)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Shard(rank, size, dist.group.WORLD), Channel(control)


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")


def load_rank(cfg: Any, shard: Shard, channel: Channel, device: torch.device) -> tuple[Any, KVPool]:
    """This rank's model part and KV pool; every rank takes the smallest pool any rank can hold."""
    import torch.distributed as dist

    from worker.assembly import load_adapters, make_kv_pool, tune_cpu_process
    from worker.model import load_model
    from worker.model.loader import model_dtype

    if device.type == "cpu":
        tune_cpu_process(cfg.cpu_threads or max(1, (os.cpu_count() or 1) // shard.size))
    loaded = load_model(
        cfg.model,
        device,
        model_dtype(cfg.dtype, device),
        shard=shard,
        max_model_len=cfg.max_model_len,
        mxfp4_experts=cfg.mxfp4_experts,
        fp8_weights=cfg.fp8_weights,
        quantization=cfg.quantization,
        fp8_activations=cfg.fp8_activations,
        kv_cache_dtype=cfg.kv_cache_dtype,
    )
    load_adapters(cfg, loaded.model)  # NOTE: every rank its own part, before the pool takes what is left

    def agree(pages: int) -> int:
        t = torch.tensor([pages], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=channel.group)
        return int(t.item())

    return loaded, make_kv_pool(cfg, loaded.model, device, agree)


def start_ranks(cfg: Any, device: torch.device) -> tuple[Any, KVPool, HostKVPool | None]:
    """Rank 0's side: start ranks 1..N-1, load this rank's part. Returns the loaded model (its
    ``model`` a LeaderModel), the KV pool and the host tier (synced), as build_engine uses them."""
    if device.type == "cuda" and torch.cuda.device_count() < cfg.tensor_parallel_size:
        raise ValueError(f"--tensor-parallel-size {cfg.tensor_parallel_size} needs as many GPUs; "
                         f"{torch.cuda.device_count()} visible")  # fmt: skip
    from worker.model.loader import read_config, safetensors_files, served_experts, served_precision

    # NOTE: before any rank starts; MXFP4 experts as --mxfp4-experts serves them (packed: whole blocks), an
    # fp8 checkpoint's projections as --fp8-weights does (kept: whole scale blocks on every rank)
    first = Shard(0, cfg.tensor_parallel_size)
    config = served_experts(read_config(cfg.model), cfg.mxfp4_experts, device)
    first.check(config)
    files = safetensors_files(cfg.model) if config.fp8_weights else []  # NOTE: the headers served_fp8 reads
    served_precision(config, device, first, files, cfg.fp8_weights, cfg.quantization, cfg.fp8_activations,
                     cfg.kv_cache_dtype)  # fmt: skip
    ranks = Ranks(cfg, device.type)
    shard, channel = init_rank(0, cfg.tensor_parallel_size, ranks.init_method, rank_device(device.type, 0))
    loaded, pool = load_rank(cfg, shard, channel, rank_device(device.type, 0))
    loaded.model = LeaderModel(loaded.model, channel, ranks)
    pages = cfg.host_cache_tokens // cfg.block_size
    host = SyncedHostKVPool(pages, pool, channel) if pages > 0 else None
    log.info("tensor parallel: %d ranks (pids %s)", cfg.tensor_parallel_size, ranks.pids)
    return loaded, pool, host


def follower_main(rank: int, cfg: Any, device_type: str, init_method: str, leader_pid: int) -> None:
    """Rank ``rank`` (>= 1): load its part, then run what rank 0 sends until told to stop."""
    from router.log_level import logging_level
    from worker.model.lora import load_adapter

    logging.basicConfig(level=logging_level(cfg.log_level), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s worker.tp rank {rank}: %(message)s")  # fmt: skip

    def watch_leader() -> None:
        while os.getppid() == leader_pid:
            threading.Event().wait(0.5)
        _exit(0)  # NOTE: rank 0 is gone; nothing will ever be sent again

    threading.Thread(target=watch_leader, name="tp-leader-watch", daemon=True).start()
    try:
        device = rank_device(device_type, rank)
        shard, channel = init_rank(rank, cfg.tensor_parallel_size, init_method, device)
        loaded, pool = load_rank(cfg, shard, channel, device)
        model = loaded.model
        pages = cfg.host_cache_tokens // cfg.block_size
        host = HostKVPool(pages, pool) if pages > 0 else None
        while True:
            msg = channel.recv()
            if msg[0] == "step":
                model.forward(step_batch(msg, device, model.lora_stack, shard.group), pool)
            elif msg[0] == "kv_read":
                channel.gather(raw(read_kv(pool, torch.from_numpy(msg[1]), msg[2], msg[3])))
            elif msg[0] == "kv_write":
                write_heads(pool, torch.from_numpy(msg[1]), msg[2].view(pool.dtype), msg[3], shard)
            elif msg[0] == "lora_add":
                model.add_lora(load_adapter(msg[1], msg[2], model, msg[3]))
            elif msg[0] == "lora_remove":
                model.remove_lora(msg[1])
            elif msg[0] == "host_save":
                host.save(msg[1], msg[2])  # type: ignore[union-attr]
            elif msg[0] == "host_load":
                host.load(msg[1], msg[2])  # type: ignore[union-attr]
            elif msg[0] == "stop":
                break
        _leave_group()
    except BaseException:
        log.critical("rank %d failed", rank, exc_info=True)
        _exit(1)
