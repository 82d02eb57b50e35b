"""``python -m vllm_ascend_mooncake.proxy``: the same as the ``vam-proxy`` command."""

from .cli import main

raise SystemExit(main())
