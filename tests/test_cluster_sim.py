"""The fleet simulator: real policies, index and radix caches under a deterministic cost-model clock."""

from __future__ import annotations

import math

import orjson
import pytest

from loadtest.cluster_sim import (
    ClusterSim,
    SimConfig,
    TraceSource,
    WorkerModel,
    WorkloadSource,
    main,
    parse_run,
)
from router.block_hash import block_hashes


def run(policy: str, source, workers: int = 4, **kw) -> tuple[dict, ClusterSim]:
    model = kw.pop("model", WorkerModel(kv_tokens=8192))
    sim = ClusterSim(SimConfig(workers, policy, kw.pop("params", {}), model=model, **kw), source)
    return sim.run(), sim


def tenants(n: int = 300, **options) -> WorkloadSource:
    return WorkloadSource("tenants", n, 40.0, 16, 0, {"num_tenants": 16, "system_tokens": 1024, **options})


def assert_fleet_consistent(sim: ClusterSim) -> None:
    """Nothing running is left holding pages, and every cache's pages are accounted for."""
    for r in sim.routers:  # every replica's count of in-flight requests and pending prefill is back to 0
        assert all(v.in_flight == 0 and v.pending_prefill == 0 for v in r.workers)
    for w in sim.workers:
        w.cache.check_invariants()
        assert not w.has_work()
        assert w.cache.protected_pages == 0
        assert w.alloc.num_free + w.cache.total_pages == w.alloc.num_pages


@pytest.mark.parametrize(
    "policy", ["round_robin", "random", "least_load", "prefix_hash", "cache_aware", "sticky"]
)
def test_every_policy_completes_the_workload_and_leaves_caches_consistent(policy):
    summary, sim = run(policy, tenants(), params={"seed": 1} if policy in ("random", "least_load") else {})
    assert summary["simulated"] is True
    assert summary["completed"] == summary["requests"] == 300
    assert summary["rejected"] == 0
    assert 0.0 < summary["hit_rate"] < 1.0
    assert summary["ttft_p50_ms"] <= summary["ttft_p99_ms"] <= summary["latency_p99_ms"]
    assert_fleet_consistent(sim)


def test_worker_events_keep_the_router_index_equal_to_the_caches():
    summary, sim = run("cache_aware", tenants(), model=WorkerModel(kv_tokens=4096))
    assert summary["index_entries"] > 0
    for w in sim.workers:  # evictions happened (small caches) and were reported back
        assert sim.routers[0].index.worker_entries(w.url) == w.cache.total_pages


def test_without_events_the_index_keeps_blocks_the_workers_evicted():
    summary, sim = run("cache_aware", tenants(), model=WorkerModel(kv_tokens=4096), events=False)
    assert sum(w.cache.total_pages for w in sim.workers) < summary["index_entries"]


def test_a_host_tier_keeps_evicted_prefixes_cached_and_the_router_index_in_step():
    src = WorkloadSource("rag", 400, 20.0, 16, 0, {"num_docs": 24, "doc_tokens": 1024, "zipf_s": 0.5})
    device_only, _ = run("round_robin", src, model=WorkerModel(kv_tokens=4096))
    tiered, sim = run("round_robin", src, model=WorkerModel(kv_tokens=4096, host_kv_tokens=32768))
    assert tiered["hit_rate"] > device_only["hit_rate"] + 0.2 and device_only["host_loaded_tokens"] == 0
    assert 0 < tiered["host_loaded_tokens"] <= tiered["cached_tokens"]
    assert_fleet_consistent(sim)
    for w in sim.workers:  # host pages are still cached: the index holds both tiers' blocks
        assert w.cache.host_pages > 0
        assert sim.routers[0].index.worker_entries(w.url) == w.cache.total_pages + w.cache.host_pages


def test_cache_aware_beats_round_robin_hit_rate_when_caches_are_bounded():
    src = WorkloadSource("rag", 400, 20.0, 16, 0, {"num_docs": 24, "doc_tokens": 1024, "zipf_s": 0.5})
    rr, _ = run("round_robin", src, model=WorkerModel(kv_tokens=8192))
    ca, _ = run("cache_aware", src, model=WorkerModel(kv_tokens=8192))
    assert ca["hit_rate"] > rr["hit_rate"] + 0.15
    assert ca["load_spread_requests"] < 1.5


