"""`make run TOPOLOGY=local-cpu-mla` (`up local-cpu-mla`) says that its model has random weights before its
smoke request prints the model's noise. A real `up` with reference engines and router, fenced as `make run`
runs it, in a network namespace of its own (tests.support.netns)."""

from __future__ import annotations

import pytest
import yaml

from sglang_pd.deploy.spec.presets import PRESETS_DIR, has_random_weights
from tests.support.netns import netns_unavailable, run_in_netns

pytestmark = pytest.mark.slow

UNAVAILABLE = netns_unavailable()
NOTE = (
    "note: local-cpu-mla's model, tiny-deepseek-v3, has random weights (it shows the MLA KV path): its answers "
    "are noise, not text. For a model that answers in words: make run (topology local-cpu).\n"
)


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespace scenarios: {UNAVAILABLE}")
def test_up_local_cpu_mla_notes_its_random_weights_before_the_smoke_answer() -> None:
    seen = run_in_netns("tests.support.gate_smoke_scenarios:up_lines", "local-cpu-mla", timeout_s=420)["lines"]
    printed = "".join(seen)
    assert NOTE in seen, printed
    smoke = next((i for i, ln in enumerate(seen) if ln.startswith("smoke: ")), None)
    assert smoke is not None and seen.index(NOTE) < smoke, printed
    # (`up local-cpu` prints no such note: tests/deploy/evals/test_local_smoke.py checks its output.)


def test_only_the_random_weight_models_get_the_note() -> None:
    shipped = {p.stem: yaml.safe_load(p.read_text())["model"]["path"] for p in PRESETS_DIR.glob("local-cpu*.yaml")}
    assert {name for name, model in shipped.items() if has_random_weights(model)} == {"local-cpu-mla"}
    assert has_random_weights(str(PRESETS_DIR / "tiny-deepseek-v3-config.json"))
    assert not has_random_weights("smollm2-135m-instruct")
