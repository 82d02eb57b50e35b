"""Test fixtures shared by the test suite and the benchmarks: the data-path harness, the reference
model of which KV heads live where, the emulated two-host network, and the fake vLLM requests
that drive the connector's scheduler side (``scheduler_fakes``). Nothing outside tests and
benchmarks imports them (what the demo and the launchers need lives in :mod:`..launch`).

They live in the package (not under ``tests/``) so that benchmarks can use them from an installed
copy too. Importing this package needs nothing beyond the standard library; the
heavy libraries are imported by the functions that use them.
"""
