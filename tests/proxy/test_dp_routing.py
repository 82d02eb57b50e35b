"""Prefill instances with data-parallel engines: the proxy pins each prefill leg to an engine
and tells decode that engine's address.

The pure bookkeeping (:class:`PrefillRanks`) is tested directly; the routing over real loopback
HTTP against a fake prefill API server that fronts several engines the way vLLM does (each with
its own engine id and port, ``X-data-parallel-rank`` selecting one).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fake_vllm import FakeVllm
from loopback_server import StartProxy, serve_on_loopback

from vllm_ascend_mooncake.proxy.prefill_ranks import (
    DP_RANK_HEADER,
    PrefillRanks,
    RankChoice,
    reported_rank,
)

COMPLETIONS = "/v1/completions"
BODY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0.0}
URL = "http://prefill:8000"


def params(rank: int, size: int, engine: str = "engine-p") -> dict:
    return {
        "remote_engine_id": f"{engine}_dp{rank}",
        "remote_request_id": "t",
        "remote_host": "10.0.0.1",
        "remote_port": 5555 + rank,
        "remote_tp_size": 1,
        "remote_block_ids": [1],
        "remote_dp_rank": rank,
        "remote_dp_size": size,
    }


def address(rank: int, engine: str = "engine-p") -> dict:
    p = params(rank, 2, engine)
    return {k: p[k] for k in ("remote_engine_id", "remote_host", "remote_port", "remote_tp_size")}


# --- the bookkeeping -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "size", "reported"),
    [
        (1, 2, (1, 2)),
        (0, 1, (0, 1)),
        (2, 2, None),  # a rank beyond the size
        (-1, 2, None),
        (True, 2, None),  # JSON true is no rank
        (0, 4096, None),  # no API server fronts that many engines
        ("1", 2, None),
        (None, None, None),  # a connector that does not say
    ],
)
def test_reported_rank_accepts_only_a_rank_within_its_size(rank, size, reported) -> None:
    assert reported_rank({"remote_dp_rank": rank, "remote_dp_size": size}) == reported


def test_an_instance_never_heard_from_is_not_pinned() -> None:
    assert PrefillRanks().choose(URL) == RankChoice(None, None)


def test_a_dp1_instance_is_never_pinned_and_keeps_its_address() -> None:
    ranks = PrefillRanks()
    ranks.learn(URL, {**params(0, 1), "remote_engine_id": "engine-p"})
    choice = ranks.choose(URL)
    assert choice.dp_rank is None and choice.address["remote_engine_id"] == "engine-p"
    assert choice.headers({"a": "b"}) == {"a": "b"}


def test_an_unknown_engine_is_chosen_so_that_its_address_is_learned() -> None:
    ranks = PrefillRanks()
    ranks.learn(URL, params(0, 2))
    first = ranks.choose(URL)
    assert first == RankChoice(0, address(0))  # the lowest rank, nothing counted yet
    ranks.started(URL, first)
    ranks.finished(URL, first)
    second = ranks.choose(URL)
    assert second == RankChoice(1, None)  # picked least; no address: serial, pinned
    assert second.headers({}) == {DP_RANK_HEADER: "1"}
    ranks.learn(URL, params(1, 2))
    assert ranks.choose(URL) == RankChoice(1, address(1))


def test_the_engine_with_fewest_legs_in_flight_is_chosen() -> None:
    ranks = PrefillRanks()
    for rank in (0, 1, 2):
        ranks.learn(URL, params(rank, 3))
    busy = ranks.choose(URL)
    ranks.started(URL, busy)
    ranks.started(URL, busy)  # engine 0: two legs in flight
    other = ranks.choose(URL)
    ranks.started(URL, other)
    assert (busy.dp_rank, other.dp_rank, ranks.choose(URL).dp_rank) == (0, 1, 2)
    ranks.finished(URL, busy)
    ranks.finished(URL, busy)
    ranks.finished(URL, busy)  # one too many is ignored, never negative
    assert ranks.choose(URL).dp_rank == 2  # 0 and 2 idle: 2 was picked fewer times
    for _ in range(2):
        ranks.started(URL, RankChoice(2, address(2)))
        ranks.finished(URL, RankChoice(2, address(2)))
    assert ranks.choose(URL).dp_rank == 0  # both idle, both picked twice: the lower rank


def test_a_new_dp_size_or_an_answer_without_address_starts_over() -> None:
    ranks = PrefillRanks()
    ranks.learn(URL, params(0, 2))
    ranks.learn(URL, params(1, 2))
    ranks.learn(URL, params(0, 4))  # restarted with more engines
    assert ranks.engines(URL) == {0: address(0)}
    ranks.learn(URL, {"remote_block_ids": [1]})  # no address: it no longer hands off
    assert ranks.engines(URL) == {}
    ranks.learn(URL, params(1, 2))
    ranks.forget(URL)
    assert ranks.choose(URL) == RankChoice(None, None)


def test_instances_are_kept_apart() -> None:
    ranks = PrefillRanks()
    ranks.learn("http://a", params(1, 2, "engine-a"))
    ranks.learn("http://b", params(0, 2, "engine-b"))
    assert ranks.engines("http://a") == {1: address(1, "engine-a")}
    assert ranks.engines("http://b") == {0: address(0, "engine-b")}


# --- routing over HTTP -----------------------------------------------------------------------


@pytest.fixture
def prefill_dp2() -> Iterator[tuple[FakeVllm, str]]:
    fake = FakeVllm("prefill-dp")
    fake.hands_off_like_the_connector = True
    fake.dp_size = 2
    with serve_on_loopback(fake.app()) as url:
        yield fake, url


@pytest.fixture
def decode() -> Iterator[tuple[FakeVllm, str]]:
    fake = FakeVllm("decode")
    with serve_on_loopback(fake.app()) as url:
        yield fake, url


def pins(fake: FakeVllm) -> list[str | None]:
    return [r.headers.get(DP_RANK_HEADER.lower()) for r in fake.generation_requests()]


def decode_targets(fake: FakeVllm) -> list[tuple[str, int, bool]]:
    """(engine id, port, overlapped) of each decode leg."""
    return [
        (
            r.body["kv_transfer_params"]["remote_engine_id"],
            r.body["kv_transfer_params"]["remote_port"],
            "remote_block_ids" not in r.body["kv_transfer_params"],
        )
        for r in fake.generation_requests()
    ]


def resends(proxy: httpx.Client) -> float:
    for line in proxy.get("/metrics").text.splitlines():
        if line.startswith("vam_proxy_decode_resends_total "):
            return float(line.split()[1])
    raise AssertionError("vam_proxy_decode_resends_total not exported")


def test_overlapped_legs_pin_prefill_to_the_engine_decode_is_told(
    prefill_dp2: tuple[FakeVllm, str], decode: tuple[FakeVllm, str], start_proxy: StartProxy
) -> None:
    """Requests come one at a time, so vLLM alone would give every one to engine 0: the proxy
    learns engine 1 with a pinned serial leg, then overlaps legs on both, each decode leg naming
    the engine that computes its prefill."""
    (prefill, prefill_url), (decoder, decode_url) = prefill_dp2, decode
    proxy = start_proxy([prefill_url], [decode_url])

    for _ in range(5):
        assert proxy.post(COMPLETIONS, json=BODY).status_code == 200

    assert pins(prefill) == [None, "0", "1", "0", "1"]
    assert decode_targets(decoder) == [
        ("engine-prefill-dp_dp0", 5555, False),  # first answer: serial, engine 0 learned
        ("engine-prefill-dp_dp0", 5555, True),
        ("engine-prefill-dp_dp1", 5556, False),  # engine 1 learned, pinned
        ("engine-prefill-dp_dp0", 5555, True),
        ("engine-prefill-dp_dp1", 5556, True),
    ]
    assert resends(proxy) == 0


def test_an_instance_that_ignores_the_pin_gets_the_decode_leg_resent(
    prefill_dp2: tuple[FakeVllm, str], decode: tuple[FakeVllm, str], start_proxy: StartProxy
) -> None:
    """Decode would wait for engine 1 in vain (``prefill_wait_s``) when engine 0 answered: the
    proxy compares the answering engine with the one it named and resends the decode leg."""
    (prefill, prefill_url), (decoder, decode_url) = prefill_dp2, decode
    proxy = start_proxy([prefill_url], [decode_url])
    for _ in range(3):  # both engines learned
        assert proxy.post(COMPLETIONS, json=BODY).status_code == 200
    prefill.ignores_dp_pin = True  # e.g. a router in between that drops the header

    for _ in range(2):
        assert proxy.post(COMPLETIONS, json=BODY).status_code == 200

    assert pins(prefill)[3:] == ["0", "1"]
    assert decode_targets(decoder)[3:] == [
        ("engine-prefill-dp_dp0", 5555, True),  # as told: kept
        ("engine-prefill-dp_dp1", 5556, True),  # told engine 1, engine 0 answered: abandoned
        ("engine-prefill-dp_dp0", 5555, False),  # resent with what engine 0 returned
    ]
    assert resends(proxy) == 1
    assert [report["in_flight"] for report in proxy.get("/ready").json()["decode"]] == [0]


def test_serial_legs_spread_over_the_engines_too(
    prefill_dp2: tuple[FakeVllm, str], decode: tuple[FakeVllm, str], start_proxy: StartProxy
) -> None:
    (prefill, prefill_url), (decoder, decode_url) = prefill_dp2, decode
    proxy = start_proxy([prefill_url], [decode_url], overlap_legs=False)

    for _ in range(4):
        assert proxy.post(COMPLETIONS, json=BODY).status_code == 200

    assert pins(prefill) == [None, "0", "1", "0"]
    assert [target[2] for target in decode_targets(decoder)] == [False] * 4
    assert {target[0] for target in decode_targets(decoder)} == {
        "engine-prefill-dp_dp0",
        "engine-prefill-dp_dp1",
    }
