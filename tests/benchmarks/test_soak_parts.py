# -- the report's verdicts ---------------------------------------------------------------------

soak = importlib.import_module("benchmarks.e2e.soak")


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

    report = soak.SoakReport(
        soak.SoakSettings(requests=100),
        None,
        [
            clean_pd(name="colocated", samples=samples({"colocated engine-core": 0.1})),
            clean_pd(
                samples=samples(
                    {"prefill engine-core": 0.3, "prefill api-server": 0.05, "proxy": 0.0}
                )
            ),
        ],
        "/tmp",
    )
    excess = report.excess_over_colocated()
    assert excess == {"prefill": pytest.approx(250.0), "proxy": pytest.approx(-100.0)}
    assert "prefill +250.0" in report.summary()
    assert soak.SoakReport(soak.SoakSettings(), None, [], "/tmp").excess_over_colocated() == {}
