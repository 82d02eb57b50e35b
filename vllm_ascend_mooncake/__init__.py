"""vllm-ascend-mooncake: a vLLM KV connector for prefill/decode disaggregation over Mooncake.

The pure planning core (``topology``, ``layout``, ``plan``) imports only numpy, so it can be used
and tested without vLLM or Mooncake. Modules that need the device stacks import them through
``vllm_ascend_mooncake.deps``, which names the extra to install when one is missing.
"""

__version__ = "0.1.0"
