"""Suite-wide setup: every test (and every engine process a test starts) sees the offline,
loopback-only vLLM environment, whether the suite runs via scripts/test.sh or plain pytest.

It also draws this run's random geometries (tests/e2e/test_random_geometry.py): their seeds are
printed in the session header, and ``--geometry-seed N`` reproduces one."""

from __future__ import annotations

import pytest

from vam_testing.geometry_draw import (
    DRAWS_ENV_VAR,
    SEED_ENV_VAR,
    draw_geometry,
    run_seeds,
)
from vllm_ascend_mooncake.launch.engine_env import apply_engine_env

apply_engine_env()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("random geometry")
    group.addoption(
        "--geometry-seed",
        type=int,
        default=None,
        help=f"run the one random-geometry draw of this seed (or set {SEED_ENV_VAR})",
    )
    group.addoption(
        "--geometry-draws",
        type=int,
        default=None,
        help=f"how many random geometries to draw (or set {DRAWS_ENV_VAR}; default 2)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[GEOMETRY_SEEDS] = run_seeds(
        config.getoption("geometry_seed"), config.getoption("geometry_draws")
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = ["random geometry draws (reproduce one with --geometry-seed N):"]
    lines += [f"  {draw_geometry(seed)}" for seed in config.stash[GEOMETRY_SEEDS]]
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes ``geometry_draw`` runs once per draw, the draw in its id."""
    if "geometry_draw" in metafunc.fixturenames:
        draws = [draw_geometry(seed) for seed in metafunc.config.stash[GEOMETRY_SEEDS]]
        metafunc.parametrize("geometry_draw", draws, ids=str)


GEOMETRY_SEEDS = pytest.StashKey[list[int]]()
