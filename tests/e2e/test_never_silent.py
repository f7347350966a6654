"""The never-silent invariant on every Ollama route, against the fake Ollama (which records whether
it cut each prompt): a prompt Ollama cut is always flagged, one it evaluated whole never is; where
ContextPaw may change the request (compact, strict) nothing is cut at all; under policy off, where
it may not, a cut it cannot be sure of is said to be possible, never passed over. Only what the
client itself received counts as told (the header, the body, the stream's final record): streamed
policy-off cases on every route, clients that did not ask for usage and one that did, and the
issue's chat whose words alone prove its cut."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import truncation_matrix as matrix
from support.backends import Backend, start_module

SERVER_DEFAULT = 2048
"""The fake's window for requests without num_ctx; ContextPaw is not told (its default is 4096)."""
TRAINED = 2048
"""The model's trained length: the server caps any window there, the client's num_ctx included."""
OVERSIZED = 4 * TRAINED
"""What aider asks for (1.25 x its count + 8192): more than the model was trained for."""


@pytest.fixture(scope="module")
def cutting(workdir: Path) -> Iterator[Backend]:
    args = ["--n-ctx", str(SERVER_DEFAULT), "--train-ctx", str(TRAINED), "--model", "fake"]
    with start_module("support.fake_ollama", args, "/", workdir / "never-silent-ollama.log") as backend:
        yield backend


@pytest.fixture(scope="module")
def outcomes(cutting: Backend, tmp_path_factory: pytest.TempPathFactory) -> list[matrix.Outcome]:
    cases = list(matrix.cases(shapes=("dense", "tools"), sizes=(300, 3000), windows=(None, OVERSIZED))) + list(matrix.told_cases())
    return matrix.measure(cutting.url, "fake", tmp_path_factory.mktemp("never-silent"), cases, [])


def test_no_cut_is_missed_and_no_whole_evaluation_is_flagged(outcomes: list[matrix.Outcome]) -> None:
    assert len(outcomes) >= 384
    assert [o.case for o in outcomes if o.missed] == []
    assert [o.case for o in outcomes if o.false_alarm] == []
    assert sum(o.cut for o in outcomes) > 0, "the matrix must contain cuts to catch"


def test_where_contextpaw_may_change_the_request_nothing_is_cut_or_left_in_doubt(outcomes: list[matrix.Outcome]) -> None:
    acting = [o for o in outcomes if o.case.policy != "off"]
    assert [o.case for o in acting if o.cut or o.warned or o.possible_told] == []
    # every route refuses with a 400, as its own server answers an overlong prompt; strict never
    # compacts: an overflow our estimate did not see is the server's own 400, passed on
    assert all(o.status in (200, 400) for o in acting)


def test_every_route_cold_and_warm_streamed_or_not_was_tried(outcomes: list[matrix.Outcome]) -> None:
    tried = collections.Counter((o.case.route, o.case.cold, o.case.stream) for o in outcomes)
    assert len(tried) == len(matrix.ROUTES) * 2 * 2


def test_cold_v1_requests_are_fitted_to_the_servers_own_default(outcomes: list[matrix.Outcome]) -> None:
    """Cold, ContextPaw would assume 4096; the server uses 2048 for /v1 and must not cut."""
    cold_v1 = [o for o in outcomes if o.case.cold and o.case.route.startswith("/v1") and o.case.policy == "compact"]
    assert cold_v1 and not any(o.cut for o in cold_v1) and all(o.status == 200 for o in cold_v1)


def test_a_cut_is_told_to_the_client_under_every_policy_streamed_or_not(outcomes: list[matrix.Outcome]) -> None:
    """Under policy off a stream's headers are gone before the count arrives: the final record says it."""
    streamed_off = [o for o in outcomes if o.cut and o.case.stream and o.case.policy == "off"]
    assert streamed_off, "the matrix must hold streamed cuts under policy off"
    assert any(o.told for o in streamed_off)
    assert [o.case for o in outcomes if o.cut and not (o.told or o.possible_told)] == []
    # what ContextPaw counted reached the client: a possible cut it counted was told as one
    assert [o.case for o in outcomes if o.warned and not (o.possible_told or o.told)] == []


def test_a_chat_whose_words_alone_exceed_the_window_is_told_as_a_certain_cut_on_every_route(outcomes: list[matrix.Outcome]) -> None:
    """The verdict's floor: 5,800 words cannot fit in 2,048 tokens, whatever the estimate says."""
    floor = [o for o in outcomes if o.case.shape == "notes" and o.case.policy == "off"]
    assert {(o.case.route, o.case.stream) for o in floor} >= {(r, s) for r in matrix.ROUTES for s in (False, True)}
    assert all(o.cut for o in floor) and [o.case for o in floor if not o.told] == []


def test_every_streamed_chat_client_gets_the_usage_it_asked_for_and_no_other(outcomes: list[matrix.Outcome]) -> None:
    asked = [o for o in outcomes if o.case.usage]
    assert asked and [o.case for o in outcomes if o.usage_wrong] == []


def test_a_window_above_the_trained_length_is_fitted_to_what_the_server_uses(outcomes: list[matrix.Outcome]) -> None:
    oversized = [o for o in outcomes if o.case.num_ctx == OVERSIZED]
    assert oversized and not any(o.cut for o in oversized if o.case.policy != "off")
    # under policy off the fake's tokenizer is out of reach: a cut is certain where the count says
    # so (a raw prompt's), and said to be possible where whole messages went (a chat's)
    cut = [o for o in oversized if o.cut]
    assert cut and all(o.told or o.possible_told for o in cut) and any(o.told for o in cut)
