"""Real sglang on one GPU: PD through our router, checked token for token against one plain server.

Runs on a CUDA machine where sglang, its kernel package and Mooncake's CUDA build import (see
`scripts/gpu/gpu_bundle.py` for a machine without internet). First it reads the commit from the
tree (`tree_commit.py verify`: refused when the tree is not the recorded commit, unless
--allow-dirty) and writes the preset's seeded weights (`seeded_checkpoint.py`) into the model folder
sglang loads. Then, in order:

1. `single`: one plain (non-PD) sglang server; greedy token ids of the prompts in five forms
   (`/generate` plain and streamed, chat plain and streamed, the `openai` client); the same for the
   control prompts and the context pair; TTFT/ITL at concurrency 1, 8 and 32; what it answers at
   the HTTP level (`record_sglang_http.py`), written to `sglang-<version>-http.json`.
2. `pd`: `sglang-pd up single-h200` with the router's default settings (prefill + decode sglang on
   GPU 0, KV over Mooncake TCP), with the check's KV-page fault armed but off
   (`faults/pd_check_kv_fault.py`); the same prompts must give the same token ids in all five forms;
   then the fault is switched on for the control prompts, whose outputs must differ; usage counts;
   client disconnects abort both servers; 200 aborted requests leave KV usage at idle;
   `sglang-pd eval gsm8k` end to end; the decode server killed mid-stream.
   `single` keeps its outputs in --reference, so that `pd` may run in a later call on the machine.
3. `doctor`: `sglang-pd doctor` on this machine.
4. `smollm2`: SmolLM2-135M-Instruct on a plain server and through `up`: the capital question and
   `eval gsm8k` on 200 questions, the PD run judged against the plain one by the gate's paired rule.
5. `migration`: the preset with a second decode server on the same GPU (1P2D), 16 greedy streams
   through `up`'s router with one decode SIGKILLed mid-stream; every stream must finish, and the
   share identical to an uninterrupted run is measured (`migration_stage.py`).
6. `breakdown`: `up` of the preset under 4 streams of load; the router's TTFT breakdown must add up
   to the client's TTFT within 5 %, and blame a 1 s delay injected into the prefill's forward
   pass, then into its KV send, on the right part (`breakdown_stage.py`, `faults/pd_check_delay.py`).
7. `routers`: `up` of the preset; our router, smg (where its wheel was carried) and the two servers
   directly, rotated round by round at concurrency 1, 8, 32 and 64, streamed and unary, each arm
   and round with prompts of its own; per cell our router over smg and what each adds over direct.
8. `admission`: `up` of the preset; one client attacks the router's admission (`bench_overload.py`:
   none, starvation, head-of-line) while 8 others send short chats, whose end-to-end p99 must stay
   under 1 s with no failure; then an attacker holding every decode slot, reported.

What must hold is in `pd_verdicts.py`: identity by token ids in every form, the context control
(two prompts that end alike answer differently) and the fault control (a corrupted page shows).
Each is a verdict in the report, and the run exits 1 when one fails. Every wait has a stated
limit: a server not ready within READY_S, or a stack whose router has no healthy prefill and decode
within READY_S, fails the stage with each component's state (process alive, `/health`, the
router's view of its workers, the log's last lines); the whole run ends after --deadline-s.
Writes `report.json` (every check with its numbers and evidence, the commit from the tree) and the
servers' logs under --out.

    python scripts/gpu/gpu_pd_check.py --out $OUT --gsm8k-data gsm8k-test.jsonl [--allow-dirty]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import aiohttp
import breakdown_stage
import engine_stages
import httpx
import migration_stage
import pd_verdicts
import tree_commit
from record_sglang_http import record

from sglang_pd.deploy.common.contract import ENV_WORKER_API_KEY
from sglang_pd.deploy.common.procs import Child, spawn

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = "single-h200"
MODEL = "tiny-deepseek-v3"  # the preset's served name
SINGLE_PORT = 31000
ROUTER = "http://127.0.0.1:8000"
PREFILL = "http://127.0.0.1:30000"
DECODE = "http://127.0.0.1:30001"
BOOTSTRAP_PORT = 8998
MAX_NEW_TOKENS = 32
CONCURRENCIES = (1, 8, 32)
# A cold start compiles FlashInfer's and sglang's JIT kernels (about 160 s on an H200); a second
# server of the same model reuses the cache.
READY_S = 420.0
#: On the PYTHONPATH of the PD stack only (`fault_env`): its sitecustomize arms the KV-page fault.
FAULTS_DIR = REPO / "scripts" / "gpu" / "faults"
FAULT_FLAG_ENV, FAULT_LOG_ENV = "PD_CHECK_KV_FAULT_FLAG", "PD_CHECK_KV_FAULT_LOG"
FORMS = ("generate", "generate_stream", "chat", "chat_stream", "openai")
#: Two prompts with different contexts that end in the same 23 tokens, more than a KV page (context control).
CONTEXT_PAIR = (
    "The river runs cold under the bridge at night. Now say it once again:",
    "Seven wise owls count the stars above a hill. Now say it once again:",
)
#: sglang's fields on the chat routes: all MAX_NEW_TOKENS tokens, and special tokens as text. A
#: streamed chat step whose text is empty sends no chunk, and its tokens' logprobs are lost (sglang
#: 0.5.17, `_generate_stream_content` in srt/entrypoints/openai/serving_chat.py, lines 749-781);
#: `<s>`, `</s>` and `<unk>` would decode to nothing with skip_special_tokens on.
CHAT_EXTRA = {"ignore_eos": True, "skip_special_tokens": False}
#: The router comparison (stage `routers`): our router, smg and the two servers directly, rotated
#: over this many rounds at each concurrency, streamed and unary.
ROUTER_ROUNDS = 5
ROUTER_CONCURRENCIES = (1, 8, 32, 64)
SMG_PORT = 8300
SMG = f"http://127.0.0.1:{SMG_PORT}"
SMG_READY_S = 90.0
#: The engines' worker key in the PD stage (`up` passes it to both servers and the router); the
#: check's own calls to the engines (cache flushes, the direct arm, metrics) carry it.
ENGINE_KEY = secrets.token_hex(16)
ENGINE_AUTH = {"Authorization": f"Bearer {ENGINE_KEY}"}
#: Servers whose radix cache is emptied before each compared request: (base URL, must succeed).
Caches = list[tuple[str, bool]]
FLUSH_TRIES = 50
#: The GPU machine has no iptables, so `up` with a worker key refuses to start unless told the KV
#: ports stay open (deploy/ops/up.py); nothing else runs on that machine.
UP_OPEN_KV = ("--allow-open-kv-ports",)
FLUSH_RETRY_S = 0.1


def pd_caches() -> Caches:
    """The PD stack's caches: the prefill's must be emptied; a decode server keeps no radix cache by
    default in sglang (`--disaggregation-decode-enable-radix-cache`), so its flush is tried, not required."""
    return [(PREFILL, True), (DECODE, False)]


def prompts() -> list[str]:
    """20 prompts of mixed length; the byte tokenizer makes one token per byte, so lengths are tokens.

    The long ones cross the preset's KV page (16 tokens) and its prefill chunk (256 tokens).
    """
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "wise",
        "owls",
        "count",
        "stars",
    ]
    out = []
    for i, n in enumerate([3, 8, 15, 17, 33, 64, 100, 150, 255, 257, 300, 400, 512, 700, 900, 1100, 5, 40, 260, 1500]):
        text = f"Prompt {i}:"
        k = i
        while len(text) < n:
            text += " " + words[k % len(words)]
            k += 3
        out.append(text[:n] if n > 12 else text)
    return out


def control_prompts() -> list[str]:
    """The fault control's prompts: each spans 6 to 15 KV pages of 16 tokens and fits one prefill
    chunk of 256, so the fault (one page a chunk) corrupts exactly one page of each; they share no
    page with the 20 prompts or with each other."""
    words = ["amber", "river", "stone", "seven", "lanterns", "drift", "north", "past", "quiet", "mills"]
    out = []
    for i, n in enumerate((96, 130, 170, 240)):
        text, k = f"Control {i}:", i
        while len(text) < n:
            text += " " + words[k % len(words)]
            k += 7
        out.append(text[:n])
    return out


# --------------------------------------------------------------------------------------------
# Processes


class Stack:
    """The checked processes (`deploy/common/procs.py` children), each logging to `<out>/<name>.log`."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.children: dict[str, Child] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        """Start `argv` logging to `<out>/<name>.log`; `env` is added to this process's environment."""
        with open(self.out / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            child = spawn(name, argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=False)
        self.children[name] = child
        return child

    def stop(self, name: str, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> None:
        child = self.children.pop(name, None)
        if child is None:
            return
        child.signal_group(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(grace_s)
        child.reap()

    def stop_all(self) -> None:
        for name in list(self.children):
            self.stop(name)


# --------------------------------------------------------------------------------------------
# Requests: each returns an output `{"status", "ids", "text"}` (pd_verdicts.py compares the ids)


def token_table(model_dir: Path) -> dict[str, int]:
    """Each token's text, as sglang decodes it for logprobs (one id at a time, with the model's own
    tokenizer), to its id. The chat routes return no ids when streamed (char_tokenizer.py says
    where), so their ids come from this; the preset's tokenizer gives every id a text of its own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    table = {text: i for i, text in enumerate(texts)}
    if len(table) != len(texts):
        raise RuntimeError(
            f"{model_dir}: {len(texts) - len(table)} token ids share their text with another, so the chat "
            "forms cannot be compared by id; use the tokenizer scripts/gpu/char_tokenizer.py writes"
        )
    return table


def _ids_from_logprobs(entries: list[dict[str, Any]], table: dict[str, int]) -> tuple[list[int] | None, str | None]:
    try:
        return [table[e["token"]] for e in entries], None
    except KeyError as exc:
        return None, f"a logprob token's text names no id: {exc}"


def _sse(raw: bytes) -> dict[str, Any] | None:
    line = raw.decode().strip()
    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
        return None
    doc: dict[str, Any] = json.loads(line[5:])
    return doc


async def generate(s: aiohttp.ClientSession, base: str, text: str, *, stream: bool) -> dict[str, Any]:
    """`/generate`: sglang's `output_ids`. Streamed, each chunk carries every id so far (sglang's
    default; with --incremental-streaming-output only the new ones, which this also reads)."""
    body = {
        "text": text,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True},
        "stream": stream,
    }
    async with s.post(f"{base}/generate", json=body) as r:
        if not stream:
            doc = await r.json(content_type=None)
            if r.status != 200:
                return {"status": r.status, "ids": None, "error": str(doc)[:300]}
            return {"status": r.status, "ids": doc.get("output_ids"), "text": doc.get("text")}
        chunks = [c async for raw in r.content if (c := _sse(raw)) is not None]
    if r.status != 200 or not chunks:
        return {"status": r.status, "ids": None, "error": "no stream chunks"}
    lists = [c.get("output_ids") or [] for c in chunks]
    cumulative = all(b[: len(a)] == a for a, b in itertools.pairwise(lists))
    ids = lists[-1] if cumulative else [i for part in lists for i in part]
    return {"status": r.status, "ids": ids, "text": chunks[-1].get("text")}


async def chat(
    s: aiohttp.ClientSession, base: str, text: str, table: dict[str, int], *, stream: bool
) -> dict[str, Any]:
    """`/v1/chat/completions` with `logprobs`: each token's text, turned into its id by `table`."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": MAX_NEW_TOKENS,
        "logprobs": True,
        "stream": stream,
        **CHAT_EXTRA,
    }
    async with s.post(f"{base}/v1/chat/completions", json=body) as r:
        if not stream:
            doc = await r.json(content_type=None)
            if r.status != 200:
                return {"status": r.status, "ids": None, "error": str(doc)[:300]}
            choice = doc["choices"][0]
            ids, error = _ids_from_logprobs((choice.get("logprobs") or {}).get("content") or [], table)
            return {"status": r.status, "ids": ids, "text": choice["message"]["content"], "error": error}
        parts: list[str] = []
        entries: list[dict[str, Any]] = []
        async for raw in r.content:
            chunk = _sse(raw)
            for c in (chunk or {}).get("choices", []):
                parts.append(c.get("delta", {}).get("content") or "")
                entries += (c.get("logprobs") or {}).get("content") or []
    ids, error = _ids_from_logprobs(entries, table)
    return {"status": r.status, "ids": ids, "text": "".join(parts), "error": error}


def openai_outputs(base: str, ps: list[str], table: dict[str, int]) -> list[dict[str, Any]]:
    """Greedy chat answers through the official `openai` client, one prompt at a time, ids from logprobs."""
    from openai import APIStatusError, OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0)
    results: list[dict[str, Any]] = []
    for p in ps:
        try:
            r = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": p}],
                max_tokens=MAX_NEW_TOKENS,
                temperature=0,
                logprobs=True,
                extra_body=CHAT_EXTRA,
            )
        except APIStatusError as exc:
            results.append({"status": exc.status_code, "ids": None, "error": str(exc)[:300]})
            continue
        content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
        ids, error = _ids_from_logprobs([{"token": t.token} for t in content or []], table)
        results.append({"status": 200, "ids": ids, "text": r.choices[0].message.content, "error": error})
    return results


