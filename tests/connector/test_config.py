"""Connector configuration: validated key by key against the running engine."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from vllm_ascend_mooncake.connector.config import draft_model_kv_heads, parse_config
from vllm_ascend_mooncake.handoff import SECRET_ENV
from vllm_ascend_mooncake.options import ConnectorConfigError


def config(**overrides):
    args = dict(
        kv_role="kv_consumer",
        engine_id="e",
        extra={"prefill": {"tp_size": 2}, "decode": {"tp_size": 1}},
        local_tp=1,
        local_dp=1,
        num_kv_heads=4,
        is_mla=False,
        block_size=32,
        device_type="cpu",
    )
    args.update(overrides)
    return parse_config(**args)


def test_defaults_and_topology() -> None:
    cfg = config()
    assert cfg.role == "consumer" and cfg.protocol == "tcp" and cfg.coalesce_runs
    assert cfg.topology().pulls_per_decode_rank == 2
    assert cfg.side_channel_base_port(dp_rank=1) == cfg.side_channel_port + 2


def test_a_draft_models_own_kv_heads_are_a_head_group_of_the_topology() -> None:
    """EAGLE's 2 KV heads beside the model's 4: the topology plans both groups; a draft of the
    model's count, or none, leaves one group."""
    assert [g.num_kv_heads for g in config(draft_kv_heads=2).topology().head_groups] == [4, 2]
    assert len(config(draft_kv_heads=4).topology().head_groups) == 1
    assert len(config().topology().head_groups) == 1


def test_a_draft_group_the_tp_sizes_cannot_shard_is_refused_at_start_up() -> None:
    with pytest.raises(ConnectorConfigError, match=r"draft \(EAGLE/MTP\) layers' 3 KV heads"):
        config(draft_kv_heads=3)


def test_the_draft_models_kv_heads_come_from_its_config() -> None:
    draft = SimpleNamespace(get_total_num_kv_heads=lambda: 2)
    with_draft = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=draft))
    assert draft_model_kv_heads(with_draft) == 2
    ngram = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=None))
    assert draft_model_kv_heads(ngram) == 0
    assert draft_model_kv_heads(SimpleNamespace(speculative_config=None)) == 0


def test_reads_poll_over_tcp_and_keep_mooncakes_wait_elsewhere() -> None:
    assert config().read_wait == "poll"
    assert config(extra={"protocol": "rdma"}).read_wait == "sync"
    assert config(extra={"protocol": "ascend", "read_wait": "poll"}).read_wait == "poll"


def test_idle_step_wait_defaults_to_10_ms_and_must_be_positive() -> None:
    assert config().idle_step_wait_ms == 10.0
    assert config(extra={"idle_step_wait_ms": 50}).idle_step_wait_ms == 50.0
    with pytest.raises(ConnectorConfigError, match="idle_step_wait_ms"):
        config(extra={"idle_step_wait_ms": 0})


def test_missing_sides_default_to_the_local_tp() -> None:
    cfg = config(extra={}, local_tp=2, kv_role="kv_producer")
    assert cfg.prefill.tp_size == cfg.decode.tp_size == 2


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"extra": {"prefil": {}}}, r"unknown kv_connector_extra_config key\(s\) \['prefil'\]"),
        ({"kv_role": "kv_both"}, "kv_role 'kv_both' is not supported"),
        (
            {"local_tp": 2},
            "runs tensor parallel size 2, but kv_connector_extra_config\\['decode'\\]",
        ),
        ({"extra": {"prefill": {"tp_size": 3}}}, "cannot pair these instances: prefill TP 3"),
        ({"extra": {"release_timeout_s": "soon"}}, "'release_timeout_s'\\] must be float"),
        ({"extra": {"max_descriptors_per_batch": 0}}, "must be > 0"),
        ({"extra": {"protocol": "carrier-pigeon"}}, "not a Mooncake transport"),
        ({"extra": {"coalesce_runs": 1}}, "must be bool"),
        ({"extra": {"read_wait": "spin"}}, "'read_wait'\\] must be one of poll, sync"),
        ({"extra": {"side_channel_port": 65535, "prefill": {"tp_size": 2}}}, "leaves no room"),
        ({"local_pp": 2}, "pipeline parallelism"),
        ({"extra": {"side_channel_secret": "short"}}, "at least 16 characters, got 5"),
        ({"engine_id": "e" * 257}, "engine_id must have 1 to 256 characters"),
    ],
)
def test_bad_settings_name_the_key(overrides, message) -> None:
    with pytest.raises(ConnectorConfigError, match=message):
        config(**overrides)


