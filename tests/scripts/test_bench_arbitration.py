"""The arbitration scenarios of scripts/bench/bench_arbitration.py, as tests: the real arbiter on a
simulated clock against a fake NVML and fake runtimes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from support.arbitration_sim import replay, scenarios, switch_bound

SCENARIOS = {s.name: s for s in scenarios()}
ALTERNATING, SMALL_CARD, BIG_CARD, INTRUDER, ROUTER_BESIDE, ROUTER_ALONE = SCENARIOS


def test_alternating_clients_switch_at_most_once_per_hold_and_lose_nothing() -> None:
    outcome = replay(SCENARIOS[ALTERNATING])
    assert 0 < outcome.switches <= switch_bound(120, 20)
    assert (outcome.dropped, outcome.evicted_in_flight, outcome.over_commits) == (0, 0, 0)
    assert outcome.served == len(SCENARIOS[ALTERNATING].schedule)
    assert outcome.decisions_logged >= outcome.switches


def test_without_a_hold_the_same_clients_thrash() -> None:
    """The comparison that makes the hold worth having: the bound above is not met by accident."""
    assert replay(replace(SCENARIOS[ALTERNATING], min_hold=0.0)).switches > 2 * switch_bound(120, 20)


def test_on_the_earlier_proxys_24_gb_card_exactly_one_runtime_is_resident() -> None:
    outcome = replay(SCENARIOS[SMALL_CARD])
    assert outcome.most_resident == 1 and outcome.over_commits == 0 and outcome.switches > 0
    assert outcome.dropped == 0 and outcome.evicted_in_flight == 0


def test_where_both_fit_nothing_is_evicted() -> None:
    outcome = replay(SCENARIOS[BIG_CARD])
    assert outcome.switches == 0 and outcome.most_resident == 2
    assert (outcome.dropped, outcome.over_commits) == (0, 0)


@pytest.mark.parametrize("intruder", [True, False])
def test_memory_another_process_takes_is_accounted_for(intruder: bool) -> None:
    """With 10 GB taken by someone else, llama-server no longer fits beside Ollama: Ollama is evicted
    instead of the card being over-committed. Without the intruder both fit."""
    scenario = SCENARIOS[INTRUDER] if intruder else replace(SCENARIOS[INTRUDER], others=lambda t: 0)
    outcome = replay(scenario)
    assert outcome.over_commits == 0 and outcome.dropped == 0
    assert (outcome.switches > 0) is intruder


@pytest.mark.parametrize("name", [ROUTER_BESIDE, ROUTER_ALONE])
def test_a_router_llama_servers_models_and_ollamas_share_the_card_by_load_and_unload(name: str) -> None:
    """Three clients (Ollama's model, the router's small and big ones) at 1 Hz each: every request
    served with its own model loaded, nothing unloaded under a request, the card never
    over-committed, and a switch at most once a hold."""
    outcome = replay(SCENARIOS[name])
    assert (outcome.dropped, outcome.evicted_in_flight, outcome.over_commits, outcome.misplaced) == (0, 0, 0, 0), outcome
    assert outcome.served == len(SCENARIOS[name].schedule)
    assert 0 < outcome.switches <= switch_bound(170, 20), outcome


def test_the_routers_two_models_stay_loaded_together_beside_nothing_where_they_fit() -> None:
    """On the 24 GB card Ollama's model fits beside the small one, and the two router models beside
    each other: at times two runtimes hold the card; on the 16 GB card, never."""
    assert replay(SCENARIOS[ROUTER_BESIDE]).most_resident == 2
    assert replay(SCENARIOS[ROUTER_ALONE]).most_resident == 1