async def flush(s: aiohttp.ClientSession, caches: Caches) -> None:
    """Empty every radix cache in `caches` before the next request, so that each request prefills
    its whole prompt from nothing on both sides. A prompt found in the cache prefills only its
    uncached tail, a different kernel call whose bf16 sums differ; and whether it is found depends
    on what ran before on that server (the decode's outputs are cached on a plain server and not
    on a PD prefill). sglang refuses the flush while a request still runs, so it is retried."""
    for base, required in caches:
        status, body = 0, ""
        for _ in range(FLUSH_TRIES):
            async with s.post(f"{base}/flush_cache", headers=ENGINE_AUTH) as r:
                status, body = r.status, (await r.text())[:200]
            if status == 200:
                break
            await asyncio.sleep(FLUSH_RETRY_S)
        if status != 200 and required:
            raise RuntimeError(f"POST {base}/flush_cache answered {status} {FLUSH_TRIES} times: {body}")


async def generate_all(base: str, texts: list[str], caches: Caches) -> list[dict[str, Any]]:
    """`/generate` outputs of `texts`, one request at a time from empty caches (`flush`)."""
    got = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for t in texts:
            await flush(s, caches)
            got.append(await generate(s, base, t, stream=False))
    return got


async def outputs(base: str, table: dict[str, int], caches: Caches) -> dict[str, list[dict[str, Any]]]:
    """Greedy outputs of every prompt in each of FORMS, one request at a time from empty caches.

    One at a time, because which requests share a batch depends on their arrival, and these
    kernels are not batch-invariant: sent together, the same server disagreed with itself on 9 of
    20 prompts (benchmarks/results/gpu_pd_h100_2026-12-05_d9f604c.json)."""
    ps = prompts()
    got: dict[str, list[dict[str, Any]]] = {form: [] for form in FORMS}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for p in ps:
            for form, stream in (("generate", False), ("generate_stream", True)):
                await flush(s, caches)
                got[form].append(await generate(s, base, p, stream=stream))
            for form, stream in (("chat", False), ("chat_stream", True)):
                await flush(s, caches)
                got[form].append(await chat(s, base, p, table, stream=stream))
            await flush(s, caches)
            got["openai"] += await asyncio.to_thread(openai_outputs, base, [p], table)
    return got


def statuses(outs: dict[str, list[dict[str, Any]]]) -> dict[str, list[int | None]]:
    """Per form, the HTTP status of each prompt."""
    return {form: [o.get("status") for o in rows] for form, rows in outs.items()}


async def _direct_pd_stream(s: aiohttp.ClientSession, body: dict[str, Any]) -> aiohttp.ClientResponse:
    """The PD protocol without a router: the same body plus bootstrap fields to both servers; the
    decode's stream is returned, the prefill's answer drained in the background."""
    room = int.from_bytes(os.urandom(8), "big") >> 1
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": BOOTSTRAP_PORT, "bootstrap_room": room}

    async def drain_prefill() -> None:
        async with s.post(f"{PREFILL}/v1/completions", json={**body, "stream": False}, headers=ENGINE_AUTH) as r:
            await r.read()

    task = asyncio.create_task(drain_prefill())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return await s.post(f"{DECODE}/v1/completions", json=body, headers=ENGINE_AUTH)


_BACKGROUND: set[asyncio.Task[None]] = set()


def latency_requests(concurrency: int) -> int:
    return max(2 * concurrency, 16)


