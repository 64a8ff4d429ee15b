"""`sglang-pd router`: flags, the topology file and the environment → RouterConfig → serve.

Precedence: a flag given on the command line wins over the topology's `router:` section, which
wins over RouterConfig's defaults (the same as RouterSpec's). Secrets may come from the
environment instead of flags (`SGLANG_PD_ROUTER_API_KEYS` comma-separated,
`SGLANG_PD_ROUTER_ADMIN_KEY`, `SGLANG_PD_ROUTER_WORKER_API_KEY`) so they stay out of process
listings. Kubernetes discovery finds the leader pods the chart labels, in every release of the
namespace unless `--k8s-release` names one.

smg (1.13) spellings are accepted where the meaning is the same (SMG_SPELLINGS below; `--help`
lists them), and `--prefill URL` without a port means what it means in smg: no bootstrap port.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from sglang_pd.deploy.common import contract
from sglang_pd.deploy.spec.revision import split_revision
from sglang_pd.deploy.spec.topology import RouterSpec, load_topology

from .config import KubernetesDiscoveryConfig, RouterConfig

__all__ = ["SMG_SPELLINGS", "add_arguments", "build_config", "run"]

# smg's `launch` flags that mean what one of ours means: smg spelling -> ours. smg's
# --retry-max-retries counts attempts (its --disable-retries is "retry_max_retries=1"), ours
# counts retries, so it is not taken; --disable-retries is, as --max-retries 0.
SMG_SPELLINGS = {
    "--pd-disaggregation": "(always on: this router is PD only)",
    "--request-timeout-secs": "--request-timeout",
    "--queue-size": "--max-queued-requests",
    "--queue-timeout-secs": "--queue-timeout",
    "--max-payload-size": "--max-body-bytes",
    "--header-read-timeout-secs": "--header-timeout",
    "--idle-connection-timeout-secs": "--keep-alive-timeout",
    "--shutdown-grace-period-secs": "--drain-timeout",
    "--disable-retries": "--max-retries 0",
    "--health-check-interval-secs": "--health-interval",
    "--health-check-timeout-secs": "--health-timeout",
    "--cb-failure-threshold": "--breaker-failure-threshold",
    "--cb-timeout-duration-secs": "--breaker-cooldown",
    "--service-discovery": "--kubernetes",
    "--service-discovery-namespace": "--k8s-namespace",
    "--service-discovery-port": "--k8s-port",
    "--prefill-selector": "--k8s-prefill-selector (smg's 'k1=v1 k2=v2' joined with ',')",
    "--decode-selector": "--k8s-decode-selector (as --prefill-selector)",
    "--log-level warn": "--log-level warning",
}
SMG_EPILOG = (
    "smg 1.13 spellings accepted (same meaning): "
    + "; ".join(f"{smg} = {ours}" for smg, ours in SMG_SPELLINGS.items())
    + ". --prefill URL without a port: no bootstrap port, as in smg (requests carry bootstrap_port null "
    "and each engine uses its own --disaggregation-bootstrap-port, sglang's default 8998)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    workers = parser.add_argument_group("workers")
    workers.add_argument("--topology", metavar="FILE", help="topology YAML: router settings and the local workers")
    workers.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar=("URL[@REVISION]", "BOOTSTRAP_PORT"),
        help="a prefill worker and its bootstrap port; repeatable. Without a port (or 'none'), as in smg, the "
        "worker has no bootstrap port: requests carry bootstrap_port null and each engine uses its own "
        f"--disaggregation-bootstrap-port (sglang's default {contract.DEFAULT_BOOTSTRAP_PORT}); give the port "
        "when the engines' settings differ. URL@REVISION gives its revision (`python -m "
        "sglang_pd.deploy.spec.revision TOPOLOGY --image IMAGE` prints a topology's; the chart's pods carry it as "
        "the sglang-pd/revision label): a prefill pairs only with "
        "decodes of its revision, a worker without one only with workers without one",
    )
    workers.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL[@REVISION]",
        help="a decode worker, and its revision after '@' (as --prefill); repeatable",
    )
    workers.add_argument(
        "--kubernetes", "--service-discovery", action="store_true", help="discover workers from pods by label selector"
    )
    workers.add_argument(
        "--k8s-namespace", "--service-discovery-namespace", default=None, help="namespace to watch (default: default)"
    )
    workers.add_argument("--k8s-release", default=None, help="only the pods of this Helm release (default: every one)")
    workers.add_argument("--k8s-prefill-selector", default=None, help="label selector of prefill pods")
    workers.add_argument("--k8s-decode-selector", default=None, help="label selector of decode pods")
    workers.add_argument("--prefill-selector", nargs="+", default=None, metavar="KEY=VALUE", help=argparse.SUPPRESS)
    workers.add_argument("--decode-selector", nargs="+", default=None, metavar="KEY=VALUE", help=argparse.SUPPRESS)
    workers.add_argument(
        "--k8s-port",
        "--service-discovery-port",
        type=int,
        default=None,
        help="workers' HTTP port when pods do not annotate it",
    )
    workers.add_argument("--pd-disaggregation", action="store_true", help=argparse.SUPPRESS)

    serve = parser.add_argument_group("serving")
    serve.add_argument("--host", default=None, help="address to listen on (default 0.0.0.0)")
    serve.add_argument("--port", type=int, default=None, help="port to listen on (default 8000)")
    serve.add_argument("--policy", choices=contract.POLICIES, default=None, help="policy for both roles")
    serve.add_argument("--prefill-policy", choices=contract.POLICIES, default=None)
    serve.add_argument(
        "--decode-policy",
        choices=[p for p in contract.POLICIES if p not in contract.PREFILL_ONLY_POLICIES],
        default=None,
    )
    serve.add_argument(
        "--log-level",
        type=lambda v: "warning" if v == "warn" else v,
        choices=["debug", "info", "warning", "error"],
        default=None,
        help="(smg's 'warn' is 'warning')",
    )
    serve.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces (a span per request and per leg, the legs' context sent to the engines "
        "as W3C traceparent, which sglang reads with --enable-trace) to this OTLP/HTTP collector URL, e.g. "
        "http://otel-collector:4318/v1/traces; off by default; needs the tracing extra",
    )
    serve.add_argument(
        "--drain-timeout",
        "--shutdown-grace-period-secs",
        type=float,
        default=None,
        help="seconds in-flight requests get on SIGTERM",
    )
    serve.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="serving processes on the port (SO_REUSEPORT), led by a control process that owns worker health; "
        "1: this process serves (default)",
    )

    limits = parser.add_argument_group("admission and timeouts")
    limits.add_argument("--max-concurrent-requests", type=int, default=None, help="0: no limit")
    limits.add_argument("--max-queued-requests", "--queue-size", type=int, default=None)
    limits.add_argument("--queue-timeout", "--queue-timeout-secs", type=float, default=None, metavar="SECONDS")
    limits.add_argument(
        "--client-reserve",
        type=float,
        default=None,
        metavar="FRACTION",
        help="share of the decodes' slots and tokens no one client may hold, kept for the next client to arrive "
        "(default 0: a client alone may take them all; clients are API keys, else addresses)",
    )
    limits.add_argument(
        "--max-body-bytes", "--max-payload-size", type=int, default=None, help="one request body; beyond: 413"
    )
    limits.add_argument(
        "--max-body-bytes-in-flight", type=int, default=None, help="all bodies held at once; beyond: 503"
    )
    limits.add_argument(
        "--header-timeout",
        "--header-read-timeout-secs",
        type=float,
        default=None,
        metavar="SECONDS",
        help="to send a head: 408",
    )
    limits.add_argument("--body-timeout", type=float, default=None, metavar="SECONDS", help="to send a body: 408")
    limits.add_argument(
        "--body-grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="time a body may take before --body-min-rate applies (default 10)",
    )
    limits.add_argument(
        "--body-min-rate",
        type=int,
        default=None,
        metavar="BYTES_PER_S",
        help="average rate a body must keep after --body-grace; slower: 408 (default 1024; 0: only --body-timeout)",
    )
    limits.add_argument(
        "--max-connections", type=int, default=None, help="client connections open at once; beyond: 503"
    )
    limits.add_argument(
        "--source-share",
        type=float,
        default=None,
        metavar="FRACTION",
        help="share of --max-connections one client address may hold; beyond: 503 (default 0.5; 1: no share)",
    )
    limits.add_argument(
        "--keep-alive-timeout", "--idle-connection-timeout-secs", type=float, default=None, metavar="SECONDS"
    )
    limits.add_argument("--max-header-bytes", type=int, default=None, help="whole request head; beyond: 431")
    limits.add_argument("--max-header-count", type=int, default=None, help="header fields; beyond: 431")
    limits.add_argument("--max-request-line-bytes", type=int, default=None, help="the URL; beyond: 414")
    limits.add_argument("--request-timeout", "--request-timeout-secs", type=float, default=None, metavar="SECONDS")
    limits.add_argument("--connect-timeout", type=float, default=None, metavar="SECONDS")
    limits.add_argument("--stream-idle-timeout", type=float, default=None, metavar="SECONDS")
    limits.add_argument(
        "--slow-reader-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="cut a streamed answer whose client has taken none of its bytes this long, and abort its "
        "engines' work (default 30; 0: off)",
    )
    limits.add_argument("--max-retries", type=int, default=None)
    limits.add_argument("--disable-retries", action="store_true", help="--max-retries 0 (smg's spelling)")
    limits.add_argument(
        "--migration-limit",
        type=int,
        default=None,
        help="moves of a stream to another pair when its decode fails mid-stream (default 1; 0: off; "
        "docs/migration.md)",
    )

    health = parser.add_argument_group(
        "health and circuit breaker",
        "A worker is admitted once GET /health passes (sglang: a one-token generation, 1-20 s), then kept by "
        "GET /v1/models (instant) every --health-interval and /health every --health-generate-interval.",
    )
    health.add_argument(
        "--health-interval",
        "--health-check-interval-secs",
        type=float,
        default=None,
        metavar="SECONDS",
        help="liveness probe period (default 2)",
    )
    health.add_argument(
        "--health-timeout",
        "--health-check-timeout-secs",
        type=float,
        default=None,
        metavar="SECONDS",
        help="liveness probe timeout (default 5)",
    )
    health.add_argument(
        "--health-failure-threshold", type=int, default=None, help="failed liveness probes in a row that eject (3)"
    )
    health.add_argument(
        "--health-success-threshold", type=int, default=None, help="passed /health probes that readmit (1)"
    )
    health.add_argument(
        "--health-generate-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="/health probe period of an admitted worker (default 30)",
    )
    health.add_argument(
        "--health-generate-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="/health probe timeout (default 25: sglang's own 20 s limit plus margin)",
    )
    health.add_argument(
        "--stream-stall", type=float, default=None, metavar="SECONDS", help="eject a worker whose streams stall; 0: off"
    )
    health.add_argument("--breaker-failure-threshold", "--cb-failure-threshold", type=int, default=None)
    health.add_argument("--breaker-cooldown", "--cb-timeout-duration-secs", type=float, default=None, metavar="SECONDS")

    security = parser.add_argument_group("security")
    security.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"client API key; repeatable (or {contract.ENV_ROUTER_API_KEYS}=k1,k2)",
    )
    security.add_argument("--admin-key", default=None, help=f"key for /workers (or {contract.ENV_ROUTER_ADMIN_KEY})")
    rollout = parser.add_argument_group("rollout")
    rollout.add_argument(
        "--canary-share",
        type=float,
        default=None,
        metavar="FRACTION",
        help="client requests sent to a candidate revision while another is approved (default 0: only requests "
        "pinned with x-sglpd-revision and the admin key reach a candidate; docs/upgrades.md)",
    )
    rollout.add_argument(
        "--approved-revision",
        default=None,
        metavar="REV",
        help="the revision client requests go to from the start (default: the first with a healthy pair); give the "
        "last approved one so that a restarted router holds client requests where they were",
    )
    security.add_argument(
        "--allow-link-local-workers",
        action="store_true",
        default=None,
        help="accept workers on link-local (169.254.0.0/16, fe80::/10) and cloud metadata addresses, "
        "refused by default from every source",
    )
    security.add_argument(
        "--worker-hosts",
        nargs="+",
        action="append",
        default=None,
        metavar="HOST",
        help="host names, IP addresses or CIDR ranges (e.g. 10.0.0.0/16) POST /workers may register workers at; "
        "repeatable, commas also separate. The router sends the worker key to every worker it probes, so by "
        "default the admin API may only name the hosts of the workers given at start (--prefill, --decode, "
        "--topology) and of discovered ones; with none of those, nothing until this names where workers run. "
        "Names match as written (no DNS lookup)",
    )
    security.add_argument(
        "--worker-api-key",
        default=None,
        help=f"key sent to workers (or {contract.ENV_ROUTER_WORKER_API_KEY}, else {contract.ENV_WORKER_API_KEY})",
    )


_FLAG_TO_FIELD = {
    "host": "host",
    "port": "port",
    "prefill_policy": "prefill_policy",
    "decode_policy": "decode_policy",
    "max_concurrent_requests": "max_concurrent_requests",
    "max_queued_requests": "max_queued_requests",
    "queue_timeout": "queue_timeout_s",
    "max_body_bytes": "max_body_bytes",
    "max_body_bytes_in_flight": "max_body_bytes_in_flight",
    "header_timeout": "header_timeout_s",
    "body_timeout": "body_timeout_s",
    "body_grace": "body_grace_s",
    "body_min_rate": "body_min_rate",
    "max_connections": "max_connections",
    "source_share": "source_share",
    "client_reserve": "client_reserve",
    "keep_alive_timeout": "keep_alive_timeout_s",
    "max_header_bytes": "max_header_bytes",
    "max_header_count": "max_header_count",
    "max_request_line_bytes": "max_request_line_bytes",
    "request_timeout": "request_timeout_s",
    "connect_timeout": "connect_timeout_s",
    "stream_idle_timeout": "stream_idle_timeout_s",
    "slow_reader_timeout": "slow_reader_timeout_s",
    "max_retries": "max_retries",
    "migration_limit": "migration_limit",
    "health_interval": "health_interval_s",
    "health_timeout": "health_timeout_s",
    "health_failure_threshold": "health_failure_threshold",
    "health_success_threshold": "health_success_threshold",
    "health_generate_interval": "health_generate_interval_s",
    "health_generate_timeout": "health_generate_timeout_s",
    "stream_stall": "stream_stall_s",
    "breaker_failure_threshold": "breaker_failure_threshold",
    "breaker_cooldown": "breaker_cooldown_s",
    "drain_timeout": "drain_timeout_s",
    "log_level": "log_level",
    "otlp_traces_endpoint": "otlp_traces_endpoint",
    "allow_link_local_workers": "allow_link_local_workers",
}


def _parse_prefill(values: list[str]) -> tuple[str, int | None]:
    if len(values) > 2:
        raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(values)!r}.")
    if len(values) == 1 or values[1].lower() == "none":
        return values[0], None
    try:
        return values[0], int(values[1])
    except ValueError:
        raise ValueError(
            f"--prefill {values[0]} {values[1]}: the bootstrap port {values[1]!r} is not an integer."
        ) from None


def router_flags(spec: RouterSpec) -> list[str]:
    """The command-line flags that give a router `spec`'s settings (all but host and port), for a
    parent that starts the router as a child (`up`); the table above is their one mapping."""
    field_to_flag = {name: flag for flag, name in _FLAG_TO_FIELD.items()}
    argv: list[str] = []
    for name, value in spec.model_dump().items():
        if name in ("host", "port"):
            continue
        flag = "--" + field_to_flag[name].replace("_", "-")
        argv += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return argv


def build_config(args: argparse.Namespace, environ: dict[str, str] | None = None) -> tuple[RouterConfig, str]:
    """RouterConfig and the worker API key from parsed flags, the topology and the environment."""
    env = os.environ if environ is None else environ
    fields: dict[str, Any] = {}
    prefill: list[tuple[str, int | None]] = []
    decode: list[str] = []
    spec = RouterSpec()
    if args.topology:
        topology = load_topology(args.topology)
        spec = topology.router
        static_prefill, static_decode = topology.static_workers()
        prefill.extend(static_prefill)
        decode.extend(static_decode)
    if args.policy:
        fields["prefill_policy"] = args.policy
        fields["decode_policy"] = "least_load" if args.policy == "cache_aware" else args.policy
    for flag, name in _FLAG_TO_FIELD.items():
        value = getattr(args, flag, None)
        if value is not None:
            fields[name] = value
    if getattr(args, "disable_retries", False):
        if fields.get("max_retries", 0) != 0:
            raise ValueError(f"--disable-retries and --max-retries {fields['max_retries']} disagree; give one of them.")
        fields["max_retries"] = 0
    for smg_flag, ours in (("prefill_selector", "k8s_prefill_selector"), ("decode_selector", "k8s_decode_selector")):
        if (pairs := getattr(args, smg_flag, None)) is not None:  # smg's `k1=v1 k2=v2`
            if getattr(args, ours, None) is not None:
                raise ValueError(f"--{smg_flag.replace('_', '-')} and --{ours.replace('_', '-')} both given; give one.")
            setattr(args, ours, ",".join(pairs))
    if args.prefill or args.decode:  # workers on the command line replace the topology's
        prefill = [_parse_prefill(v) for v in args.prefill]
        decode = list(args.decode)
    for option in [url for url, _ in prefill] + decode:
        split_revision(option)  # a bad revision is refused here, with the fix
    api_keys = list(args.api_key or [])
    api_keys += [k for k in env.get(contract.ENV_ROUTER_API_KEYS, "").split(",") if k.strip()]
    fields["api_keys"] = tuple(k.strip() for k in api_keys)
    fields["admin_key"] = args.admin_key or env.get(contract.ENV_ROUTER_ADMIN_KEY, "")
    if args.worker_hosts is not None:
        entries = [entry for values in args.worker_hosts for value in values for entry in value.split(",")]
        fields["worker_hosts"] = tuple(entry.strip() for entry in entries if entry.strip())
    if args.canary_share is not None:
        fields["canary_share"] = args.canary_share
    if args.approved_revision is not None:
        fields["approved_revision"] = args.approved_revision
    worker_api_key = (
        args.worker_api_key
        or env.get(contract.ENV_ROUTER_WORKER_API_KEY, "")
        or env.get(contract.ENV_WORKER_API_KEY, "")
    )
    use_k8s = args.kubernetes or (args.topology and not prefill and not decode)
    if use_k8s:
        k8s: dict[str, Any] = {}
        if release := getattr(args, "k8s_release", None):
            k8s["prefill_selector"] = contract.worker_selector("prefill", release)
            k8s["decode_selector"] = contract.worker_selector("decode", release)
        for flag, name in (
            ("k8s_namespace", "namespace"),
            ("k8s_prefill_selector", "prefill_selector"),
            ("k8s_decode_selector", "decode_selector"),
            ("k8s_port", "port"),
        ):
            value = getattr(args, flag, None)
            if value is not None:
                k8s[name] = value
        fields["kubernetes"] = KubernetesDiscoveryConfig(**k8s)
    fields["prefill_workers"] = tuple(prefill)
    fields["decode_workers"] = tuple(decode)
    return RouterConfig.from_spec(spec, **fields), worker_api_key


def run(args: argparse.Namespace) -> int:
    from .app import create_app
    from .exceptions import RouterError
    from .group.process_group import ProcessGroup
    from .server import serve

    if args.processes < 1:
        print(f"sglang-pd router: --processes {args.processes}: it must be 1 or more.", file=sys.stderr)
        return 2
    try:
        config, worker_api_key = build_config(args)
        if args.processes > 1:
            group = ProcessGroup(config, worker_api_key=worker_api_key, processes=args.processes)
        else:
            app = create_app(config, worker_api_key=worker_api_key)
    except (ValueError, RouterError) as exc:
        print(f"sglang-pd router: {exc}", file=sys.stderr)
        return 2
    if not config.prefill_workers and not config.decode_workers and config.kubernetes is None:
        print(
            "sglang-pd router: starting with no workers; add them with POST /workers "
            "(needs --admin-key, and --worker-hosts naming where they run), or pass --prefill/--decode, "
            "--topology or --kubernetes.",
            file=sys.stderr,
        )
    if args.processes > 1:
        return group.serve()
    return serve(app)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sglang-pd router", description="The OpenAI-compatible PD router.", epilog=SMG_EPILOG
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
