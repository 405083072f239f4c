"""How a router learns its workers: Kubernetes discovery (EndpointSlices to worker URLs, and a real
router process following a Service's endpoints as they change; a small stand-in API server serves
the EndpointSlice list), and a worker's model list asked again after a failed answer."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import httpx
import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.discovery import KubeTarget, worker_urls
from tests.support import ROOT, wait_until

TARGET = KubeTarget(service="rg-worker", namespace="llm", api_url="", token_file="", ca_file=None)


def endpoint(hostname: str | None = None, address: str = "10.0.0.1", **conditions) -> dict:
    out: dict = {"addresses": [address], "conditions": {"ready": True, **conditions}}
    if hostname:
        out["hostname"] = hostname
    return out


def test_statefulset_endpoints_become_their_stable_names() -> None:
    slices = [
        {"ports": [{"name": "metrics", "port": 9100}, {"name": "http", "port": 8001}],
         "endpoints": [endpoint("rg-worker-0"), endpoint("rg-worker-1", ready=False),
                       endpoint("rg-worker-2", terminating=True)]},
        {"ports": [{"port": 8001}], "endpoints": [endpoint(address="10.0.0.9"), endpoint(address="fd00::7")]},
        {"ports": [], "endpoints": [endpoint("no-port")]},
    ]  # fmt: skip
    assert worker_urls(slices, TARGET) == {
        "http://rg-worker-0.rg-worker.llm.svc.cluster.local:9100",
        "http://rg-worker-1.rg-worker.llm.svc.cluster.local:9100",  # not ready yet: health checks decide
        "http://10.0.0.9:8001",
        "http://[fd00::7]:8001",
    }
    named = KubeTarget("rg-worker", "llm", "", "", None, port_name="http", cluster_domain="k8s.example")
    assert "http://rg-worker-0.rg-worker.llm.svc.k8s.example:8001" in worker_urls(slices, named)


def test_an_endpoint_whose_name_is_no_host_name_is_skipped_not_a_crash_of_the_health_checks() -> None:
    slices = [
        {"ports": [{"port": 8001}], "endpoints": [endpoint("rg-worker-0"), endpoint(address="10.0.0.9")]}
    ]
    bad_domain = KubeTarget("rg-worker", "llm", "", "", None, cluster_domain="cluster..local")
    assert worker_urls(slices, bad_domain) == {"http://10.0.0.9:8001"}


def test_malformed_slices_are_skipped_and_a_dual_stack_pod_is_one_worker() -> None:
    good = {"addressType": "IPv4", "ports": [{"port": 8001}], "endpoints": [endpoint(address="10.0.0.2")]}
    odd = [None, 7, "x", {"ports": None, "endpoints": [endpoint()]}, {"ports": [None, {"port": "80"}]},
           {"ports": [{"port": 8001}], "endpoints": [None, 3, {"addresses": [None, 5]}, {"addresses": "10.0.0.3"},
                                                      {"conditions": None, "addresses": ["10.0.0.4"]}]}]  # fmt: skip
    assert worker_urls([*odd, good], TARGET) == {"http://10.0.0.4:8001", "http://10.0.0.2:8001"}
    ipv6 = {"addressType": "IPv6", "ports": [{"port": 8001}], "endpoints": [endpoint(address="fd00::2")]}
    assert worker_urls([good, ipv6], TARGET) == {"http://10.0.0.2:8001"}  # the same pod, once
    assert worker_urls([ipv6], TARGET) == {"http://[fd00::2]:8001"}  # an IPv6-only Service


class FakeKubeAPI:
    """The API server's EndpointSlice list for one Service, as the test sets it."""

    TOKEN = "sa-token"

    def __init__(self) -> None:
        self.ports: list[int] = []  # one slice per port, like one worker per node port
        self.fail = False
        self.garbage: bytes | None = None  # a 200 answer that is not an EndpointSliceList
        self.calls = 0

        async def slices(request: Request) -> Response:
            self.calls += 1
            if request.headers.get("authorization") != f"Bearer {self.TOKEN}":
                return Response(b"{}", 401)
            if self.fail or request.query_params.get("labelSelector") != "kubernetes.io/service-name=workers":
                return Response(b"{}", 500)
            if self.garbage is not None:
                return Response(self.garbage, media_type="application/json")
            items = [{"ports": [{"name": "http", "port": p}], "endpoints": [endpoint(address="127.0.0.1")]}
                     for p in self.ports]  # fmt: skip
            return Response(
                orjson.dumps({"kind": "EndpointSliceList", "items": items}), media_type="application/json"
            )

        app = Starlette(routes=[Route("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices", slices)])
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 10, what="fake API server")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def kube():
    api = FakeKubeAPI()
    yield api
    api.close()


