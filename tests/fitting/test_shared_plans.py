"""A conversation keeps its cuts on whichever instance serves it: with a shared (Redis) archive,
the plan one fitter made is found by another that never saw the conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from contextpaw.core.compact import Plan
from contextpaw.fitting.fitter import Fitter
from contextpaw.fitting.flow import Forward
from contextpaw.ops.metrics import Stats
from contextpaw.settings import FitSettings
from support.fitters import FakeServices, chat, next_turn, repeats_prefix, state
from support.redis_server import redis_server

SECRET = b"fleet" * 8


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as url:
        yield url


def instance(url: str) -> Fitter:
    from contextpaw.ops.archive_redis import RedisStore

    store = RedisStore(url, max_items=100, max_bytes=1 << 20, max_age_s=60)
    f = Fitter(FakeServices(), Stats(store), store, replace(FitSettings()))
    f.configure(f.settings, None, store.shared_secret(SECRET))
    return f


def test_a_plan_goes_through_json_unchanged() -> None:
    from contextpaw.core.shrink import Cut

    plan = Plan(frozenset({"u1", "u2"}), {"u3:0": Cut(100, 10, 90, 42)}, {"cp-1.2": "note"}, frozenset({"u1"}), 0.125, True)
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


async def test_the_next_turn_on_another_instance_repeats_the_first_instances_cuts(redis_url: str) -> None:
    first, second = instance(redis_url), instance(redis_url)
    turn = chat(turns=16, num_ctx=4096)  # a window whose markers share holds several: the plan repeats as it was
    one = state(turn)
    decision = await first.fit(one)
    assert isinstance(decision, Forward) and decision.body is not None and one.report is not None
    first.store.flush()
    key = next(iter(first.plans))
    assert key not in second.plans and Plan.from_json(json.loads(second.store.get_plan(key) or b"{}")) == first.plans.get(key)
    again, two, asked = await next_turn(second, turn)
    assert isinstance(again, Forward) and two.report is not None
    assert asked == [key]  # found in the shared store: the same conversation key under the fleet's secret
    assert repeats_prefix(decision.body, again.body)  # the cut and its markers byte for byte
    assert set(one.report.markers) <= set(two.report.markers)
    for f in (first, second):
        f.store.close()
