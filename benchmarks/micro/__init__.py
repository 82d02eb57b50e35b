"""Micro-benchmarks: the planner, the transfer path, the read wait and the scheduler side, each on
its own. Run one with ``python -m benchmarks.micro.<name> --help`` from the repository root."""