def test_sticky_pins_a_hot_group_to_one_worker_and_cache_aware_spreads_it():
    src = WorkloadSource("seed", 300, 200.0, 16, 0, {"hot_fraction": 0.8})
    sticky, _ = run("sticky", src)
    ca, _ = run("cache_aware", src)
    assert sticky["load_spread_requests"] > 2.5  # ~80% of requests on one of 4 workers
    assert ca["load_spread_requests"] < 2.0  # the hot group is spread over holders
    assert ca["requests_per_worker_min_max"][0] > 0  # every worker takes a share
    assert ca["ttft_p99_ms"] < sticky["ttft_p99_ms"] / 2  # and nobody queues behind one worker
    assert ca["hit_rate"] > 0.5


def test_sticky_does_not_pin_requests_that_share_nothing_together():
    """The ``unique`` requests share no prefix: each is a group of its own, so ``sticky`` spreads them
    (it pinned all of them to one worker, as one group, and left the others idle)."""
    summary, _ = run("sticky", WorkloadSource("unique", 400, 200.0, 16, 0, {}))
    low, _ = summary["requests_per_worker_min_max"]
    assert low > 0 and summary["load_spread_requests"] < 1.6, summary["requests_per_worker_min_max"]


def test_later_turns_hit_the_previous_turn_and_its_reply_on_one_worker():
    def source() -> WorkloadSource:
        return WorkloadSource("multi_turn", 40, 5.0, 32, 0, {"turns": 4, "think_time_s": 0.5})

    summary, sim = run("round_robin", source(), workers=1, model=WorkerModel(kv_tokens=65536))
    offline = source()
    lengths = [offline.prompt_ids(i).size for i in range(40)]
    # every later turn finds the previous prompt + its 32-token reply, whole 16-token pages of it but
    # the reply's last token (no K/V: never fed back)
    floor = sum((lengths[r.after] + 32 - 1) // 16 * 16 for r in offline.reqs if r.after is not None)
    assert summary["cached_tokens"] >= floor
    unique, _ = run("round_robin", WorkloadSource("unique", 40, 5.0, 32, 0, {}), workers=1)
    assert unique["hit_rate"] < 0.01  # only the chat template's first bytes can repeat
    assert_fleet_consistent(sim)


def test_single_request_timing_follows_the_cost_model():
    src = WorkloadSource("unique", 1, 1.0, 10, 0, {"prompt_tokens": 500})
    m = WorkerModel(prefill_ms_per_token=0.1, decode_base_ms=5.0, decode_ms_per_seq=1.0)
    summary, _ = run("round_robin", src, workers=1, model=m)
    prompt = summary["prompt_tokens"]
    assert summary["ttft_p50_ms"] == pytest.approx(0.1 * prompt, abs=0.01)  # one prefill step
    assert summary["latency_p50_ms"] == pytest.approx(0.1 * prompt + 9 * 6.0, abs=0.01)  # + 9 decode steps


def test_trace_ids_become_shared_token_prefixes_and_costs_scale_back(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [7, 8]},
        {"timestamp": 500, "input_length": 1500, "output_length": 4, "hash_ids": [7, 8, 9]},
        {"timestamp": 900, "input_length": 512, "output_length": 4, "hash_ids": [5]},
    ]
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows))
    src = TraceSource(str(path), None, 32, 1.0, 0)
    a, b, c = (src.prompt_ids(i) for i in range(3))
    assert src.weight == 16 and a.size == 64 and b.size == 93 and c.size == 32
    assert block_hashes(a.tolist(), 16) == block_hashes(b.tolist(), 16)[:4]  # two shared ids
    assert block_hashes(c.tolist(), 16)[0] != block_hashes(a.tolist(), 16)[0]
    assert [t for t, _ in src.first_turns()] == [0.0, 0.5, 0.9]
    summary, _ = run("cache_aware", src, workers=2)
    # the summary counts real tokens: b reuses a's two ids, 64 simulated tokens = 1,024 real
    assert summary["completed"] == 3 and summary["cached_tokens"] == 1024 and summary["token_weight"] == 16
    assert summary["prompt_tokens"] == (64 + 93 + 32) * 16 and summary["hit_rate"] == round(64 / 189, 4)


def write_trace(path, rows) -> TraceSource:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows))
    return TraceSource(str(path), None, 32, 1.0, 0)  # 32 simulated tokens (2 pages) per id