def fleet(router_url: str) -> tuple[set[str], dict | None]:
    body = httpx.get(router_url + "/workers", timeout=5).json()
    return {w["url"] for w in body["workers"]}, body["discovery"]


def test_the_router_follows_the_services_endpoints(launch, kube, tmp_path) -> None:
    a, b, static = (launch.echo_backend("--name", n) for n in ("a", "b", "static"))
    port = lambda proc: int(proc.url.rsplit(":", 1)[1])  # noqa: E731
    kube.ports = [port(a)]
    token = tmp_path / "token"
    token.write_text(FakeKubeAPI.TOKEN + "\n")
    router = launch.router(
        [static.url], "--k8s-worker-service", "workers", "--k8s-namespace", "ns", "--k8s-api-url", kube.url,
        "--k8s-token-file", str(token), "--discovery-interval-s", "0.1", "--policy", "round_robin",
    )  # fmt: skip
    # the first listing happens before the router serves
    assert fleet(router.url)[0] == {static.url, a.url}
    kube.ports = [port(a), port(b)]  # scaled up
    wait_until(lambda: fleet(router.url)[0] == {static.url, a.url, b.url}, 10, what="b discovered")
    body = {"model": "echo", "prompt": "hello", "max_tokens": 1}
    served = {httpx.post(router.url + "/v1/completions", json=body, timeout=10).headers["x-radixgate-worker"]
              for _ in range(12)}  # fmt: skip
    assert served == {static.url, a.url, b.url}  # round robin over the whole fleet
    # a listing that fails leaves the fleet alone
    kube.fail = True
    calls = kube.calls
    wait_until(lambda: kube.calls >= calls + 3, 10, what="failed listings")
    workers, discovery = fleet(router.url)
    assert workers == {static.url, a.url, b.url} and discovery["failures"] >= 3
    kube.fail = False
    for garbage in (b"[1, 2]", b"null", b'{"items": "none"}'):  # a 200 of the wrong shape is a failure
        kube.garbage, failed = garbage, fleet(router.url)[1]["failures"]
        wait_until(
            lambda f=failed: fleet(router.url)[1]["failures"] >= f + 2, 10, what=f"{garbage!r} refused"
        )
        assert fleet(router.url)[0] == {static.url, a.url, b.url}
    # a list whose entries are of the wrong shape: they are skipped (here: no endpoint at all)
    kube.garbage = b'{"items": [{"ports": [{"port": 1}], "endpoints": [null, 3]}, 7]}'
    wait_until(lambda: fleet(router.url)[0] == {static.url}, 10, what="an empty listing applied")
    kube.garbage = None
    kube.ports = [port(b)]  # a scaled down; the static worker is never discovery's to remove
    wait_until(lambda: fleet(router.url)[0] == {static.url, b.url}, 10, what="a removed")
    # removed by hand, a listed worker comes back
    assert httpx.delete(router.url + "/workers", params={"url": b.url}, timeout=5).status_code == 200
    wait_until(lambda: b.url in fleet(router.url)[0], 10, what="b re-discovered")
    assert fleet(router.url)[1]["workers"] == [b.url]
    metrics = httpx.get(router.url + "/metrics", timeout=5).text
    assert "radixgate_discovered_workers 1.0" in metrics
    failures = next(
        line for line in metrics.splitlines() if line.startswith("radixgate_discovery_failures_total")
    )
    assert float(failures.split()[-1]) >= 3
    # removed and added again by hand while listings fail: b is the operator's now, not the Service's
    kube.fail = True
    calls = kube.calls
    wait_until(lambda: kube.calls >= calls + 2, 10, what="failing listings")
    assert httpx.delete(router.url + "/workers", params={"url": b.url}, timeout=5).status_code == 200
    assert httpx.post(router.url + "/workers", json={"url": b.url}, timeout=5).status_code == 201
    kube.ports, kube.fail, calls = [], False, kube.calls
    wait_until(lambda: kube.calls >= calls + 3, 10, what="listings without b")
    assert fleet(router.url)[0] == {static.url, b.url} and fleet(router.url)[1]["workers"] == []
    # a discovered worker given to POST /workers (already registered: a 200) is the operator's too
    kube.ports = [port(a)]
    wait_until(lambda: fleet(router.url)[1]["workers"] == [a.url], 10, what="a discovered again")
    pinned = httpx.post(router.url + "/workers", json={"url": a.url}, timeout=5)
    assert pinned.status_code == 200 and pinned.json()["added"] is False
    kube.ports, calls = [], kube.calls
    wait_until(lambda: kube.calls >= calls + 3, 10, what="listings without a")
    assert fleet(router.url)[0] == {static.url, a.url, b.url} and fleet(router.url)[1]["workers"] == []


