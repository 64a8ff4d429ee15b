"""Rendered commands against two sglang releases' own parsers: 0.5.23 (installed) and 0.5.17 (recorded).

The 0.5.17 option strings were read from `ServerArgs.add_cli_args` on the GPU machine that runs
sglang 0.5.17 (`scripts/gpu/gpu_pd_run.sh` writes them); 0.5.23's come from the installed package.
"""

from __future__ import annotations

import json

import pytest

from sglang_pd.deploy.sglang.compat import (
    EQUIVALENTS,
    SglangVersionError,
    adapt_argv,
    compatibility_rows,
    installed_options,
)
from sglang_pd.deploy.sglang.render import render_plan
from sglang_pd.deploy.spec.topology import find_topology, load_topology
from tests.support.paths import SGLANG_RECORDINGS

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

RECORDED_0517 = SGLANG_RECORDINGS / "sglang-0.5.17-options.json"
OPTIONS_0517 = frozenset(json.loads(RECORDED_0517.read_text())["options"])
PRESETS = ["deepseek-r1-h200-1p1d", "deepseek-v3-h20-3p2d", "single-h200"]


def _argvs(preset: str) -> list[list[str]]:
    t = load_topology(find_topology(preset))
    return [c.argv for cmds in render_plan(t, "10.0.0.1").values() for c in cmds]


def test_recorded_options_are_sglang_0517():
    data = json.loads(RECORDED_0517.read_text())
    assert data["sglang"] == "0.5.17"
    assert "--dp-size" in OPTIONS_0517 and "--attn-dp-size" not in OPTIONS_0517


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_renders_for_0517_with_known_equivalents_only(preset):
    for argv in _argvs(preset):
        adapted = adapt_argv(argv, OPTIONS_0517, "0.5.17")
        assert all(a in OPTIONS_0517 for a in adapted if a.startswith("--")), adapted


def test_attn_dp_size_becomes_dp_size_with_dp_attention_on_0517():
    argv = ["-m", "sglang.launch_server", "--tp-size", "16", "--attn-dp-size", "16", "--page-size", "64"]
    expected = ["-m", "sglang.launch_server", "--tp-size", "16", "--dp-size", "16", "--enable-dp-attention"]
    assert adapt_argv(argv, OPTIONS_0517, "0.5.17") == [*expected, "--page-size", "64"]


def test_a_flag_without_equivalent_is_refused_with_its_name_and_the_version():
    with pytest.raises(SglangVersionError, match=r"sglang 0\.5\.17 does not accept --enable-pd-role-switch"):
        adapt_argv(["--enable-pd-role-switch", "--page-size", "64"], OPTIONS_0517, "0.5.17")


def test_flags_written_with_an_equals_sign_are_kept_or_rewritten_alike():
    # `sglang-pd launch` passes the worker key as one argument, `--api-key=KEY`.
    argv = ["--attn-dp-size=16", "--page-size=64", "--api-key=-k3y"]
    expected = ["--dp-size", "16", "--enable-dp-attention", "--page-size=64", "--api-key=-k3y"]
    assert adapt_argv(argv, OPTIONS_0517, "0.5.17") == expected
    with pytest.raises(SglangVersionError, match=r"does not accept --enable-pd-role-switch \(") as refused:
        adapt_argv(["--enable-pd-role-switch=s3cret"], OPTIONS_0517, "0.5.17")
    assert "s3cret" not in str(refused.value)  # a refused flag is named without its value
    rows = {r.flag: r.status for r in compatibility_rows(argv, OPTIONS_0517)}
    assert rows == {"--attn-dp-size": "rewritten", "--page-size": "ok", "--api-key": "ok"}


def test_compatibility_rows_say_what_happens_to_each_flag():
    rows = {r.flag: r for r in compatibility_rows(["--attn-dp-size", "16", "--page-size", "64", "--x-y"], OPTIONS_0517)}
    assert rows["--page-size"].status == "ok"
    assert rows["--attn-dp-size"].status == "rewritten"
    assert rows["--attn-dp-size"].replacement == "--dp-size N --enable-dp-attention"
    assert rows["--x-y"].status == "unsupported"


@pytest.fixture
def installed() -> tuple[str, frozenset[str]]:
    found = installed_options()
    if found is None:
        pytest.skip("sglang does not import here (the `validate` extra installs it)")
    return found


@pytest.mark.sglang
def test_installed_0523_takes_every_preset_unchanged(installed):
    version, options = installed
    assert version == "0.5.23"
    for preset in PRESETS:
        for argv in _argvs(preset):
            assert adapt_argv(argv, options, version) == argv


@pytest.mark.sglang
def test_equivalents_name_only_flags_the_installed_release_knows(installed):
    _, options = installed
    for new in EQUIVALENTS:
        assert new in options, f"{new} is not a flag of the deployed sglang"


def test_flag_report_against_0517_names_the_rewritten_flag(monkeypatch):
    import sglang_pd.deploy.sglang.compat as compat

    monkeypatch.setattr(compat, "installed_options", lambda: ("0.5.17", OPTIONS_0517))
    report = compat.flag_report(_argvs("deepseek-r1-h200-1p1d"))
    assert report is not None
    assert report["installed"] == "0.5.17" and report["rendered_for"] == "0.5.23"
    assert report["rewritten"] == {"--attn-dp-size": "--dp-size N --enable-dp-attention"}
    assert report["unsupported"] == []
    assert "--attn-dp-size -> --dp-size N --enable-dp-attention" in compat.flag_summary(report)


@pytest.mark.sglang
def test_plan_check_reports_the_installed_sglang_against_the_rendered_flags(installed, capsys):
    from sglang_pd.deploy.cli import main

    code = main(["plan", "single-h200", "--check", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    flags = json.loads(out)["sglang_flags"]
    assert flags["installed"] == installed[0]
    assert flags["unsupported"] == [] and flags["rewritten"] == {}
