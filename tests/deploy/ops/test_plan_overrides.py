"""`plan`, `plan --check` and `launch --dry-run` refuse a topology whose extra_args or env would override a value
the topology rules checked, and accept the same topology without the override."""

from __future__ import annotations

import pytest

from sglang_pd.deploy.cli import main
from tests.support.override_cases import OVERRIDES

# A decode pod of the R1 preset's two-node group, as LeaderWorkerSet starts it (launch reads its rank here).
LWS = {"LWS_LEADER_ADDRESS": "decode-0.decode.llm", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"}


def _launch(role: str, path: str) -> list[str]:
    return ["launch", "--role", role, "--topology", path, "--dry-run", "--skip-checks", "--no-kv-firewall"]


@pytest.mark.parametrize("case", OVERRIDES)
def test_plan_check_and_launch_refuse_the_override(
    case: str, preset_dict, write_topology, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    override = OVERRIDES[case]
    for k, v in LWS.items():
        monkeypatch.setenv(k, v)
    control = str(write_topology(override.control(preset_dict()), "control.yaml"))
    assert main(["plan", control]) == 0
    assert main(_launch(override.role, control)) == 0
    capsys.readouterr()
    path = str(write_topology(override.apply(preset_dict()), "override.yaml"))
    # --check refuses before sglang's resolver runs: the rules come first.
    for argv in (["plan", path], ["plan", path, "--check"], _launch(override.role, path)):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert "the topology breaks 1 rule(s)" in err and override.says in err, (argv, err)
