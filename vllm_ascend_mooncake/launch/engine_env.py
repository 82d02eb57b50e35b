"""Environment variables a vLLM CPU engine needs on an offline, loopback-only test machine.

Tests, benchmarks and the demo start real engines; sharing one definition keeps them from
drifting apart (an engine that phones home or reserves a default-sized KV cache hangs or runs out
of memory on a 2-core, 24 GiB CI machine).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping, Sequence

from ..connector.busy_wait import BUSY_WAIT_ENV

#: GiB of KV cache a CPU engine reserves when the caller does not say; vLLM's own default (4 GiB
#: when unset) is too much for several engines side by side on a small machine.
DEFAULT_KVCACHE_SPACE_GIB = 1


def engine_env(
    kvcache_space_gib: int = DEFAULT_KVCACHE_SPACE_GIB, host_ip: str = "127.0.0.1"
) -> dict[str, str]:
    """Return the variables (name -> value) for a vLLM CPU engine that stays on this machine.

    * ``VLLM_HOST_IP``: the address engines advertise to each other (loopback only here);
    * ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``: never try to reach the Hugging Face hub;
    * ``VLLM_NO_USAGE_STATS``/``DO_NOT_TRACK``: no usage reporting;
    * ``VLLM_CPU_KVCACHE_SPACE``: KV-cache size in GiB;
    * ``VLLM_CPU_OMP_THREADS_BIND=nobind``: do not pin OpenMP threads to cores, which fails or
      starves other processes when the machine has fewer cores than vLLM assumes;
    * ``TORCH_COMPILE_DISABLE=1``: even with ``--enforce-eager``, a TP > 1 CPU engine compiles a
      C++ kernel with gcc on its first request (``get_masked_input_and_mask`` is
      ``torch.compile``-decorated) and the first request asking for logprobs compiles another;
      on a loaded 2-core machine that stalled first requests for up to ~100 s. Disabling
      torch.compile removes the stall and changes no output.
    * ``VAM_SHM_BUSY_WAIT_S=0.005``: vLLM's processes busy-wait 1 s for each other after every
      step; with prefill and decode on the same two cores each instance's spinning starves the
      other (decode's inter-token latency was 16x colocated); see :mod:`..connector.busy_wait`.
    * ``OMP_WAIT_POLICY=PASSIVE``: torch's OpenMP threads (GNU libgomp) otherwise spin after
      every parallel region; two instances' spinning teams on the same cores slow each other's
      forward passes (P/D inter-token latency p99 144 -> 46 ms, TTFT p50 at concurrency 2
      403 -> 263 ms on 2 cores); a colocated instance measured no worse for it.
    """
    if kvcache_space_gib <= 0:
        raise ValueError(f"kvcache_space_gib must be positive, got {kvcache_space_gib}")
    return {
        "VLLM_HOST_IP": host_ip,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_space_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TORCH_COMPILE_DISABLE": "1",
        BUSY_WAIT_ENV: "0.005",
        "OMP_WAIT_POLICY": "PASSIVE",
    }


def apply_engine_env(
    environ: MutableMapping[str, str] | None = None,
    *,
    override: bool = False,
    kvcache_space_gib: int = DEFAULT_KVCACHE_SPACE_GIB,
    host_ip: str = "127.0.0.1",
) -> dict[str, str]:
    """Put :func:`engine_env` into ``environ`` (default ``os.environ``) and return what is in force.

    Without ``override`` a variable the user already set wins (``setdefault``), so a developer can
    still, say, give an engine more KV cache from the shell.
    """
    target = os.environ if environ is None else environ
    in_force = {}
    for name, value in engine_env(kvcache_space_gib, host_ip).items():
        if override:
            target[name] = value
        else:
            target.setdefault(name, value)
        in_force[name] = target[name]
    return in_force


#: The allocator vLLM's CPU installation guide has users preload (``LD_PRELOAD``), first found
#: first: gperftools' minimal build (Debian/Ubuntu ``libtcmalloc-minimal4``), then the full one.
TCMALLOC_LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def library_in_cache(ldconfig_output: str, names: Sequence[str]) -> str | None:
    """The path of the first of ``names`` in ``ldconfig -p``'s listing (lines like
    ``libfoo.so.4 (libc6,x86-64) => /lib/x86_64-linux-gnu/libfoo.so.4``), or None."""
    paths: dict[str, str] = {}
    for line in ldconfig_output.splitlines():
        name, arrow, path = line.strip().partition(" => ")
        if arrow:
            paths.setdefault(name.split(" ", 1)[0], path.strip())
    return next((paths[name] for name in names if name in paths), None)


def find_tcmalloc() -> str | None:
    """The tcmalloc library the dynamic linker knows (``ldconfig -p``), or None."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        listing = subprocess.run(
            [ldconfig, "-p"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return library_in_cache(listing, TCMALLOC_LIBRARIES)


def preload_env(library: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{"LD_PRELOAD": ...}`` that loads ``library`` first, keeping what ``environ`` (default
    ``os.environ``) preloads already; for a server's ``extra_env``."""
    inherited = (os.environ if environ is None else environ).get("LD_PRELOAD", "")
    kept = [entry for entry in inherited.replace(" ", ":").split(":") if entry and entry != library]
    return {"LD_PRELOAD": ":".join([library, *kept])}
