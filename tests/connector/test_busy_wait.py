"""The opt-in cap on vLLM's shared-memory busy-wait, on vLLM's real ``SpinCondition`` over ZMQ."""

from __future__ import annotations

import logging
import time

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast
from vllm.utils.network_utils import get_open_zmq_ipc_path

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.connector import busy_wait
from vllm_ascend_mooncake.connector.busy_wait import (
    BUSY_WAIT_ENV,
    busy_wait_cap_from_env,
    cap_busy_wait,
)


@pytest.fixture
def restore_wait():
    original = shm_broadcast.SpinCondition.wait
    yield
    shm_broadcast.SpinCondition.wait = original


@pytest.fixture
def reader_and_writer():
    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address=address)

    def notified() -> bool:
        if reader.local_notify_socket.poll(50):
            return True
        writer.notify()
        return False

    wait_until(notified, "a notification reaches the reader")  # ZMQ's subscription handshake
    time.sleep(0.05)  # let handshake notifications still in flight arrive, then drop them
    while reader.local_notify_socket.poll(0):
        reader.local_notify_socket.recv()
    writer.notify()
    assert reader.local_notify_socket.poll(5000), "a notification was lost"
    yield reader, writer
    for socket in (reader.local_notify_socket, reader.read_cancel_socket):
        socket.close(linger=0)
    reader.write_cancel_socket.close(linger=0)
    writer.local_notify_socket.close(linger=0)
    context.term()


def notification_pending(reader) -> bool:
    return bool(reader.local_notify_socket.poll(0))


def test_unset_or_empty_leaves_vllm_alone() -> None:
    assert busy_wait_cap_from_env({}) is None
    assert busy_wait_cap_from_env({BUSY_WAIT_ENV: " "}) is None
    assert busy_wait_cap_from_env({BUSY_WAIT_ENV: "0.005"}) == 0.005


@pytest.mark.parametrize("value", ["0", "0.0001", "-1", "nan", "fast"])
def test_values_that_would_stall_vllm_are_refused_with_the_variable_named(value) -> None:
    with pytest.raises(ValueError, match=BUSY_WAIT_ENV):
        busy_wait_cap_from_env({BUSY_WAIT_ENV: value})


def test_a_bad_value_is_logged_and_the_plugin_still_loads(monkeypatch, caplog, restore_wait):
    monkeypatch.setenv(BUSY_WAIT_ENV, "0")
    original = shm_broadcast.SpinCondition.wait
    with caplog.at_level(logging.ERROR):
        busy_wait.apply_from_env()
    assert shm_broadcast.SpinCondition.wait is original
    assert BUSY_WAIT_ENV in caplog.text


def test_without_the_cap_a_recent_reader_spins_past_a_notification(reader_and_writer) -> None:
    reader, _ = reader_and_writer
    reader.record_read()
    reader.wait(timeout_ms=1000)  # vLLM's 1 s window: sched_yield, the notification untouched
    assert notification_pending(reader)


def test_capped_reader_sleeps_on_the_notification_once_idle_longer_than_the_cap(
    reader_and_writer, restore_wait
) -> None:
    reader, writer = reader_and_writer
    assert cap_busy_wait(0.005)  # applies to readers that already exist
    assert cap_busy_wait(0.005)  # idempotent: no wrapper stacked on a wrapper
    assert not hasattr(shm_broadcast.SpinCondition.wait.__wrapped__, "__wrapped__")
    reader.record_read()
    time.sleep(0.02)
    reader.wait(timeout_ms=1000)  # idle past the cap: polls ZMQ and consumes the notification
    assert reader.busy_loop_s == 0.005
    assert not notification_pending(reader)
    started = time.monotonic()
    reader.wait(timeout_ms=300)  # nothing written: it sleeps until the timeout, it does not spin
    assert time.monotonic() - started >= 0.25
    writer.notify()
    assert reader.local_notify_socket.poll(5000), "a notification was lost"
    reader.record_read()
    reader.wait(timeout_ms=1000)  # read moments ago: still spins within the cap, as vLLM does
    assert notification_pending(reader)
