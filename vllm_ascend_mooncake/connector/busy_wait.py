"""Opt-in: shorten how long vLLM's processes busy-wait for each other after a step.

vLLM's engine core and its workers talk through a shared-memory ring buffer
(``shm_broadcast.MessageQueue``). A reader that read a message in the last second does not sleep
until the next one: it loops on ``sched_yield`` (``SpinCondition.busy_loop_s``, 1 s, not
configurable in vLLM 0.32). Every vLLM instance on CPU has two such readers (the engine core waits
for the worker, the worker for the engine core), so each instance keeps about two cores busy for a
second after every step it takes.

Colocated, that costs nothing visible. In P/D on hosts where the prefill and decode instances share
cores (CPU deployments, this project's tests), each instance's spinning takes the CPU the other
needs: measured on a 2-core host (TP 1 -> 1, 256-token prompts, 16 tokens), decode's inter-token
latency went from 3.6 ms to 59 ms and P/D time to first token from 78 ms to 221 ms.

Setting ``VAM_SHM_BUSY_WAIT_S`` (seconds, e.g. ``0.005``) caps that busy-wait in every vLLM process
that loads this package's plugin: a reader idle longer than that sleeps on the queue's ZMQ
notification instead (woken within tens of microseconds of the next message). Steps closer together
than the cap still spin exactly as before. Values below 1 ms are refused: with no busy window at all
vLLM 0.32 was seen to lose wake-ups and stall for hundreds of milliseconds per step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..log import get_logger

logger = get_logger(__name__)

#: Environment variable holding the cap, in seconds; unset or empty leaves vLLM as it is.
BUSY_WAIT_ENV = "VAM_SHM_BUSY_WAIT_S"

#: The smallest cap accepted (see the module docstring for why not 0).
MIN_BUSY_WAIT_S = 0.001

_PATCH_MARK = "_vam_busy_wait_cap_s"


def busy_wait_cap_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """The cap requested through :data:`BUSY_WAIT_ENV`, or None when it is unset.

    Raises ``ValueError`` naming the variable when the value is not a number of at least
    :data:`MIN_BUSY_WAIT_S`.
    """
    raw = (os.environ if environ is None else environ).get(BUSY_WAIT_ENV, "").strip()
    if not raw:
        return None
    try:
        cap = float(raw)
    except ValueError:
        raise ValueError(f"{BUSY_WAIT_ENV}={raw!r} is not a number of seconds") from None
    if not cap >= MIN_BUSY_WAIT_S:  # also refuses NaN
        raise ValueError(
            f"{BUSY_WAIT_ENV}={raw!r}: use at least {MIN_BUSY_WAIT_S} s, or unset it to keep "
            f"vLLM's 1 s busy-wait"
        )
    return cap


def cap_busy_wait(cap_s: float) -> bool:
    """Cap ``SpinCondition``'s busy-wait at ``cap_s`` seconds in this process.

    Applies to readers created before and after the call (the cap is enforced when a reader
    waits). Idempotent; the last cap wins. Returns False, with a warning, when this vLLM has no
    ``SpinCondition`` of the expected shape (the setting then does nothing).
    """
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    spin = getattr(shm_broadcast, "SpinCondition", None)
    wait = getattr(spin, "wait", None)
    if spin is None or wait is None:
        logger.warning(
            "%s is set, but this vLLM has no shm_broadcast.SpinCondition.wait; ignored",
            BUSY_WAIT_ENV,
        )
        return False
    original = wait.__wrapped__ if hasattr(wait, _PATCH_MARK) else wait  # re-cap, never stack

    def capped_wait(self, *args, **kwargs):
        if getattr(self, "busy_loop_s", 0) > cap_s:
            self.busy_loop_s = cap_s
        return original(self, *args, **kwargs)

    capped_wait.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(capped_wait, _PATCH_MARK, cap_s)
    capped_wait.__doc__ = original.__doc__
    spin.wait = capped_wait
    return True


def apply_from_env() -> None:
    """Apply :data:`BUSY_WAIT_ENV` if it is set (called by the vLLM plugin in every process).

    A bad value is logged and ignored rather than raised: vLLM would skip the whole plugin, and
    the connector would then be unknown by name.
    """
    try:
        cap = busy_wait_cap_from_env()
    except ValueError as exc:
        logger.error("%s; keeping vLLM's busy-wait as it is", exc)
        return
    if cap is not None and cap_busy_wait(cap):
        logger.debug("vLLM's shared-memory busy-wait capped at %.3f s (%s)", cap, BUSY_WAIT_ENV)