@pytest.mark.parametrize("sharing", [True, False])
def test_a_prefix_in_prefill_is_shared_only_with_prefix_sharing(tmp_path, sharing):
    # r0 (unique) occupies the worker's prefill step while r1 and r2, sharing ids 7 and 8 (4 pages),
    # queue; at the step's end both could be admitted together
    src = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 512, "output_length": 50, "hash_ids": [1]},
        {"timestamp": 1, "input_length": 1024, "output_length": 50, "hash_ids": [7, 8]},
        {"timestamp": 2, "input_length": 1536, "output_length": 50, "hash_ids": [7, 8, 9]},
    ])  # fmt: skip
    summary, sim = run(
        "round_robin", src, workers=1, model=WorkerModel(kv_tokens=8192, prefix_sharing=sharing)
    )
    assert summary["completed"] == 3
    # sharing: r2 waits one step for r1's pages and reuses them; without it both compute them
    assert summary["cached_tokens"] == (1024 if sharing else 0)
    assert_fleet_consistent(sim)


def test_prefix_sharing_caches_a_prompt_before_its_request_finishes(tmp_path):
    # r1 arrives while r0 (same prompt start, 200 output tokens) is decoding
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 200, "hash_ids": [7, 8]},
            {"timestamp": 300, "input_length": 1536, "output_length": 4, "hash_ids": [7, 8, 9]}]  # fmt: skip
    for sharing, cached in ((True, 1024), (False, 0)):
        src = write_trace(tmp_path / "t.jsonl", rows)
        summary, _ = run("round_robin", src, workers=1, model=WorkerModel(prefix_sharing=sharing))
        assert summary["cached_tokens"] == cached
        assert summary["latency_p99_ms"] > 300  # r0 was still running when r1 arrived


def test_a_decoding_request_steps_between_the_prefill_steps_of_a_long_prompt(tmp_path):
    # as the worker's scheduler: while r1's prompt takes 8 prefill steps, r0 (decoding) makes a token
    # after each of them, and finishes before r1's first token
    src = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 512, "output_length": 5, "hash_ids": [1]},
        {"timestamp": 1, "input_length": 8192, "output_length": 1, "hash_ids": list(range(2, 18))},
    ])  # fmt: skip
    summary, sim = run("round_robin", src, workers=1, model=WorkerModel(chunked_prefill_tokens=1024))
    assert summary["completed"] == 2 and src.weight == 16
    first, last = sim.latency  # in finish order: r0 first
    assert first < max(sim.ttft) and last == pytest.approx(max(sim.ttft), abs=0.001)
    assert_fleet_consistent(sim)


def test_pending_prefill_in_the_load_keeps_a_miss_off_a_worker_busy_prefilling(tmp_path):
    # worker X decodes r0 and r1 (one shared prefix), worker Y prefills r2's 40 ids (~1.4 s); then
    # the short miss r3 comes: by request count Y is less loaded (1 vs 2), by pending prefill X is
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 200, "hash_ids": [1, 3]},
        {"timestamp": 50, "input_length": 1024, "output_length": 200, "hash_ids": [1, 4]},
        {"timestamp": 100, "input_length": 20480, "output_length": 4, "hash_ids": list(range(10, 50))},
        {"timestamp": 200, "input_length": 512, "output_length": 4, "hash_ids": [60]},
    ]
    by_setting = {}
    for tokens_per_load in (0, 256):
        src = write_trace(tmp_path / "t.jsonl", rows)
        summary, sim = run("cache_aware", src, workers=2, prefill_tokens_per_load=tokens_per_load)
        assert summary["completed"] == 4
        assert_fleet_consistent(sim)
        second_slowest_ttft = sorted(sim.ttft)[-2]  # the slowest is r2's own long prefill
        by_setting[tokens_per_load] = summary["requests_per_worker_min_max"], second_slowest_ttft
    requests, ttft = by_setting[0]
    assert requests == [2, 2] and ttft > 1.0  # r3 joined r2 on Y and waited behind its prefill
    requests, ttft = by_setting[256]
    assert requests == [1, 3] and ttft < 0.2  # r3 went to X and was served at once


def test_workers_that_join_take_requests_only_after_the_join():
    src = WorkloadSource("unique", 400, 40.0, 8, 0, {"prompt_tokens": 200})
    summary, sim = run("round_robin", src, workers=2, join_workers=2, join_at_s=5.0)
    join = summary["join"]
    assert summary["completed"] == 400 and join["fair_share"] == 0.5
    assert 0 < join["routed_after"] < 400  # the join fell inside the run
    assert join["share_to_joiners"] == pytest.approx(0.5, abs=0.01)  # round robin over four from then on
    assert sum(join["joiner_requests"]) == pytest.approx(join["routed_after"] / 2, abs=1)
    first_two = [w.requests for w in sim.workers[:2]]
    assert sum(first_two) == 400 - sum(join["joiner_requests"])
    assert join["ttft_p50_ms_after"] is not None
    assert_fleet_consistent(sim)
    assert "join" not in run("round_robin", src, workers=2)[0]


