"""Fast checks of the soak's pure parts (no engine): the growth fit over the last half, process
roles from command lines, the request mix, the tcmalloc lookup and preload, the PNG.

The soak itself (``python -m benchmarks.e2e.soak``) needs real ``vllm serve`` instances;
``tests/e2e/test_soak.py`` runs a bounded one.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the benchmark lives outside the installed package
    sys.path.insert(0, str(REPO_ROOT))

rss_growth = importlib.import_module("benchmarks.e2e.rss_growth")
soak_load = importlib.import_module("benchmarks.e2e.soak_load")
soak_plot = importlib.import_module("benchmarks.e2e.soak_plot")
soak = importlib.import_module("benchmarks.e2e.soak")
engine_env = importlib.import_module("vllm_ascend_mooncake.launch.engine_env")

RssSample = rss_growth.RssSample


# -- process roles -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cmdline", "role"),
    [
        (
            ["/v/bin/python", "-m", "vllm_ascend_mooncake.launch.vllm_cli", "serve", "/m"],
            "api-server",
        ),
        (["/v/bin/vllm", "serve", "/m", "--port", "8000"], "api-server"),
        (["VLLM::EngineCore"], "engine-core"),
        (["VLLM::EngineCore_DP1"], "engine-core-dp1"),
        (["VLLM::Worker_TP1"], "worker-tp1"),
        (["VLLM::Worker"], "worker"),
        # setproctitle may leave the title padded in the old argument area
        (["VLLM::Worker_TP0          "], "worker-tp0"),
        (["VLLM::APIServer_0"], "api-server-0"),
        (["VLLM::DPCoordinator"], "dp-coordinator"),
        (["/v/bin/python", "-m", "vllm_ascend_mooncake.proxy", "--port", "1"], "proxy"),
        (["/v/bin/python", "-m", "benchmarks.e2e.mooncake_proxy"], "proxy"),
        (["/v/bin/vllm-router", "--port", "1"], "proxy"),
        (
            ["/v/bin/python", "-c", "from multiprocessing.resource_tracker import main;main(7)"],
            "resource-tracker",
        ),
        (["/usr/bin/sleep", "10"], "other"),
        ([], "other"),
    ],
)
def test_process_role_from_cmdline(cmdline: list[str], role: str) -> None:
    assert rss_growth.process_role(cmdline) == role


def test_process_label_names_the_instance_unless_it_is_the_role() -> None:
    assert rss_growth.process_label("prefill", "engine-core") == "prefill engine-core"
    assert rss_growth.process_label("proxy", "proxy") == "proxy"
    assert rss_growth.instance_of("prefill engine-core") == "prefill"
    assert rss_growth.instance_of("proxy") == "proxy"


def test_vm_rss_is_read_from_proc_status_text() -> None:
    status = "Name:\tpython\nVmPeak:\t 9000 kB\nVmRSS:\t  123456 kB\nThreads:\t4\n"
    assert rss_growth.parse_vm_rss_kib(status) == 123456
    assert rss_growth.parse_vm_rss_kib("Name:\tkthreadd\n") is None


# -- the fit -----------------------------------------------------------------------------------


def test_slope_is_least_squares() -> None:
    assert rss_growth.slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx(2.0)
    # noise around a line: the fitted slope, not the end points'
    assert rss_growth.slope([(0, 0.0), (1, 2.0), (2, 0.0), (3, 2.0)]) == pytest.approx(0.4)
    assert rss_growth.slope([(5, 1.0), (5, 2.0)]) is None
    assert rss_growth.slope([]) is None


def test_halves_split_at_half_the_requests_with_the_middle_in_both() -> None:
    points = [(float(x), 0.0) for x in range(0, 101, 10)]
    first, last = rss_growth.halves(points)
    assert [x for x, _ in first] == [0, 10, 20, 30, 40, 50]
    assert [x for x, _ in last] == [50, 60, 70, 80, 90, 100]
    assert rss_growth.halves([]) == ([], [])


def plateau_and_leak(requests: int = 1000, step: int = 50) -> list[RssSample]:
    """A warm-up that plateaus at 100 MiB by request 300, and a leak of 0.2 MiB per request."""
    return [
        RssSample(
            n,
            n / 10,
            {
                "colocated engine-core": 1000 + min(n, 300) / 3,
                "colocated api-server": 600 + 0.2 * n,
            },
        )
        for n in range(0, requests + 1, step)
    ]


def test_a_plateau_grows_in_the_first_half_only_and_a_leak_in_both() -> None:
    rows = {row.process: row for row in rss_growth.growth("colocated", plateau_and_leak())}
    plateau, leak = rows["colocated engine-core"], rows["colocated api-server"]
    assert plateau.first_half_per_1000 > 100
    assert plateau.last_half_per_1000 == pytest.approx(0.0)
    assert leak.first_half_per_1000 == pytest.approx(200.0)
    assert leak.last_half_per_1000 == pytest.approx(200.0)
    assert (plateau.first_mib, plateau.last_mib) == (1000, 1100)
    total = rows["colocated (all)"]
    assert total.last_half_per_1000 == pytest.approx(200.0)
    assert total.first_mib == 1600
    assert rss_growth.instance_growth(rows.values()) == {"colocated": pytest.approx(200.0)}


def test_instance_totals_sum_the_processes_of_each_instance() -> None:
    sample = RssSample(
        10, 1.0, {"prefill api-server": 600, "prefill engine-core": 1700, "proxy": 400}
    )
    (total,) = rss_growth.instance_totals([sample])
    assert total.rss_mib == {"prefill (all)": 2300, "proxy (all)": 400}


def test_a_process_seen_in_few_samples_has_no_fit_but_a_row() -> None:
    samples = [RssSample(0, 0.0, {"decode worker": 10.0}), RssSample(10, 1.0, {})]
    (row, _total) = rss_growth.growth("pd", samples)
    assert row.process == "decode worker"
    assert row.last_half_per_1000 is None
    assert "| pd | decode worker | 10 | 10 | - | - |" in rss_growth.growth_table([row])


# -- the request mix ---------------------------------------------------------------------------


def test_the_mix_is_deterministic_and_in_its_ranges() -> None:
    requests = soak_load.draw_requests(3000, seed=1)
    assert requests == soak_load.draw_requests(3000, seed=1)
    assert requests != soak_load.draw_requests(3000, seed=2)
    assert [r.index for r in requests] == list(range(3000))
    assert {r.max_tokens for r in requests} == set(range(4, 25))
    assert min(r.prompt_tokens for r in requests) == 20
    assert max(r.prompt_tokens for r in requests) == 200
    streamed = sum(r.stream for r in requests) / len(requests)
    prefixed = sum(r.prefix is not None for r in requests) / len(requests)
    assert streamed == pytest.approx(1 / 3, abs=0.03)
    assert prefixed == pytest.approx(0.5, abs=0.03)
    assert {r.prefix for r in requests} == {None, 0, 1, 2, 3}
    later = soak_load.draw_requests(10, seed=1, first_index=2990)
    assert later == requests[2990:]


def test_prompts_are_unique_and_share_only_their_prefix() -> None:
    vocabulary = list(range(100, 5000))
    requests = soak_load.draw_requests(400, seed=0)
    prompts = [soak_load.prompt_ids(r, vocabulary) for r in requests]
    assert len({tuple(p) for p in prompts}) == len(prompts)
    for request, prompt in zip(requests, prompts, strict=True):
        assert len(prompt) == request.prompt_tokens
    same_prefix = [p for r, p in zip(requests, prompts, strict=True) if r.prefix == 2]
    assert len(same_prefix) > 10
    assert len({tuple(p[: soak_load.PREFIX_TOKENS]) for p in same_prefix}) == 1
    assert soak_load.draw_requests(100, shared_prefix_share=0.0)[0].prefix is None


def test_a_body_is_greedy_fixed_length_and_unsalted() -> None:
    request = soak_load.SoakRequest(3, 40, 7, True, None)
    body = soak_load.request_body("m", [1, 2, 3], request)
    assert body["max_tokens"] == 7
    assert body["stream"] is True
    assert body["ignore_eos"] is True
    assert body["temperature"] == 0.0
    assert "cache_salt" not in body  # the prefix cache acts as in production


# -- tcmalloc ----------------------------------------------------------------------------------

LDCONFIG = """\
1234 libs found in cache `/etc/ld.so.cache'
\tlibtcmalloc_minimal_debug.so.4 (libc6,x86-64) => /lib/libtcmalloc_minimal_debug.so.4
\tlibtcmalloc_minimal.so.4 (libc6,x86-64) => /lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
\tlibtcmalloc.so.4 (libc6,x86-64) => /usr/lib/libtcmalloc.so.4
\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6
"""


def test_tcmalloc_is_found_in_ldconfig_output_minimal_first() -> None:
    names = engine_env.TCMALLOC_LIBRARIES
    found = engine_env.library_in_cache(LDCONFIG, names)
    assert found == "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    only_full = "\n".join(line for line in LDCONFIG.splitlines() if "minimal.so" not in line)
    assert engine_env.library_in_cache(only_full, names) == "/usr/lib/libtcmalloc.so.4"
    assert engine_env.library_in_cache("\tlibc.so.6 (libc6) => /lib/libc.so.6\n", names) is None


def test_preload_puts_the_library_first_and_keeps_what_is_preloaded() -> None:
    lib = "/lib/libtcmalloc_minimal.so.4"
    assert engine_env.preload_env(lib, {}) == {"LD_PRELOAD": lib}
    assert engine_env.preload_env(lib, {"LD_PRELOAD": "/a.so /b.so"}) == {
        "LD_PRELOAD": f"{lib}:/a.so:/b.so"
    }
    assert engine_env.preload_env(lib, {"LD_PRELOAD": f"/a.so:{lib}"}) == {
        "LD_PRELOAD": f"{lib}:/a.so"
    }


# -- the PNG -----------------------------------------------------------------------------------


def test_the_curves_are_drawn(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    path = soak_plot.write_png(
        {"colocated": plateau_and_leak(), "pd": plateau_and_leak(600, 6)},
        tmp_path / "soak.png",
        "title",
    )
    from PIL import Image

    with Image.open(path) as image:
        assert image.width == 1100
        assert image.height > 600


def test_ticks_cover_the_range() -> None:
    ticks = soak_plot._ticks(-12.0, 349.0)
    assert ticks[0] <= -12 and ticks[-1] >= 349
    assert len(ticks) <= 8


# -- the report's verdicts ---------------------------------------------------------------------


def clean_pd(**changes) -> object:
    system = soak.SystemSoak(
        "pd",
        status="ok",
        completed=10,
        transfers={"successful": 10, "failed": 0, "expired": 0},
    )
    for name, value in changes.items():
        setattr(system, name, value)
    return system


def test_a_clean_system_has_no_problem_and_each_defect_is_named() -> None:
    assert clean_pd().problems(10, 10) == []
    assert soak.SystemSoak("colocated", status="ok", completed=10).problems(10, 10) == []
    found = {
        "failed": clean_pd(failed_requests=1, first_errors=["HTTP 500"]).problems(10, 10),
        "ended": clean_pd(completed=9).problems(10, 10),
        "dead": clean_pd(dead=["decode"]).problems(10, 10),
        "held": clean_pd(held_kv={"prefill": 0.01}).problems(10, 10),
        "pull": clean_pd(transfers={"successful": 9, "failed": 1, "expired": 0}).problems(10, 10),
        "ranks": clean_pd().problems(10, 20),  # decode TP 2: two pulls per request
        "tcmalloc": clean_pd(without_tcmalloc=["proxy"]).problems(10, 10),
        "start": soak.SystemSoak("pd", status="failed", error="boom").problems(10, 10),
    }
    assert all(found.values()), found
    assert "HTTP 500" in found["failed"][0]
    assert "decode is not alive" in found["dead"][0]
    assert "10 expected" in found["pull"][1]


def test_excess_over_colocated_is_per_pd_instance() -> None:
    def samples(slopes: dict[str, float]) -> list[RssSample]:
        return [
            RssSample(n, 0.0, {label: 100 + slope * n for label, slope in slopes.items()})
            for n in range(0, 101, 10)
        ]

    colocated = clean_pd(name="colocated", samples=samples({"colocated engine-core": 0.1}))
    pd = clean_pd(samples=samples({"prefill engine-core": 0.3, "prefill api-server": 0.05}))
    pd.samples = [
        RssSample(s.requests, s.seconds, {**s.rss_mib, "proxy": 400.0}) for s in pd.samples
    ]
    report = soak.SoakReport(soak.SoakSettings(requests=100), None, [colocated, pd], "/tmp")
    excess = report.excess_over_colocated()
    assert excess == {"prefill": pytest.approx(250.0), "proxy": pytest.approx(-100.0)}
    assert "prefill +250.0" in report.summary()
    assert soak.SoakReport(soak.SoakSettings(), None, [], "/tmp").excess_over_colocated() == {}

    # colocated shrinking (its heap trimmed) is no growth P/D must beat: measured against zero
    trimmed = clean_pd(name="colocated", samples=samples({"colocated engine-core": -0.4}))
    report = soak.SoakReport(soak.SoakSettings(requests=100), None, [trimmed, pd], "/tmp")
    assert report.excess_over_colocated()["prefill"] == pytest.approx(350.0)