def test_a_service_that_lists_the_router_itself_gives_it_no_worker_of_its_own_address(launch, kube, tmp_path):
    """The Service's endpoints include the router's own address (a selector that matches its pods):
    not taken as a worker (one request forwarded itself ~10,000 times in 11 s, then a 502)."""
    a = launch.echo_backend("--name", "a")
    token = tmp_path / "token"
    token.write_text(FakeKubeAPI.TOKEN + "\n")
    router = launch.router(
        [], "--k8s-worker-service", "workers", "--k8s-namespace", "ns", "--k8s-api-url", kube.url,
        "--k8s-token-file", str(token), "--discovery-interval-s", "0.1",
    )  # fmt: skip
    kube.ports = [int(a.url.rsplit(":", 1)[1]), int(router.url.rsplit(":", 1)[1])]
    wait_until(lambda: fleet(router.url)[0] == {a.url}, 10, what="a discovered")
    calls = kube.calls
    wait_until(lambda: kube.calls >= calls + 3, 10, what="more listings")
    assert fleet(router.url)[0] == {a.url}
    body = {"model": "echo", "prompt": "hello", "max_tokens": 1}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200


def test_discovery_outside_a_pod_needs_an_api_url() -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT}  # NOTE: no KUBERNETES_SERVICE_HOST
    proc = subprocess.run([sys.executable, "-m", "router", "--k8s-worker-service", "w", "--k8s-namespace", "ns"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2 and "--k8s-api-url" in proc.stderr, proc.stderr


def test_a_worker_whose_model_list_failed_once_is_asked_again(launch) -> None:
    """The first /v1/models answer fails (a slow or starting backend): the router asks again on
    the next health check instead of taking the worker for one that serves any model for good."""
    calls = {"models": 0}

    async def models(request: Request) -> Response:
        calls["models"] += 1
        if calls["models"] == 1:
            return Response(b"{}", 500)
        return Response(orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}),
                        media_type="application/json")  # fmt: skip

    async def health(request: Request) -> Response:
        return Response(b'{"status": "ok"}', media_type="application/json")

    app = Starlette(routes=[Route("/v1/models", models), Route("/health", health)])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 10, what="backend")
        router = launch.router([url], "--health-interval-s", "0.1", "--kv-events", "off")
        wait_until(lambda: fleet(router.url)[0] == {url} and httpx.get(router.url + "/workers").json()["workers"][0]["models"] == ["m"],
                   10, what="the model list asked again")  # fmt: skip
        assert calls["models"] >= 2
        assert httpx.post(router.url + "/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