def test_requests_larger_than_a_worker_pool_are_rejected_not_hung():
    src = WorkloadSource("unique", 5, 10.0, 8, 0, {"prompt_tokens": 3000})
    summary, sim = run("least_load", src, workers=2, model=WorkerModel(kv_tokens=1024), params={"seed": 0})
    assert summary["rejected"] == 5 and summary["completed"] == 0
    assert_fleet_consistent(sim)


def test_parse_run_reads_labels_and_typed_parameters():
    assert parse_run("cache_aware") == ("cache_aware", "cache_aware", {})
    assert parse_run("wide=cache_aware:balance_abs=8,balance_rel=0.2") == (
        "wide",
        "cache_aware",
        {"balance_abs": 8, "balance_rel": 0.2},
    )
    with pytest.raises(ValueError):
        parse_run("cache_aware:balance_abs")


def test_cli_prints_a_simulated_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["--workload", "tenants", "--requests", "120", "--workers", "3", "--policies", "round_robin",
            "--run", "wide=cache_aware:balance_abs=6", "--kv-tokens", "8192", "--no-prefix-sharing",
            "--routers", "1,2", "--health-interval-s", "0.5", "--no-prefill-report", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert table.startswith("| simulated | round_robin x1 | wide x1 | round_robin x2 | wide x2 |")
    doc = orjson.loads(out.read_bytes())
    # the index memory estimate is in MiB, and its row says so
    mib = round(doc["runs"][0]["index_nodes"] * 96 / 2**20, 1)
    assert f"\n| index memory (MiB, est.) | {mib} |" in table
    assert doc["simulated"] is True
    assert [r["config"]["routers"] for r in doc["runs"]] == [1, 1, 2, 2]
    assert doc["runs"][1]["params"]["balance_abs"] == 6
    config = doc["runs"][2]["config"]
    assert config["model"]["prefix_sharing"] is False
    assert (config["routers"], config["health_interval_s"], config["prefill_report"]) == (2, 0.5, False)


def test_cli_rejects_unknown_policies_and_options(capsys):
    assert main(["--policies", "fastest"]) == 2
    assert main(["--routers", "0"]) == 2
    assert main(["--requests", "0"]) == 2  # a table of n/a, exit 0 (the driver refuses it too)
    assert main(["--workload", "tenants", "--option", "bogus=1"]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.timeout(60)  # NOTE: before the check, 0 running slots or a 0 window never ended
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-running", "0"], "max_running must be >= 1, got 0"),
        (["--admit-window", "0"], "admit_window must be >= 1, got 0"),
        (["--workers", "0"], "workers must be >= 1, got 0"),
        (["--block-size", "0"], "block_size must be >= 1, got 0"),
        (["--index-entries", "0"], "index_entries must be >= 1, got 0"),
        (["--rate", "nan"], "rate must be positive and finite (requests/s), got nan"),
        (["--max-wait-s", "nan", "--schedule-policy", "lpm"], "max_wait_s must be >= 0, got nan"),
        (["--prefill-ms-per-token", "nan"], "prefill_ms_per_token must be >= 0, got nan"),
        (["--join-workers", "1", "--join-at", "nan"], "join_at_s must be >= 0, got nan"),
        (["--event-delay-ms", "nan"], "--event-delay-ms must be >= 0, got nan"),
        (["--health-interval-s", "nan"], "--health-interval-s"),
        (["--run", "x=cache_aware:bogus=1"], "unknown parameter(s) ['bogus']"),
        (["--run", "x=cache_aware:balance_abs=abc"], "balance_abs"),
        (["--option", "foo"], "--option expects KEY=VALUE, got 'foo'"),
        (["--option", "num_tenants=abc"], "num_tenants must be a whole number"),
    ],
)
def test_cli_refuses_settings_it_cannot_run_before_any_run(argv, message, tmp_path, capsys):
    """A clear error and exit status 2, before the first (valid) run, not a hang or a traceback."""
    out = tmp_path / "sim.md"
    argv = ["--requests", "20", "--workers", "2", "--policies", "round_robin", "--md", str(out), *argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and message in captured.err
    assert captured.out == "" and not out.exists()  # round_robin did not run first


@pytest.mark.timeout(60)
def test_a_sim_config_that_could_never_finish_is_refused_in_process():
    with pytest.raises(ValueError, match="max_running must be >= 1"):
        ClusterSim(SimConfig(2, "round_robin", model=WorkerModel(max_running=0)), tenants(10))
    # NOTE: a NaN wait dropped the requests LPM reordered: they were neither old nor young
    with pytest.raises(ValueError, match="max_wait_s must be >= 0, got nan"):
        ClusterSim(SimConfig(2, "round_robin", model=WorkerModel(max_wait_s=math.nan)), tenants(10))


def test_cli_creates_the_output_folders(tmp_path, capsys):
    md, js = tmp_path / "out" / "sim.md", tmp_path / "json" / "sim.json"
    assert main(["--requests", "20", "--workers", "2", "--policies", "round_robin", "--md", str(md),
                 "--json", str(js)]) == 0  # fmt: skip
    assert md.read_text() == capsys.readouterr().out
    assert orjson.loads(js.read_bytes())["runs"][0]["completed"] == 20


def test_router_replicas_share_the_requests_and_each_hears_every_kv_event():
    summary, sim = run("cache_aware", tenants(), model=WorkerModel(kv_tokens=4096), routers=3)
    assert summary["completed"] == summary["requests"] == 300
    routed = [len(r.decision_ns) for r in sim.routers]
    assert sum(routed) == 300 and min(routed) > 50  # each replica took its share at random
    for r in sim.routers:  # every replica's index follows every worker's cache, not only its own routing
        for w in sim.workers:
            assert r.index.worker_entries(w.url) == w.cache.total_pages
    assert_fleet_consistent(sim)
    assert summary["config"]["routers"] == 3
    # a replica applies every worker's events: its event time is over all the fleet's requests (it was
    # divided by its own third of them)
    assert summary["event_apply_us_per_request"] == round(sim.routers[0].event_ns / 1e3 / 300, 1) > 0


def test_a_replica_counts_what_workers_report_beyond_its_own_requests():
    from loadtest.sim_router import SimRouter

    router = SimRouter("least_load", {}, 1000, 100.0, "default")
    for url in ("http://a", "http://b"):
        router.add_worker(url)
    view, _, _ = router.route(list(range(64)), 16, "g", ["http://a", "http://b"])
    router.apply_reports({view.url: (3, 500), "http://unknown": (9, 9)})  # 2 requests not ours there
    assert view.others_queue == 2 and view.others_prefill == 500
    assert view.load == pytest.approx(1 + 2 + 500 / 100)
    other, _, _ = router.route(list(range(64)), 16, "g", ["http://a", "http://b"])
    assert other is not view  # least loaded: the worker other replicas keep busy is avoided


def test_health_reports_go_on_while_a_conversation_thinks_between_turns():
    # one conversation at a time: the fleet is idle during every think time
    src = WorkloadSource("multi_turn", 12, 0.2, 8, 0, {"turns": 4, "think_time_s": 3.0})
    polls = []
    sim = ClusterSim(SimConfig(2, "least_load", {"seed": 0}, model=WorkerModel(kv_tokens=8192)), src)
    original = sim._poll
    sim._poll = lambda replica, t: (polls.append(t), original(replica, t))
    summary = sim.run()
    assert summary["completed"] == 12
    assert max(polls) >= sim.last_finish - 1.0  # still polling when the last turn ran


@pytest.mark.parametrize(
    ("policy", "now", "first"), [("fcfs", 1.0, "miss"), ("lpm", 1.0, "hit"), ("lpm", 9.0, "miss")]
)
def test_admission_order_follows_the_workers_schedule_policy(policy, now, first):
    """LPM admits the longest cached prefix first, except a request older than max_wait_s (5 s)."""
    import numpy as np

    from loadtest.sim_worker import SimJob, SimWorker, WorkerModel

    w = SimWorker("w", WorkerModel(max_running=1, kv_tokens=4096, schedule_policy=policy), False, "ns")
    shared = np.arange(64, dtype=np.int32)
    w.cache.insert(shared, w.alloc.alloc(4))
    out = np.zeros(4, dtype=np.int32)
    miss = SimJob(0, np.arange(1000, 1064, dtype=np.int32), out, 4, start=0.0)
    hit = SimJob(1, np.concatenate((shared, np.arange(5000, 5016, dtype=np.int32))), out, 4, start=5.0)
    w.enqueue(miss)
    w.enqueue(hit)
    assert w.admit(now) == []
    assert [j.id for j in w.prefilling] == [0 if first == "miss" else 1]
    assert hit.uncached == 16 and miss.uncached == 64


@pytest.mark.parametrize("output_tokens", [12, 13])
def test_a_finished_request_leaves_cached_what_the_workers_scheduler_leaves(output_tokens):
    """A follow-up extending prompt (20 tokens) + output finds the same tokens cached in the
    simulator as in the worker's own scheduler: whole pages of all but the last output token, which
    was sampled but never fed back (so 16 of 32, not 32)."""
    import numpy as np

    from loadtest.sim_worker import SimJob, SimWorker
    from worker.kv_pool import PageAllocator
    from worker.radix_cache import RadixCache
    from worker.request import Request, SchedulerConfig
    from worker.scheduler import Scheduler

    prompt = np.arange(1, 21, dtype=np.int32)
    output = np.arange(100, 100 + output_tokens, dtype=np.int32)
    follow_up = np.concatenate((prompt, output, np.arange(200, 220, dtype=np.int32)))

    alloc = PageAllocator(64)
    sched = Scheduler(SchedulerConfig(page_size=16), alloc, RadixCache(alloc, 16, namespace="ns"))
    sched.add(Request("first", prompt.tolist(), max_tokens=output_tokens))
    while sched.has_work():
        batch = sched.schedule()
        for req in sched.commit(batch, [int(output[r.num_output]) for r in batch.requests]):
            if req.finish_reason is not None:
                sched.finish(req, req.finish_reason)
    second = Request("second", follow_up.tolist(), max_tokens=1)
    sched.add(second)
    sched.schedule()

    w = SimWorker("w", WorkerModel(kv_tokens=1024), False, "ns")
    first = SimJob(0, prompt, output, output_tokens, start=0.0)
    w.enqueue(first)
    w.admit()
    first.prefill_left = 0  # its prefill step, as loadtest.fleet_sim ends it
    w.cache_prompt(first)
    w.prefilling.remove(first)
    w.release(first)
    w.enqueue(SimJob(1, follow_up, output[:1], 1, start=1.0))
    w.admit()
    assert w.cached_tokens == second.cached_tokens == (20 + output_tokens - 1) // 16 * 16
    w.cache.check_invariants()


def test_a_request_sent_away_from_its_prefix_fetches_the_kv_and_pays_the_link_not_the_prefill(tmp_path):
    # r0 caches ids 7, 8 (64 simulated tokens, 1,024 real) on worker 0; round robin sends r1, which
    # extends them, to worker 1: with fetches on it takes the 4 pages from worker 0 over the link
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [7, 8]},
            {"timestamp": 1000, "input_length": 1536, "output_length": 4, "hash_ids": [7, 8, 9]}]  # fmt: skip
    m = WorkerModel(prefill_ms_per_token=0.07, host_copy_ms_per_token=0.003, kv_fetch_ms_per_token=0.12,
                    kv_fetch_base_ms=3.0)  # fmt: skip
    summary, sim = run("round_robin", write_trace(tmp_path / "t.jsonl", rows), workers=2, model=m,
                       kv_fetch_min_tokens=256)  # fmt: skip
    assert summary["kv_fetches"] == {"ok": 1, "cached": 0, "miss": 0, "busy": 0, "error": 0}
    # fetched tokens count as cached, both in real tokens; r0 and r1 are 1,024 + 1,536 real
    assert summary["kv_fetched_tokens"] == summary["cached_tokens"] == 1024
    assert summary["prompt_tokens"] == 2560 and summary["kv_fetched_share"] == 0.4
    # export copy + link, then the import's copy and the 512 uncached tokens in r1's prefill step
    fetch_ms = 0.003 * 1024 + 3.0 + 0.12 * 1024
    assert summary["kv_fetch_p50_ms"] == pytest.approx(fetch_ms, abs=0.01)
    assert sim.ttft[1] * 1e3 == pytest.approx(fetch_ms + 0.003 * 1024 + 0.07 * 512, abs=0.01)
    w1 = sim.workers[1]
    index = sim.routers[0].index  # the receiver's stored events told the router it holds them now
    assert index.worker_entries(w1.url) == w1.cache.total_pages
    assert_fleet_consistent(sim)
    # the same run without fetches computes the whole prompt on worker 1
    summary, sim = run("round_robin", write_trace(tmp_path / "t.jsonl", rows), workers=2, model=m)
    assert summary["kv_fetches"]["ok"] == 0 and summary["cached_tokens"] == 0
    assert sim.ttft[1] * 1e3 == pytest.approx(0.07 * 1536, abs=0.01)


