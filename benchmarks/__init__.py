"""Benchmarks (run from the repository root, never by the test suite's timed assertions).

* :mod:`benchmarks.micro`: one component at a time, seconds to minutes
  (``python -m benchmarks.micro.bench_plan --help``);
* :mod:`benchmarks.e2e`: real ``vllm serve`` P/D systems compared end to end
  (``python -m benchmarks.e2e.bench_e2e --help``);
* :mod:`benchmarks.common`: the command-line arguments they share and how they write JSON.
"""
