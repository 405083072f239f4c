"""Workers found in Kubernetes (``--k8s-worker-service``): the router lists the EndpointSlices of the
workers' (headless) Service every few seconds and registers what appeared, removes what went, as
``POST`` / ``DELETE /workers`` would. So ``kubectl scale`` or an autoscaler changes the fleet with
no router restart.

A worker's URL is ``http://<hostname>.<service>.<namespace>.svc.<domain>:<port>`` where the
endpoint has a hostname (StatefulSet pods: the name each worker advertises in its KV events,
docs/deploy.md), else ``http://<address>:<port>``; the port is the slice's (the one named
``--k8s-worker-port-name``, else its first). Terminating endpoints are dropped; not-ready ones are
kept (the router's own health checks decide when they get traffic, as for listed workers). Workers
given with ``--workers`` or ``POST /workers`` are never removed by discovery (a discovered worker
given to ``POST /workers`` becomes one of those); a discovered worker removed by hand comes back
next round while the Service lists it. A failed listing keeps the fleet
as it is and is retried next round.

It talks to the API server over plain HTTPS with the pod's service account (token and CA under
/var/run/secrets/kubernetes.io/serviceaccount); the Helm chart grants ``list`` on EndpointSlices.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from router.http_client import worker_base_url

if TYPE_CHECKING:  # pragma: no cover - typing only
    from router.gateway import Router

log = logging.getLogger("radixgate.discovery")

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass
class KubeTarget:
    service: str  # the workers' Service
    namespace: str
    api_url: str  # https://host:port of the API server
    token_file: str
    ca_file: str | None  # None: the system's CAs (or plain http, in tests)
    port_name: str | None = None  # which port of the slice; None: its first
    cluster_domain: str = "cluster.local"


def target_from_config(config: Any) -> KubeTarget:
    """The discovery target the router's settings describe (in-cluster defaults from the pod)."""
    namespace = config.k8s_namespace
    if namespace is None:
        with open(os.path.join(SERVICE_ACCOUNT, "namespace"), encoding="utf-8") as f:
            namespace = f.read().strip()
    api_url = config.k8s_api_url
    if api_url is None:
        host, port = (
            os.environ.get("KUBERNETES_SERVICE_HOST"),
            os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
        )
        if not host:
            raise ValueError("--k8s-api-url is needed outside a pod (KUBERNETES_SERVICE_HOST is not set)")
        api_url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    ca = os.path.join(SERVICE_ACCOUNT, "ca.crt")
    return KubeTarget(
        service=config.k8s_worker_service,
        namespace=namespace,
        api_url=api_url.rstrip("/"),
        token_file=config.k8s_token_file or os.path.join(SERVICE_ACCOUNT, "token"),
        ca_file=ca if api_url.startswith("https") and os.path.exists(ca) else None,
        port_name=config.k8s_worker_port_name,
        cluster_domain=config.k8s_cluster_domain,
    )


def worker_urls(slices: Iterable[object], target: KubeTarget) -> set[str]:
    """Worker URLs in an EndpointSliceList's items. Entries of the wrong shape are skipped; a
    dual-stack Service's IPv6 slices are skipped when it has IPv4 ones (one URL per pod)."""
    items = [item for item in slices if isinstance(item, dict)]
    ipv4 = any(item.get("addressType") == "IPv4" for item in items)
    urls = set()
    for item in items:
        if ipv4 and item.get("addressType") == "IPv6":
            continue
        ports = [p for p in _list_of(item.get("ports")) if isinstance(p, dict)]
        chosen = [p for p in ports if target.port_name is None or p.get("name") == target.port_name]
        if not chosen or type(chosen[0].get("port")) is not int:
            continue
        port = chosen[0]["port"]
        for endpoint in _list_of(item.get("endpoints")):
            if not isinstance(endpoint, dict):
                continue
            conditions = endpoint.get("conditions")
            if isinstance(conditions, dict) and conditions.get("terminating"):
                continue
            hostname = endpoint.get("hostname")
            addresses = [a for a in _list_of(endpoint.get("addresses")) if isinstance(a, str) and a]
            if isinstance(hostname, str) and hostname:
                host = f"{hostname}.{target.service}.{target.namespace}.svc.{target.cluster_domain}"
            elif addresses:
                host = f"[{addresses[0]}]" if ":" in addresses[0] else addresses[0]
            else:
                continue
            try:
                urls.add(worker_base_url(f"http://{host}:{port}"))
            except ValueError as exc:  # NOTE: e.g. a --k8s-cluster-domain with an empty label
                log.warning("endpoint skipped: %s", exc)
    return urls


