"""The ``vam-vllm`` wrapper's defaults for CPU P/D instances (``launch/vllm_cli.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

from vllm_ascend_mooncake.launch.vllm_cli import CPU_PD_DEFAULTS, cpu_pd_defaults

PD_ARGS = [
    "serve",
    "model",
    "--kv-transfer-config",
    json.dumps({"kv_connector": "MooncakeHeteroConnector", "kv_role": "kv_consumer"}),
]


def test_a_pd_instance_gets_the_shared_host_settings_its_environment_leaves_unset() -> None:
    assert cpu_pd_defaults(PD_ARGS, {}) == CPU_PD_DEFAULTS
    assert cpu_pd_defaults(PD_ARGS, {"OMP_WAIT_POLICY": "ACTIVE"}) == {
        "VAM_SHM_BUSY_WAIT_S": "0.005"
    }
    assert cpu_pd_defaults(PD_ARGS, dict.fromkeys(CPU_PD_DEFAULTS, "1")) == {}


def test_an_instance_without_this_connector_is_left_as_vllm_runs_it() -> None:
    assert cpu_pd_defaults(["serve", "model", "--max-num-seqs", "4"], {}) == {}
    other = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    assert cpu_pd_defaults(["serve", "model", "--kv-transfer-config", other], {}) == {}


def test_the_wrapper_decides_before_torch_loads() -> None:
    """``OMP_WAIT_POLICY`` is read by torch's OpenMP runtime when torch loads: the wrapper must
    set it before importing anything that imports torch."""
    probe = (
        "import sys; import vllm_ascend_mooncake.launch.vllm_cli; "
        "print('torch' in sys.modules, 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
