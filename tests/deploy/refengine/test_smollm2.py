"""SmolLM2-135M-Instruct, the reference engine's default model, through prefill → Mooncake → decode.

Its KV cache is grouped-query attention (K and V buffers per layer), unlike the tiny MLA model of the
other tests here; greedy answers through our router must equal the same model run in this process,
token for token, and the gsm8k gate must run against the stack end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import PDStack, greedy_reference, pd_stack_of

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PAGE_SIZE = 16  # the engine's default; the question below spans several pages
QUESTION = (
    "A farmer has 12 cows and buys 7 more. Each cow gives 9 litres of milk a day, and the farmer sells "
    "the milk for 2 dollars a litre. Explain step by step how much money the farmer makes in one week, "
    "then give the final number."
)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDStack]:
    with pd_stack_of(tmp_path_factory.mktemp("smollm2"), model=MODEL) as stack:
        yield stack


@pytest.fixture(scope="module")
def smollm2():  # type: ignore[no-untyped-def]
    from sglang_pd.deploy.refengine.model import load_model

    return load_model(MODEL, threads=1)


def test_greedy_chat_through_pd_equals_single_process(smollm2_stack: PDStack, smollm2) -> None:  # type: ignore[no-untyped-def]
    from sglang_pd.deploy.refengine.tokenizer import IncrementalDetokenizer

    messages = [{"role": "user", "content": QUESTION}]
    prompt = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(messages))
    assert len(prompt) > 4 * PAGE_SIZE
    expected = greedy_reference(smollm2, prompt, NEW_TOKENS, stop_at_eos=True)
    detok = IncrementalDetokenizer(smollm2.tokenizer)
    expected_deltas = [detok.add(t) for t in expected if t != smollm2.tokenizer.eos_token_id]

    # The same prompt ids through /generate: the output ids themselves.
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
    r = httpx.post(f"{smollm2_stack.router.url}/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == expected

    # The chat API, streamed: one delta per generated token, each the single-process token's text.
    chat = {"model": MODEL, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{smollm2_stack.router.url}/v1/chat/completions", json=chat, timeout=180) as s:
        assert s.status_code == 200
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    token_chunks = [c["choices"][0]["delta"] for c in chunks if "role" not in c["choices"][0]["delta"]]
    deltas = [d["content"] for d in token_chunks if "content" in d]  # the last chunk carries only finish_reason
    assert deltas == expected_deltas
    assert "".join(deltas).strip(), "an empty answer"
    # The prompt's pages went through Mooncake, and every page came back.
    assert smollm2_stack.prefill.metric("sglang_pd_kv_transfers_total") >= 2
    assert smollm2_stack.decode.metric("sglang_pd_refengine_kv_pages_used") == 0


def test_openai_chat_shapes_through_pd_with_the_models_template(smollm2_stack: PDStack) -> None:
    # SmolLM2's template concatenates `message['content']` as a string: content parts and null
    # content must reach it as sglang hands them over (joined text, ""), not as a list or None.
    url = f"{smollm2_stack.router.url}/v1/chat/completions"
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    history = [
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    ]
    plain = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": ""}, history[2]]
    answers = []
    for messages in (history, plain):
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
        r = httpx.post(url, json=body, timeout=180)
        assert r.status_code == 200, r.text
        answers.append(r.json())
    assert answers[0]["usage"] == answers[1]["usage"]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    # a text-only model refuses an image, as sglang does (the router words the error its own way)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [image]}], "max_tokens": 4}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400 and "unsupported content type 'image_url'" in r.text, r.text


def test_gsm8k_gate_runs_against_the_stack(smollm2_stack: PDStack, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "eval", "gsm8k"]
    argv += ["--base-url", f"{smollm2_stack.router.url}/v1"]
    # Short answers keep the run to a minute or two here; a 135M model rambles, so cut answers are allowed.
    # No --data: the test set shipped in the package.
    argv += ["--num-questions", "5", "--max-tokens", "48", "--max-truncation-rate", "1"]
    argv += ["--quiet", "--output", str(report)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(report.read_text())
    assert result["status"] == "pass", result["status"]
    assert result["model"] == MODEL and result["metrics"]["n"] == 5 and result["metrics"]["errors"] == 0
    # Every question got an answer back through PD (SmolLM2's score is low; an answer may be empty).
    assert all(r["output"] is not None for r in result["records"])
