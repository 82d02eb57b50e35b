"""The per-request timeline: log lines written by each process, joined and split by the benchmark.

No engine is started: records are written through the real :class:`TimelineLog` into a log file,
read back and joined as ``bench_e2e`` does after a run.
"""

from __future__ import annotations

import importlib
import io
import logging
import sys
from pathlib import Path

import pytest

from vllm_ascend_mooncake.timeline import (
    LINE_MARKER,
    PullTimeline,
    TimelineLog,
    parse_timeline_line,
    wall_clock,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
request_timeline = importlib.import_module("benchmarks.e2e.request_timeline")


def _logger(name: str, level: int) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    logger = logging.getLogger(f"test.timeline.{name}")
    logger.handlers[:] = [logging.StreamHandler(stream)]
    logger.setLevel(level)
    logger.propagate = False
    return logger, stream


def test_lines_are_debug_unless_switched_on_and_round_trip() -> None:
    logger, stream = _logger("levels", logging.INFO)
    TimelineLog(logger, environ={}).emit("proxy", "t-1", {"received": 1.0})
    assert stream.getvalue() == ""  # DEBUG by default: an INFO logger writes nothing
    log = TimelineLog(logger, environ={"VAM_TIMELINE_LOG": "1"})
    assert log.enabled
    log.emit("decode", "t-1", {"granted": 2.5, "landed": None}, rank=1)
    line = stream.getvalue().strip()
    assert line.startswith(LINE_MARKER)
    record = parse_timeline_line(f"INFO 12-02 10:00:00 [worker.py:1] {line}")
    assert record == {"source": "decode", "transfer": "t-1", "rank": 1, "stamps": {"granted": 2.5}}
    assert parse_timeline_line("INFO something else") is None
    assert parse_timeline_line(f"{LINE_MARKER}{{not json") is None


def test_pull_timeline_wall_stamps_keep_the_gaps() -> None:
    pull = PullTimeline(submitted=100.0, granted=100.25, first_read=100.5, landed=101.0)
    stamps = pull.wall_stamps()
    assert stamps["fixed_up"] is None and stamps["reported"] is None
    assert stamps["landed"] - stamps["submitted"] == pytest.approx(1.0)
    assert wall_clock(100.0) == pytest.approx(stamps["submitted"])


def _write(path: Path, records: list[tuple[str, str, dict, dict]]) -> None:
    logger, stream = _logger(path.stem, logging.INFO)
    log = TimelineLog(logger, environ={"VAM_TIMELINE_LOG": "1"})
    for source, transfer, stamps, fields in records:
        log.emit(source, transfer, stamps, **fields)
    path.write_text("some vLLM line\n" + stream.getvalue())


def _overlapped_request(tmp_path: Path, transfer: str, t0: float) -> None:
    _write(
        tmp_path / f"proxy-{transfer}.log",
        [("proxy", transfer, {"received": t0, "first_chunk": t0 + 0.100}, {"mode": "overlapped"})],
    )
    _write(
        tmp_path / f"prefill-{transfer}.log",
        [
            # two prefill ranks: the later hold is the one the request waits for
            (
                "prefill",
                transfer,
                {"scheduled": t0 + 0.005, "finished": t0 + 0.040, "held": t0 + 0.041},
                {"rank": 0},
            ),
            (
                "prefill",
                transfer,
                {"scheduled": t0 + 0.005, "finished": t0 + 0.040, "held": t0 + 0.043},
                {"rank": 1},
            ),
        ],
    )
    _write(
        tmp_path / f"decode-{transfer}.log",
        [
            # submitted long before prefill finished: off the critical path
            (
                "decode",
                transfer,
                {
                    "submitted": t0 + 0.010,
                    "granted": t0 + 0.045,
                    "landed": t0 + 0.050,
                    "fixed_up": t0 + 0.051,
                    "reported": t0 + 0.055,
                },
                {"rank": 0},
            ),
            (
                "decode_scheduler",
                transfer,
                {"admitted": t0 + 0.008, "load_reported": t0 + 0.060, "first_step": t0 + 0.062},
                {},
            ),
        ],
    )


def test_segments_follow_the_critical_path_and_add_up_to_the_proxy_ttft(tmp_path: Path) -> None:
    _overlapped_request(tmp_path, "t-a", 1000.0)
    joined = request_timeline.join(request_timeline.read_records(sorted(tmp_path.glob("*.log"))))
    split = request_timeline.segments(joined["t-a"])
    assert split is not None
    assert sum(split.values()) == pytest.approx(0.100)
    assert split["prefill computing"] == pytest.approx(0.035)
    assert split["prefill hold registered"] == pytest.approx(0.003)  # the slower rank
    assert split["lease granted to decode"] == pytest.approx(0.002)
    assert split["first token to proxy"] == pytest.approx(0.038)
    assert "decode admits" not in split  # overlapped: admission is off the path


def test_serial_path_counts_the_second_leg(tmp_path: Path) -> None:
    t0 = 50.0
    _write(
        tmp_path / "all.log",
        [
            (
                "proxy",
                "t-s",
                {"received": t0, "prefill_answered": t0 + 0.050, "first_chunk": t0 + 0.120},
                {"mode": "serial"},
            ),
            (
                "prefill",
                "t-s",
                {"scheduled": t0 + 0.002, "finished": t0 + 0.040, "held": t0 + 0.041},
                {"rank": 0},
            ),
            (
                "decode_scheduler",
                "t-s",
                {"admitted": t0 + 0.060, "load_reported": t0 + 0.090, "first_step": t0 + 0.095},
                {},
            ),
            (
                "decode",
                "t-s",
                {
                    "submitted": t0 + 0.065,
                    "granted": t0 + 0.070,
                    "landed": t0 + 0.075,
                    "fixed_up": t0 + 0.075,
                    "reported": t0 + 0.085,
                },
                {"rank": 0},
            ),
        ],
    )
    joined = request_timeline.join(request_timeline.read_records([tmp_path / "all.log"]))
    split = request_timeline.segments(joined["t-s"])
    assert split["prefill answer to proxy"] == pytest.approx(0.009)
    assert split["decode admits"] == pytest.approx(0.010)
    assert sum(split.values()) == pytest.approx(0.120)


def test_cells_take_the_requests_received_in_their_window(tmp_path: Path) -> None:
    _overlapped_request(tmp_path, "t-1", 1000.0)
    _overlapped_request(tmp_path, "t-2", 1001.0)
    _overlapped_request(tmp_path, "t-3", 2000.0)
    # a request whose decode lines are missing is counted, not joined
    _write(
        tmp_path / "lonely.log",
        [("proxy", "t-4", {"received": 1000.5, "first_chunk": 1000.6}, {"mode": "overlapped"})],
    )
    joined = request_timeline.join(request_timeline.read_records(sorted(tmp_path.glob("*.log"))))
    cell = request_timeline.cell_timeline(joined, 999.0, 1500.0)
    assert (cell.requests, cell.unjoined) == (2, 1)
    assert sum(cell.mean_ms.values()) == pytest.approx(100.0)
    assert cell.ttft_p50_ms == pytest.approx(100.0)
    assert request_timeline.cell_timeline(joined, 3000.0, 4000.0) is None
    table = request_timeline.breakdown_table([("ours", 256, 1, cell)])
    assert "prefill computing" in table and "2/3" in table
    png = request_timeline.write_png([("ours", 256, 1, cell)], tmp_path / "out" / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_continued_request_splits_its_first_token_and_its_hand_off_to_decode(
    tmp_path: Path,
) -> None:
    """The first token comes from prefill: its path ends at prefill's answer; the hand-off to
    decode (the gap to the second token) is split on its own."""
    t0 = 70.0
    proxy_stamps = {
        "received": t0,
        "prefill_answered": t0 + 0.030,
        "first_chunk": t0 + 0.031,
        "decode_first_chunk": t0 + 0.061,
    }
    _write(
        tmp_path / "all.log",
        [
            ("proxy", "t-c", proxy_stamps, {"mode": "continued"}),
            ("prefill", "t-c", {"scheduled": t0 + 0.002, "finished": t0 + 0.025}, {"rank": 0}),
            (
                "decode_scheduler",
                "t-c",
                {"admitted": t0 + 0.035, "load_reported": t0 + 0.050, "first_step": t0 + 0.052},
                {},
            ),
            (
                "decode",
                "t-c",
                {
                    "submitted": t0 + 0.037,
                    "granted": t0 + 0.040,
                    "landed": t0 + 0.044,
                    "fixed_up": t0 + 0.044,
                    "reported": t0 + 0.048,
                },
                {"rank": 0},
            ),
        ],
    )
    joined = request_timeline.join(request_timeline.read_records([tmp_path / "all.log"]))
    split = request_timeline.segments(joined["t-c"])
    assert split["prefill answer to proxy"] == pytest.approx(0.005)
    assert split["prefill's token to client"] == pytest.approx(0.001)
    assert sum(split.values()) == pytest.approx(0.031)
    cell = request_timeline.cell_timeline(joined, t0 - 1, t0 + 1)
    assert cell.handoffs == 1
    assert cell.handoff_ms["decode admits"] == pytest.approx(4.0)
    assert cell.handoff_ms["decode's token to client"] == pytest.approx(9.0)
    assert sum(cell.handoff_ms.values()) == pytest.approx(30.0)
    table = request_timeline.handoff_table([("ours", 256, 1, cell)])
    assert "first-to-second token gap" in table and "30.0" in table
