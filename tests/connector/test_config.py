"""Connector configuration: validated key by key against the running engine."""

from __future__ import annotations

import pytest

from vllm_ascend_mooncake.config import SECRET_ENV, ConnectorConfigError, parse_config


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
    from vllm_ascend_mooncake import config as config_module

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
    from vllm_ascend_mooncake.config import is_loopback

    assert is_loopback(host) is loopback