def test_the_side_channel_secret_comes_from_the_config_or_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert config().side_channel_secret is None
    monkeypatch.setenv(SECRET_ENV, "from the environment")
    assert config().side_channel_secret == b"from the environment"
    explicit = config(extra={"side_channel_secret": "from the config file"})
    assert explicit.side_channel_secret == b"from the config file"
    assert "from the" not in repr(explicit)  # never in a log line


def test_the_advertised_address_is_vllm_host_ip_else_the_hosts_own(monkeypatch) -> None:
    from vllm_ascend_mooncake.connector import config as config_module

    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    assert config().side_channel_host == "10.1.2.3"
    monkeypatch.delenv("VLLM_HOST_IP")
    # vLLM's own choice for the host (here stubbed: the real one asks the routing table)
    monkeypatch.setattr("vllm.utils.network_utils.get_ip", lambda: "192.0.2.7")
    assert config_module.default_host() == "192.0.2.7"
    assert config(extra={"side_channel_host": "127.0.0.1"}).side_channel_host == "127.0.0.1"


@pytest.mark.parametrize(
    "host,loopback",
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("localhost", True),
        ("10.0.0.1", False),
        ("prefill-0.example", False),
        ("fe80::1", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool) -> None:
    from vllm_ascend_mooncake.connector.config import is_loopback

    assert is_loopback(host) is loopback


# -- keys of vllm-ascend's MooncakeConnectorV1 and vLLM's MooncakeConnector ----------------------


@pytest.fixture
def config_log(caplog):
    """Records of the config and migration modules' loggers (vLLM's loggers do not propagate
    to the root)."""
    import logging

    from vllm_ascend_mooncake.connector import config as config_module
    from vllm_ascend_mooncake.connector import migration

    loggers = (config_module._log(), migration._log())
    for logger in loggers:
        logger.addHandler(caplog.handler)
        caplog.set_level(logging.INFO, logger=logger.name)
    yield caplog
    for logger in loggers:
        logger.removeHandler(caplog.handler)


def with_sizes(**keys):
    return {"prefill": {"tp_size": 2}, "decode": {"tp_size": 1}, **keys}


@pytest.mark.parametrize(
    "old,ours,expected",
    [
        ({"mooncake_protocol": "rdma"}, "protocol", "rdma"),
        ({"use_ascend_direct": True}, "protocol", "ascend"),
        ({"kv_port": 36000}, "side_channel_port", 36000),
        ({"kv_port": "36000"}, "side_channel_port", 36000),  # vllm-ascend's guides write strings
    ],
)
def test_keys_of_other_connectors_are_read_under_our_name(config_log, old, ours, expected) -> None:
    cfg = config(extra=with_sizes(**old))
    assert getattr(cfg, ours) == expected
    assert set(old).isdisjoint(cfg.extra)
    (key,) = old
    warning = next(r.getMessage() for r in config_log.records if key in r.getMessage())
    assert "write that instead" in warning and f"kv_connector_extra_config[{ours!r}]" in warning


def test_vllms_kv_port_field_is_read_as_the_side_channel_port(config_log) -> None:
    cfg = config(kv_port=36000)
    assert cfg.side_channel_port == 36000 and cfg.side_channel_base_port(dp_rank=1) == 36002
    assert any("kv_transfer_config.kv_port" in r.getMessage() for r in config_log.records)
    assert config(kv_port=None).side_channel_port == 36100


def test_kv_port_is_read_only_when_it_differs_from_vllms_default() -> None:
    from vllm.config import KVTransferConfig

    from vllm_ascend_mooncake.connector.migration import VLLM_DEFAULT_KV_PORT, explicit_kv_port

    def transfer(**fields):
        return KVTransferConfig(
            kv_connector="MooncakeHeteroConnector", kv_role="kv_producer", **fields
        )

    assert transfer().kv_port == VLLM_DEFAULT_KV_PORT  # pinned to the installed vLLM
    assert explicit_kv_port(transfer()) is None
    assert explicit_kv_port(transfer(kv_port=36000)) == 36000
    assert explicit_kv_port(object()) is None


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            {"extra": with_sizes(mooncake_protocol="rdma", protocol="tcp")},
            r"\['mooncake_protocol'\] \(vLLM's MooncakeConnector\) = 'rdma' set the same thing "
            r"differently: keep only kv_connector_extra_config\['protocol'\]",
        ),
        (
            {"extra": with_sizes(use_ascend_direct=True, protocol="tcp")},
            r"\['protocol'\] = 'tcp' and .*\['use_ascend_direct'\].* = 'ascend' set the same",
        ),
        (
            {"extra": with_sizes(kv_port=36000, side_channel_port=36100)},
            r"\['side_channel_port'\] = 36100 and .*\['kv_port'\].* = 36000 set the same thing",
        ),
        (
            {"extra": with_sizes(side_channel_port=36100), "kv_port": 36000},
            r"kv_transfer_config.kv_port \(vllm-ascend's MooncakeConnectorV1\) = 36000 set",
        ),
        (
            {"extra": with_sizes(kv_port=36200), "kv_port": 36000},
            r"\['kv_port'\].* = 36200 and kv_transfer_config.kv_port .* = 36000 set the same",
        ),
    ],
)
def test_old_and_new_spellings_that_disagree_are_refused(overrides, message) -> None:
    with pytest.raises(ConnectorConfigError, match=message):
        config(**overrides)


