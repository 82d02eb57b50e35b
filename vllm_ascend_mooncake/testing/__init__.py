"""Test fixtures shared by the test suite, the benchmarks and the demo.

They live in the package (not under ``tests/``) so that benchmarks and the demo can use them from
an installed copy too. Importing this package needs nothing beyond the standard library; the
heavy libraries are imported by the functions that use them.
"""
