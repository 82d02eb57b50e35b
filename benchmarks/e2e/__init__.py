"""End-to-end P/D latency benchmark: real ``vllm serve`` instances on CPU with the tiny model.

Compares a colocated instance, this package's ``MooncakeHeteroConnector`` and vLLM's in-tree
``MooncakeConnector`` on the same model, TP pair and machine, in one run. Entry point:
``python -m benchmarks.e2e.bench_e2e --help`` (from the repository root).
"""