def _list_of(value: object) -> list:
    return value if isinstance(value, list) else []


class KubeDiscovery:
    """Keeps the router's fleet equal to its static workers + the Service's endpoints."""

    def __init__(self, router: Router, target: KubeTarget, interval_s: float = 5.0) -> None:
        self._router = router
        self._own: set[str] = set()  # listed addresses that are this router's (warned about once)
        self.target = target
        self.interval_s = interval_s
        self.found: set[str] = set()  # workers this discovery registered
        self.rounds = self.failures = 0
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        # NOTE: one removed by hand is no longer discovery's: added again by POST /workers, it stays
        router.workers.on_removed.append(lambda worker: self.found.discard(worker.url))

    async def start(self) -> None:
        context = ssl.create_default_context(cafile=self.target.ca_file) if self.target.ca_file else None
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context) if context else None
        )
        await self.sync()  # NOTE: the first fleet is there before the first request
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync()
            except Exception:  # NOTE: a bug here must not end discovery for good
                self.failures += 1
                log.exception("discovery round failed")

    async def sync(self) -> None:
        """One round: list, then add and remove. A failure leaves the fleet alone."""
        self.rounds += 1
        try:
            urls = worker_urls(await self._list(), self.target)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            self.failures += 1
            log.warning("listing %s/%s endpoints failed: %r", self.target.namespace, self.target.service, exc)
            return
        workers = self._router.workers
        own = {url for url in urls if self._router.config.names_this_router(url)}
        if own - self._own:  # NOTE: the Service lists this router: every request would forward itself again
            log.warning("%s lists this router's own address, not taken as a worker: %s", self.target.service,
                        ", ".join(sorted(own - self._own)))  # fmt: skip
        self._own, urls = own, urls - own
        new = [
            url for url in sorted(urls) if workers.get(url) is None
        ]  # or removed by hand: the Service rules
        for url in new:
            self.found.add(url)
            log.info("worker discovered: %s", url)
        # NOTE: at once: N pods that do not answer yet cost one health timeout, not N
        await asyncio.gather(*(self._router.health.check(workers.add(url)) for url in new))
        for url in sorted(self.found - urls):
            workers.remove(url)  # NOTE: out of found too (on_removed)
            log.info("worker gone from %s: %s", self.target.service, url)

    async def _list(self) -> list[dict]:
        assert self._session is not None
        with open(self.target.token_file, encoding="utf-8") as f:  # NOTE: re-read: tokens rotate
            token = f.read().strip()
        t = self.target
        url = (f"{t.api_url}/apis/discovery.k8s.io/v1/namespaces/{t.namespace}/endpointslices"
               f"?labelSelector=kubernetes.io%2Fservice-name%3D{t.service}")  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=10)
        async with self._session.get(
            url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout
        ) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {body[:200]!r}")
        listing = orjson.loads(body)
        items = listing.get("items") if isinstance(listing, dict) else None
        if not isinstance(items, list):
            raise ValueError("not an EndpointSliceList")
        return items

    def describe(self) -> dict:
        return {"service": f"{self.target.namespace}/{self.target.service}", "workers": sorted(self.found),
                "rounds": self.rounds, "failures": self.failures}  # fmt: skip
