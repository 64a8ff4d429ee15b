"""Which request fields reach the engines: an allowlist per endpoint.

The engines accept far more than OpenAI's fields. sglang's request models
(sglang/srt/entrypoints/openai/protocol.py, `GenerateReqInput` in sglang/srt/managers/io_struct.py)
also take fields meant for the operator or for the router itself, and a client that sets them acts
on other clients or on the machine:

- `lora_path` names a file on the engine's host; `custom_logit_processor` and `custom_params` carry
  a serialized callable that runs inside the engine when `--enable-custom-logit-processor` is on;
- `rid`, `bootstrap_host`/`_port`/`_room` and the DP-rank fields address the engines' work: the
  router sets them per request, and a client's copy would address another client's request;
- `priority` outranks every other client under `--enable-priority-scheduling`;
- `return_hidden_states`, `return_routed_experts` and `session_params` expose or keep engine state.

So a request may carry OpenAI's fields (the API reference, 2026) and the sglang sampling fields
its documentation lists for clients ("Sampling Parameters" in docs.sglang.io). A field the router
does not know is refused with a 400 naming it, as OpenAI refuses one ("Unrecognized request
argument supplied"). An internal field is refused too, unless the request carries the router's
admin key: an operator can still use them.
"""

from __future__ import annotations

from typing import Any

from ...common.openai_errors import ApiError

__all__ = ["INTERNAL_FIELDS", "refused_fields"]

# OpenAI's chat-completions request body.
_OPENAI_CHAT = frozenset(
    {
        "messages",
        "model",
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "metadata",
        "modalities",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    }
)

# OpenAI's legacy completions request body.
_OPENAI_COMPLETIONS = frozenset(
    {
        "model",
        "prompt",
        "best_of",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "n",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "suffix",
        "temperature",
        "top_p",
        "user",
    }
)

# sglang's documented client-side sampling and output fields, accepted on its OpenAI routes too.
_SGLANG_SAMPLING = frozenset(
    {
        "top_k",
        "min_p",
        "min_tokens",
        "repetition_penalty",
        "regex",
        "ebnf",
        "json_schema",
        "stop_token_ids",
        "stop_regex",
        "no_stop_trim",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "sampling_seed",
        "cache_salt",
    }
)
_SGLANG_CHAT = frozenset(
    {"continue_final_message", "separate_reasoning", "stream_reasoning", "chat_template_kwargs", "thinking"}
)

# `/generate` (sglang's native API): the prompt, sampling_params and the logprob options.
_GENERATE = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "stream",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "token_ids_logprob",
        "return_text_in_logprobs",
    }
)
# sglang's SamplingParams (sglang/srt/sampling/sampling_params.py) less `custom_params`.
_GENERATE_SAMPLING = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
    }
)

# Fields that act on other clients or on the engine's host (the module docstring says how); an
# admin-key request may send them.
INTERNAL_FIELDS = frozenset(
    {
        "lora_path",
        "lora_id",
        "custom_logit_processor",
        "custom_params",
        "return_hidden_states",
        "return_routed_experts",
        "routed_experts_start_len",
        "session_id",
        "session_params",
        "rid",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "decode_tp_size",
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
        "routing_key",
        "conversation_id",
        "priority",
        "extra_key",
        "custom_labels",
        "http_worker_ipc",
        "log_metrics",
        "background",
        "positional_embed_overrides",
        "input_embeds",
    }
)

_ALLOWED = {
    "/v1/chat/completions": _OPENAI_CHAT | _SGLANG_SAMPLING | _SGLANG_CHAT,
    "/v1/completions": _OPENAI_COMPLETIONS | _SGLANG_SAMPLING,
    "/generate": _GENERATE,
}


def refused_fields(endpoint: str, payload: dict[str, Any], *, admin: bool) -> None:
    """Raise a 400 naming the first field of `payload` (or of `/generate`'s sampling_params) that
    may not reach the engines; `admin`: the request carries the admin key, internal fields pass."""
    _check(payload, _ALLOWED[endpoint], "", admin=admin)
    if endpoint == "/generate":
        params = payload.get("sampling_params")
        for i, one in enumerate(params if isinstance(params, list) else [params]):
            if isinstance(one, dict):
                prefix = f"sampling_params[{i}]." if isinstance(params, list) else "sampling_params."
                _check(one, _GENERATE_SAMPLING, prefix, admin=admin)


def _check(fields: dict[str, Any], allowed: frozenset[str], prefix: str, *, admin: bool) -> None:
    for name in fields:
        if name in allowed:
            continue
        param = prefix + name
        if name in INTERNAL_FIELDS:
            if admin:
                continue
            raise ApiError(
                400,
                f"'{param}' is an engine-internal field that clients may not set: it would act on other "
                "requests or on the engine's host. Remove it, or send the request with the router's admin key.",
                param=param,
                code="internal_field",
            )
        raise ApiError(
            400,
            f"Unrecognized request argument supplied: {param}. Remove it: the router forwards OpenAI's fields "
            "and sglang's documented sampling fields only.",
            param=param,
            code="unknown_parameter",
        )
