"""The single-h200 model answers from the whole prompt, so the GPU check can see a wrong KV page.

The weights come from scripts/gpu/seeded_checkpoint.py with the preset's config, tokenizer and
seed, the bytes the GPU machine writes (drawn on the CPU there too); transformers'
`DeepseekV3ForCausalLM` runs them here in float32. Its MLA cache holds what sglang's KV pages hold
(the normalized latent and the rotated key, per token and layer), so a page of the cache is a page
the prefill sends. The check's own prompts are used: its context pair and its fault controls, with
the corruption its fault applies (faults/pd_check_kv_fault.py `corrupt`). A control with sglang's
`--load-format dummy` weights shows what these tests catch.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sglang_pd.deploy.spec.topology import PRESETS_DIR, load_topology

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts/gpu"))
sys.path.insert(0, str(REPO / "scripts/gpu/faults"))
seeded = importlib.import_module("seeded_checkpoint")
check = importlib.import_module("gpu_pd_check")
char_tokenizer = importlib.import_module("char_tokenizer")
fault = importlib.import_module("pd_check_kv_fault")

MODEL_DIR = PRESETS_DIR / "models/tiny-deepseek-v3-bf16"
PAGE = 16
N = check.MAX_NEW_TOKENS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny-deepseek-v3-bf16")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, d / name)
    seeded.write(d, seed=0)
    return d


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _load(model_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import DeepseekV3ForCausalLM

    model, info = DeepseekV3ForCausalLM.from_pretrained(str(model_dir), dtype=dtype, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return _load(model_dir)[0]


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


Corruption = Callable[[Any], None]


@torch.no_grad()
def greedy(model: Any, ids: list[int], corrupt: Corruption | None = None, n: int = N) -> list[int]:
    """Greedy tokens as a PD stack makes them: the prefill computes the prompt's cache and the first
    token; `corrupt` then changes the cache (what the decode received), which the decode continues from."""
    out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    if corrupt is not None:
        corrupt(cache)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < n:
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def send_pages_as(sent: list[int]) -> Corruption:
    """The cache the decode holds when page k of the prompt was written from page sent[k]."""

    def corrupt(cache: Any) -> None:
        for layer in cache.layers:
            for t in (layer.keys, layer.values):  # the normalized latent and the rotated key
                orig = t.clone()
                for k, src in enumerate(sent):
                    if src != k:
                        t[:, :, k * PAGE : (k + 1) * PAGE] = orig[:, :, src * PAGE : (src + 1) * PAGE]

    return corrupt


def zero_page(k: int) -> Corruption:
    def corrupt(cache: Any) -> None:
        for layer in cache.layers:
            layer.keys[:, :, k * PAGE : (k + 1) * PAGE] = 0
            layer.values[:, :, k * PAGE : (k + 1) * PAGE] = 0

    return corrupt


def short_cycle(tokens: list[int], longest: int = 8) -> int | None:
    """The period (up to `longest`) with which the second half of `tokens` repeats, if any."""
    half = len(tokens) // 2
    return next(
        (p for p in range(1, longest + 1) if all(tokens[i] == tokens[i + p] for i in range(half, len(tokens) - p))),
        None,
    )


def test_the_writer_gives_transformers_every_weight_and_the_same_bytes_each_time(
    model_dir: Path, tmp_path: Path
) -> None:
    _, info = _load(model_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(model_dir / "config.json", again / "config.json")
    assert seeded.sha256(seeded.write(again, seed=0)) == seeded.sha256(model_dir / "model.safetensors")
    assert seeded.sha256(seeded.write(again, seed=1)) != seeded.sha256(model_dir / "model.safetensors")


def test_the_writer_refuses_a_quantized_config(tmp_path: Path) -> None:
    shutil.copy(PRESETS_DIR / "models/tiny-deepseek-v3-fp8/config.json", tmp_path / "config.json")
    with pytest.raises(SystemExit, match=r"fp8_checkpoint\.py"):
        seeded.write(tmp_path)


def test_the_preset_loads_this_folder_without_dummy_weights() -> None:
    t = load_topology("single-h200")
    assert Path(t.model_path()) == MODEL_DIR.resolve()
    for role in (t.prefill, t.decode):
        assert "--load-format" not in role.extra_args


def test_two_contexts_with_the_same_last_tokens_answer_differently(model: Any, tokenizer: Any) -> None:
    a, b = (ids_of(tokenizer, p) for p in check.CONTEXT_PAIR)
    common = next(i for i in range(1, len(a)) if a[-i] != b[-i]) - 1
    assert common > PAGE  # they end in more than a whole page of the same tokens

    with torch.no_grad():
        la, lb = (model(torch.tensor([x])).logits[0, -1] for x in (a, b))
    assert float((la - lb).abs().max() / la.abs().max()) > 0.1
    assert greedy(model, a) != greedy(model, b)  # what the check's context control requires


def test_control_sglangs_dummy_weights_answer_from_the_last_token_alone(model_dir: Path, tokenizer: Any) -> None:
    # sglang's initialize_dummy_weights (srt/model_loader/weight_utils.py, 0.5.17 lines 1514-1546):
    # every floating-point parameter from U(-1e-3, 1e-3), norms included, served in bf16.
    dummy, _ = _load(model_dir, torch.bfloat16)
    for p in dummy.state_dict().values():
        if torch.is_floating_point(p):
            p.uniform_(-1e-3, 1e-3, generator=torch.Generator().manual_seed(1234))
    with torch.no_grad():
        la, lb = (dummy(torch.tensor([ids_of(tokenizer, p)])).logits[0, -1] for p in check.CONTEXT_PAIR)
    assert torch.equal(la, lb)  # the test above would fail on these weights


def test_one_wrong_kv_page_changes_each_fault_controls_greedy_output(model: Any, tokenizer: Any) -> None:
    for i, prompt in enumerate(check.control_prompts()):
        ids = ids_of(tokenizer, prompt)
        pages = -(-len(ids) // PAGE)
        assert pages >= 2 and len(ids) <= 256, "a control spans pages and fits one prefill chunk"
        sent = fault.corrupt(np.arange(pages))
        assert sent is not None and sum(int(s) != k for k, s in enumerate(sent)) == 1  # exactly one page
        clean = greedy(model, ids)
        assert greedy(model, ids, send_pages_as(list(range(pages)))) == clean  # the harness alone changes nothing
        assert greedy(model, ids, send_pages_as([int(s) for s in sent])) != clean, f"control {i}"
        assert short_cycle(clean) is None, f"control {i} decodes into a short cycle: {clean}"
        if i == 0:
            assert greedy(model, ids, zero_page(pages // 2)) != clean  # a page never written


def test_greedy_outputs_are_not_short_cycles(model: Any, tokenizer: Any) -> None:
    for prompt in (check.prompts()[0], check.prompts()[7]):
        tokens = greedy(model, ids_of(tokenizer, prompt))
        assert short_cycle(tokens) is None and len(set(tokens)) >= N // 2, tokens
    assert short_cycle([622, 772] * (N // 2)) == 2  # the dummy weights' output: caught
