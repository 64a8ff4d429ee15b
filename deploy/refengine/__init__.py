"""The reference engine: SGLang's HTTP API subset and PD protocol on CPU, with a small real model
(SmolLM2-135M-Instruct) by default or a tiny DeepSeek-V3-shaped one for the MLA layout."""

from __future__ import annotations

from .engine import Bootstrap, EngineConfig, RefEngine, RequestFailed, SamplingParams, StepOutput
from .kvpool import KVPool, PoolExhausted
from .model import LoadedModel, load_model, sample_token
from .tokenizer import ByteTokenizer

__all__ = [
    "Bootstrap",
    "ByteTokenizer",
    "EngineConfig",
    "KVPool",
    "LoadedModel",
    "PoolExhausted",
    "RefEngine",
    "RequestFailed",
    "SamplingParams",
    "StepOutput",
    "load_model",
    "sample_token",
]
