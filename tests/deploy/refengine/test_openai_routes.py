"""The reference engine takes standard OpenAI requests as sglang 0.5.23 does, and refuses what
sglang refuses with sglang's 400s.

Read in sglang 0.5.23's source (`srt/entrypoints/openai/serving_chat.py`,
`srt/parser/jinja_template_utils.py`, `srt/managers/tokenizer_manager.py`): content parts of a
text-only model's messages are joined with spaces, `content: null` is "", a media part is refused
by its type, `max_tokens` above the context length is refused on chat, and a prompt plus its
`max_tokens` must fit the context (`--context-length`, else the model's).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.polling import free_port
from tests.support.standalone_engine import MODEL, engine_argv, standalone_engine

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

MODEL_CONTEXT = 4096  # the tiny model's max_position_embeddings
VOCAB_SIZE = 512  # and its vocab_size
CONTEXT = 256  # what the engine below is started with


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One reference engine on its own, with a context shorter than its model's."""
    log = tmp_path_factory.mktemp("refengine-openai") / "engine.log"
    with standalone_engine(log, "--context-length", str(CONTEXT)) as url:
        yield url


def chat(url: str, messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def assert_openai_400(r: httpx.Response, *words: str) -> str:
    """sglang's flat error body of its OpenAI routes; returns the message."""
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["object"] == "error" and body["code"] == 400 and body["type"] == "BadRequestError"
    assert all(w in body["message"] for w in words), body["message"]
    return str(body["message"])


def assert_native_400(r: httpx.Response, *words: str) -> str:
    """sglang's `{"error": {"message"}}` of its native routes; returns the message."""
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message
    return str(message)


# --- chat messages -----------------------------------------------------------------------------------


def test_text_parts_are_joined_with_spaces(engine: str) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    as_parts = chat(engine, [{"role": "user", "content": parts}])
    as_text = chat(engine, [{"role": "user", "content": "Hello world"}])
    assert as_parts.status_code == 200, as_parts.text
    assert as_parts.json()["usage"] == as_text.json()["usage"]
    assert as_parts.json()["choices"][0]["message"] == as_text.json()["choices"][0]["message"]


def test_a_tool_call_history_is_served(engine: str) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    history = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "4"}]},
    ]
    r = chat(engine, history)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    # null content is "" and the tool's parts its text, as with the plain-string history
    plain = [*history[:2], {"role": "assistant", "content": ""}, {"role": "tool", "content": "4"}]
    assert r.json()["usage"]["prompt_tokens"] == chat(engine, plain).json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    ],
)
def test_a_media_part_is_refused_by_its_type(engine: str, part: dict[str, Any]) -> None:
    content = [{"type": "text", "text": "What is this?"}, part]
    message = assert_openai_400(chat(engine, [{"role": "user", "content": content}]), f"'{part['type']}'")
    assert message.startswith("Model only supports text input")  # sglang's words


@pytest.mark.parametrize(
    "messages, words",
    [
        ([{"role": "user", "content": None}], ["messages[0]", "user"]),
        ([{"role": "robot", "content": "hi"}], ["'robot'"]),
        ([{"role": "user", "content": [{"type": "text"}]}], ["messages[0]", "text"]),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}], ["arguments"]),
    ],
)
def test_malformed_messages_are_a_400_naming_the_problem(
    engine: str, messages: list[dict[str, Any]], words: list[str]
) -> None:
    assert_openai_400(chat(engine, messages), *words)


# --- input_ids ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids, words",
    [
        ([5, VOCAB_SIZE], ["input_ids[1]", str(VOCAB_SIZE), "vocabulary"]),
        ([5, 10**9], ["input_ids[1]", str(VOCAB_SIZE), "vocabulary"]),
        ([-1, 5], ["input_ids[0]", str(VOCAB_SIZE), "vocabulary"]),
        ([5, 6.5], ["input_ids[1]", "integers"]),
        ([5, "7"], ["input_ids[1]", "integers"]),
    ],
)
def test_input_ids_outside_the_vocabulary_are_a_400(engine: str, ids: list[Any], words: list[str]) -> None:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    assert_native_400(httpx.post(engine + "/generate", json=body, timeout=30), *words)
    # and the engine still serves the last id of the vocabulary
    body = {"input_ids": [5, VOCAB_SIZE - 1], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(engine + "/generate", json=body, timeout=30).status_code == 200


# --- the context length ------------------------------------------------------------------------------


def test_the_context_length_set_is_the_one_reported(engine: str) -> None:
    assert httpx.get(engine + "/v1/models").json()["data"][0]["max_model_len"] == CONTEXT
    assert httpx.get(engine + "/server_info").json()["context_length"] == CONTEXT


def test_max_tokens_above_the_context_length_is_refused_on_chat(engine: str) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        r = chat(engine, [{"role": "user", "content": "hi"}], **{"max_tokens": None, field: CONTEXT + 1})
        assert_openai_400(r, "max_completion_tokens is too large", str(CONTEXT + 1), str(CONTEXT))


def test_prompt_and_max_tokens_must_fit_the_context_length(engine: str) -> None:
    prompt = "x" * (CONTEXT - 10)  # the tiny model's tokens are bytes
    r = httpx.post(engine + "/v1/completions", json={"prompt": prompt, "max_tokens": 10}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(engine + "/v1/completions", json={"prompt": prompt, "max_tokens": 11}, timeout=60)
    assert_openai_400(r, f"maximum context length of {CONTEXT} tokens", f"total of {CONTEXT + 1} tokens")
    r = httpx.post(engine + "/generate", json={"text": "x" * CONTEXT}, timeout=60)
    assert_native_400(r, f"The input ({CONTEXT} tokens) is longer than the model's context length ({CONTEXT} tokens)")


def test_a_chat_without_max_tokens_gets_what_the_context_has_left(engine: str) -> None:
    # sglang caps an unlimited request at the context; it does not refuse it
    r = chat(engine, [{"role": "user", "content": "x" * (CONTEXT - 40)}], max_tokens=None, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == CONTEXT


def test_a_context_length_above_the_models_stops_the_engine() -> None:
    argv = engine_argv(free_port(), "--context-length", str(MODEL_CONTEXT + 1))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"--context-length has value {MODEL_CONTEXT + 1}" in done.stderr and str(MODEL_CONTEXT) in done.stderr
