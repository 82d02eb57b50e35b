"""Byte-exact KV pulls over real Mooncake (TCP) between real prefill and decode processes."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
import zlib

import pytest

from vam_testing.datapath_cases import CaseSpec, RequestSpec
from vam_testing.datapath_harness import WorkerProcess
from vllm_ascend_mooncake.launch.ports import free_port_range
from vllm_ascend_mooncake.timeline import PHASES

pytestmark = pytest.mark.mooncake

MAX_PREFILL, MAX_DECODE = 4, 4

CASES = [
    # name, heads, prefill TP, decode TP, layout
    ("merge-hm", 4, 2, 1, "vllm_head_major"),
    ("equal-hm", 4, 2, 2, "vllm_head_major"),
    ("slice-hm", 4, 1, 2, "vllm_head_major"),
    ("merge-tm", 4, 4, 2, "vllm_token_major"),
    ("slice-tm", 4, 1, 4, "vllm_token_major"),
    ("merge-split", 4, 4, 1, "split_kv"),
    ("slice-split", 4, 2, 4, "split_kv"),
    ("prefill-replicas", 2, 4, 1, "vllm_head_major"),
    ("both-replicas", 1, 2, 4, "split_kv"),
    ("decode-replicas", 2, 1, 4, "vllm_token_major"),
    ("mla", 1, 4, 2, "mla"),
    # vllm-ascend MLA: per layer a nope (512) and a rope (64) tensor, each its own latent region
    ("ascend-mla-merge", 1, 2, 1, "ascend_mla"),
    ("ascend-mla-slice", 1, 1, 2, "ascend_mla"),
    ("ascend-mla-2-4", 1, 2, 4, "ascend_mla"),
]


@pytest.fixture(scope="module")
def workers():
    prefill = [WorkerProcess() for _ in range(MAX_PREFILL)]
    decode = [WorkerProcess() for _ in range(MAX_DECODE)]
    yield prefill, decode
    for worker in prefill + decode:
        worker.close()


def make_requests(case: CaseSpec, rng: random.Random, count: int) -> list[RequestSpec]:
    """Contiguous runs, fragmented tables and decode prefix hits, on disjoint decode blocks."""
    cursor = 0
    requests = []
    for i in range(count):
        n = rng.randint(1, 6)
        # style 2: decode already caches a prefix (of 0 to n blocks), it reads only the suffix
        remote, local, cursor = draw_tables(case, rng, i % 3, cursor, (n, n), (0, n))
        requests.append(request_spec(case, rng, i, remote, local))
    return requests


def draw_tables(
    case: CaseSpec,
    rng: random.Random,
    style: int,
    cursor: int,
    counts: tuple[int, int],
    hits: tuple[int, int],
) -> tuple[list[int], list[int], int]:
    """A request's prefill and decode block ids (``counts`` of them), contiguous on both sides
    (``style`` 0), fragmented on both (1), or with a prefix of ``hits`` (bounds) decode blocks
    cached on decode (2), which decode does not read; decode's ids from ``cursor`` on, and the
    cursor past them."""
    prefill_count, decode_count = counts
    if style == 0:
        start = rng.randint(0, case.prefill_blocks - prefill_count)
        remote = list(range(start, start + prefill_count))
        local = list(range(cursor, cursor + decode_count))
        cursor += decode_count
    elif style == 1:
        remote = rng.sample(range(case.prefill_blocks), prefill_count)
        local = rng.sample(range(cursor, cursor + 2 * decode_count), decode_count)
        cursor += 2 * decode_count
    else:
        remote = rng.sample(range(case.prefill_blocks), prefill_count)
        hit = rng.randint(*hits)
        local = list(range(cursor, cursor + decode_count - hit))
        cursor += decode_count - hit
    assert cursor <= case.decode_blocks
    return remote, local, cursor


def request_spec(
    case: CaseSpec, rng: random.Random, i: int, remote: list[int], local: list[int], **fields
) -> RequestSpec:
    """The ``i``-th request of ``case`` (every other one admitted before prefill finished)."""
    return RequestSpec(
        request_id=f"{case.name}-d{i}",
        transfer_id=f"{case.name}-req-{i}-{rng.random()}",
        local_block_ids=tuple(local),
        remote_block_ids=tuple(remote),
        early=i % 2 == 1,
        **fields,
    )


def run_case(workers, case: CaseSpec, requests: list[RequestSpec]):
    prefill, decode = workers
    for rank in range(case.prefill_tp):
        prefill[rank].call("setup_prefill", case, rank)
    for rank in range(case.decode_tp):
        decode[rank].call("setup_decode", case, rank)
    try:
        transfer_ids = [r.transfer_id for r in requests]
        half = len(transfer_ids) // 2
        # Half the requests are held before decode pulls, half only once decode already asks
        # for them (decode's read claims are answered "pending" until then, and read-done
        # notifications of requests with nothing to read arrive before the hold). Odd requests
        # are pulled "early", as when the proxy overlaps the legs: decode learns the prefill
        # block ids from the read lease.
        for rank in range(case.prefill_tp):
            prefill[rank].call("hold", requests[:half])
        for rank in range(case.decode_tp):
            decode[rank].send("pull", requests, 120.0)
        time.sleep(0.3)
        for rank in range(case.prefill_tp):
            prefill[rank].call("hold", requests[half:])
        outcomes = [decode[rank].receive(180) for rank in range(case.decode_tp)]
        finished = [
            prefill[rank].call("collect_finished", transfer_ids, 30.0)
            for rank in range(case.prefill_tp)
        ]
    finally:
        for rank in range(case.prefill_tp):
            prefill[rank].call("teardown")
        for rank in range(case.decode_tp):
            decode[rank].call("teardown")
    return outcomes, finished


def seeded_case(
    name: str, heads: int, prefill_tp: int, decode_tp: int, layout: str, **fields
) -> CaseSpec:
    """A case on free ports, its seed drawn from its name (``hash()`` differs per interpreter
    start)."""
    seed = zlib.crc32(name.encode()) % 1000
    base_port = free_port_range(prefill_tp)
    return CaseSpec(
        name, heads, prefill_tp, decode_tp, layout, seed=seed, base_port=base_port, **fields
    )


@pytest.mark.parametrize("name,heads,prefill_tp,decode_tp,layout", CASES)
def test_pulls_are_byte_exact_and_every_prefill_rank_finishes_once(
    workers, name, heads, prefill_tp, decode_tp, layout
):
    # a few prefill blocks of staging: forces several staging rounds
    case = seeded_case(name, heads, prefill_tp, decode_tp, layout, staging_bytes=3 * 4 * 16 * 64)
    requests = make_requests(case, random.Random(case.seed), 6)
    outcomes, finished = run_case(workers, case, requests)
    for rank, outcome in enumerate(outcomes):
        assert outcome.failed == {}, f"decode rank {rank} failed: {outcome.failed}"
        loads = [r.request_id for r in requests if r.local_block_ids]  # others only release
        assert sorted(outcome.done) == sorted(loads)
        assert outcome.wrong_requests == {}, f"decode rank {rank}: {outcome.wrong_requests}"
        assert outcome.stray_bytes == 0, f"decode rank {rank} wrote outside its blocks"
        # Every loaded request's timeline reached each phase, in order.
        assert sorted(outcome.phases) == sorted(loads)
        assert all(list(p) == list(PHASES) for p in outcome.phases.values()), outcome.phases
    for rank, report in enumerate(finished):
        assert report["counts"] == {r.transfer_id: 1 for r in requests}, f"prefill rank {rank}"
        assert report["expired"] == 0


# Prefill and decode with different block sizes (one divides the other), moved token by token.
MIXED_LAYOUTS = [
    # layout, heads, vLLM CPU packing of head-major chunks
    ("vllm_head_major", 4, "vec"),
    ("vllm_head_major", 4, "amx"),  # bf16 K tiles of 16 tokens, V in pairs of tokens
    ("split_kv", 4, None),
    ("vllm_token_major", 4, None),
    ("mla", 1, None),
]
MIXED_TPS = [(1, 1), (2, 1), (1, 2)]
MIXED_BLOCKS = [(16, 32), (32, 16)]  # (prefill, decode) tokens per block


def make_mixed_requests(case: CaseSpec, rng: random.Random, count: int) -> list[RequestSpec]:
    """Prompts of random lengths (rarely whole blocks) on contiguous and fragmented tables, and
    decode prefix hits (decode reads only the prompt's last decode blocks); each request names
    exactly the prefill blocks its prompt fills, on disjoint decode blocks."""
    bp, bd = case.prefill_tokens_per_block, case.block_size
    cursor = 0
    requests = []
    for i in range(count):
        style = i % 3
        tokens = rng.randint(bd + 1 if style == 2 else 1, 4 * max(bp, bd))
        counts = case.prompt_blocks(tokens)
        # style 2: decode already caches at least one whole block, it reads only the suffix
        hits = (1, counts[1] - 1)
        remote, local, cursor = draw_tables(case, rng, style, cursor, counts, hits)
        requests.append(request_spec(case, rng, i, remote, local, prompt_tokens=tokens))
    return requests


def assert_clean_pulls(case, requests, outcomes, finished) -> None:
    for rank, outcome in enumerate(outcomes):
        assert outcome.failed == {}, f"decode rank {rank} failed: {outcome.failed}"
        loads = [r.request_id for r in requests if r.local_block_ids]
        assert sorted(outcome.done) == sorted(loads)
        assert outcome.wrong_requests == {}, f"decode rank {rank}: {outcome.wrong_requests}"
        assert outcome.stray_bytes == 0, f"decode rank {rank} wrote outside the moved tokens"
    for rank, report in enumerate(finished):
        assert report["counts"] == {r.transfer_id: 1 for r in requests}, f"prefill rank {rank}"
        assert report["expired"] == 0


def mixed_case(
    name: str, heads: int, tps: tuple[int, int], layout: str, blocks: tuple[int, int], **fields
) -> CaseSpec:
    """:func:`seeded_case` with ``blocks`` (prefill's, decode's) tokens per block, staging a few
    prefill blocks at a time (several staging rounds)."""
    prefill_block, decode_block = blocks
    staging = 3 * 4 * 32 * 64
    fields.update(block_size=decode_block, prefill_block_size=prefill_block, staging_bytes=staging)
    return seeded_case(name, heads, *tps, layout, **fields)


@pytest.mark.parametrize("prefill_block,decode_block", MIXED_BLOCKS)
@pytest.mark.parametrize("prefill_tp,decode_tp", MIXED_TPS)
@pytest.mark.parametrize("layout,heads,cpu_packing", MIXED_LAYOUTS)
def test_blocks_of_different_sizes_land_token_by_token_between_processes(
    workers, layout, heads, cpu_packing, prefill_tp, decode_tp, prefill_block, decode_block
):
    """Prefill blocks of 16 tokens into decode blocks of 32 and the reverse: every token the
    pull moves lands in its decode slot (head-major chunks in vLLM CPU's vec and amx packings,
    cut by token through staging), the decode blocks' other slots and the rest of the cache
    keep their bytes, cached decode prefixes are not read, and each prefill rank reports each
    request finished exactly once."""
    name = f"mixed-{layout}-{prefill_tp}-{decode_tp}-{prefill_block}-{decode_block}"
    tps, blocks = (prefill_tp, decode_tp), (prefill_block, decode_block)
    case = mixed_case(name, heads, tps, layout, blocks, cpu_packing=cpu_packing)
    requests = make_mixed_requests(case, random.Random(case.seed), 6)
    assert any(
        r.local_block_ids and len(r.local_block_ids) < case.prompt_blocks(r.num_prompt_tokens)[1]
        for r in requests
    ), "no request with a cached decode prefix"
    outcomes, finished = run_case(workers, case, requests)
    assert_clean_pulls(case, requests, outcomes, finished)


VERIFIED_CASES = [
    # name, heads, prefill TP, decode TP, layout, prefill block, decode block, CPU packing
    ("verified-merge-hm", 4, 2, 1, "vllm_head_major", 16, 16, None),
    ("verified-slice-tm", 4, 1, 2, "vllm_token_major", 16, 16, None),
    ("verified-mla", 1, 4, 2, "mla", 16, 16, None),
    ("verified-mixed-hm", 4, 2, 1, "vllm_head_major", 16, 32, "vec"),
]


@pytest.mark.parametrize(
    "name,heads,prefill_tp,decode_tp,layout,prefill_block,decode_block,cpu_packing",
    VERIFIED_CASES,
)
def test_verified_pulls_over_mooncake_pass_their_checksums(
    workers, name, heads, prefill_tp, decode_tp, layout, prefill_block, decode_block, cpu_packing
):
    """``verify_reads`` over real Mooncake between processes: every batch's landed bytes match
    prefill's checksum (merges, slices, MLA latents, staged rows), so the check never fails a
    right pull; the bytes are also compared with the reference as in every other case."""
    tps, blocks = (prefill_tp, decode_tp), (prefill_block, decode_block)
    case = mixed_case(name, heads, tps, layout, blocks, cpu_packing=cpu_packing, verify_reads=True)
    requests = make_mixed_requests(case, random.Random(case.seed), 6)
    outcomes, finished = run_case(workers, case, requests)
    assert_clean_pulls(case, requests, outcomes, finished)


def slow_read_case(name: str) -> CaseSpec:
    """Prefill TP 2 -> decode TP 1 whose 96-block read takes seconds (about 200,000 tiny
    descriptors), long enough to kill or freeze a prefill worker while decode reads from it."""
    return CaseSpec(
        name=name,
        heads=4,
        prefill_tp=2,
        decode_tp=1,
        layout="vllm_head_major",
        num_layers=4,
        block_size=64,
        head_size=64,
        prefill_blocks=96,
        decode_blocks=100,
        coalesce_runs=False,
        max_descriptor_bytes=128,  # ~200,000 descriptors: the read takes seconds
        base_port=free_port_range(2),
    )


def start_slow_read(
    case: CaseSpec, prefill: list[WorkerProcess], decode: WorkerProcess
) -> tuple[RequestSpec, float]:
    """Set ``case`` up on the workers, hold its 96 blocks on both prefill ranks and send decode's
    pull of them; returns the request and when the pull was sent, 0.3 s into its read."""
    for rank in range(2):
        prefill[rank].call("setup_prefill", case, rank)
    decode.call("setup_decode", case, 0)
    big = RequestSpec("big", "big-transfer", tuple(range(96)), tuple(range(96)))
    for worker in prefill:
        worker.call("hold", [big])
    started = time.monotonic()
    decode.send("pull", [big], 120.0)
    time.sleep(0.3)
    return big, started


def test_prefill_killed_mid_transfer_fails_the_request_and_decode_recovers() -> None:
    """kill -9 a prefill worker while decode reads from it (about 200,000 tiny descriptors keep
    the read in flight for seconds): the request fails within the transport's timeout, no
    byte outside its blocks changes, and decode reads from a restarted worker afterwards."""
    case = slow_read_case("kill-mid-transfer")
    prefill = [WorkerProcess(), WorkerProcess()]
    decode = WorkerProcess()
    try:
        _, started = start_slow_read(case, prefill, decode)
        prefill[1].process.kill()
        outcome = decode.receive(180)
        elapsed = time.monotonic() - started
        assert "big" in outcome.failed, "the read finished before the kill: make it slower"
        assert elapsed < 60, f"the failure took {elapsed:.0f} s to surface"
        assert outcome.stray_bytes == 0

        decode.call("resnapshot")  # the failed request's blocks hold garbage, as reported
        prefill[1] = WorkerProcess()  # restarted worker: same port, new incarnation
        prefill[1].call("setup_prefill", case, 1)
        small = RequestSpec("small", "small-transfer", (97, 98), (5, 6))
        for worker in prefill:
            worker.call("hold", [small])
        after = decode.call("pull", [small], 60.0)
        assert after.done == ["small"] and after.wrong_requests == {} and after.stray_bytes == 0
    finally:
        for worker in [*prefill, decode]:
            worker.close()


@contextlib.contextmanager
def two_prefill_ranks_one_decode(workers, name: str):
    """Prefill TP 2 -> decode TP 1 (4 heads, head-major) set up on the module's workers, torn
    down after: yields (prefill workers, decode worker)."""
    case = CaseSpec(
        name=name,
        heads=4,
        prefill_tp=2,
        decode_tp=1,
        layout="vllm_head_major",
        base_port=free_port_range(2),
    )
    prefill, decode = workers
    for rank in range(2):
        prefill[rank].call("setup_prefill", case, rank)
    decode[0].call("setup_decode", case, 0)
    try:
        yield prefill[:2], decode[0]
    finally:
        for rank in range(2):
            prefill[rank].call("teardown")
        decode[0].call("teardown")


def test_early_pulls_fail_fast_when_prefill_drops_them_or_computed_another_prompt(workers):
    """Decode admitted before prefill finished: a prefill that aborts the request refuses the
    claim at once (rather than after ``prefill_wait_s``), and one that computed a prompt of
    another length refuses too; decode writes nothing either way, and pulls correctly after."""
    dropped = RequestSpec("dropped", "t-dropped", (0, 1), (3, 4), early=True)
    other_prompt = RequestSpec("other", "t-other", (2, 3), (5, 6), early=True)
    fine = RequestSpec("fine", "t-fine", (4, 5), (7, 8), early=True)
    with two_prefill_ranks_one_decode(workers, "early-refusals") as (prefill, decode):
        decode.send("pull", [dropped, other_prompt, fine], 60.0)
        time.sleep(0.3)
        longer = RequestSpec("other", "t-other", (2, 3), (5, 6, 9), early=True)
        for rank in range(2):
            prefill[rank].call("drop", [dropped.transfer_id])
            prefill[rank].call("hold", [longer, fine])
        outcome = decode.receive(120)
        expected = [fine.transfer_id, other_prompt.transfer_id]
        finished = [prefill[rank].call("collect_finished", expected, 30.0) for rank in range(2)]
    assert outcome.done == ["fine"] and outcome.wrong_requests == {}
    assert "prefill failed" in outcome.failed["dropped"]
    assert "prompts differ" in outcome.failed["other"]
    assert outcome.stray_bytes == 0
    for report in finished:  # the refused reader's notice frees the mismatched hold at once
        assert report["counts"] == {"t-fine": 1, "t-other": 1} and report["expired"] == 0


def test_params_naming_blocks_prefill_does_not_hold_for_the_transfer_are_never_read(workers):
    """Serial legs: decode reads only the blocks prefill's grant names for the transfer id.
    Params that name other blocks of the same prefill (a client's own, a stale or a forged
    hand-off) fail the pull before any byte moves; the right params still pull byte-exact."""
    held = RequestSpec("held", "t-held", (0, 1), (3, 4))
    forged = RequestSpec("forged", "t-held", (2, 3), (5, 6))  # same transfer, other blocks
    with two_prefill_ranks_one_decode(workers, "forged-blocks") as (prefill, decode):
        for rank in range(2):
            prefill[rank].call("hold", [held])
        refused = decode.call("pull", [forged], 60.0)
        written = decode.call("bytes_changed")  # in the refused request's own blocks too
        for rank in range(2):
            prefill[rank].call("hold", [RequestSpec("held", "t-held-2", (0, 1), (3, 4))])
        pulled = decode.call("pull", [RequestSpec("held", "t-held-2", (0, 1), (3, 4))], 60.0)
    assert refused.done == [] and refused.stray_bytes == 0 and written == 0
    assert "refusing to read blocks prefill does not hold" in refused.failed["forged"]
    assert refused.failure_kinds == {"forged": "grant_mismatch"}
    assert pulled.done == ["held"] and pulled.wrong_requests == {} and pulled.stray_bytes == 0


def test_a_read_outliving_the_timeout_is_reported_only_once_no_byte_can_land() -> None:
    """A prefill worker frozen mid-read (SIGSTOP) past MC_TRANSFER_TIMEOUT, then thawed: its
    in-flight descriptors land late. The request is reported failed only after they settled
    (no decode byte may change after the report), or, once the peer answers again, loaded
    with the right bytes. Reporting it at the timeout let late bytes land in blocks vLLM had
    already recomputed or reused: wrong tokens."""
    case = slow_read_case("frozen-mid-read")
    timeout_s, thaw_after_s = 5, 12.0  # Mooncake's minimum timeout; thaw after it fired
    saved = os.environ.get("MC_TRANSFER_TIMEOUT")
    os.environ["MC_TRANSFER_TIMEOUT"] = str(timeout_s)
    try:
        prefill = [WorkerProcess(), WorkerProcess()]
        decode = WorkerProcess()
    finally:
        if saved is None:
            os.environ.pop("MC_TRANSFER_TIMEOUT")
        else:
            os.environ["MC_TRANSFER_TIMEOUT"] = saved
    frozen = prefill[1].process.pid
    try:
        _, started = start_slow_read(case, prefill, decode)
        os.kill(frozen, signal.SIGSTOP)
        thaw = threading.Timer(thaw_after_s - 0.3, os.kill, (frozen, signal.SIGCONT))
        thaw.start()
        outcome = decode.receive(180)
        reported_after = time.monotonic() - started
        decode.call("resnapshot")
        thaw.join()
        time.sleep(3)  # late descriptors, if any, land now
        late_bytes = decode.call("bytes_changed")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGCONT)
        for worker in [*prefill, decode]:
            worker.close()
    assert outcome.stray_bytes == 0
    if "big" in outcome.failed:
        assert late_bytes == 0, (
            f"{late_bytes} bytes landed after the read was reported failed at "
            f"{reported_after:.1f} s: {outcome.failed['big']}"
        )
    else:
        assert outcome.done == ["big"] and outcome.wrong_requests == {}
        assert reported_after > thaw_after_s and late_bytes == 0


def test_a_pull_cancelled_while_waiting_for_prefill_gives_up_at_once_and_releases(workers):
    """vLLM aborts a request whose KV is loading (its client left) while prefill has not handed
    off yet: the pull stops waiting at its next ask instead of at ``prefill_wait_s``, reads
    nothing, is reported cancelled (not a transfer failure), and prefill frees the hold it
    registers later at once. Other pulls are untouched."""
    leaving = RequestSpec("leaving", "t-leaving", (0, 1), (3, 4), early=True)
    staying = RequestSpec("staying", "t-staying", (2, 3), (5, 6), early=True)
    with two_prefill_ranks_one_decode(workers, "cancel") as (prefill, decode):
        decode.send("pull", [leaving, staying], 60.0, {"leaving": 0.3})
        time.sleep(3.0)  # prefill still computing both; "leaving" is cancelled meanwhile
        for rank in range(2):
            prefill[rank].call("hold", [staying, leaving])
        outcome = decode.receive(120)
        finished = [
            prefill[rank].call("collect_finished", [s.transfer_id for s in (leaving, staying)], 30)
            for rank in range(2)
        ]
    assert outcome.done == ["staying"] and outcome.wrong_requests == {}
    assert outcome.cancelled == ["leaving"], outcome.failed
    assert outcome.stray_bytes == 0
    for report in finished:  # the cancelled reader's notice frees the later hold at once
        assert report["counts"] == {"t-leaving": 1, "t-staying": 1} and report["expired"] == 0