async def latency_samples(
    base: str,
    concurrency: int,
    n_requests: int,
    tag: str,
    *,
    stream: bool = True,
    prompt_len: int = 512,
    max_tokens: int = 64,
    direct_pd: bool = False,
) -> dict[str, Any]:
    """Completions in a closed loop, in ms: each request's end-to-end time, and when streamed its
    TTFT (the KV hand-off included in PD) and ITL. Every prompt starts with its number and `tag`,
    so that its first KV page is its own and no request reads another's prefix from the radix cache.
    `direct_pd`: to the two PD servers without a router (`base` unused).

    The output tokens are the ones each answer reports (`usage.completion_tokens`; streamed, in
    the usage chunk `stream_options.include_usage` asks for), not `max_tokens` assumed: a path
    that cut answers short would otherwise look faster. `short`: the answers with fewer."""
    prompt = ("benchmark text " * 200)[:prompt_len]
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    statuses: dict[str, int] = {}
    counted = {"tokens": 0, "short": 0}
    queue = list(range(n_requests))

    async def worker(s: aiohttp.ClientSession) -> None:
        while queue:
            i = queue.pop()
            body = {
                "model": MODEL,
                "prompt": f"{i} {tag} {prompt}",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {}),
            }
            t0 = time.perf_counter()
            last = None
            usage: dict[str, Any] | None = None
            opened = _direct_pd_stream(s, body) if direct_pd else s.post(f"{base}/v1/completions", json=body)
            async with await opened as r:
                statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
                if not stream:
                    with contextlib.suppress(ValueError, aiohttp.ContentTypeError):
                        doc = await r.json(content_type=None)
                        usage = doc.get("usage") if isinstance(doc, dict) else None
                else:
                    async for raw in r.content:
                        event = _sse(raw)
                        if event is None:
                            continue
                        usage = event.get("usage") or usage
                        if not event.get("choices"):  # the usage chunk is no token
                            continue
                        now = time.perf_counter()
                        if last is None:
                            ttft.append((now - t0) * 1e3)
                        else:
                            itl.append((now - last) * 1e3)
                        last = now
            e2e.append((time.perf_counter() - t0) * 1e3)
            tokens = int((usage or {}).get("completion_tokens") or 0)
            counted["tokens"] += tokens
            counted["short"] += tokens < max_tokens

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120), headers=ENGINE_AUTH) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        if _BACKGROUND:
            await asyncio.wait(list(_BACKGROUND), timeout=30)
    return {
        "ttft": ttft,
        "itl": itl,
        "e2e": e2e,
        "statuses": statuses,
        "wall_s": wall,
        "tokens": counted["tokens"],
        "short": counted["short"],
    }


def _quantile(values: list[float], q: float) -> float | None:
    """The q-quantile by linear interpolation (None without values)."""
    if not values:
        return None
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def summarize(concurrency: int, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p99 of TTFT, ITL and end-to-end time over every sample of one arm, and its output rate."""
    out: dict[str, Any] = {"concurrency": concurrency, "requests": sum(len(one["e2e"]) for one in samples)}
    for key in ("ttft", "itl", "e2e"):
        values = [t for one in samples for t in one[key]]
        out[f"{key}_p50_ms"] = _quantile(values, 0.5)
        out[f"{key}_p99_ms"] = _quantile(values, 0.99)
    statuses: dict[str, int] = {}
    for one in samples:
        for code, n in one.get("statuses", {}).items():
            statuses[code] = statuses.get(code, 0) + n
    out["statuses"] = statuses
    out["short_answers"] = sum(one["short"] for one in samples)
    out["output_tokens"] = sum(one["tokens"] for one in samples)
    out["output_tok_per_s"] = out["output_tokens"] / sum(one["wall_s"] for one in samples)
    return out


def latency(base: str, concurrency: int) -> dict[str, Any]:
    """One server's TTFT/ITL at `concurrency`."""
    n = latency_requests(concurrency)
    return summarize(concurrency, [asyncio.run(latency_samples(base, concurrency, n, "single"))])


def arm_order(rounds: int, arms: list[str]) -> list[tuple[int, str]]:
    """(round, arm) in the order measured: each round starts one arm later (A B C, B C A, C A B), so
    that no arm always runs first, on a warmer or a busier machine."""
    k = len(arms)
    return [(r, arms[(i + r) % k]) for r in range(rounds) for i in range(k)]


def engine_readings(engines: dict[str, str]) -> dict[str, engine_stages.Reading]:
    """Each server's stage histograms now (engine_stages.py); one whose /metrics failed is left out."""
    out: dict[str, engine_stages.Reading] = {}
    for name, base in engines.items():
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(f"{base}/metrics", timeout=10, headers=ENGINE_AUTH)
            if r.status_code == 200:
                out[name] = engine_stages.parse(r.text)
    return out


def stage_histogram_lines(base: str) -> dict[str, Any]:
    """The sum and count lines of engine_stages.HISTOGRAMS in one server's /metrics, as it wrote
    them: recorded, so that the reader is tested on real sglang output."""
    r = httpx.get(f"{base}/metrics", timeout=10, headers=ENGINE_AUTH)
    lines = [line for line in r.text.splitlines() if line.startswith(engine_stages.SERIES)]
    return {"status": r.status_code, "lines": lines}


def routers_compared(
    concurrency: int,
    arms: dict[str, str | None],
    *,
    stream: bool,
    rounds: int = ROUTER_ROUNDS,
    engines: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Each arm (name: base URL, None for the two PD servers directly) at `concurrency`, interleaved
    round by round, each arm and round with prompts of its own; per arm the whole summary and each
    round's, and what each router adds over direct per round (its spread). `engines` (name: base
    URL): the servers whose stage histograms are read around each round, so that per arm the
    cell's `engine_stages` gives the mean time its requests spent in each stage on each server."""
    per_round = latency_requests(concurrency)
    mode = "stream" if stream else "unary"
    raw: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    stages: dict[str, list[dict[str, engine_stages.Reading]]] = {arm: [] for arm in arms}
    for r, arm in arm_order(rounds, list(arms)):
        base = arms[arm]
        one = latency_samples(
            base or "", concurrency, per_round, f"{arm} r{r} {mode}", stream=stream, direct_pd=base is None
        )
        before = engine_readings(engines) if engines else {}
        raw[arm].append(asyncio.run(one))
        if engines:
            stages[arm].append(engine_stages.delta(before, engine_readings(engines)))
    cell: dict[str, Any] = {"concurrency": concurrency, "mode": mode, "order": arm_order(rounds, list(arms))}
    cell["arms"] = {arm: summarize(concurrency, got) for arm, got in raw.items()}
    if engines:
        # Beside each arm's request count: the routers' health probes (one-token generations that
        # sglang's scheduler times like any request) fall into whichever round runs, so a stage's
        # count above the requests is theirs.
        cell["engine_stages"] = {
            arm: {"requests": cell["arms"][arm]["requests"], **engine_stages.means(engine_stages.total(got))}
            for arm, got in stages.items()
        }
    cell["rounds"] = {arm: [summarize(concurrency, [one]) for one in got] for arm, got in raw.items()}
    key = "ttft_p50_ms" if stream else "e2e_p50_ms"
    if "direct" in raw:
        cell["adds_over_direct_ms"] = {
            arm: [
                round(mine[key] - theirs[key], 2)
                for mine, theirs in zip(cell["rounds"][arm], cell["rounds"]["direct"], strict=True)
            ]
            for arm in raw
            if arm != "direct"
        }
    return cell


def start_smg(stack: Stack) -> dict[str, Any]:
    """smg (PyPI `smg`, the SGLang model gateway) in PD mode in front of the same two servers, where
    gpu_pd_run.sh installed its wheel (SMG_SITE); ready once a one-token completion through it is a 200."""
    site = os.environ.get("SMG_SITE")
    if not site:
        return {"started": False, "why": "no smg wheel was carried (SMG_SITE unset)"}
    argv = [sys.executable, "-m", "smg", "launch", "--pd-disaggregation", "--host", "127.0.0.1"]
    argv += ["--port", str(SMG_PORT), "--policy", "round_robin", "--log-level", "warn", "--disable-retries"]
    argv += ["--prefill", PREFILL, str(BOOTSTRAP_PORT), "--decode", DECODE, "--api-key", ENGINE_KEY]
    inherited = os.environ.get("PYTHONPATH")
    stack.start("smg", argv, env={"PYTHONPATH": os.pathsep.join([site, *([inherited] if inherited else [])])})
    body = {"model": MODEL, "prompt": "ready?", "max_tokens": 1, "temperature": 0}
    t0, last = time.monotonic(), "no answer"
    while time.monotonic() - t0 < SMG_READY_S:
        if not stack.children["smg"].alive():
            return {"started": False, "why": f"smg exited: {_log_tail(stack.out / 'smg.log')}"}
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.post(f"{SMG}/v1/completions", json=body, timeout=10, headers=ENGINE_AUTH)
            if r.status_code == 200:
                return {"started": True, "argv": argv[1:], "ready_s": round(time.monotonic() - t0, 1)}
            last = f"{r.status_code} {r.text[:200]}"
        time.sleep(1.0)
    return {"started": False, "why": f"smg was not ready within {SMG_READY_S:g} s: {last}"}


def metric(base: str, name: str) -> float | None:
    """One sglang Prometheus gauge, summed over its label sets (None when absent)."""
    text = httpx.get(f"{base}/metrics", timeout=10, headers=ENGINE_AUTH).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values) if values else None


