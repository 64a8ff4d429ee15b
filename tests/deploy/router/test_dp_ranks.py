"""Prefill DP ranks: read from `/server_info` as sglang 0.5.17 and 0.5.23 report them, chosen by
the prompt's prefix and then by load, with `bootstrap_room % dp_size == routed_dp_rank` (the
rank sglang's prefill and decode agree on) and the rank sent to the prefill leg only."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable

import httpx
import pytest

from sglang_pd.deploy.router.pd.bootstrap import AFFINITY_SLACK, choose_rooms, prefix_rank
from sglang_pd.deploy.router.workers.health import dp_ranks

from .conftest import Cluster

COMPLETIONS = "/v1/completions"
DP = 8


@pytest.mark.parametrize(
    ("info", "ranks"),
    [
        ({"dp_size": 1, "attn_dp_size": 8, "enable_dp_attention": True}, 8),  # sglang 0.5.23, --attn-dp-size 8
        ({"dp_size": 8, "enable_dp_attention": True}, 8),  # sglang 0.5.17, --dp-size 8 --enable-dp-attention
        ({"dp_size": 4}, 4),  # plain data parallelism: the prefill still follows the room
        ({"dp_size": 1, "attn_dp_size": 1}, 1),
        ({"dp_size": True, "attn_dp_size": "8"}, 1),  # not counts: ignored
        ({}, 1),
    ],
)
def test_dp_ranks_from_server_info(info: dict[str, object], ranks: int) -> None:
    assert dp_ranks(info) == ranks


def test_a_prefix_keeps_its_rank_until_the_rank_is_overloaded() -> None:
    rng = random.Random(0)
    preferred = prefix_rank("You are a helpful assistant. " * 4 + "question 1", DP)
    assert preferred == prefix_rank("You are a helpful assistant. " * 4 + "question 2", DP), "one prefix, one rank"
    assert preferred is not None and prefix_rank("", DP) is None
    loads = [3] * DP
    loads[preferred] = 3 + AFFINITY_SLACK
    rooms, ranks = choose_rooms(1, rng, dp_in_flight=loads, preferred=preferred)
    assert ranks == [preferred] and rooms[0] % DP == preferred
    loads[preferred] += 1  # one more than the slack: the least-loaded rank instead
    rooms, ranks = choose_rooms(1, rng, dp_in_flight=loads, preferred=preferred)
    assert ranks != [preferred] and rooms[0] % DP == ranks[0]
    # A batch spills over as its own prompts load the rank.
    _, ranks = choose_rooms(AFFINITY_SLACK + 3, rng, dp_in_flight=[0] * DP, preferred=preferred)
    assert ranks[: AFFINITY_SLACK + 1] == [preferred] * (AFFINITY_SLACK + 1) and preferred not in ranks[-2:]


def test_prefixes_spread_over_the_ranks() -> None:
    ranks = Counter(
        prefix_rank(f"conversation {i}: what is the weather like in city number {i}?", DP) for i in range(400)
    )
    assert len(ranks) == DP and min(ranks.values()) > 25


@pytest.mark.parametrize("sglang_version", ["0.5.23", "0.5.17"])
def test_prefill_dp_ranks_engage_by_prefix_and_load(
    cluster_factory: Callable[..., Cluster], sglang_version: str
) -> None:
    # The prefill reports sglang's layout for 8 DP-attention ranks (0.5.23: dp_size=1, attn_dp_size=8).
    cluster = cluster_factory(1, 1, dp_size=DP, sglang_version=sglang_version, prefill_delay=0.05)
    with cluster.serve(cluster.config()) as running:
        assert running.app.registry.prefill[0].dp_size == DP
        prefill = cluster.prefills[0]

        async def send(prompts: list[str]) -> list[int]:
            async with httpx.AsyncClient(timeout=20) as client:
                replies = await asyncio.gather(
                    *(client.post(running.url + COMPLETIONS, json={"prompt": p, "max_tokens": 1}) for p in prompts)
                )
            return [r.status_code for r in replies]

        # Under load, distinct prompts spread over the ranks.
        assert (
            asyncio.run(send([f"user {i} asks question number {i} about the weather " * 2 for i in range(48)]))
            == [200] * 48
        )
        requests = prefill.state()["requests"]
        assert all(r["routed_dp_rank"] is not None and r["room"] % DP == r["routed_dp_rank"] for r in requests)
        assert len({r["routed_dp_rank"] for r in requests}) >= DP - 2, Counter(r["routed_dp_rank"] for r in requests)
        decode_requests = cluster.decodes[0].state()["requests"]
        assert all(r["routed_dp_rank"] is None for r in decode_requests), "the prefill rank is not sent to decode"

        # One after another (no load), prompts sharing a prefix reach one rank.
        prefill.configure(reset=True)
        shared = "A long shared system prompt that starts every request of this tenant. "
        with httpx.Client(timeout=20) as client:
            for i in range(6):
                resp = client.post(running.url + COMPLETIONS, json={"prompt": f"{shared}question {i}", "max_tokens": 1})
                assert resp.status_code == 200, resp.text
        assert len({r["routed_dp_rank"] for r in prefill.state()["requests"]}) == 1

        # At once, they spill over to other ranks once their rank is loaded beyond the slack.
        prefill.configure(reset=True, prefill_delay=0.5)
        assert asyncio.run(send([f"{shared}question {i}" for i in range(24)])) == [200] * 24
        per_rank = Counter(r["routed_dp_rank"] for r in prefill.state()["requests"])
        assert len(per_rank) > 1 and max(per_rank.values()) < 24, per_rank
