"""Start real ``vllm serve`` instances: a CLI wrapper that works with every vLLM distribution
(:mod:`.vllm_cli`) and a small process manager for tests, benchmarks and the demo
(:mod:`.servers`).

Nothing here imports vLLM at module level; the wrapper imports it only when it runs.
"""