async def disconnect_after_first_chunk(base: str, n: int, concurrency: int = 50) -> int:
    """Open n long streams and drop each connection after its first chunk; returns how many got one."""
    got = 0
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        nonlocal got
        async with sem:
            body = {
                "model": MODEL,
                "prompt": f"abort {i} " + "x" * 300,
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            s = aiohttp.ClientSession()
            try:
                r = await s.post(f"{base}/v1/completions", json=body)
                async for raw in r.content:
                    if raw.strip().startswith(b"data:"):
                        got += 1
                        break
                r.close()  # drop the connection mid-stream
            finally:
                await s.close()

    await asyncio.gather(*(one(i) for i in range(n)))
    return got


async def kill_mid_stream(base: str, victim_pgid: int, n: int = 8) -> list[str]:
    """Start n long streams, SIGKILL the decode server after their first chunks; each must end."""
    outcomes: list[str] = []
    started = asyncio.Event()

    async def one(i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"kill {i}",
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            try:
                async with s.post(f"{base}/v1/completions", json=body) as r:
                    saw_error = False
                    async for raw in r.content:
                        started.set()
                        if b'"error"' in raw:
                            saw_error = True
                    outcomes.append("error event" if saw_error else "clean end")
            except TimeoutError:
                outcomes.append("HUNG (60 s)")
            except aiohttp.ClientError as exc:
                outcomes.append(f"connection error: {type(exc).__name__}")

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    async with asyncio.timeout(60):
        await started.wait()
    await asyncio.sleep(0.5)
    os.killpg(victim_pgid, signal.SIGKILL)
    await asyncio.gather(*tasks)
    return outcomes


# --------------------------------------------------------------------------------------------
# Stages


def rendered_commands() -> dict[str, Any]:
    """The topology's rendered sglang commands (what `up` starts), for the single server's flags."""
    out = subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.cli", "plan", TOPOLOGY, "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def single_server_argv(plan: dict[str, Any]) -> list[str]:
    """The decode command without its PD flags: the same model and kernels as one plain server."""
    argv = list(plan["roles"]["decode"][0]["argv"])
    drop_with_value = {
        "--disaggregation-mode",
        "--disaggregation-transfer-backend",
        "--disaggregation-bootstrap-port",
        "--disaggregation-ib-device",
        "--port",
        "--base-gpu-id",
        "--mem-fraction-static",
    }
    clean: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in drop_with_value:
            skip = True
            continue
        clean.append(a)
    # The renderer names the module (`-m sglang.launch_server ...`); this interpreter runs it.
    return [sys.executable, *clean, "--port", str(SINGLE_PORT), "--mem-fraction-static", "0.3"]


class NotReady(RuntimeError):
    """A component did not come up within its limit; the message says which, with the evidence."""


def _health(base: str) -> str:
    try:
        r = httpx.get(f"{base}/health", timeout=25, headers=ENGINE_AUTH)
        return f"GET /health answered {r.status_code}"
    except httpx.HTTPError as exc:
        return f"GET /health failed: {type(exc).__name__} {exc}"


def _log_tail(path: Path, lines: int = 15) -> list[str]:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace").splitlines()[-lines:]
    return []


def diagnose(stack: Stack) -> dict[str, Any]:
    """Each component's state, for a stack that did not come up."""
    state: dict[str, Any] = {
        "processes": {
            name: ("alive" if c.alive() else f"exited {c.proc.returncode}") for name, c in stack.children.items()
        },
        "prefill": _health(PREFILL),
        "decode": _health(DECODE),
    }
    try:
        state["router_workers"] = httpx.get(f"{ROUTER}/workers", timeout=5).json()
    except (httpx.HTTPError, ValueError) as exc:
        state["router_workers"] = f"GET /workers failed: {type(exc).__name__} {exc}"
    logs = sorted(stack.out.glob("*.log")) + sorted((stack.out / "engines").glob("*.log"))
    state["log_tails"] = {str(p.relative_to(stack.out)): _log_tail(p) for p in logs}
    return state


def wait_server(stack: Stack, name: str, base: str, timeout_s: float) -> dict[str, Any]:
    """Poll `GET /health` until 200, noting what the server answered before (sglang: 503 while it
    starts). NotReady when the process exits or `timeout_s` passes."""
    child, t0 = stack.children[name], time.monotonic()
    first_answer: float | None = None
    before_ready: dict[str, int] = {}
    while time.monotonic() - t0 < timeout_s:
        if not child.alive():
            raise NotReady(f"{name} exited with code {child.proc.returncode} before it was ready: {diagnose(stack)}")
        with contextlib.suppress(httpx.HTTPError):
            status = httpx.get(f"{base}/health", timeout=25).status_code
            first_answer = first_answer if first_answer is not None else time.monotonic() - t0
            if status == 200:
                return {
                    "ready_s": time.monotonic() - t0,
                    "first_http_answer_s": first_answer,
                    "statuses_before_ready": before_ready,
                }
            before_ready[str(status)] = before_ready.get(str(status), 0) + 1
        time.sleep(1.0)
    raise NotReady(f"{name} was not ready within {timeout_s:g} s: {diagnose(stack)}")


#: What `up` prints last in its start-up, after its smoke request through the router (deploy/ops/up.py;
#: tests/deploy/ops/test_up_smoke.py reads it after the smoke line). Until then that request shares the
#: engines with whatever is measured: on the H200 its streamed chat shared decode batches with the
#: first measured prompt, whose tokens then came out as those of a batch of two.
UP_STARTED = "try: curl "


def wait_stack(stack: Stack, timeout_s: float, name: str = "up") -> dict[str, Any]:
    """Wait until `up` (the child `name`) has finished starting (its smoke request included) and the
    router has a healthy prefill and decode (its /readiness is 200 as soon as it serves, with or
    without workers: the workers' health is in GET /workers)."""
    t0 = time.monotonic()
    up_log = stack.out / f"{name}.log"
    up = stack.children[name]
    while time.monotonic() - t0 < timeout_s:
        if not up.alive():
            raise NotReady(f"`sglang-pd up` exited with code {up.proc.returncode}: {diagnose(stack)}")
        if UP_STARTED not in up_log.read_text(errors="replace"):
            time.sleep(0.2)
            continue
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            workers = httpx.get(f"{ROUTER}/workers", timeout=5).json()
            if all(any(w["healthy"] for w in workers[role]) for role in ("prefill", "decode")):
                readiness = httpx.get(f"{ROUTER}/readiness", timeout=5)
                return {"ready_s": time.monotonic() - t0, "readiness": readiness.status_code}
        time.sleep(1.0)
    raise NotReady(f"the PD stack was not ready within {timeout_s:g} s: {diagnose(stack)}")


def stage_single(
    stack: Stack, report: dict[str, Any], recording: dict[str, Any], table: dict[str, int]
) -> dict[str, Any]:
    """The single server's outputs (the reference), its controls' outputs, latency and HTTP recording."""
    argv = single_server_argv(rendered_commands())
    single: dict[str, Any] = {"argv": argv}
    report["single"] = single
    base = f"http://127.0.0.1:{SINGLE_PORT}"
    stack.start("single", argv)
    start = wait_server(stack, "single", base, READY_S)
    single.update(start)
    caches = [(base, True)]
    ref: dict[str, Any] = {"forms": asyncio.run(outputs(base, table, caches))}
    ref["controls"] = asyncio.run(generate_all(base, control_prompts(), caches))
    ref["context_pair"] = asyncio.run(generate_all(base, list(CONTEXT_PAIR), caches))
    single["statuses"] = statuses(ref["forms"])
    single["forms"] = {
        form: [{"status": o.get("status"), "ids": o.get("ids")} for o in rows] for form, rows in ref["forms"].items()
    }
    # The server against itself: the same prompt in two forms gives the same tokens when every
    # request runs alone from an empty cache; a spread here would bound what identity can show.
    single["self_agreement"] = {
        f"{a} vs {b}": pd_verdicts.compare_form(ref["forms"][a], ref["forms"][b], MAX_NEW_TOKENS)["identical"]
        for a, b in (("generate", "generate_stream"), ("chat", "chat_stream"), ("chat", "openai"))
    }
    first, second = ref["context_pair"]
    context = pd_verdicts.context_verdict(first, second, MAX_NEW_TOKENS)
    single["context_control"] = {
        "prompts": list(CONTEXT_PAIR),
        "ids": [o.get("ids") for o in ref["context_pair"]],
        "verdict": context or "passed",
    }
    verdict(report, "context_control", context)
    single["latency"] = [latency(base, c) for c in CONCURRENCIES]
    recording["servers"]["single"] = {"start": start, **asyncio.run(record(base, "single"))}
    stack.stop("single")
    return ref


#: A warm machine keeps /tmp between calls, so `single` and `pd` can each take a call of their own.
REFERENCE = Path("/tmp/pd-check-single-reference.json")


def save_reference(path: Path, report: dict[str, Any], ref: dict[str, Any]) -> None:
    """The single server's outputs, with the commit and weights they came from."""
    key = {"commit": report["commit"], "weights_sha256": report["model"]["weights_sha256"]}
    path.write_text(json.dumps({**key, "single": report["single"], "ref": ref}))


def load_reference(path: Path, report: dict[str, Any]) -> dict[str, Any] | None:
    """The outputs an earlier `single` kept, when they came from this commit and these weights;
    their single-server report goes into this report too. None otherwise (the identity verdict
    then says that no reference was run)."""
    if not path.is_file():
        return None
    kept = json.loads(path.read_text())
    if (kept["commit"], kept["weights_sha256"]) != (report["commit"], report["model"]["weights_sha256"]):
        report["reference_refused"] = f"{path} is from {kept['commit']}, weights {kept['weights_sha256'][:12]}"
        return None
    report.setdefault("single", kept["single"])
    report["single_from"] = str(path)
    ref: dict[str, Any] = kept["ref"]
    return ref


def reference_from_report(path: Path, report: dict[str, Any]) -> dict[str, Any] | None:
    """The single server's outputs as an earlier check's committed report keeps them (each form's
    statuses and ids, the controls' ids), for a `pd` stage in a call too short for `single`. Taken
    only when that report's weights and GPU are this run's; the report names where its reference
    came from (`single_from`), and its commit may differ: what the single server runs is sglang
    alone, from the preset's rendered single-server command. None otherwise, with the reason."""
    kept = json.loads(path.read_text())
    ours, theirs = report["model"]["weights_sha256"], kept.get("model", {}).get("weights_sha256")
    # The GPU's name; its driver and memory figures, also in the description, may differ by machine.
    if theirs != ours or str(kept.get("gpu")).split(",")[0] != str(report.get("gpu")).split(",")[0]:
        report["reference_refused"] = (
            f"{path}: weights {str(theirs)[:12]} on {kept.get('gpu')}; "
            f"this run: weights {ours[:12]} on {report.get('gpu')}"
        )
        return None
    single = kept["single"]
    controls = kept["pd"]["fault_control"]["controls"]
    report["single"] = single
    report["single_from"] = f"{path} (commit {kept['commit']}, {kept.get('date')}, {kept.get('gpu')})"
    return {
        "forms": {form: list(rows) for form, rows in single["forms"].items()},
        "controls": [{"status": 200, "ids": c["single"]} for c in controls],
    }


def verdict(report: dict[str, Any], name: str, failure: str | None) -> None:
    """Record one requirement's outcome; a failure makes the run exit 1."""
    report.setdefault("verdicts", {})[name] = failure or "passed"
    if failure:
        report.setdefault("failures", []).append(failure)


def fault_env(out: Path) -> dict[str, str]:
    """What the PD stack's processes get, and no other process: the folder whose sitecustomize arms
    the KV-page fault, the flag file that turns it on (absent) and the log it writes."""
    inherited = os.environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": os.pathsep.join([str(FAULTS_DIR), *([inherited] if inherited else [])]),
        FAULT_FLAG_ENV: str(out / "kv-fault.on"),
        FAULT_LOG_ENV: str(out / "kv-fault.log"),
    }


def fault_control(env: dict[str, str], ref: list[dict[str, Any]]) -> dict[str, Any]:
    """The control prompts through the router without the fault, which must give `ref`, then with it
    on, which must not."""
    flag, log = Path(env[FAULT_FLAG_ENV]), Path(env[FAULT_LOG_ENV])
    clean = asyncio.run(generate_all(ROUTER, control_prompts(), pd_caches()))
    before = len(pd_verdicts.read_fault_log(log))
    flag.touch()
    try:
        got = asyncio.run(generate_all(ROUTER, control_prompts(), pd_caches()))
    finally:
        flag.unlink()
    events = pd_verdicts.read_fault_log(log)
    failure = pd_verdicts.fault_verdict(ref, clean, got, events[before:], MAX_NEW_TOKENS)
    return {
        "verdict": failure or "passed",
        "armed_in_pids": sorted({e["pid"] for e in events if e.get("event") == "armed"}),
        "faults": events[before:],
        "controls": [
            {
                "prompt": i,
                "single": r.get("ids"),
                "pd_without_fault": c.get("ids"),
                "pd_with_fault": g.get("ids"),
                "pd_status": g.get("status"),
            }
            for i, (r, c, g) in enumerate(zip(ref, clean, got, strict=True))
        ],
    }


def up_argv(topology: str | Path, log_dir: Path) -> list[str]:
    """`sglang-pd up` of `topology` with sglang, its engines logging to `log_dir`."""
    cli = [sys.executable, "-m", "sglang_pd.deploy.cli"]
    return [*cli, "up", str(topology), "--engine", "sglang", "--log-dir", str(log_dir), *UP_OPEN_KV]


def stage_pd(
    stack: Stack,
    report: dict[str, Any],
    ref: dict[str, Any] | None,
    gsm8k: Path | None,
    recording: dict[str, Any],
    table: dict[str, int],
) -> None:
    pd: dict[str, Any] = {}
    report["pd"] = pd
    engine_logs = stack.out / "engines"
    up = up_argv(TOPOLOGY, engine_logs)
    pd["argv"] = up[1:]
    env = fault_env(stack.out)
    Path(env[FAULT_FLAG_ENV]).unlink(missing_ok=True)
    pd["fault_env"] = dict(env)
    stack.start("up", up, env={**env, ENV_WORKER_API_KEY: ENGINE_KEY})
    pd.update(wait_stack(stack, READY_S))
    pd["router_workers_at_ready"] = httpx.get(f"{ROUTER}/workers", timeout=5).json()

    got = asyncio.run(outputs(ROUTER, table, pd_caches()))
    pd["statuses"] = statuses(got)
    if ref is None:
        verdict(report, "identity", "identity: no single-server reference in this run; run the single stage first")
    else:
        pd["forms"] = {form: pd_verdicts.compare_form(ref["forms"][form], got[form], MAX_NEW_TOKENS) for form in FORMS}
        pd["identical"] = {form: pd["forms"][form]["identical"] for form in FORMS}
        wrong = [f"{form} {pd['identical'][form]}" for form in FORMS if not pd["forms"][form]["all_identical"]]
        verdict(
            report,
            "identity",
            f"identity: not every output is the single server's ({', '.join(wrong)})" if wrong else None,
        )
        pd["fault_control"] = fault_control(env, ref["controls"])
        verdict(
            report,
            "fault_control",
            None if pd["fault_control"]["verdict"] == "passed" else pd["fault_control"]["verdict"],
        )
    pd["openai"] = check_openai_client()
    recording["servers"]["prefill"] = asyncio.run(record(PREFILL, "prefill", ENGINE_AUTH))
    recording["servers"]["decode"] = asyncio.run(record(DECODE, "decode", ENGINE_AUTH))
    for role, base in (("prefill", PREFILL), ("decode", DECODE)):  # after the requests above
        with contextlib.suppress(httpx.HTTPError):  # a recording only: the stage goes on without it
            recording["servers"][role]["stage_histograms"] = stage_histogram_lines(base)
    with contextlib.suppress(httpx.HTTPError):
        r = httpx.get(f"http://127.0.0.1:{BOOTSTRAP_PORT}/health", timeout=5)
        recording["servers"]["prefill"]["bootstrap_health"] = {"status": r.status_code, "body": r.text[:200]}

    servers = {"prefill": PREFILL, "decode": DECODE}
    idle = {r: metric(u, "sglang:num_used_tokens") for r, u in servers.items()}
    n_streams = asyncio.run(disconnect_after_first_chunk(ROUTER, 200))
    time.sleep(5)
    after = {r: metric(u, "sglang:num_used_tokens") for r, u in servers.items()}
    running = {r: metric(u, "sglang:num_running_reqs") for r, u in servers.items()}
    # sglang logs every abort it receives as an access-log line of its own.
    aborts = {r: (engine_logs / f"{r}-0.log").read_text(errors="replace").count("POST /abort_request") for r in servers}
    pd["abort"] = {
        "streams_dropped_after_first_chunk": n_streams,
        "num_used_tokens_idle": idle,
        "num_used_tokens_after_5s": after,
        "num_running_reqs_after_5s": running,
        "abort_requests_in_logs": aborts,
    }
    if gsm8k is not None:
        pd["gsm8k"] = run_gsm8k(stack.out, gsm8k)
    pd["router_workers_before_kill"] = httpx.get(f"{ROUTER}/workers", timeout=5).json()
    decode = find_child("sglang.launch_server", "--disaggregation-mode decode")
    if decode is not None:
        pd["decode_killed_mid_stream"] = asyncio.run(kill_mid_stream(ROUTER, os.getpgid(decode)))
    stack.stop("up", signal.SIGINT, grace_s=60)


def find_child(*needles: str) -> int | None:
    """The pid of the process whose command line holds every needle (the decode scheduler's parent)."""
    for proc in sorted(Path("/proc").glob("[0-9]*"), key=lambda p: int(p.name)):
        with contextlib.suppress(OSError):
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if all(n in cmd for n in needles):
                return int(proc.name)
    return None


def check_openai_client() -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{ROUTER}/v1", api_key="none")
    models = [m.id for m in client.models.list().data]
    r = client.chat.completions.create(
        model=models[0], messages=[{"role": "user", "content": "Hello there"}], max_tokens=16, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=models[0],
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next((c.usage for c in reversed(chunks) if c.usage), None)
    return {
        "models": models,
        "sync_text": r.choices[0].message.content,
        "sync_usage": r.usage.model_dump() if r.usage else None,
        "stream_text": streamed,
        "stream_equals_sync": streamed == r.choices[0].message.content,
        "stream_usage": usage.model_dump() if usage else None,
    }


def run_gsm8k(
    out: Path,
    data: Path,
    *,
    name: str = "gsm8k",
    base: str = ROUTER,
    extra: tuple[str, ...] = ("--num-questions", "20", "--max-tokens", "64"),
) -> dict[str, Any]:
    """`sglang-pd eval gsm8k` against `base`, its report written to `<out>/<name>.json`."""
    report = out / f"{name}.json"
    argv = [
        sys.executable,
        "-m",
        "sglang_pd.deploy.cli",
        "eval",
        "gsm8k",
        "--base-url",
        f"{base}/v1",
        "--data",
        str(data),
        *extra,
        "--output",
        str(report),
        "--quiet",
    ]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    result: dict[str, Any] = {
        "argv": argv[1:],
        "exit_code": p.returncode,
        "stdout_tail": p.stdout[-1500:],
        "stderr_tail": p.stderr[-1500:],
    }
    if report.exists():
        data_ = json.loads(report.read_text())
        result["report"] = str(report)
        result["report_keys"] = sorted(data_)
        for key in ("accuracy", "status", "truncation_rate", "num_questions", "gate", "baseline"):
            if key in data_:
                result[key] = data_[key]
    return result


#: The trained model's stage: its served name, the question it must answer, the word its answer holds.
SMOLLM2 = "smollm2-135m-instruct"
CAPITAL_QUESTION, CAPITAL_ANSWER = "What is the capital of France?", "paris"
#: The gate on SmolLM2: enough questions for its interval to mean something, answers long enough
#: for a small model's reasoning, and every run scored whatever it truncates (the report says how much).
SMOLLM2_GSM8K = (
    "--num-questions",
    "200",
    "--max-tokens",
    "256",
    "--max-truncation-rate",
    "1",
    "--max-invalid-rate",
    "1",
)


def smollm2_topology(out: Path, model_dir: Path) -> Path:
    """The `single-h200` preset serving SmolLM2 (a Llama: GQA attention, no MoE) from `model_dir`."""
    import yaml

    preset = REPO / "deploy/spec/presets/single-h200.yaml"
    t = yaml.safe_load(preset.read_text())
    t["name"] = "single-h200-smollm2"
    t["model"].update(path=str(model_dir), served_name=SMOLLM2, config_json=str(model_dir / "config.json"))
    path = out / "single-h200-smollm2.yaml"
    path.write_text(yaml.safe_dump(t, sort_keys=False))
    return path


def ask_capital(base: str) -> dict[str, Any]:
    """The capital question as a greedy chat; the verdict wants the answer's word in the reply."""
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "model": SMOLLM2,
            "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
            "temperature": 0,
            "max_tokens": 48,
        },
        timeout=120,
    )
    text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
    return {"status": r.status_code, "text": text, "body": None if text is not None else r.text[:300]}