def test_old_and_new_spellings_that_agree_are_accepted(config_log) -> None:
    cfg = config(
        extra=with_sizes(mooncake_protocol="tcp", protocol="tcp", kv_port=36000), kv_port=36000
    )
    assert cfg.protocol == "tcp" and cfg.side_channel_port == 36000
    cfg = config(extra=with_sizes(use_ascend_direct=True, protocol="ascend"))
    assert cfg.protocol == "ascend"


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"num_workers": 10}, r"'num_workers': .*decode readers are receiver_threads"),
        (
            {"bootstrap_server_address": "p:8998"},
            r"'bootstrap_server_address': .*from the kv_transfer_params the proxy forwards",
        ),
        ({"tls_config": {}}, r"'tls_config': .*has no metaserver"),
        ({"use_ascend_direct": False}, r"legacy HCCL .*no equivalent.*Remove the key"),
        ({"use_ascend_direct": "yes"}, r"\['use_ascend_direct'\].* must be bool"),
        ({"mooncake_protocol": 1}, r"\['mooncake_protocol'\].* must be str"),
        ({"kv_port": "port"}, r"\['kv_port'\].* must be a port number"),
        ({"kv_port": 65535}, "side_channel_port 65535 leaves no room"),
    ],
)
def test_keys_without_an_equivalent_are_refused_naming_what_to_do(extra, message) -> None:
    with pytest.raises(ConnectorConfigError, match=message):
        config(extra=with_sizes(**extra))


def test_vllm_ascends_pipeline_size_1_is_accepted_and_real_pp_refused(config_log) -> None:
    cfg = config(
        extra={
            "prefill": {"tp_size": 2, "dp_size": 1, "pp_size": 1},
            "decode": {"tp_size": 1, "pp_size": 1},
        }
    )
    assert cfg.prefill.tp_size == 2 and cfg.decode.tp_size == 1
    assert any("can be removed" in r.getMessage() for r in config_log.records)
    for prefill in ({"tp_size": 2, "pp_size": 2}, {"tp_size": 2, "pp_layer_partition": "14,14"}):
        with pytest.raises(ConnectorConfigError, match="pipeline parallel size 1 only"):
            config(extra={"prefill": prefill, "decode": {"tp_size": 1}})


def test_vllm_ascends_a5_endpoint_path_passes_through() -> None:
    assert config(extra=with_sizes(ascend_local_comm_res_path="/etc/ub")).protocol == "tcp"
    with pytest.raises(ConnectorConfigError, match="ascend_local_comm_res_path"):
        config(extra=with_sizes(ascend_local_comm_res_path=1))


def test_other_connectors_environment_is_named_as_unused(config_log, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "480")
    config()
    assert any(
        "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT" in r.getMessage()
        and "release_timeout_s" in r.getMessage()
        for r in config_log.records
    )


