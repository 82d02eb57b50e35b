"""A step's orders reach the worker side when vLLM binds the metadata, before the forward, once.

vLLM 0.32 calls ``start_load_kv`` only after the forward when no load is synchronous, which held
every prefill hold and decode pull back by a whole forward. The worker side here is a recorder,
not the real ConnectorWorker (which needs a registered KV cache and a transfer engine); the E2E
tests run the real one.
"""

from __future__ import annotations

from vllm_ascend_mooncake.connector.facade import MooncakeHeteroConnector, StepMetadata
from vllm_ascend_mooncake.datapath.orders import HoldOrder, StepOrders


class RecordingWorker:
    def __init__(self) -> None:
        self.applied: list[StepOrders] = []

    def start_load_kv(self, orders: StepOrders) -> None:
        self.applied.append(orders)


def worker_side_connector() -> tuple[MooncakeHeteroConnector, RecordingWorker]:
    connector = object.__new__(MooncakeHeteroConnector)  # skips the KV-cache registration path
    connector._connector_metadata = None
    connector._worker = RecordingWorker()
    connector._scheduler = None
    return connector, connector._worker


def test_orders_run_at_bind_and_not_again_after_the_forward() -> None:
    connector, worker = worker_side_connector()
    orders = StepOrders(holds=[HoldOrder("r-1", "t-1", (1, 2), 40)])
    metadata = StepMetadata(orders)
    connector.bind_connector_metadata(metadata)
    assert worker.applied == [orders]  # before the forward
    connector.start_load_kv(forward_context=None)  # vLLM's call after the forward
    assert worker.applied == [orders]
    connector.clear_connector_metadata()

    later = StepMetadata(StepOrders(drops=["t-2"]))
    connector.bind_connector_metadata(later)
    connector.start_load_kv(forward_context=None)
    assert worker.applied == [orders, later.orders]


def test_a_runner_that_never_binds_still_gets_the_orders_once() -> None:
    connector, worker = worker_side_connector()
    metadata = StepMetadata(StepOrders(drops=["t-3"]))
    connector._connector_metadata = metadata  # bound by other means
    connector.start_load_kv(forward_context=None)
    connector.start_load_kv(forward_context=None)
    assert worker.applied == [metadata.orders]
