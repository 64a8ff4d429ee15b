"""`sglang-pd kv-probe`: a pre-flight check of KV transfer between a prefill and a decode host.

On the decode host: `sglang-pd kv-probe --serve --hostname DECODE_IP` (prints the control URL).
On the prefill host: `sglang-pd kv-probe --peer http://DECODE_IP:PORT --hostname PREFILL_IP`.
With no `--peer` it starts a peer process here and checks this machine (loopback).

It opens the transfer engine, registers page-shaped KV memory (host memory, or with `--memory gpu` GPU
memory as sglang's KV pool is, which over rdma needs GPUDirect RDMA), probes the peer, measures the
latency of one-page writes and the bandwidth of contiguous and fragmented page writes, checks
the bytes arrived (crc32), and on failure prints a diagnosis a user can act on. On loopback both
engines share this machine's NIC (or GPU): it proves the node's RDMA set-up and memory registration
(GPUDirect RDMA included, with `--memory gpu`), not the path between two nodes.
While `sglang-pd up` fences the KV ports on this machine (docs/ports-and-auth.md), a loopback probe
run as root joins the engines' group, which the fence admits; run as another user it is refused, naming
`up`'s fence, and a `--serve` peer warns that hosts elsewhere cannot reach it.
Exit codes: 0 all checks passed, 1 a check failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import zlib
from contextlib import ExitStack
from typing import Any

import httpx

from ..common.node import MEMLOCK_FIX, deepep_driver, memlock_limit
from .config import KVConfig
from .engine import get_engine
from .exceptions import (
    BadAddress,
    DeviceMissing,
    GpuMemoryUnavailable,
    KVError,
    PeerUnreachable,
    RegistrationRefused,
    TransportUnavailable,
)
from .firewall import KV_ENGINE_GID, fenced_engines
from .listeners import mooncake_port_range
from .memory import MEMORY_KINDS, KVBuffer, allocate
from .pages import PagedLayout

__all__ = ["add_arguments", "diagnose", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--peer", metavar="URL", help="control URL of a `kv-probe --serve` peer (default: one here)")
    parser.add_argument("--serve", action="store_true", help="be the decode side: register memory and wait")
    parser.add_argument("--listen", default="0.0.0.0", help="address of the --serve control API (default 0.0.0.0)")
    parser.add_argument("--http-port", type=int, default=18998, help="port of the --serve control API")
    parser.add_argument("--hostname", default=None, help="address peers reach this engine at (SGLANG_PD_KV_HOSTNAME)")
    parser.add_argument("--protocol", choices=("tcp", "rdma"), default=None, help="tcp, or rdma in clusters")
    parser.add_argument("--device", default=None, help="RDMA device(s), e.g. mlx5_0")
    parser.add_argument(
        "--memory",
        choices=MEMORY_KINDS,
        default="host",
        help="memory to register on both sides: host, or gpu (a CUDA buffer, as sglang's KV pool; needs torch "
        "with CUDA) (default host)",
    )
    parser.add_argument("--pages", type=int, default=256, help="pages per bandwidth write (default 256)")
    parser.add_argument("--page-bytes", type=int, default=64 * 1152, help="bytes per page and layer (DeepSeek-V3)")
    parser.add_argument("--layers", type=int, default=4, help="KV layers to write (default 4)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--format", choices=("table", "json"), default="table")


def diagnose(exc: BaseException) -> str:
    """What a user should do about `exc`."""
    if isinstance(exc, FencedByUp):
        return "run the probe as root (sudo sglang-pd kv-probe): it then joins the engines' group; or stop `up` first."
    if isinstance(exc, GpuMemoryUnavailable):
        return "give the probe a GPU (the chart's kv-probe pod requests one where decode pods run), or --memory host."
    if isinstance(exc, DeviceMissing):
        return "mount /dev/infiniband and /sys/class/infiniband into the pod, or name an existing device (--device)."
    if isinstance(exc, RegistrationRefused):
        _, limit = memlock_limit()
        gpu = (
            " With --memory gpu over rdma, the NIC must reach GPU memory (GPUDirect RDMA): load nvidia-peermem, "
            "or use a kernel and driver with DMA-BUF (Linux 5.12+, open kernel modules)."
        )
        return f"the locked-memory limit is {limit}: {MEMLOCK_FIX}." + (gpu if "gpu" in str(exc).lower() else "")
    if isinstance(exc, TransportUnavailable):
        return (
            "install exactly one Mooncake wheel (mooncake-transfer-engine-non-cuda without CUDA) and the Debian "
            "package libibverbs1; check that --hostname is an address of this machine."
        )
    if isinstance(exc, PeerUnreachable):
        return (
            "the decode host's transfer engine does not answer: check it runs, that --hostname on the decode side is "
            "an address the prefill host can reach, and that no firewall blocks its ports."
        )
    if isinstance(exc, BadAddress):
        return "the peer rejected an address: prefill and decode must use the same page size and KV dtype."
    if isinstance(exc, httpx.HTTPError | OSError):
        return "the peer's control URL does not answer: start `sglang-pd kv-probe --serve` there, check host and port."
    return "see the error above."


class FencedByUp(RuntimeError):
    """`sglang-pd up`'s KV fence is in force here and this probe cannot join its engines' group."""


def _loopback(url: str | None) -> bool:
    return url is None or httpx.URL(url).host in ("127.0.0.1", "localhost", "::1")


def _up_fence() -> tuple[str, str] | None:
    """When `sglang-pd up` fences the KV ports here: what fences them (up's pid and the ports) and the group."""
    engines = fenced_engines()
    if not engines:
        return None
    ups = sorted(set(engines.values()))
    low, high = mooncake_port_range()
    pids = ", ".join(str(p) for p in ups)
    return (
        f"`sglang-pd up` (pid {pids}) fences the KV ports (TCP {low}-{high}) on this machine",
        f"its engines' group (gid {KV_ENGINE_GID})",
    )


def join_up_fence(peer: str | None, serve: bool) -> str | None:
    """Pass `up`'s fence where it is in force: a loopback probe run as root joins the engines' group (and
    its peer process with it); one run as another user raises FencedByUp. Returns a note for the user."""
    fence = _up_fence()
    if fence is None:
        return None
    what, group = fence
    if serve:
        return (
            f"warning: {what}: connections to them from other hosts are dropped, so a prefill host's probe cannot "
            "reach this peer while it runs; stop it first."
        )
    if not _loopback(peer):
        return None
    if os.geteuid() != 0:
        raise FencedByUp(
            f"{what}: loopback connections to them are reset unless they come from {group}, and this probe runs "
            f"as uid {os.geteuid()}."
        )
    os.setgid(KV_ENGINE_GID)
    return f"note: {what}; this probe runs in {group}, which the fence admits."


def _get(url: str) -> dict[str, Any]:
    result: dict[str, Any] = httpx.get(url, timeout=10).raise_for_status().json()
    return result


def _probe(args: argparse.Namespace, config: KVConfig, peer_url: str, buf: KVBuffer) -> dict[str, Any]:
    report: dict[str, Any] = {"checks": []}

    def check(name: str, detail: str) -> None:
        report["checks"].append({"check": name, "ok": True, "detail": detail})

    engine = get_engine(config)
    check("engine", f"{config.protocol} engine at {engine.session_id}")
    info = _get(peer_url + "/info")
    peer, dst_base, dst_len = info["session_id"], int(info["base"]), int(info["length"])
    page, layers = args.page_bytes, args.layers
    pages = min(args.pages, dst_len // (page * layers))
    if pages < 2:
        raise ValueError(f"The peer registered {dst_len} bytes: too small for {layers} layers of {page}-byte pages.")
    size = page * pages * layers
    data = random.Random(1).randbytes(size)
    buf.write(0, data)
    base = buf.base
    try:
        engine.register(base, size)
    except RegistrationRefused as exc:
        raise RegistrationRefused(f"{exc} (registering {buf.describe()})") from exc
    check("register", f"{size} bytes of {buf.describe()} registered; the peer's: {info.get('memory', 'host memory')}")
    engine.probe(peer)
    check("probe", f"peer {peer} answers")

    src = PagedLayout(tuple(base + i * page * pages for i in range(layers)), page, pages)
    dst = PagedLayout(tuple(dst_base + i * page * pages for i in range(layers)), page, pages)
    lat = []
    for _ in range(max(args.repeat * 4, 10)):
        t0 = time.perf_counter()
        engine.write(peer, [(base, dst_base, page)], pages=1)
        lat.append(time.perf_counter() - t0)
    check("latency", f"one {page}-byte page: p50 {statistics.median(lat) * 1e6:.0f} µs")
    rows = []
    for shape, dst_pages in (
        ("contiguous", list(range(pages))),
        ("fragmented", random.Random(2).sample(range(pages), pages)),
    ):
        times = []
        for _ in range(args.repeat):
            r = engine.write_pages(peer, src, dst, list(range(pages)), dst_pages)
            times.append(r.seconds)
        best = min(times)
        rows.append(
            {
                "shape": shape,
                "pages": pages,
                "layers": layers,
                "bytes": size,
                "items": r.items,
                "p50_ms": statistics.median(times) * 1e3,
                "best_gbps": size / best / 1e9,
            }
        )
        # every layer's pages must have arrived where the decode side expects them
        want = zlib.crc32(
            b"".join(
                data[src_off : src_off + page]
                for layer in range(layers)
                for d in range(pages)
                for src_off in [layer * page * pages + dst_pages.index(d) * page]
            )
        )
        got = int(_get(f"{peer_url}/crc?offset=0&length={size}")["crc"])
        if got != want:
            raise BadAddress(f"The bytes the peer holds after the {shape} write differ from those sent (crc32).")
    check("integrity", "crc32 of every written page matches")
    report["bandwidth"] = rows
    report["memory"] = buf.kind
    report["ok"] = True
    return report


def _deepep_driver_check() -> dict[str, Any]:
    """DeepEP across nodes (the decode group's all-to-all) needs NVIDIA driver options or GDRCopy.

    Reported beside the KV checks because it is the same node's RDMA set-up; it is advice and does
    not change the exit code (KV transfer itself does not need it).
    """
    found = deepep_driver()
    row = {"check": "deepep-driver", "ok": found["ok"] is not False, "advisory": True, "detail": found["detail"]}
    if found["ok"] is None:  # no NVIDIA driver at all: nothing to judge, and the table says n/a, not yes
        row["not_applicable"] = True
    return row


def _format_table(report: dict[str, Any]) -> str:
    out = [f"{'check':<13} {'ok':<4} detail"]
    for c in report["checks"]:
        ok = "n/a" if c.get("not_applicable") else "yes" if c["ok"] else "NO"
        out.append(f"{c['check']:<13} {ok:<4} {c['detail']}")
    if report.get("bandwidth"):
        out.append("")
        out.append(f"{'shape':<11} {'pages':>6} {'layers':>6} {'MiB':>8} {'items':>6} {'p50 ms':>8} {'GB/s':>6}")
        for r in report["bandwidth"]:
            out.append(
                f"{r['shape']:<11} {r['pages']:>6} {r['layers']:>6} {r['bytes'] / 2**20:>8.1f} {r['items']:>6} "
                f"{r['p50_ms']:>8.2f} {r['best_gbps']:>6.2f}"
            )
    if not report["ok"]:
        out.append("")
        out.append(f"FAILED: {report['error']}")
        out.append(f"what to do: {report['diagnosis']}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    config = KVConfig.from_env(hostname=args.hostname, protocol=args.protocol, device=args.device)
    try:
        note = join_up_fence(args.peer, args.serve)
    except FencedByUp as exc:
        refused: dict[str, Any] = {"checks": [], "ok": False, "error": str(exc), "diagnosis": diagnose(exc)}
        print(json.dumps(refused, indent=2) if args.format == "json" else _format_table(refused))
        return 1
    if note:
        print(note, file=sys.stderr)
    if args.serve:
        from .peer import _serve

        size = args.page_bytes * args.pages * args.layers
        print(f"kv-probe peer: control API on http://{args.listen}:{args.http_port}; Ctrl-C to stop", file=sys.stderr)
        try:
            _serve(size, args.listen, args.http_port, config, args.memory)
        except KeyboardInterrupt:
            pass
        except KVError as exc:
            print(f"FAILED: {exc}\nwhat to do: {diagnose(exc)}", file=sys.stderr)
            return 1
        return 0
    report: dict[str, Any]
    with ExitStack() as stack:
        try:
            size = args.page_bytes * args.pages * args.layers
            # This side's memory first: a GPU asked for and missing is said here, before a peer starts.
            buf = allocate(args.memory, size)
            if args.peer:
                peer_url = args.peer.rstrip("/")
            else:
                from .peer import start_peer

                env = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_PD_KV_")}
                peer_url = stack.enter_context(start_peer(size, env=env, memory=args.memory)).info.http
            report = _probe(args, config, peer_url, buf)
        except (KVError, OSError, httpx.HTTPError, ValueError, RuntimeError) as exc:
            report = {"checks": [], "ok": False, "error": f"{type(exc).__name__}: {exc}", "diagnosis": diagnose(exc)}
    report["checks"].append(_deepep_driver_check())
    print(json.dumps(report, indent=2) if args.format == "json" else _format_table(report))
    return 0 if report["ok"] else 1
