"""Start real ``vllm serve`` instances: a CLI wrapper that works with every vLLM distribution
(:mod:`.vllm_cli`), a small process manager for tests, benchmarks and the demo
(:mod:`.servers`, :mod:`.deployment`), the environment an engine needs on an offline machine
(:mod:`.engine_env`) and the tiny random model the demo serves (:mod:`.tiny_model`).

Nothing here imports vLLM at module level; the wrapper imports it only when it runs.
"""