def test_config_from_vllm_reads_an_explicit_kv_port() -> None:
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig

    from vllm_ascend_mooncake.connector.config import config_from_vllm

    def vllm_config(**transfer_fields):
        return SimpleNamespace(
            kv_transfer_config=KVTransferConfig(
                kv_connector="MooncakeHeteroConnector",
                kv_role="kv_producer",
                engine_id="p",
                kv_connector_extra_config={"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}},
                **transfer_fields,
            ),
            parallel_config=SimpleNamespace(
                tensor_parallel_size=1,
                data_parallel_size=1,
                pipeline_parallel_size=1,
                data_parallel_rank=0,
            ),
            model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2, use_mla=False),
            cache_config=SimpleNamespace(block_size=32),
        )

    assert config_from_vllm(vllm_config(kv_port=36000)).side_channel_port == 36000
    assert config_from_vllm(vllm_config()).side_channel_port == 36100


@pytest.mark.parametrize(
    ("settings", "position"),
    [
        ({}, (0, 1)),
        ({"data_parallel_size": 2, "data_parallel_rank": 1}, (1, 2)),  # one API server for all
        (  # one API server per node: it numbers its own engines from 0
            {
                "data_parallel_size": 4,
                "data_parallel_size_local": 2,
                "data_parallel_rank": 3,
                "data_parallel_rank_local": 1,
                "data_parallel_hybrid_lb": True,
            },
            (1, 2),
        ),
        (  # one API server per engine: nothing to pin
            {
                "data_parallel_size": 4,
                "data_parallel_size_local": 1,
                "data_parallel_rank": 2,
                "data_parallel_rank_local": 0,
                "data_parallel_external_lb": True,
            },
            (0, 1),
        ),
    ],
)
def test_server_dp_position_numbers_engines_as_the_api_server_does(settings, position) -> None:
    """What prefill reports as ``remote_dp_rank`` / ``remote_dp_size``: the index vLLM's
    ``X-data-parallel-rank`` header selects among the engines behind that API server."""
    from vllm.config import ParallelConfig

    from vllm_ascend_mooncake.connector.config import server_dp_position

    assert server_dp_position(ParallelConfig(**settings)) == position


def test_a_dense_models_engines_keep_their_rank_and_the_declared_size() -> None:
    """vLLM runs each DP engine of a dense model as DP 1, rank 0; only data_parallel_index
    keeps the rank. The connector must still give engine 1 its own side-channel ports."""
    from vllm.config import ParallelConfig

    from vllm_ascend_mooncake.connector.config import server_dp_position
    from vllm_ascend_mooncake.connector.vllm_compat import data_parallel_index

    parallel = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    parallel.reconfigure_for_independent_dp_rank()  # what vLLM's engine core does
    assert (parallel.data_parallel_rank, parallel.data_parallel_size) == (0, 1)
    assert data_parallel_index(parallel) == 1
    assert server_dp_position(parallel, declared_dp_size=2) == (1, 2)
    engine_1 = config(
        kv_role="kv_producer",
        extra={"prefill": {"tp_size": 2, "dp_size": 2}, "side_channel_port": 30000},
        local_tp=2,
        dp_rank=1,
    )
    assert engine_1.side_channel_base_port() == 30002


def test_a_prefill_engine_beyond_the_declared_dp_size_is_refused() -> None:
    """Two engines on one side-channel port would fail later, and less clearly."""
    with pytest.raises(ConnectorConfigError, match=r"data-parallel engine 1.*dp_size is 1"):
        config(kv_role="kv_producer", extra={"prefill": {"tp_size": 1}}, dp_rank=1)


def test_every_accepted_protocol_is_named_when_one_is_refused() -> None:
    from vllm_ascend_mooncake.datapath.mooncake import PROTOCOLS

    for protocol in PROTOCOLS:
        assert config(extra={"protocol": protocol}).protocol == protocol
    with pytest.raises(ConnectorConfigError) as refused:
        config(extra={"protocol": "carrier-pigeon"})
    assert all(protocol in str(refused.value) for protocol in PROTOCOLS)


