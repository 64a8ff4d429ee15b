from __future__ import annotations

import argparse

import pytest

import sglang_pd.deploy.router as router_pkg
from sglang_pd.deploy.router.cli import add_arguments, build_config
from sglang_pd.deploy.spec.topology import PRESETS_DIR

PRESETS = PRESETS_DIR


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_as_smg_spells_them() -> None:
    args = _parse("--prefill", "http://p1:30000", "9001", "--prefill", "http://p2:30000", "none",
                  "--prefill", "http://p3:30000", "--decode", "http://d1:30001", "--decode", "http://d2:30001",
                  "--host", "127.0.0.1", "--port", "9000", "--prefill-policy", "cache_aware",
                  "--decode-policy", "least_load", "--max-concurrent-requests", "64", "--queue-timeout", "2",
                  "--request-timeout", "30", "--api-key", "sk-one-111", "--admin-key", "sk-admin-zzz")  # fmt: skip
    config, worker_key = build_config(args, environ={"SGLANG_PD_ROUTER_API_KEYS": "k2, k3"})
    assert config.prefill_workers == (("http://p1:30000", 9001), ("http://p2:30000", None), ("http://p3:30000", None))
    assert config.decode_workers == ("http://d1:30001", "http://d2:30001")
    assert (config.host, config.port) == ("127.0.0.1", 9000)
    assert (config.prefill_policy, config.decode_policy) == ("cache_aware", "least_load")
    assert config.max_concurrent_requests == 64 and config.queue_timeout_s == 2 and config.request_timeout_s == 30
    assert config.api_keys == ("sk-one-111", "k2", "k3") and config.admin_key == "sk-admin-zzz" and worker_key == ""
    assert config.kubernetes is None
    assert "sk-one-111" not in repr(config) and "sk-admin-zzz" not in repr(config), "secrets are masked"


def test_health_flags() -> None:
    args = _parse("--health-interval", "1", "--health-timeout", "3", "--health-failure-threshold", "4",
                  "--health-success-threshold", "2", "--health-generate-interval", "60",
                  "--health-generate-timeout", "40", "--stream-stall", "0")  # fmt: skip
    config, _ = build_config(args, environ={})
    assert (config.health_interval_s, config.health_timeout_s, config.health_failure_threshold) == (1, 3, 4)
    assert (config.health_success_threshold, config.stream_stall_s) == (2, 0)
    assert (config.health_generate_interval_s, config.health_generate_timeout_s) == (60, 40)
    assert (config.timeouts.health, config.timeouts.health_generate) == (3, 40)
    with pytest.raises(ValueError, match="'health_failure_threshold' has value 0"):
        build_config(_parse("--health-failure-threshold", "0"), environ={})


def test_link_local_workers_are_refused_unless_the_flag_allows_them() -> None:
    assert build_config(_parse(), environ={})[0].allow_link_local_workers is False
    assert build_config(_parse("--allow-link-local-workers"), environ={})[0].allow_link_local_workers is True


def test_bad_prefill_port_names_the_flag() -> None:
    with pytest.raises(ValueError, match="bootstrap port 'abc' is not an integer"):
        build_config(_parse("--prefill", "http://p:1", "abc"), environ={})


def test_cache_aware_is_prefill_only() -> None:
    with pytest.raises(ValueError, match="prefill only"):
        from sglang_pd.deploy.router import RouterConfig

        RouterConfig(decode_policy="cache_aware")


def test_local_topology_gives_static_workers_and_router_settings() -> None:
    config, _ = build_config(_parse("--topology", str(PRESETS / "local-cpu.yaml")), environ={})
    assert config.prefill_workers == (("http://127.0.0.1:30000", 8998),)
    assert config.decode_workers == ("http://127.0.0.1:30001",)
    assert (config.host, config.port, config.prefill_policy) == ("127.0.0.1", 8000, "round_robin")
    assert config.kubernetes is None


def test_flags_override_the_topology_and_cluster_topology_uses_discovery() -> None:
    args = _parse("--topology", str(PRESETS / "deepseek-r1-h200-1p1d.yaml"), "--port", "8100",
                  "--k8s-namespace", "llm")  # fmt: skip
    config, _ = build_config(args, environ={})
    assert config.port == 8100
    assert config.prefill_workers == () and config.kubernetes is not None
    assert config.kubernetes.namespace == "llm"
    # The leader pods of every release, labelled as the chart labels them (tests/deploy/router/workers/test_discovery.py
    # checks these against the rendered chart).
    assert config.kubernetes.prefill_selector == (
        "app.kubernetes.io/part-of=sglang-pd,app.kubernetes.io/component=prefill,"
        "leaderworkerset.sigs.k8s.io/worker-index=0"
    )
    released = build_config(_parse("--kubernetes", "--k8s-release", "demo"), environ={})[0].kubernetes
    assert released is not None and released.decode_selector == (
        "app.kubernetes.io/instance=demo,app.kubernetes.io/component=decode,leaderworkerset.sigs.k8s.io/worker-index=0"
    )


def test_one_default_set_from_the_topology_spec() -> None:
    from sglang_pd.deploy.router import RouterConfig
    from sglang_pd.deploy.spec.topology import RouterSpec

    spec, config = RouterSpec(), RouterConfig()
    for name in ("max_concurrent_requests", "max_queued_requests", "queue_timeout_s", "request_timeout_s", "port"):
        assert getattr(config, name) == getattr(spec, name), name
    assert build_config(_parse(), environ={})[0] == config


def test_exported_members() -> None:
    exported = set(router_pkg.__all__)
    assert exported == {name for name in dir(router_pkg) if not name.startswith("_") and name[0].isupper()} | {
        "create_app"
    }
    assert sorted(router_pkg.__all__) == router_pkg.__all__
