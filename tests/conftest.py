"""Suite-wide setup: every test (and every engine process a test starts) sees the offline,
loopback-only vLLM environment, whether the suite runs via scripts/test.sh or plain pytest."""

from vllm_ascend_mooncake.launch.engine_env import apply_engine_env

apply_engine_env()