def test_defaults_are_the_declared_ones_and_the_options_defaults() -> None:
    """One definition per default: what parse_config fills in, and what the data path's option
    dataclasses default to, are the defaults declared with each key (where it is read)."""
    from vllm_ascend_mooncake.connector.config import KEYS_BY_NAME
    from vllm_ascend_mooncake.core.plan import PlanOptions
    from vllm_ascend_mooncake.datapath import mooncake
    from vllm_ascend_mooncake.datapath.receiver import CLAIM_PARK_S, ReceiverOptions

    def declared(name: str, protocol: str = "tcp"):
        default = KEYS_BY_NAME[name].default
        return default.of_protocol(protocol) if hasattr(default, "of_protocol") else default

    names = (
        "device_name",
        "side_channel_port",
        "release_timeout_s",
        "side_channel_timeout_s",
        "claim_wait_s",
        "prefill_wait_s",
        "read_retries",
        "max_descriptors_per_batch",
        "max_descriptor_kib",
        "coalesce_runs",
        "block_reads_from_kib",
        "receiver_threads",
        "staging_buffer_mib",
        "read_wait",
        "idle_step_wait_ms",
    )
    cfg = config(extra={"prefill": {"tp_size": 2}, "decode": {"tp_size": 1}, "protocol": "tcp"})
    assert tuple(getattr(cfg, name) for name in names) == tuple(declared(n) for n in names)
    # The values these defaults had before they were declared where they are read.
    assert tuple(declared(name) for name in names) == (
        "",
        36100,
        120.0,
        10.0,
        10.0,
        120.0,
        1,
        1024,
        1024,
        True,
        256,
        4,
        64,
        "poll",
        10.0,
    )
    rdma = config(extra={"protocol": "rdma"})
    assert (rdma.max_descriptor_kib, rdma.block_reads_from_kib, rdma.read_wait) == (0, 0, "sync")
    assert config(device_type="npu").protocol == mooncake.DEFAULT_PROTOCOLS["npu"] == "ascend"
    assert config(device_type="tpu").protocol == mooncake.FALLBACK_PROTOCOL == "tcp"

    receiver, plan = ReceiverOptions(), PlanOptions()
    assert plan.max_descriptors_per_batch == receiver.max_descriptors_per_batch == 1024
    assert plan.coalesce_runs is receiver.coalesce_runs is declared("coalesce_runs")
    assert receiver.num_threads == declared("receiver_threads")
    assert (receiver.claim_wait_s, receiver.prefill_wait_s, receiver.read_retries) == (
        declared("claim_wait_s"),
        declared("prefill_wait_s"),
        declared("read_retries"),
    )
    assert receiver.claim_park_s == CLAIM_PARK_S == cfg.claim_park_s == 1.0
    assert cfg.receiver == replace(
        ReceiverOptions(), max_descriptor_bytes=1 << 20, block_reads_from_bytes=256 << 10
    )


def test_sizes_and_waits_in_the_units_the_data_path_uses() -> None:
    cfg = config(
        extra={
            "max_descriptor_kib": 3,
            "block_reads_from_kib": 5,
            "staging_buffer_mib": 2,
            "idle_step_wait_ms": 50,
            "side_channel_timeout_s": 1.0,
        }
    )
    assert cfg.max_descriptor_bytes == 3 * 1024
    assert cfg.block_reads_from_bytes == 5 * 1024
    assert cfg.staging_buffer_bytes == 2 * 1024 * 1024
    assert cfg.idle_step_wait_s == 0.05
    assert cfg.claim_park_s == 0.5  # half an exchange's timeout, below the 1 s cap


# -- the declaration of the keys (config.KEYS) drives their checks --------------------------------


def _declared(name):
    from vllm_ascend_mooncake.connector.config import KEYS

    return next(key for key in KEYS if key.name == name)


def _table_checked_keys():
    from vllm_ascend_mooncake.connector.config import KEYS

    return [key.name for key in KEYS if not key.own_check]


@pytest.mark.parametrize("name", _table_checked_keys())
def test_a_value_of_the_wrong_type_is_refused_naming_the_key_and_type(name) -> None:
    key = _declared(name)
    wrong = 1 if key.type is str else "x"
    with pytest.raises(ConnectorConfigError) as refused:
        config(extra=with_sizes(**{name: wrong}))
    assert f"kv_connector_extra_config[{name!r}] must be {key.type.__name__}, got {wrong!r}" in (
        str(refused.value)
    )


