"""A worker's fields change only through `Worker`'s own methods: no other router module assigns them."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from sglang_pd.deploy.router.workers.registry import Worker, WorkerRegistry
from tests.support.paths import REPO

ROUTER = REPO / "deploy" / "router"
FIELDS = {f.name for f in dataclasses.fields(Worker)} - {"breaker"}  # the breaker guards its own state


def _foreign_writes(path: Path) -> list[str]:
    """`x.field = ...` / `x.field += ...` on a Worker field name, where x is not `self`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for target in targets:
            mine = (
                isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
            )
            if isinstance(target, ast.Attribute) and target.attr in FIELDS and not mine:
                found.append(f"{path.relative_to(REPO)}:{target.lineno} {ast.unparse(target)}")
    return found


def test_no_router_module_but_the_registry_writes_a_workers_fields() -> None:
    modules = [p for p in ROUTER.rglob("*.py") if p.name != "registry.py"]
    assert len(modules) > 40
    assert [w for p in modules for w in _foreign_writes(p)] == []


def test_the_scan_sees_a_write() -> None:
    sample = REPO / "deploy" / "router" / "workers" / "registry.py"
    assert any(".bootstrap_port" in w for w in _foreign_writes(sample))  # registry.add updates a kept worker


def test_record_probe_admits_on_a_generation_pass_and_ejects_after_liveness_failures() -> None:
    worker = WorkerRegistry().add("http://10.0.0.1:30000", "decode")
    worker.record_probe(True, "", generation=False, admit_after=2, eject_after=3)
    assert not worker.healthy and not worker.checked  # a liveness pass leaves a new worker unsettled
    worker.record_probe(True, "", generation=True, admit_after=2, eject_after=3)
    assert worker.healthy and worker.checked  # a new worker's first generation pass admits it
    for _ in range(2):
        worker.record_probe(False, "GET /v1/models answered 500", generation=False, admit_after=2, eject_after=3)
    assert worker.healthy and worker.consecutive_health_failures == 2
    worker.record_probe(False, "GET /v1/models answered 500", generation=False, admit_after=2, eject_after=3)
    assert not worker.healthy and worker.last_error == "GET /v1/models answered 500"
    worker.record_probe(True, "", generation=True, admit_after=2, eject_after=3)
    assert not worker.healthy  # an ejected worker needs two passes in a row
    worker.record_probe(True, "", generation=True, admit_after=2, eject_after=3)
    assert worker.healthy