def test_a_fetch_from_a_worker_that_evicted_the_prefix_is_a_miss_and_the_request_computes_it(tmp_path):
    # no events: the router still believes worker 0 holds ids 7, 8 after r2 (its whole pool) evicted them
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [7, 8]},
            {"timestamp": 1000, "input_length": 512, "output_length": 4, "hash_ids": [5]},
            {"timestamp": 2000, "input_length": 2560, "output_length": 4, "hash_ids": [1, 2, 3, 4, 6]},
            {"timestamp": 3000, "input_length": 1536, "output_length": 4, "hash_ids": [7, 8, 9]}]  # fmt: skip
    m = WorkerModel(kv_tokens=11 * 16, kv_fetch_base_ms=3.0)
    summary, sim = run("round_robin", write_trace(tmp_path / "t.jsonl", rows), workers=2, model=m,
                       kv_fetch_min_tokens=256, events=False)  # fmt: skip
    assert summary["completed"] == 4
    assert summary["kv_fetches"] == {"ok": 0, "cached": 0, "miss": 1, "busy": 0, "error": 0}
    assert summary["cached_tokens"] == 0  # nothing fetched, nothing cached on worker 1
    assert sim.ttft[3] * 1e3 == pytest.approx(3.0 + m.prefill_ms_per_token * 1536, abs=0.01)
    assert_fleet_consistent(sim)


