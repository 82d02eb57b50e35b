"""Fast checks of the end-to-end benchmark's pure parts (no vLLM engine is started).

The benchmark itself (``python -m benchmarks.e2e.bench_e2e``) needs minutes of real ``vllm
serve`` instances and is not run here; these tests cover what decides its numbers and verdicts:
percentiles and ratios, the timing of streamed chunks, the summaries and tables, the parsing of
the connectors' transfer metrics, the prompts, the ``transfer_id`` proxy for vLLM's
``MooncakeConnector`` (against a mock transport) and the CPU accelerator shim.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import itertools
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the benchmark lives outside the installed package
    sys.path.insert(0, str(REPO_ROOT))

latency_stats = importlib.import_module("benchmarks.e2e.latency_stats")
sse_timing = importlib.import_module("benchmarks.e2e.sse_timing")
load_generator = importlib.import_module("benchmarks.e2e.load_generator")
report = importlib.import_module("benchmarks.e2e.report")
transfer_logs = importlib.import_module("benchmarks.e2e.transfer_logs")
prompts = importlib.import_module("benchmarks.e2e.prompts")
mooncake_proxy = importlib.import_module("benchmarks.e2e.mooncake_proxy")
systems = importlib.import_module("benchmarks.e2e.systems")
cpu_usage = importlib.import_module("benchmarks.e2e.cpu_usage")

SHIM_FILE = REPO_ROOT / "benchmarks" / "e2e" / "cpu_accelerator_shim" / "sitecustomize.py"


# -- percentiles and ratios --------------------------------------------------------------------


def test_percentile_interpolates_like_numpy_default() -> None:
    samples = [4.0, 1.0, 3.0, 2.0]
    assert latency_stats.percentile(samples, 50) == pytest.approx(2.5)
    assert latency_stats.percentile(samples, 99) == pytest.approx(3.97)
    assert latency_stats.percentile(samples, 0) == 1.0
    assert latency_stats.percentile(samples, 100) == 4.0
    assert latency_stats.percentile([7.0], 99) == 7.0
    assert latency_stats.percentile([], 50) is None
    with pytest.raises(ValueError):
        latency_stats.percentile(samples, 101)


def test_summarize_seconds_reports_milliseconds_and_count() -> None:
    summary = latency_stats.summarize_seconds([0.1, 0.2, 0.3])
    assert summary.count == 3
    assert summary.p50_ms == pytest.approx(200.0)
    assert summary.mean_ms == pytest.approx(200.0)
    empty = latency_stats.summarize_seconds([])
    assert (empty.count, empty.p50_ms, empty.p99_ms) == (0, None, None)


def test_ratio_handles_missing_and_zero() -> None:
    assert latency_stats.ratio(3.0, 2.0) == pytest.approx(1.5)
    assert latency_stats.ratio(None, 2.0) is None
    assert latency_stats.ratio(1.0, None) is None
    assert latency_stats.ratio(1.0, 0.0) is None


# -- streamed chunk timing ---------------------------------------------------------------------


def _chunk(token_ids: list[int] | None, text: str = "x", **extra: Any) -> str:
    choice: dict[str, Any] = {"index": 0, "text": text, **extra}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return "data: " + json.dumps({"choices": [choice]})


def test_sse_parser_times_first_token_and_gaps() -> None:
    parser = sse_timing.SseTimingParser(sent_at_s=10.0)
    lines = [
        (_chunk([5], prompt_token_ids=[1, 2, 3]), 10.5),
        ("", 10.5),
        (": keep-alive comment", 10.6),
        (_chunk([6], text=""), 10.7),  # text held back by the detokenizer still counts
        (_chunk([7, 8]), 11.0),
        ('data: {"choices": [], "usage": {"completion_tokens": 4}}', 11.1),
        ("data: [DONE]", 11.2),
    ]
    for line, arrived in lines:
        parser.feed_line(line, arrived)
    timing = parser.timing
    assert timing.succeeded
    assert timing.token_ids == [5, 6, 7, 8]
    assert timing.ttft_s == pytest.approx(0.5)
    assert timing.inter_token_gaps_s == pytest.approx([0.2, 0.3])
    assert timing.e2e_s == pytest.approx(1.0)
    assert timing.tpot_s == pytest.approx(0.5 / 3)


def test_sse_parser_counts_text_chunks_without_token_ids() -> None:
    parser = sse_timing.SseTimingParser(sent_at_s=0.0)
    parser.feed_line(_chunk(None, text="a"), 1.0)
    parser.feed_line(_chunk(None, text=""), 1.5)  # nothing generated: not a content chunk
    parser.feed_line(_chunk(None, text="b"), 2.0)
    parser.feed_line("data: [DONE]", 2.0)
    assert parser.timing.text == "ab"
    assert parser.timing.ttft_s == 1.0
    assert parser.timing.inter_token_gaps_s == [1.0]


def test_sse_parser_records_errors_and_missing_done() -> None:
    parser = sse_timing.SseTimingParser(sent_at_s=0.0)
    parser.feed_line(_chunk([1]), 1.0)
    parser.feed_line('data: {"error": {"message": "boom", "code": 500}}', 2.0)
    parser.feed_line("data: [DONE]", 2.0)
    assert not parser.timing.succeeded
    assert "boom" in (parser.timing.error or "")

    unfinished = sse_timing.SseTimingParser(sent_at_s=0.0)
    unfinished.feed_line(_chunk([1]), 1.0)
    assert not unfinished.timing.succeeded

    garbled = sse_timing.SseTimingParser(sent_at_s=0.0)
    garbled.feed_line("data: {not json", 1.0)
    assert "unparseable" in (garbled.timing.error or "")


def test_completion_body_is_greedy_fixed_length_and_salted() -> None:
    first = load_generator.completion_body("m", [1, 2], 32)
    second = load_generator.completion_body("m", [1, 2], 32)
    assert first["temperature"] == 0.0
    assert first["ignore_eos"] is True
    assert first["max_tokens"] == 32
    assert first["stream"] is True
    assert first["return_token_ids"] is True
    assert first["prompt"] == [1, 2]
    assert first["cache_salt"] != second["cache_salt"]


# -- summaries, ratios and tables ----------------------------------------------------------------


def _timing(sent: float, chunk_times: list[float], error: str | None = None) -> Any:
    timing = sse_timing.StreamTiming(sent_at_s=sent)
    timing.content_chunk_times_s = list(chunk_times)
    timing.token_ids = list(range(len(chunk_times)))
    timing.done = True
    timing.error = error
    return timing


def _cell(ttfts: list[float], gap: float, tokens: int = 3, failed: int = 0) -> Any:
    timings = [_timing(0.0, [ttft + i * gap for i in range(tokens)]) for ttft in ttfts]
    timings += [_timing(0.0, [], error="HTTP 500: x") for _ in range(failed)]
    return load_generator.CellResult(timings=timings, not_started=0, wall_s=1.0)


def test_summarize_cell_uses_only_complete_requests() -> None:
    result = _cell([0.1, 0.3], gap=0.01, failed=1)
    result.timings.append(_timing(0.0, [0.2, 0.21]))  # two tokens instead of three
    summary = report.summarize_cell("ours", 64, 2, result, max_tokens=3)
    assert (summary.requests, summary.succeeded, summary.failed) == (4, 2, 2)
    assert summary.ttft.p50_ms == pytest.approx(200.0)
    assert summary.itl.count == 4
    assert summary.itl.p50_ms == pytest.approx(10.0)
    assert summary.mean_content_chunks == pytest.approx(3.0)
    assert summary.tpot.p50_ms == pytest.approx(10.0)
    assert summary.first_error == "HTTP 500: x"
    assert len(summary.per_request) == 4
    assert summary.to_dict()["ttft"]["count"] == 2


def test_ratios_target_and_tables() -> None:
    summaries = [
        report.summarize_cell("colocated", 64, 1, _cell([0.1, 0.1], 0.01), 3),
        report.summarize_cell("ours", 64, 1, _cell([0.3, 0.3], 0.02), 3),
        report.summarize_cell("vllm_mooncake", 64, 1, _cell([0.4, 0.4], 0.01), 3),
        report.summarize_cell("colocated", 256, 1, _cell([0.2, 0.2], 0.01), 3),
        report.summarize_cell("ours", 256, 1, _cell([0.6, 0.6], 0.01), 3),
        report.summarize_cell("vllm_mooncake", 256, 1, _cell([0.5, 0.5], 0.01), 3),
    ]
    rows = report.ratio_rows(summaries)
    assert [(row["prompt_len"], row["concurrency"]) for row in rows] == [(64, 1), (256, 1)]
    assert rows[0]["ours/vllm_mooncake:ttft_p50_ms"] == pytest.approx(0.75)
    assert rows[0]["ours/colocated:ttft_p50_ms"] == pytest.approx(3.0)
    assert rows[0]["ours/colocated:itl_p50_ms"] == pytest.approx(2.0)
    assert rows[1]["vllm_mooncake/colocated:ttft_p99_ms"] == pytest.approx(2.5)
    assert rows[0]["ours/vllm_mooncake:tpot_p50_ms"] == pytest.approx(2.0)

    ttft_colocated, ttft_peers, itl = report.targets(summaries)
    assert [cell["ratio"] for cell in ttft_colocated["cells"]] == pytest.approx([3.0, 3.0])
    assert ttft_colocated["met"] is False
    assert [cell["ratio"] for cell in ttft_peers["cells"]] == pytest.approx([0.75, 1.2])
    assert [cell["versus"] for cell in ttft_peers["cells"]] == ["vllm_mooncake"] * 2
    assert [cell["met"] for cell in itl["cells"]] == [False, True]
    assert "TTFT p50 ours/each peer <= 0.5: NOT met" in report.targets_table([ttft_peers])

    table = report.latency_table(summaries)
    assert table.splitlines()[2].split()[:3] == ["64", "1", "colocated"]
    assert "vllm_mooncake" in table
    ratios = report.ratio_table(rows)
    assert "ours/vllm_mooncake" in ratios
    assert "0.75" in ratios


def test_ratios_to_sub_millisecond_latencies_are_omitted() -> None:
    bunched = _cell([0.1], gap=0.0001)  # all chunks arrived in one read
    summaries = [
        report.summarize_cell("ours", 64, 1, _cell([0.2], 0.01), 3),
        report.summarize_cell("vllm_mooncake", 64, 1, bunched, 3),
    ]
    row = report.ratio_rows(summaries)[0]
    assert row["ours/vllm_mooncake:itl_p50_ms"] is None
    assert row["ours/vllm_mooncake:ttft_p50_ms"] == pytest.approx(2.0)


def test_ratio_rows_skip_systems_that_did_not_run() -> None:
    summaries = [report.summarize_cell("ours", 64, 1, _cell([0.3], 0.02), 3)]
    assert report.ratio_rows(summaries) == [{"prompt_len": 64, "concurrency": 1}]
    assert all(not v["cells"] and not v["met"] for v in report.targets(summaries))


# -- transfer metrics in logs ------------------------------------------------------------------


def test_transfer_count_totals_sum_counts_over_lines() -> None:
    log = "\n".join(
        [
            "(APIServer pid=1) INFO 11-30 [metrics.py:103] KV Transfer metrics: Num successful "
            "transfers=2, Avg xfer time (ms)=28.7, Num failed transfers=0, Num failed recvs=0",
            "(APIServer pid=1) INFO 11-30 unrelated line",
            "(APIServer pid=1) INFO 11-30 [metrics.py:103] KV Transfer metrics: Num successful "
            "transfers=3, Avg xfer time (ms)=1.5, Num failed transfers=1, Num failed recvs=0",
            "(EngineCore pid=2) ERROR 11-30 [x.py:1] pulling kv_caches failed",
        ]
    )
    totals = transfer_logs.transfer_count_totals(log)
    assert totals == {
        "Num successful transfers": 5,
        "Num failed transfers": 1,
        "Num failed recvs": 0,
    }
    assert transfer_logs.error_lines(log) == [
        "(EngineCore pid=2) ERROR 11-30 [x.py:1] pulling kv_caches failed"
    ]


def test_mooncake_glog_errors_and_timeouts_are_found() -> None:
    log = "\n".join(
        [
            "E1130 10:45:36.1 123 transfer_metadata.cpp:1098] Local segment descriptor not found",
            "E1130 10:49:47.7 456 tcp_transport_session_impl.h:518] ClientSession: no transfer "
            "progress within 30s; dropping connection",
            "I1130 10:49:47.7 789 transfer_engine_py.cpp:664] Sync batch data transfer timeout "
            "after 30000524350ns",
        ]
    )
    errors = transfer_logs.error_lines(log)
    assert len(errors) == 1 and "no transfer progress" in errors[0]
    assert transfer_logs.mooncake_timeouts(log) == 1


def test_weighted_mean_field_weights_interval_averages_by_count() -> None:
    log = "\n".join(
        [
            "KV Transfer metrics: Num successful pulls=1, Avg pull time (ms)=10.0",
            "KV Transfer metrics: Num successful pulls=3, Avg pull time (ms)=2.0",
            "KV Transfer metrics: Num successful pulls=0, Avg pull time (ms)=0",
            "KV Transfer metrics: Num failed pulls=1",
        ]
    )
    mean = transfer_logs.weighted_mean_field(log, "Num successful pulls", "Avg pull time (ms)")
    assert mean == pytest.approx(4.0)
    assert transfer_logs.weighted_mean_field("", "Num successful pulls", "x") is None


def test_transfer_check_needs_successes_and_no_failures(tmp_path: Path) -> None:
    decode_log = tmp_path / "decode.log"
    prefill_log = tmp_path / "prefill.log"
    decode_log.write_text(
        "KV Transfer metrics: Num successful pulls=4, Num failed pulls=0, Avg pull time (ms)=3\n"
    )
    prefill_log.write_text("nothing here\n")
    keys = ("Num failed pulls", "Num expired releases")
    logs = {"decode": decode_log, "prefill": prefill_log}
    check = systems._check_transfers("Num successful pulls", keys, logs, "Avg pull time (ms)")
    assert check.ok and check.successful_transfers == 4
    assert check.mean_transfer_ms == pytest.approx(3.0)
    prefill_log.write_text("KV Transfer metrics: Num expired releases=1\n")
    assert not systems._check_transfers("Num successful pulls", keys, logs).ok
    decode_log.write_text("")
    prefill_log.write_text("")
    assert not systems._check_transfers("Num successful pulls", keys, logs).ok
    # Counts taken elsewhere (Prometheus) replace the logged ones, which can miss intervals.
    counted = {"Num successful pulls": 5, "Num failed pulls": 0, "Num expired releases": 0}
    check = systems._check_transfers("Num successful pulls", keys, logs, counts=counted)
    assert check.ok and check.successful_transfers == 5
    failed = {**counted, "Num failed pulls": 1}
    assert not systems._check_transfers("Num successful pulls", keys, logs, counts=failed).ok


def test_vllm_mooncake_config_roles() -> None:
    producer = systems.vllm_mooncake_config("kv_producer")
    consumer = systems.vllm_mooncake_config("kv_consumer")
    assert producer["kv_connector"] == "MooncakeConnector"
    assert producer["kv_connector_extra_config"]["mooncake_protocol"] == "tcp"
    assert "kv_load_failure_policy" not in producer
    assert consumer["kv_load_failure_policy"] == "fail"


# -- CPU accounting ----------------------------------------------------------------------------


def test_parse_cpu_seconds_reads_utime_and_stime() -> None:
    # pid (comm with ") " inside) state ppid pgrp session tty tpgid flags 4x faults utime stime
    line = "42 (odd) name) S 1 42 42 0 -1 4194560 10 0 0 0 150 50 0 0 20 0 3 0"
    assert cpu_usage.parse_cpu_seconds(line, ticks_per_s=100) == pytest.approx(2.0)


def test_cpu_seconds_between_counts_new_and_grown_processes() -> None:
    before = {1: 1.0, 2: 5.0}
    after = {1: 1.5, 3: 0.25}  # 2 exited, 3 started
    assert cpu_usage.cpu_seconds_between(before, after) == pytest.approx(0.75)
    own_group = cpu_usage.group_cpu_seconds([os.getpgid(0)])
    assert own_group.get(os.getpid(), -1.0) >= 0.0


# -- prompts -----------------------------------------------------------------------------------


def test_prompts_are_exact_deterministic_and_regular(tmp_path: Path) -> None:
    tokenizer = {
        "added_tokens": [{"id": 0, "content": "<s>"}, {"id": 1, "content": "</s>"}],
        "model": {"vocab": {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "c": 4}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    vocabulary = prompts.regular_token_ids(tmp_path)
    assert vocabulary == [2, 3, 4]
    prompt = prompts.make_prompt(vocabulary, 256, index=3, seed=7)
    assert len(prompt) == 256
    assert set(prompt) <= {2, 3, 4}
    assert prompt == prompts.make_prompt(vocabulary, 256, index=3, seed=7)
    assert prompt != prompts.make_prompt(vocabulary, 256, index=4, seed=7)
    with pytest.raises(ValueError):
        prompts.make_prompt(vocabulary, 0, index=0)


# -- the transfer_id proxy for vLLM's MooncakeConnector ------------------------------------------


def test_leg_bodies_share_transfer_id_and_leave_client_body_alone() -> None:
    client_body = {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 32,
        "max_completion_tokens": 32,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 4,
        "ignore_eos": False,
        "cache_salt": "s",
    }
    original = json.loads(json.dumps(client_body))
    prefill = mooncake_proxy.prefill_leg_body(client_body, "T")
    decode = mooncake_proxy.decode_leg_body(client_body, "T", "http://127.0.0.1:8998", "E")
    assert client_body == original
    assert prefill["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": "T",
    }
    assert (prefill["max_tokens"], prefill["max_completion_tokens"]) == (1, 1)
    assert prefill["stream"] is False
    assert prefill["ignore_eos"] is True
    assert "stream_options" not in prefill and "min_tokens" not in prefill
    assert prefill["cache_salt"] == "s"
    assert decode["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_bootstrap_addr": "http://127.0.0.1:8998",
        "remote_engine_id": "E",
        "transfer_id": "T",
    }
    assert {k: v for k, v in decode.items() if k != "kv_transfer_params"} == original


def test_engine_id_from_bootstrap() -> None:
    answer = {"0": {"engine_id": "E", "worker_addr": {"0": {"0": "tcp://127.0.0.1:1"}}}}
    assert mooncake_proxy.engine_id_from_bootstrap(answer) == "E"
    for bad in ({}, {"0": {}}, [], {"1": {"engine_id": "E"}}):
        with pytest.raises(mooncake_proxy.BootstrapError):
            mooncake_proxy.engine_id_from_bootstrap(bad)


def test_sse_error_event_is_read_as_a_failed_stream() -> None:
    parser = sse_timing.SseTimingParser(sent_at_s=0.0)
    for line in mooncake_proxy.sse_error_event("prefill died").decode().splitlines():
        parser.feed_line(line, 1.0)
    assert parser.timing.done and not parser.timing.succeeded
    assert "prefill died" in (parser.timing.error or "")


class _SlowStream(httpx.AsyncByteStream):
    """An event stream whose first chunk comes only after ``delay_s`` (D waiting for KV)."""

    def __init__(self, chunks: list[bytes], delay_s: float) -> None:
        self.chunks = chunks
        self.delay_s = delay_s

    async def __aiter__(self):  # type: ignore[override]
        await asyncio.sleep(self.delay_s)
        for chunk in self.chunks:
            yield chunk


def _run_proxy_request(prefill_status: int, decode_delay_s: float) -> tuple[bytes, list[Any]]:
    """One streamed request through :class:`MooncakeProxy` with mocked P, D and bootstrap."""
    seen: list[httpx.Request] = []
    decode_chunks = [_chunk([9]).encode() + b"\n\n", b"data: [DONE]\n\n"]

    async def upstreams(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/query":
            return httpx.Response(200, json={"0": {"engine_id": "E", "worker_addr": {}}})
        if request.url.host == "prefill":
            return httpx.Response(prefill_status, json={"choices": [{"text": "x"}]})
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            stream=_SlowStream(decode_chunks, decode_delay_s),
        )

    async def scenario() -> bytes:
        from starlette.requests import Request

        body = json.dumps(load_generator.completion_body("m", [1, 2, 3], 4)).encode()

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        async with httpx.AsyncClient(transport=httpx.MockTransport(upstreams)) as client:
            proxy = mooncake_proxy.MooncakeProxy(
                client, "http://prefill", "http://decode", "http://bootstrap"
            )
            response = await proxy.completions(Request(scope, receive))
            return b"".join([chunk async for chunk in response.body_iterator])

    return asyncio.run(scenario()), seen


def test_proxy_sends_both_legs_under_one_transfer_id() -> None:
    relayed, seen = _run_proxy_request(prefill_status=200, decode_delay_s=0.05)
    assert b"data: [DONE]" in relayed and b'"token_ids": [9]' in relayed
    legs = {request.url.host: request for request in seen if request.url.path != "/query"}
    prefill_params = json.loads(legs["prefill"].content)["kv_transfer_params"]
    decode_params = json.loads(legs["decode"].content)["kv_transfer_params"]
    assert prefill_params["transfer_id"] == decode_params["transfer_id"]
    assert decode_params["remote_engine_id"] == "E"
    assert decode_params["remote_bootstrap_addr"] == "http://bootstrap"
    assert legs["prefill"].headers["X-data-parallel-rank"] == "0"


def test_proxy_ends_stream_with_error_when_prefill_fails_first() -> None:
    relayed, _ = _run_proxy_request(prefill_status=500, decode_delay_s=2.0)
    parser = sse_timing.SseTimingParser(sent_at_s=0.0)
    for line in relayed.decode().splitlines():
        parser.feed_line(line, 0.0)
    assert not parser.timing.succeeded
    assert "prefill answered HTTP 500" in (parser.timing.error or "")


# -- CPU accelerator shim ----------------------------------------------------------------------


def _load_shim(monkeypatch: pytest.MonkeyPatch, flag: str | None, available: bool) -> Any:
    """Import the shim file under a private name with a fake ``torch``; return the fake."""
    accelerator = types.SimpleNamespace(
        is_available=lambda: available, current_device_index=lambda: 7
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(accelerator=accelerator))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    if flag is None:
        monkeypatch.delenv("VAM_BENCH_CPU_ACCELERATOR_SHIM", raising=False)
    else:
        monkeypatch.setenv("VAM_BENCH_CPU_ACCELERATOR_SHIM", flag)
    spec = importlib.util.spec_from_file_location("_bench_shim_under_test", SHIM_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    finders = [finder for finder in sys.meta_path if type(finder).__module__ == module.__name__]
    for finder in finders:
        assert finder.find_spec("some.other.module", None) is None
        assert finder.find_spec(module.PATCHED_MODULE, None) is None
    return accelerator, finders


def test_shim_patches_only_when_enabled_and_no_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    accelerator, finders = _load_shim(monkeypatch, flag="1", available=False)
    assert len(finders) == 1
    assert accelerator.current_device_index() == 0


def test_shim_leaves_real_accelerators_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator, _ = _load_shim(monkeypatch, flag="1", available=True)
    assert accelerator.current_device_index() == 7


def test_shim_is_inert_without_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator, finders = _load_shim(monkeypatch, flag=None, available=False)
    assert finders == []
    assert accelerator.current_device_index() == 7


# -- per-phase means ---------------------------------------------------------------------------

phase_means = importlib.import_module("benchmarks.e2e.phase_means")


def _metrics_server(pages: list[str]):
    """A real HTTP server answering /metrics with the next page of ``pages`` on each GET."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (pages.pop(0) if len(pages) > 1 else pages[0]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _page(grant_sum: float, grant_count: int, ttft_sum: float, ttft_count: int) -> str:
    phase = "vllm:mooncake_hetero_pull_phase_seconds"
    return "\n".join(
        [
            f"# TYPE {phase} histogram",
            f'{phase}_sum{{engine="0",phase="grant_wait"}} {grant_sum}',
            f'{phase}_count{{engine="0",phase="grant_wait"}} {grant_count}',
            f'{phase}_sum{{engine="0",phase="read"}} 0.0',
            f'{phase}_count{{engine="0",phase="read"}} 0.0',
            "# TYPE vllm:time_to_first_token_seconds histogram",
            f'vllm:time_to_first_token_seconds_sum{{engine="0"}} {ttft_sum}',
            f'vllm:time_to_first_token_seconds_count{{engine="0"}} {ttft_count}',
            "",
        ]
    )


