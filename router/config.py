"""Router settings: one dataclass, filled from defaults < YAML (--config) < env (RADIXGATE_*) < flags.

Defaults work on a laptop. Unknown YAML keys and malformed values are errors at start-up, never
silently ignored."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml

from router.affinity import AffinityGroups
from router.api_keys import check_limits, header_token_ok
from router.http_client import worker_base_url
from router.policies import POLICY_NAMES, make_policy
from router.prefix_index import PrefixIndex
from router.resp import redis_url_error, tcp_url_options
from router.tokenization import load_tokenizer

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's names
# seconds at most, for any time setting: past it timers overflow (threading's, at infinity) or never fire
MAX_SECONDS = 7 * 24 * 3600.0
# seconds that must be > 0: at 0 a timeout fails every request, an interval spins a core
_POSITIVE_SECONDS = (
    "health_interval_s",
    "health_timeout_s",
    "breaker_open_s",
    "connect_timeout_s",
    "first_byte_timeout_s",
    "request_timeout_s",
    "body_timeout_s",
    "replica_sync_heartbeat_s",
    "event_stream_timeout_s",
    "queue_timeout_s",
    "discovery_interval_s",
)


@dataclass
class RouterConfig:
    workers: list[str] = field(default_factory=list)  # worker base URLs
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cache_aware"
    policy_params: dict[str, Any] = field(default_factory=dict)  # see router/policies.py
    tokenizer: str = "bytes"  # "bytes" or a directory with tokenizer.json (+ chat template)
    block_size: int = 16  # tokens per block until workers advertise theirs (/v1/cache/info)
    max_index_entries: int = 2_000_000  # ONE budget of (block, worker) entries for the whole index
    # predicted uncached prompt tokens (router tokens), sent and not yet answered, that weigh as much
    # in a worker's load as one outstanding request; 0 counts requests only (router/workers.py)
    prefill_tokens_per_load: float = 256.0
    # hint the picked worker (header x-radixgate-kv-source) to fetch a prefix's KV from another worker
    # predicted to hold at least this many more of the prompt's tokens than it does; 0 = off
    kv_fetch_min_tokens: int = 0
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    breaker_failure_threshold: int = 3
    breaker_open_s: float = 2.0
    max_retries: int = 2  # extra workers tried on connect error / 5xx before the first byte
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 120.0  # upstream must answer (headers) within this
    request_timeout_s: float = 600.0  # whole request
    max_body_bytes: int = 16 * 1024 * 1024
    body_timeout_s: float = 30.0  # a client's request body must have arrived within this (else 408)
    # admission (router/admission.py): requests forwarded at once by this replica, 0 = no limit; the
    # next ones wait by priority, then arrival (at most max_queued_requests, else 429) up to queue_timeout_s (else 503)
    max_concurrent_requests: int = 0
    max_queued_requests: int = 1024
    queue_timeout_s: float = 30.0
    admin_token: str | None = None  # required by /workers when set
    # clients must send one of these as "Authorization: Bearer <key>" on /v1/*, /tokenize,
    # /detokenize and /debug/route (empty: no check); /health, /ready and /metrics stay open
    api_keys: list[str] = field(default_factory=list)  # KEY or NAME:KEY (router/api_keys.py)
    api_key_limits: dict[str, Any] = field(default_factory=dict)  # NAME -> {requests_per_minute: N}
    worker_api_key: str | None = None  # sent to workers as Authorization: Bearer (their --api-key)
    kv_events: str = "auto"  # auto | redis | http | off
    redis_url: str | None = None
    # a worker's HTTP event stream silent this long is opened again: the workers send a ping every 15 s
    # when idle, so it was dropped on the way (a NAT or firewall forgot it) with no end seen here
    event_stream_timeout_s: float = 45.0
    # router replicas announce their per-worker load to each other over Redis (router/replica_sync.py):
    # auto = on when redis_url is set
    replica_sync: str = "auto"  # auto | on | off
    replica_sync_heartbeat_s: float = 1.0  # full announcements; a replica silent 3x this is forgotten
    # streams: ask workers for the usage chunk where the client did not (stream_options.include_usage)
    # and take it out again, so stream hit rates are known from any backend (off: bodies pass unchanged)
    stream_usage: bool = True
    # Kubernetes discovery (router/discovery.py): workers = the endpoints of this Service, re-listed
    # every discovery_interval_s; the rest default to the pod's service account and cluster.local
    k8s_worker_service: str | None = None
    k8s_namespace: str | None = None
    k8s_api_url: str | None = None
    k8s_token_file: str | None = None
    k8s_worker_port_name: str | None = None
    k8s_cluster_domain: str = "cluster.local"
    discovery_interval_s: float = 5.0
    launch_workers: int = 0  # start N local workers (python -m worker) as child processes
    worker_model: str = "tiny"  # --model for launched workers
    worker_args: list[str] = field(default_factory=list)  # extra flags for launched workers
    log_level: str = "info"
    # on SIGTERM / SIGINT: serve on this long with /ready answering 503, so load balancers (Kubernetes
    # endpoints) stop sending new connections first; then shut down, letting requests in flight finish
    shutdown_delay_s: float = 0.0
    access_log: bool = False  # one JSON line per completion request (router/access_log.py)
    affinity_groups: list[dict[str, Any]] = field(default_factory=list)  # see router/affinity.py

    @property
    def replica_sync_enabled(self) -> bool:
        """``replica_sync`` resolved: on unless off, and only with a Redis URL (``on`` demands one)."""
        return bool(self.redis_url) and self.replica_sync != "off"

    def names_this_router(self, url: str) -> bool:
        """Whether worker URL ``url`` (``worker_base_url``'s spelling) is this router's own listening
        address on this machine: requests sent there come back in, each forwarding itself again.
        Any spelling of a loopback or unspecified address (``127.1``, ``[::ffff:127.0.0.1]``, ``0``)
        is this machine, and so, where the router listens on every address, are the addresses this
        machine's name resolves to (a pod's IP, as a Service lists it to discovery)."""
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        if parts.port != self.port:
            return False
        own = self.host.strip("[]").lower()
        if host in ("localhost", own):
            return True
        address, listening = _ip_address(host), _ip_address(own)
        if address is None:
            return False
        if address.is_loopback or address.is_unspecified or address == listening:
            return True
        return listening is not None and listening.is_unspecified and address in _machine_addresses()

    def validate(self) -> None:
        """ValueError naming the first setting that is malformed or would break the router. Only
        what needs no filesystem: the tokenizer is loaded by ``check_tokenizer`` at start-up."""
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        try:
            make_policy(self.policy, PrefixIndex(), self.policy_params)  # a throw-away, as a check
        except ValueError as exc:
            raise ValueError(f"policy_params: {exc}") from None
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, not {self.log_level!r}")
        if self.kv_events not in ("auto", "redis", "http", "off"):
            raise ValueError("kv_events must be auto, redis, http or off")
        if self.kv_events == "redis" and not self.redis_url:
            raise ValueError("kv_events=redis needs redis_url")
        if self.replica_sync not in ("auto", "on", "off"):
            raise ValueError("replica_sync must be auto, on or off")
        if self.replica_sync == "on" and not self.redis_url:
            raise ValueError("replica_sync=on needs redis_url")
        if not 0 <= self.shutdown_delay_s <= MAX_SECONDS:  # NaN fails too
            raise ValueError(
                f"shutdown_delay_s must be 0 to {MAX_SECONDS:g} seconds, not {self.shutdown_delay_s!r}"
            )
        for name in _POSITIVE_SECONDS:
            if not 0 < getattr(self, name) <= MAX_SECONDS:  # NaN fails too
                raise ValueError(
                    f"{name} must be > 0 and at most {MAX_SECONDS:g} seconds, not {getattr(self, name)!r}"
                )
        if self.redis_url and (error := redis_url_error(self.redis_url)):  # NOTE: what the event reader reads
            raise ValueError(f"redis_url {error}")
        if not self.host.strip():  # NOTE: uvicorn would listen on every interface, IPv4 and IPv6
            raise ValueError(
                "host must not be empty (0.0.0.0 listens on every interface, 127.0.0.1 here only)"
            )
        if self.replica_sync_enabled:
            try:
                tcp_url_options(self.redis_url)
            except ValueError as exc:
                raise ValueError(f"replica sync: {exc}; or set replica_sync off") from None
        for name in ("block_size", "max_index_entries", "max_body_bytes", "breaker_failure_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)!r}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, not {self.port}")
        if self.kv_fetch_min_tokens < 0:
            raise ValueError("kv_fetch_min_tokens must be >= 0 (0: off)")
        if not self.prefill_tokens_per_load >= 0:  # NaN fails too
            raise ValueError("prefill_tokens_per_load must be >= 0 (0: load counts requests only)")
        if self.max_concurrent_requests < 0 or self.max_queued_requests < 0:
            raise ValueError("max_concurrent_requests and max_queued_requests must be >= 0")
        for name in ("admin_token", "worker_api_key"):
            value = getattr(self, name)
            if value is not None and not value.strip():  # NOTE: "" would mean none: the guard off
                raise ValueError(f"{name} is empty: give it a value or leave it out")
            if value is not None and not header_token_ok(value):
                raise ValueError(f"{name} must be printable ASCII without spaces (a header carries it)")
        if self.max_retries < 0 or self.launch_workers < 0:
            raise ValueError("max_retries and launch_workers must be >= 0")
        for url in self.workers:
            if self.names_this_router(worker_base_url(url)):
                raise ValueError(f"worker URL {url!r} is this router's own address: it would route to itself")
        AffinityGroups.from_config(self.affinity_groups)
        check_limits(self.api_keys, self.api_key_limits)


_FIELDS = {f.name: f for f in dataclasses.fields(RouterConfig)}
_ENV_NAMES = {"RADIXGATE_" + name.upper(): name for name in _FIELDS}  # env name -> field
# NOTE: set from Secrets: one given but empty would turn its guard off (over YAML's, from env)
_SECRETS = ("api_keys", "admin_token", "worker_api_key")


def _coerce(name: str, value: Any) -> Any:
    """Turn a YAML or env value into the field's type; raises ValueError with the field name."""
    kind = _FIELDS[name].type
    if name in _SECRETS and isinstance(value, str) and not value.replace(",", " ").strip():
        raise ValueError(f"{name} is given but empty (RADIXGATE_{name.upper()} from an empty Secret?): give it "
                         "a value or leave it out")  # fmt: skip
    secrets = value if name == "api_keys" and isinstance(value, list) else [value]
    if name in _SECRETS and value is not None and not all(isinstance(v, str) for v in secrets):
        # NOTE: YAML reads unquoted 0777 as 511, 0x1F as 31, yes as true: not the key the operator wrote
        raise ValueError(f"{name}: a value is not text (YAML read it as a number or a boolean): quote it")

    # NOTE: YAML 1.1 reads unquoted on/off (yes/no) as booleans; for the modes they are the words
    if name in ("kv_events", "replica_sync") and isinstance(value, bool):
        if value and name == "kv_events":
            raise ValueError(
                "kv_events: true (YAML reads unquoted on/yes as true) is not a mode; "
                "write one of auto, redis, http or off, quoted if in doubt"
            )
        return "on" if value else "off"
    try:
        if kind == "list[str]":
            if isinstance(value, str):
                return [v.strip() for v in value.replace(",", " ").split() if v.strip()]
            return [str(v) for v in value]
        if kind == "dict[str, Any]":
            if isinstance(value, str):
                value = _yaml_value(value)
            if not isinstance(value, dict):
                raise TypeError("expected a mapping")
            return value
        if kind == "list[dict[str, Any]]":
            if isinstance(value, str):
                value = _yaml_value(value)
            if value is None:
                return []
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise TypeError("expected a list of mappings")
            return value
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if str(value).strip().lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError("expected a whole number")  # NOTE: YAML's 2.9 or yes, not truncated to 2 or 1
            return int(value)
        if kind == "float":
            if isinstance(value, bool):  # NOTE: YAML's unquoted on / no, not 1.0 / 0.0
                raise TypeError("expected a number")
            return float(value)
        if isinstance(value, (list, dict)):  # NOTE: str() would make a YAML list a setting's text
            raise TypeError("expected text")
        if isinstance(value, bool):  # NOTE: YAML reads unquoted on / off / yes / no as true / false
            raise TypeError(
                "expected text: quote it (YAML reads unquoted on, off, yes and no as true or false)"
            )
        if kind == "str | None":
            return None if value in (None, "") else str(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad value for {name}: {value!r} ({exc})") from None


def _yaml_value(text: str) -> Any:
    """One value written in YAML (env values, --policy-param); ValueError when it is not YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not valid YAML: {text!r} ({getattr(exc, 'problem', None) or exc})") from None


def load_yaml(path: str) -> dict[str, Any]:
    """The settings of a YAML file: a mapping of them, or one under a top-level ``router:`` key
    (then nothing else may be at the top level: a setting there by mistake would be ignored)."""
    with open(path, encoding="utf-8") as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    if "router" in raw:
        others = sorted(str(k) for k in raw if k != "router")
        if others:
            raise ValueError(
                f"{path}: unknown top-level key(s) {', '.join(map(repr, others))} beside router:; "
                "settings go under router:"
            )
        raw = raw["router"]
        if not isinstance(raw, dict):
            what = "empty" if raw is None else f"a {type(raw).__name__}"
            raise ValueError(f"{path}: the router: section must be a mapping of settings; it is {what}")
    out = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in _FIELDS:
            raise ValueError(f"{path}: unknown setting {key!r}")
        out[name] = _coerce(name, value)
    return out


# NOTE: RADIXGATE_ names that are not the router's: the worker's settings, the test suite's switches
_OTHERS_ENV = ("RADIXGATE_WORKER_", "RADIXGATE_TEST_", "RADIXGATE_FULL_TESTS")


def unknown_env(environ: dict[str, str]) -> list[str]:
    """``RADIXGATE_`` names in ``environ`` that no router setting has (a typo is not an error, since
    others use the prefix too, but it must not pass unseen: a misspelt key would leave a guard off)."""
    return sorted(
        k
        for k in environ
        if k.startswith("RADIXGATE_") and k not in _ENV_NAMES and not k.startswith(_OTHERS_ENV)
    )


def from_env(environ: dict[str, str]) -> dict[str, Any]:
    out = {}
    for env_name, name in _ENV_NAMES.items():
        value = environ.get(env_name)
        if value is not None:
            out[name] = _coerce(name, value)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router", description="radixgate cache-aware router")
    p.add_argument("--workers", help="comma-separated worker base URLs")
    p.add_argument("--worker-urls", nargs="+", help="worker base URLs (sglang-router spelling)")
    p.add_argument("--config", help="YAML settings file")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--policy", choices=POLICY_NAMES)
    p.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy parameter, repeatable (e.g. balance_abs=4)",
    )
    p.add_argument("--tokenizer", help="'bytes' (default) or a directory holding tokenizer.json")
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-index-entries", type=int)
    p.add_argument(
        "--prefill-tokens-per-load",
        type=float,
        help="unanswered prefill tokens that count as one request of load (default 256; 0: off)",
    )
    p.add_argument(
        "--kv-fetch-min-tokens",
        type=int,
        metavar="N",
        help="when the picked worker is predicted to hold N or more fewer tokens of the prompt than another "
        "worker, name that worker in x-radixgate-kv-source: a radixgate worker fetches the KV from it "
        "instead of computing that prefill (default 0: off)",
    )
    p.add_argument("--health-interval-s", type=float)
    p.add_argument("--max-retries", type=int)
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        help="requests forwarded at once by this router; the rest queue by priority, then arrival (default 0: no limit)",
    )
    p.add_argument("--max-queued-requests", type=int, help="queued requests before 429 (default 1024)")
    p.add_argument("--queue-timeout-s", type=float, help="longest wait in the queue before 503 (default 30)")
    p.add_argument("--request-timeout-s", type=float)
    p.add_argument("--admin-token")
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        metavar="KEY",
        help="a key clients must send as 'Authorization: Bearer KEY' (repeatable; prefer env "
        "RADIXGATE_API_KEYS=a,b, which process listings do not show)",
    )
    p.add_argument(
        "--worker-api-key",
        metavar="KEY",
        help="the key workers require ('Authorization: Bearer KEY', a radixgate worker's --api-key or "
        "vLLM's): sent on every request to them instead of the client's (prefer env RADIXGATE_WORKER_API_KEY)",
    )
    p.add_argument(
        "--k8s-worker-service",
        metavar="SERVICE",
        help="discover workers as the endpoints of this Kubernetes Service (its EndpointSlices, "
        "re-listed every --discovery-interval-s; in-cluster credentials)",
    )
    p.add_argument("--k8s-namespace", help="the Service's namespace (default: this pod's)")
    p.add_argument("--k8s-api-url", help="API server (default: https://$KUBERNETES_SERVICE_HOST:PORT)")
    p.add_argument("--k8s-token-file", help="bearer token file (default: the service account's)")
    p.add_argument("--k8s-worker-port-name", help="the Service port workers serve on (default: its first)")
    p.add_argument("--k8s-cluster-domain", help="DNS domain of worker names (default cluster.local)")
    p.add_argument("--discovery-interval-s", type=float)
    p.add_argument("--kv-events", choices=("auto", "redis", "http", "off"))
    p.add_argument("--redis-url")
    p.add_argument(
        "--replica-sync",
        choices=("auto", "on", "off"),
        help="announce per-worker load to other router replicas over Redis (auto: when --redis-url)",
    )
    p.add_argument(
        "--stream-usage",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask workers for a stream's usage chunk where the client did not, and remove it (default on)",
    )
    p.add_argument("--launch-workers", type=int, metavar="N", help="start N local workers")
    p.add_argument("--model", dest="worker_model", help="model for --launch-workers (default tiny)")
    p.add_argument(
        "--worker-arg",
        dest="worker_args",
        action="append",
        help="extra flag passed to launched workers, repeatable",
    )
    p.add_argument("--log-level")
    p.add_argument(
        "--shutdown-delay-s",
        type=float,
        help="on SIGTERM, serve on this long with /ready answering 503 so load balancers stop sending new "
        "connections, then shut down as requests in flight finish; a second signal stops at once (default 0)",
    )
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="log one JSON line per completion request: worker, attempts, policy reason, predicted vs actual "
        "cached tokens, TTFT and duration (logger radixgate.access)",
    )
    return p


def build_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> RouterConfig:
    """Merge defaults < YAML < env < flags and validate. Raises ValueError / SystemExit on bad input."""
    args = build_parser().parse_args(argv)
    yaml_settings = load_yaml(args.config) if args.config else {}
    environ = dict(os.environ) if environ is None else environ
    env = from_env(environ)
    for name in unknown_env(environ):
        near = difflib.get_close_matches(name, list(_ENV_NAMES), 1)
        logging.getLogger("radixgate.router").warning(
            "env %s is not a router setting: ignored%s", name, f" (did you mean {near[0]}?)" if near else ""
        )
    flags = {k: v for k, v in vars(args).items() if v is not None and k in _FIELDS}
    if args.workers:
        flags["workers"] = _coerce("workers", args.workers)
    if args.worker_urls:
        flags["workers"] = flags.get("workers", []) + list(args.worker_urls)
    lower = {**yaml_settings, **env}
    _drop_params_of_another_policy(lower, yaml_settings, env, flags.get("policy"))
    if args.policy_param:
        params = dict(lower.get("policy_params", {}))
        for item in args.policy_param:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--policy-param expects KEY=VALUE, got {item!r}")
            try:
                params[key] = _yaml_value(value)
            except ValueError as exc:
                raise ValueError(f"--policy-param {key}: {exc}") from None
        flags["policy_params"] = params
    settings = {**lower, **flags}
    config = RouterConfig(**settings)
    config.workers = list(dict.fromkeys(worker_base_url(w) for w in config.workers))
    config.log_level = config.log_level.lower()  # NOTE: uvicorn knows only the lower-case names
    for name in ("admin_token", "worker_api_key"):  # NOTE: a Secret file's newline: no header carries it
        if getattr(config, name) is not None:
            setattr(config, name, getattr(config, name).strip())
    config.validate()
    return config


def _drop_params_of_another_policy(
    lower: dict[str, Any], yaml_settings: dict[str, Any], env: dict[str, Any], flag_policy: str | None
) -> None:
    """``policy_params`` are their policy's: a policy chosen at a higher level (env, a flag) than the
    params (the YAML's, the env's) does not take params written for another one (the example config's
    ``cache_aware`` ones made ``RADIXGATE_POLICY=round_robin`` a start-up error): they are left out
    of ``lower`` (the YAML and env merged), with a warning."""
    if "policy_params" not in lower:
        return
    written = yaml_settings if "policy_params" not in env else {**yaml_settings, **env}
    theirs = written.get("policy", RouterConfig.policy)
    policy = flag_policy or lower.get("policy", RouterConfig.policy)
    if policy != theirs:
        logging.getLogger("radixgate.router").warning(
            "policy_params %s were given for policy %r, not %r: left out",
            lower["policy_params"],
            theirs,
            policy,
        )
        del lower["policy_params"]


def check_tokenizer(spec: str) -> None:
    """ValueError unless ``spec`` (the tokenizer setting) loads. Called at start-up, not by
    ``validate``: a config names paths of the machine it runs on (a Helm chart's, a pod's)."""
    try:
        load_tokenizer(spec)
    except Exception as exc:  # NOTE: the tokenizers library raises bare Exceptions on a bad file
        raise ValueError(f"tokenizer {spec!r} does not load: {exc}") from None


def _ip_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address, in each spelling a connect takes (``127.1``, ``0``, an IPv4-mapped
    IPv6 address as its IPv4 one); None for a name."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.inet_aton(host))  # NOTE: the C library's short forms
        except (OSError, ValueError):
            return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


@functools.cache
def _machine_addresses() -> frozenset:
    """The addresses this machine's name resolves to (a pod's IP); empty where it resolves to none."""
    try:
        found = socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        return frozenset()
    return frozenset(a for info in found if (a := _ip_address(str(info[4][0]).split("%")[0])) is not None)