def test_the_cli_runs_every_policy_at_each_fetch_setting(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["--workload", "multi_turn", "--requests", "200", "--rate", "40", "--workers", "3",
                 "--kv-tokens", "4096", "--policies", "least_load", "--kv-fetch-min-tokens", "0,64",
                 "--json", str(out)]) == 0  # fmt: skip
    runs = orjson.loads(out.read_bytes())["runs"]
    assert [r["label"] for r in runs] == ["least_load no fetch", "least_load fetch>=64"]
    assert runs[0]["kv_fetched_tokens"] == 0 and runs[1]["kv_fetches"]["ok"] > 0
    assert runs[1]["kv_fetched_share"] > 0 and "KV fetched" in capsys.readouterr().out
    assert main(["--kv-fetch-min-tokens", "-1"]) == 2


# r0 caches ids 7, 8 on worker 0; r1 and r2 extend them at the same moment and round robin sends
# them to workers 1 and 2, which both fetch the 1,024 real tokens from worker 0
TWO_FETCH_THE_SAME = [
    {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [7, 8]},
    {"timestamp": 1000, "input_length": 1536, "output_length": 4, "hash_ids": [7, 8, 9]},
    {"timestamp": 1000, "input_length": 1536, "output_length": 4, "hash_ids": [7, 8, 10]},
]