@pytest.mark.parametrize(
    "name,value,bound",
    [
        ("release_timeout_s", 0, "> 0"),
        ("side_channel_timeout_s", -1.5, "> 0"),
        ("claim_wait_s", 0.0, "> 0"),
        ("prefill_wait_s", 0, "> 0"),
        ("max_descriptors_per_batch", 0, "> 0"),
        ("receiver_threads", -1, "> 0"),
        ("staging_buffer_mib", 0, "> 0"),
        ("idle_step_wait_ms", 0, "> 0"),
        ("read_retries", -1, ">= 0"),
        ("side_channel_port", 0, "a port number, 1 to 65535"),
        ("side_channel_port", 70000, "a port number, 1 to 65535"),
        ("read_wait", "spin", "one of poll, sync"),
    ],
)
def test_a_value_out_of_bounds_is_refused_naming_the_key_and_bound(name, value, bound) -> None:
    with pytest.raises(ConnectorConfigError) as refused:
        config(extra=with_sizes(**{name: value}))
    message = str(refused.value)  # an int where a float is due is shown as the float read
    assert message.startswith(f"kv_connector_extra_config[{name!r}] must be {bound}, got ")
    assert message.endswith(repr(float(value) if isinstance(value, int) else value)) or (
        message.endswith(repr(value))
    )


def test_every_bound_is_declared_on_the_keys_it_checks() -> None:
    """Every key the table checks by value has a bound, or says why not (a type says it all)."""
    from vllm_ascend_mooncake.connector.config import KEYS

    unbounded = {key.name for key in KEYS if key.bound is None and not key.own_check}
    assert unbounded == {
        "device_name",  # any NIC list
        "side_channel_host",  # any address or name
        "side_channel_secret",  # its length is checked with the environment's
        "coalesce_runs",  # a bool
        "verify_reads",  # a bool
        "pair_before_pull",  # a bool
        "ascend_local_comm_res_path",  # not read here
    }


@pytest.mark.parametrize("name", ["max_descriptor_kib", "block_reads_from_kib", "read_wait"])
def test_values_that_meant_the_default_still_do(name) -> None:
    """Kept from before the keys were declared: a negative size, an empty read_wait."""
    value = "" if name == "read_wait" else -1
    for protocol in ("tcp", "rdma"):
        explicit = config(extra=with_sizes(protocol=protocol, **{name: value}))
        assert getattr(explicit, name) == getattr(config(extra=with_sizes(protocol=protocol)), name)


def test_the_declared_plain_defaults_are_what_parse_config_fills_in() -> None:
    from vllm_ascend_mooncake.connector.config import KEYS, ConnectorConfig
    from vllm_ascend_mooncake.options import Computed

    fields = set(ConnectorConfig.__dataclass_fields__)
    plain = [k for k in KEYS if not isinstance(k.default, Computed)]
    assert {k.name for k in plain} - fields  # the parts' keys too, read under their names
    assert len(plain) >= 10
    cfg = config()
    for key in plain:
        assert getattr(cfg, key.name) == key.default, key.name
    for key in KEYS:
        if isinstance(key.default, Computed) and key.default.of_protocol is not None:
            for protocol in ("tcp", "rdma", "ascend"):
                got = getattr(config(extra=with_sizes(protocol=protocol)), key.name)
                assert got == key.default.of_protocol(protocol), (key.name, protocol)


def test_every_key_names_its_parts_and_each_part_is_of_its_kind() -> None:
    """After the default, a key's parts are named where declared: a value cannot slide into
    another's column (the ``max_descriptors_per_batch`` row once showed a default as its
    meaning and its details as its unit)."""
    from vllm_ascend_mooncake.connector.config import KEYS
    from vllm_ascend_mooncake.options import Option as Key

    for key in KEYS:
        assert isinstance(key.summary, str) and key.summary.endswith("."), key.name
        assert isinstance(key.details, str), key.name
        assert key.unit in ("", "s", "ms", "KiB", "MiB"), (key.name, key.unit)
    with pytest.raises(TypeError):
        Key("positional", int, 1, "a summary given by position.")


def test_other_connectors_keys_are_declared_with_ours() -> None:
    """Each alias is declared on the key it is read as, once."""
    from vllm_ascend_mooncake.connector.config import KEYS, RENAMED_KEYS

    aliases = [alias.name for key in KEYS for alias in key.aliases]
    assert len(aliases) == len(set(aliases))
    assert {name: ours for name, (ours, _) in RENAMED_KEYS.items()} == {
        "mooncake_protocol": "protocol",
        "use_ascend_direct": "protocol",
        "kv_port": "side_channel_port",
    }