def stage_smollm2(stack: Stack, report: dict[str, Any], gsm8k: Path | None) -> None:
    """SmolLM2-135M-Instruct on one plain server, then through `up`: the capital question, and the
    gsm8k gate on both, the PD run judged against the single server's report with the gate's own
    paired rule (`--baseline`)."""
    import smollm2_model

    from sglang_pd.deploy.refengine.sources import converted_gguf_dir

    stage: dict[str, Any] = {}
    report["smollm2"] = stage
    t0 = time.monotonic()
    gguf = smollm2_model.path()
    model_dir = converted_gguf_dir(gguf)
    stage["model"] = {"gguf": str(gguf), "hf_dir": str(model_dir), "converted_in_s": round(time.monotonic() - t0, 1)}
    topology = smollm2_topology(stack.out, model_dir)
    plan = json.loads(
        subprocess.run(
            [sys.executable, "-m", "sglang_pd.deploy.cli", "plan", str(topology), "--format", "json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    argv = single_server_argv(plan)
    base = f"http://127.0.0.1:{SINGLE_PORT}"
    stage["single"] = {"argv": argv}
    stack.start("smollm2-single", argv)
    stage["single"].update(wait_server(stack, "smollm2-single", base, READY_S))
    stage["single"]["capital"] = ask_capital(base)
    if gsm8k is not None:
        stage["single"]["gsm8k"] = run_gsm8k(
            stack.out, gsm8k, name="smollm2-gsm8k-single", base=base, extra=SMOLLM2_GSM8K
        )
    stack.stop("smollm2-single")

    up = up_argv(topology, stack.out / "smollm2-engines")
    stage["pd"] = {"argv": up[1:]}
    stack.start("up", up, env={ENV_WORKER_API_KEY: ENGINE_KEY})
    stage["pd"].update(wait_stack(stack, READY_S))
    stage["pd"]["capital"] = ask_capital(ROUTER)
    for side in ("single", "pd"):
        text = stage[side]["capital"]["text"] or ""
        verdict(
            report,
            f"smollm2_capital_{side}",
            None if CAPITAL_ANSWER in text.lower() else f"SmolLM2 ({side}) did not name Paris: {text!r}",
        )
    single_report = stack.out / "smollm2-gsm8k-single.json"
    if gsm8k is not None and single_report.exists():
        paired = (*SMOLLM2_GSM8K, "--baseline", str(single_report))
        stage["pd"]["gsm8k"] = run_gsm8k(stack.out, gsm8k, name="smollm2-gsm8k-pd", extra=paired)
        code = stage["pd"]["gsm8k"]["exit_code"]
        verdict(
            report,
            "smollm2_gsm8k_paired",
            None
            if code == 0
            else f"the PD run's gsm8k is not within the gate's interval of the single server's (exit {code})",
        )
    stack.stop("up", signal.SIGINT, grace_s=60)


def gpu_description() -> str | None:
    """The GPUs' name, driver and memory as nvidia-smi gives them (None where it cannot run)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    return None


def prepare_model() -> dict[str, Any]:
    """Write the preset's seeded weights into the model folder that sglang loads (the installed
    preset's, as `plan` and `up` resolve it), and say which weights they are."""
    import seeded_checkpoint  # torch: only where the check runs

    from sglang_pd.deploy.spec.topology import load_topology

    model_dir = Path(load_topology(TOPOLOGY).model_path())
    t0 = time.monotonic()
    weights = seeded_checkpoint.write(model_dir)
    return {
        "model_dir": str(model_dir),
        "weights": str(weights),
        "weights_sha256": seeded_checkpoint.sha256(weights),
        "written_in_s": round(time.monotonic() - t0, 1),
    }


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The report without its evidence (each prompt's ids), for the console."""
    short = {k: v for k, v in report.items() if k not in ("single", "pd")}
    for stage in ("single", "pd"):
        if stage in report:
            short[stage] = {k: v for k, v in report[stage].items() if k not in ("forms", "fault_env", "argv")}
            if "fault_control" in short[stage]:
                short[stage]["fault_control"] = {
                    k: v for k, v in short[stage]["fault_control"].items() if k in ("verdict", "armed_in_pids")
                }
    return short


#: Each server's share of the GPU in the migration stage, where three share it: 0.25 (20 GiB on an
#: H100) holds the 4-layer model and a KV pool far larger than 16 streams need.
MIGRATION_MEM_FRACTION = 0.25
STAGES = ("single", "pd", "doctor", "smollm2", "migration", "breakdown", "routers", "admission")


def stage_routers(stack: Stack, report: dict[str, Any]) -> None:
    """Our router, smg and the two servers directly in front of one `up` of the preset (no fault
    armed), interleaved round by round at each concurrency, streamed and unary (`routers_compared`);
    then, per cell, our router against smg and what each adds over direct."""
    section: dict[str, Any] = {}
    report["routers"] = section  # filled as the stage goes: a stage cut short keeps its cells
    up = up_argv(TOPOLOGY, stack.out / "routers" / "engines")
    section["argv"] = up[1:]
    stack.start("up-routers", up, env={ENV_WORKER_API_KEY: ENGINE_KEY})
    section.update(wait_stack(stack, READY_S, name="up-routers"))
    section["smg"] = start_smg(stack)
    arms: dict[str, str | None] = {"router": ROUTER, "direct": None}
    if section["smg"]["started"]:
        arms = {"router": ROUTER, "smg": SMG, "direct": None}
    section["rounds"] = ROUTER_ROUNDS
    cells: list[dict[str, Any]] = []
    section["cells"] = cells
    try:
        for stream in (True, False):
            for c in ROUTER_CONCURRENCIES:
                engines = {"prefill": PREFILL, "decode": DECODE}
                cells.append(routers_compared(c, arms, stream=stream, engines=engines))
                section["table"] = router_table(cells)
                (stack.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    finally:  # a stage cut short by its deadline is judged on the cells it has
        verdict(report, "routers_whole_answers", whole_answers(cells))
    stack.stop("smg")
    stack.stop("up-routers", signal.SIGINT, grace_s=60)


def whole_answers(cells: list[dict[str, Any]]) -> str | None:
    """None when every arm answered every request of every cell with a 200 and all its tokens:
    a router compared on answers it failed or cut short would look faster than it is."""
    wrong = [
        f"{cell['mode']} c={cell['concurrency']} {arm}: statuses {got['statuses']}, {got['short_answers']} short"
        for cell in cells
        for arm, got in cell["arms"].items()
        if set(got["statuses"]) != {"200"} or got["short_answers"]
    ]
    return f"answers not whole, so not comparable: {'; '.join(wrong)}" if wrong else None


def router_table(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: our router's TTFT p50/p99 (streamed) or end-to-end p50/p99 (unary) and output rate
    over smg's (a ratio below 1 is faster for latency; above 1 for the rate), and what each router
    adds over direct per round (ms, median and range)."""
    rows = []
    for cell in cells:
        arms = cell["arms"]
        lat = "ttft" if cell["mode"] == "stream" else "e2e"
        row: dict[str, Any] = {"concurrency": cell["concurrency"], "mode": cell["mode"], "latency": lat}
        for arm, got in arms.items():
            row[arm] = {
                "p50_ms": got[f"{lat}_p50_ms"],
                "p99_ms": got[f"{lat}_p99_ms"],
                "tok_per_s": got["output_tok_per_s"],
                "statuses": got["statuses"],
                "short_answers": got["short_answers"],
            }
        if "smg" in arms:
            ours, theirs = arms["router"], arms["smg"]
            row["router_over_smg"] = {
                "p50": ours[f"{lat}_p50_ms"] / theirs[f"{lat}_p50_ms"],
                "p99": ours[f"{lat}_p99_ms"] / theirs[f"{lat}_p99_ms"],
                "tok_per_s": ours["output_tok_per_s"] / theirs["output_tok_per_s"],
            }
        for arm, adds in cell.get("adds_over_direct_ms", {}).items():
            row[f"{arm}_adds_ms"] = {"median": statistics.median(adds), "min": min(adds), "max": max(adds)}
        rows.append(row)
    return rows


def stage_breakdown(stack: Stack, report: dict[str, Any]) -> None:
    """The TTFT breakdown under load with no delay, a slowed prefill and a slowed KV send
    (`breakdown_stage.py`), on `up` of the preset whose processes carry `faults/pd_check_delay.py`."""
    out = stack.out / "breakdown"
    delays = out / "delays"
    delays.mkdir(parents=True, exist_ok=True)
    inherited = os.environ.get("PYTHONPATH")
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAULTS_DIR), *([inherited] if inherited else [])]),
        "PD_CHECK_DELAY_DIR": str(delays),
        ENV_WORKER_API_KEY: ENGINE_KEY,
    }
    up = up_argv(TOPOLOGY, out / "engines")
    section: dict[str, Any] = {"argv": up[1:]}
    report["breakdown"] = section
    stack.start("up-breakdown", up, env=env)
    section.update(wait_stack(stack, READY_S, name="up-breakdown"))
    result = breakdown_stage.measure(ROUTER, delays, out)
    section.update(result)
    events = pd_verdicts.read_fault_log(delays / "delays.log")
    # Counted: a delay line is written per slowed batch or chunk.
    section["delay_events"] = dict(collections.Counter(f"{e['event']} {e.get('part')}" for e in events))
    section["table"] = breakdown_stage.table(breakdown_stage.by_case(result))
    section["verdicts"] = breakdown_stage.verdicts(result)
    for name, why in section["verdicts"].items():
        verdict(report, f"breakdown_{name}", why)
    stack.stop("up-breakdown", signal.SIGINT, grace_s=60)


#: The admission stage: seconds of each attack, and the slot attack's length per stream (long
#: enough that its streams outlast the attack; short enough to leave the decode in seconds after).
ADMISSION_SECONDS = 20
ADMISSION_SLOT_ATTACK_TOKENS = 2048
#: The second router's client reserve in the slot attack: of the preset's 64 decode slots, 8 are kept
#: from the attacker, one for each victim client.
ADMISSION_RESERVE = 0.125
RESERVE_ROUTER_PORT = 8301


def overload_argv(out: Path, *args: str, router: str = ROUTER) -> list[str]:
    """`benchmarks/bench_overload.py` against `router`, writing `out`: one client attacks from
    127.0.0.1 while 8 victims from 127.0.0.2 send 4-token streamed chats."""
    bench = [sys.executable, "-m", "benchmarks.bench_overload", "--router", router, "--out", str(out)]
    return [*bench, "--seconds", str(ADMISSION_SECONDS), *args]


def reserve_router_argv(router_argv: list[str], port: int, reserve: float) -> list[str]:
    """`up`'s router command line (from /proc) on another port with a client reserve: a second
    router, alike but for the reserve, in front of the same engines."""
    argv = list(router_argv)
    try:
        at = argv.index("--port")
    except ValueError:
        raise RuntimeError(f"the router's command line has no --port: {' '.join(argv)}") from None
    argv[at + 1] = str(port)
    return [*argv, "--client-reserve", f"{reserve:g}"]


def start_reserve_router(stack: Stack, timeout_s: float = 60.0) -> dict[str, Any]:
    """Start `reserve_router_argv` of the stack's router; ready once its decode's slots are known
    (before that the reserve has nothing to keep). Whatever goes wrong is returned, not raised:
    the runs before it keep their verdicts."""
    try:
        pid = migration_stage.find_process("deploy.cli router", f"--port {ROUTER.rsplit(':', 1)[1]}")
        if pid is None:
            return {"started": False, "why": "no router process of up found in /proc"}
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        argv = reserve_router_argv([a for a in cmdline if a], RESERVE_ROUTER_PORT, ADMISSION_RESERVE)
        stack.start("router-reserve", argv, env={ENV_WORKER_API_KEY: ENGINE_KEY})
    except (OSError, RuntimeError) as exc:
        return {"started": False, "why": f"{type(exc).__name__}: {exc}"}
    url = f"http://127.0.0.1:{RESERVE_ROUTER_PORT}"
    t0, last = time.monotonic(), "no answer"
    while time.monotonic() - t0 < timeout_s:
        if not stack.children["router-reserve"].alive():
            return {"started": False, "why": f"it exited: {_log_tail(stack.out / 'router-reserve.log')}"}
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            decode = httpx.get(f"{url}/workers", timeout=5).json()["decode"][0]
            last = json.dumps(decode)[:300]
            if decode["healthy"] and decode["capacity"]["max_running_requests"]:
                return {"started": True, "url": url, "argv": argv[1:], "ready_s": round(time.monotonic() - t0, 1)}
        time.sleep(0.5)
    return {"started": False, "why": f"its decode's slots were not known within {timeout_s:g} s: {last}"}


def admission_failure(row: dict[str, Any]) -> str | None:
    """Why one attack's victims fared worse than the bound (`bench_overload.run_attack`'s row:
    every victim request 200, p99 admission wait and end-to-end p99 under 1 s), or None."""
    if row["victims_ok"] and row["victims_end_to_end_ok"]:
        return None
    return (
        f"{row['attack']}: victims {row['victims']['outcomes']}, end-to-end p99 {row['victim_p99_s']} s, "
        f"admission wait p99 {row['victim_admission_wait_p99_s']} s (bound 1 s)"
    )


def stage_admission(stack: Stack, report: dict[str, Any]) -> None:
    """One client attacking the router's admission while others are served, on real sglang: the
    attacks of the CPU measurement (docs/admission.md), with the victims' end-to-end p99 held to
    1 s; then an attacker holding every decode slot the preset has, reported without a verdict, and
    the same attack against a second router alike but for `--client-reserve`, held to the bound."""
    out = stack.out / "admission"
    out.mkdir(parents=True, exist_ok=True)
    up = up_argv(TOPOLOGY, out / "engines")
    section: dict[str, Any] = {"argv": up[1:]}
    report["admission"] = section
    stack.start("up-admission", up, env={ENV_WORKER_API_KEY: ENGINE_KEY})
    section.update(wait_stack(stack, READY_S, name="up-admission"))
    from sglang_pd.deploy.spec.topology import load_topology

    slots = load_topology(TOPOLOGY).decode.max_running_requests
    every_slot = ("--attack", "starvation", "--starvation-streams", str(slots))
    every_slot += ("--starvation-max-tokens", str(ADMISSION_SLOT_ATTACK_TOKENS), "--end-to-end")
    runs = {
        "attacks": overload_argv(
            out / "attacks.json",
            *("--attack", "none", "--attack", "starvation", "--attack", "head-of-line", "--end-to-end"),
        ),
        "all_slots": overload_argv(out / "all_slots.json", *every_slot),
    }

    def bench(name: str, argv: list[str]) -> None:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=ADMISSION_SECONDS * 4 + 120, cwd=REPO)
        kept = json.loads((out / f"{name}.json").read_text()) if (out / f"{name}.json").exists() else {}
        section[name] = {"argv": argv[1:], "exit_code": p.returncode, "output": p.stdout[-4000:] + p.stderr[-4000:]}
        section[name]["results"] = kept.get("results", [])

    for name, argv in runs.items():
        bench(name, argv)
    # Started once the runs above are done: a router that cannot start costs them nothing.
    section["reserve_router"] = start_reserve_router(stack)
    if section["reserve_router"]["started"]:
        reserved_at = section["reserve_router"]["url"]
        bench("all_slots_reserved", overload_argv(out / "all_slots_reserved.json", *every_slot, router=reserved_at))
    for row in section["attacks"]["results"]:
        verdict(report, f"admission_{row['attack']}", admission_failure(row))
    if not section["attacks"]["results"]:
        verdict(report, "admission", f"no result: {section['attacks']['output'][-500:]}")
    reserved = section.get("all_slots_reserved", {"results": [], "output": "not run"})
    why = admission_failure(reserved["results"][0]) if reserved["results"] else None
    if not reserved["results"]:
        why = f"no result: {section['reserve_router']}; {reserved['output'][-500:]}"
    verdict(report, "admission_all_slots_reserved", why)
    stack.stop("router-reserve")
    stack.stop("up-admission", signal.SIGINT, grace_s=60)


def stage_migration(stack: Stack, report: dict[str, Any]) -> None:
    """A decode killed mid-stream on a one-GPU 1P2D stack (`migration_stage.py`)."""
    out = stack.out / "migration"
    out.mkdir(parents=True, exist_ok=True)
    # The preset as installed, whose model folder holds the weights `prepare_model` seeded (the
    # checkout's copy of the folder has none).
    preset = Path(report["model"]["model_dir"]).parents[1] / f"{TOPOLOGY}.yaml"
    topology = migration_stage.one_prefill_two_decodes(preset, out, mem_fraction=MIGRATION_MEM_FRACTION)
    section: dict[str, Any] = {}
    report["migration"] = section  # filled as the stage goes: a stage cut short keeps what it measured
    try:
        migration_stage.run(
            out,
            topology,
            migration_stage.SGLANG,
            up_args=UP_OPEN_KV,
            env={ENV_WORKER_API_KEY: ENGINE_KEY},
            auth=ENGINE_AUTH,
            ready_s=READY_S,
            report=section,
        )
    finally:
        for name, why in section.get("verdicts", {}).items():
            verdict(report, f"migration_{name}", why)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gsm8k-data", type=Path, default=None)
    parser.add_argument("--stages", default="single,pd,doctor")
    parser.add_argument(
        "--allow-dirty", action="store_true", help="run on a tree that is not the recorded commit, and say so"
    )
    parser.add_argument("--deadline-s", type=float, default=560.0, help="stop every stage after this long")
    parser.add_argument(
        "--reference",
        type=Path,
        default=REFERENCE,
        help="where `single` keeps its outputs for a `pd` stage run in a later call on the same machine",
    )
    parser.add_argument(
        "--reference-report",
        type=Path,
        default=None,
        help="a committed report of an earlier check on the same GPU and weights whose single-server outputs "
        "`pd` compares with when `single` does not run (a call too short for both); the report says so",
    )
    args = parser.parse_args()
    stages = args.stages.split(",")
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        print(f"error: --stages: no stage {', '.join(unknown)}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        tree = tree_commit.verify(REPO, allow_dirty=args.allow_dirty)
    except tree_commit.TreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    report: dict[str, Any] = {"date": date, "commit": tree.label(), "tree": tree.as_dict(), "argv": sys.argv}
    report["gpu"] = gpu_description()
    import sglang

    recording: dict[str, Any] = {
        "sglang": sglang.__version__,
        "source": "recorded from live servers by scripts/gpu/gpu_pd_check.py (scripts/gpu/record_sglang_http.py)",
        "gpu": report.get("gpu"),
        "date": date,
        "commit": tree.label(),
        "servers": {},
    }

    def out_of_time(*_: object) -> None:
        raise TimeoutError(f"the check's deadline of {args.deadline_s:g} s passed")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(int(args.deadline_s))
    stack = Stack(args.out)
    ref = None
    try:
        report["model"] = prepare_model()
        table = token_table(Path(report["model"]["model_dir"]))
        for stage in stages:
            t0 = time.monotonic()
            try:
                if stage == "single":
                    ref = stage_single(stack, report, recording, table)
                    save_reference(args.reference, report, ref)
                elif stage == "pd":
                    if ref is None:
                        ref = load_reference(args.reference, report)
                    if ref is None and args.reference_report is not None:
                        ref = reference_from_report(args.reference_report, report)
                    stage_pd(stack, report, ref, args.gsm8k_data, recording, table)
                elif stage == "smollm2":
                    stage_smollm2(stack, report, args.gsm8k_data)
                elif stage == "migration":
                    stage_migration(stack, report)
                elif stage == "breakdown":
                    stage_breakdown(stack, report)
                elif stage == "routers":
                    stage_routers(stack, report)
                elif stage == "admission":
                    stage_admission(stack, report)
                elif stage == "doctor":
                    p = subprocess.run(
                        [sys.executable, "-m", "sglang_pd.deploy.cli", "doctor"],
                        capture_output=True,
                        text=True,
                        timeout=120,
                    )
                    report["doctor"] = {"exit_code": p.returncode, "output": p.stdout + p.stderr}
            except Exception:
                report.setdefault("errors", {})[stage] = traceback.format_exc()
            finally:
                report.setdefault("stage_seconds", {})[stage] = round(time.monotonic() - t0, 1)
                # What the stage measured is on disk before its processes stop: stopping a PD stack
                # can take its drain time, and a call's limit may end this run meanwhile.
                (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
                stack.stop_all()
            (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
            if recording["servers"]:
                name = f"sglang-{recording['sglang']}-http.json"
                (args.out / name).write_text(json.dumps(recording, indent=2, default=str))
    except Exception:
        report.setdefault("errors", {})["setup"] = traceback.format_exc()
    finally:
        signal.alarm(0)
        stack.stop_all()
        (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(summary(report), indent=2, default=str)[-8000:])
    return 1 if report.get("errors") or report.get("failures") else 0


if __name__ == "__main__":
    sys.exit(main())