def fetch_run(tmp_path, rows: list, m: WorkerModel) -> tuple[dict, ClusterSim]:
    """Round robin over one worker per request, with KV fetch hints at 256 tokens."""
    return run("round_robin", write_trace(tmp_path / "t.jsonl", rows), workers=len(rows), model=m,
               kv_fetch_min_tokens=256)  # fmt: skip


def test_concurrent_fetches_from_one_source_queue_for_its_link(tmp_path):
    m = WorkerModel(host_copy_ms_per_token=0.003, kv_fetch_ms_per_token=0.12, kv_fetch_base_ms=3.0)
    summary, sim = fetch_run(tmp_path, TWO_FETCH_THE_SAME, m)
    assert summary["kv_fetches"]["ok"] == 2
    first = 0.003 * 1024 + 3.0 + 0.12 * 1024
    # NOTE: both exports run at the same step boundary (the source's copies are charged to its next step)
    assert sorted(x * 1e3 for x in sim.kv_fetch_s) == pytest.approx([first, first + 0.12 * 1024], abs=0.01)
    assert_fleet_consistent(sim)


def test_a_fetch_that_would_queue_past_the_wait_bound_is_busy(tmp_path):
    # three fetches of the same 1,024 tokens from worker 0 at once: each holds its link ~126 ms, so
    # the third would wait ~250 ms, past the 200 ms bound (the worker's --kv-transfer-max-wait-ms)
    rows = [
        *TWO_FETCH_THE_SAME,
        {"timestamp": 1000, "input_length": 1536, "output_length": 4, "hash_ids": [7, 8, 11]},
    ]
    m = WorkerModel(kv_fetch_ms_per_token=0.12, kv_fetch_base_ms=3.0)
    summary, sim = fetch_run(tmp_path, rows, m)
    assert summary["kv_fetches"] == {"ok": 2, "cached": 0, "miss": 0, "busy": 1, "error": 0}
    assert_fleet_consistent(sim)
    summary, _ = fetch_run(tmp_path, rows, WorkerModel(kv_fetch_ms_per_token=0.12, kv_fetch_max_wait_ms=0))
    assert summary["kv_fetches"]["ok"] == 3  # 0: no bound