def test_phase_means_are_per_cell_differences_of_the_instances_histograms() -> None:
    server = _metrics_server([_page(1.0, 10, 2.0, 10), _page(1.3, 13, 2.6, 13)])
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        before = phase_means.snapshot({"decode": url})
        after = phase_means.snapshot({"decode": url})
    finally:
        server.shutdown()
    means = phase_means.mean_ms(before, after)
    assert means == {
        "decode: pull grant wait": pytest.approx(100.0),
        "decode: arrival to first token": pytest.approx(200.0),
    }  # the read phase saw nothing in this cell: left out
    table = phase_means.phase_means_table([("ours", 256, 1, means), ("colocated", 256, 1, {})])
    assert "ours, prompt 256, concurrency 1:" in table and "colocated" not in table


def test_phase_means_skip_an_instance_that_does_not_answer() -> None:
    assert phase_means.snapshot({"decode": "http://127.0.0.1:9"}, timeout_s=2) == {}


# -- vllm bench serve ----------------------------------------------------------------------------

bench_serve = importlib.import_module("benchmarks.e2e.bench_serve")


def test_bench_serve_records_become_stream_timings() -> None:
    result = {
        "ttfts": [0.05, 0.0, 0.07],
        "itls": [[0.01, 0.02], [], [0.03, 0.01]],
        "output_lens": [3, 0, 3],
        "errors": ["", "HTTP 500: boom", ""],
    }
    first, failed, third = bench_serve.timings_from_result(result)
    assert first.succeeded and first.ttft_s == pytest.approx(0.05)
    assert first.inter_token_gaps_s == pytest.approx([0.01, 0.02])
    assert first.e2e_s == pytest.approx(0.08) and len(first.token_ids) == 3
    assert not failed.succeeded and failed.error == "HTTP 500: boom"
    summary = report.summarize_cell(
        "ours",
        256,
        2,
        load_generator.CellResult([first, failed, third], not_started=0, wall_s=1.0),
        max_tokens=3,
    )
    assert (summary.succeeded, summary.failed) == (2, 1)
    assert summary.ttft.p50_ms == pytest.approx(60.0)
    assert summary.ttft.p25_ms == pytest.approx(55.0) and summary.ttft.p75_ms == pytest.approx(65.0)


def test_bench_serve_command_measures_one_cell_greedy_without_eos() -> None:
    argv = bench_serve.command(
        "http://127.0.0.1:1",
        "/m",
        prompt_len=1024,
        max_tokens=32,
        concurrency=4,
        num_prompts=16,
        seed=7,
        result_path=Path("/tmp/x/r.json"),
    )
    options = dict(itertools.pairwise(argv))
    assert argv[3:5] == ["bench", "serve"]
    assert options["--random-input-len"] == "1024" and options["--random-output-len"] == "32"
    assert options["--max-concurrency"] == "4" and options["--num-prompts"] == "16"
    assert options["--temperature"] == "0" and "--ignore-eos" in argv and "--save-detailed" in argv
    assert options["--result-dir"] == "/tmp/x" and options["--result-filename"] == "r.json"