def test_a_fetch_past_the_transfer_bound_is_busy_and_one_past_the_timeout_is_given_up(tmp_path):
    # a bound of 48 real tokens' KV: a 1,024-token transfer streams (64 slabs: 32 layers' K and V) a
    # slab of 16 tokens' KV at a time and holds two, 32; worker 0 sends one fetch, refuses the other
    m = WorkerModel(kv_fetch_max_tokens=48, kv_fetch_base_ms=3.0, prefill_ms_per_token=0.07)
    summary, sim = fetch_run(tmp_path, TWO_FETCH_THE_SAME, m)
    assert summary["kv_fetches"] == {"ok": 1, "cached": 0, "miss": 0, "busy": 1, "error": 0}
    assert summary["kv_fetched_tokens"] == 1024
    assert_fleet_consistent(sim)
    assert all(w.kv_held == 0 for w in sim.workers) and sim.fetching == 0
    # 1,024 tokens at 0.12 ms take 123 ms on the link: a 0.1 s timeout gives up and r1 computes
    m = WorkerModel(kv_fetch_timeout_s=0.1, kv_fetch_base_ms=3.0, prefill_ms_per_token=0.07)
    summary, sim = fetch_run(tmp_path, TWO_FETCH_THE_SAME[:2], m)
    assert summary["kv_fetches"]["error"] == 1 and summary["cached_tokens"] == 0
    assert sim.ttft[1] * 1e3 == pytest.approx(100.0 + 0.07 * 1536, abs=0.01)
    assert_fleet_consistent(sim)


def test_a_fetch_asks_for_what_its_link_brings_in_half_the_timeout(tmp_path):
    # round robin over 3 workers: w2 fetches 1,024 tokens from w0 (measured), then 4,096 from w1:
    # 3 + 4,096 x 0.12 = 495 ms + copies, past a 0.5 s timeout, so it asks for what comes in 0.25 s
    # at the rate it measured and computes the rest
    long = list(range(30, 38))
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [7, 8]},
        {"timestamp": 0, "input_length": 4096, "output_length": 4, "hash_ids": long},
        {"timestamp": 1000, "input_length": 1536, "output_length": 4, "hash_ids": [7, 8, 9]},
        {"timestamp": 1000, "input_length": 512, "output_length": 4, "hash_ids": [50]},
        {"timestamp": 1000, "input_length": 512, "output_length": 4, "hash_ids": [51]},
        {"timestamp": 2000, "input_length": 4608, "output_length": 4, "hash_ids": [*long, 38]},
    ]
    m = WorkerModel(kv_fetch_timeout_s=0.5, kv_fetch_base_ms=3.0, kv_fetch_ms_per_token=0.12)

    def on_three(rows: list) -> tuple[dict, ClusterSim]:
        trace = write_trace(tmp_path / "t.jsonl", rows)
        return run("round_robin", trace, workers=3, model=m, kv_fetch_min_tokens=256)

    summary, sim = on_three(rows)
    assert summary["kv_fetches"] == {"ok": 2, "cached": 0, "miss": 0, "busy": 0, "error": 0}
    # NOTE: 1,024 tokens in the first fetch's time (the source's step boundary included), for 0.25 s,
    # in whole pages (16 simulated tokens = 256 real at this trace's weight)
    assert summary["kv_fetched_tokens"] - 1024 == int(1024 / sim.kv_fetch_s[0] * 0.25) // 256 * 256 > 1024
    assert_fleet_consistent(sim)
    # the same long fetch as the worker's first: nothing measured, it asks for all and times out
    summary, sim = on_three([rows[1], rows[3], rows[5]])
    assert summary["kv_fetches"]["error"] == 1 and summary["kv_fetched_tokens"] == 0
    assert_fleet_consistent(sim)


def test_the_cli_repeats_its_random_policies_runs_for_a_seed(tmp_path):
    """random and least_load draw from their own generator, which the router leaves unseeded: two runs of the
    same command differed by more than the published differences between policies (TTFT p99 94.6 against
    135.1 ms). The CLI seeds them with --seed (the run's own seed wins); two routers draw apart."""

    def runs(name: str, *extra: str) -> list[dict]:
        out = tmp_path / f"{name}.json"
        argv = ["--workload", "tenants", "--requests", "300", "--rate", "60", "--workers", "3", "--routers", "2",
                "--policies", "random,least_load", "--json", str(out), *extra]  # fmt: skip
        assert main(argv) == 0
        return [
            {k: r[k] for k in ("label", "ttft_p50_ms", "ttft_p99_ms", "requests_per_worker_min_max")}
            for r in orjson.loads(out.read_bytes())["runs"]
        ]

    first, again, other = runs("a"), runs("b"), runs("c", "--seed", "5")
    assert first == again and first != other
