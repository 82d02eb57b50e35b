"""Prefill and decode sharing one host's two cores, without the single-host settings
(``VAM_SHM_BUSY_WAIT_S``, ``OMP_WAIT_POLICY=PASSIVE``, ``idle_step_wait_ms`` 50): those make a
shared host faster, never correct. Issue #43 ("Also seen") found otherwise: decode with
``--max-num-seqs 2``, prefill ``release_timeout_s`` 5, 24 long requests at once through
``vam-proxy`` ended 10 of 24 in HTTP 500 (holds expired while their decode requests queued,
because a renewal whose reply took over 2 s on the starved host was dropped). Renewals now start
at a third of the lease and are retried within it (``proxy/holds.py``).

Each answer is compared with decode's own colocated answer (float32, TP 1: equal token for token)
and the deployment must end clean: no failed pull, no hold released by its timeout, every block
back, both engines alive.
"""

from __future__ import annotations

import concurrent.futures

import httpx
from pd_checks import TIMEOUT, assert_clean_transfers, assert_same, metric

from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

REQUESTS = 24
#: long enough that the last requests queue on decode past prefill's 5 s release timeout (and
#: its renewals matter), short of the 4 x 5 s a hold may be renewed to
OUTPUT_TOKENS = 150
#: vLLM's own defaults where the single-host settings would be (engine_env sets them)
WITHOUT_SINGLE_HOST_SETTINGS = {"VAM_SHM_BUSY_WAIT_S": "", "OMP_WAIT_POLICY": ""}


def body(model: str, prompt: str, **extra) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 5,
        "return_token_ids": True,
        **extra,
    }


def test_a_starved_host_without_single_host_settings_answers_every_request(tmp_path) -> None:
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2)))
    spec = DeploymentSpec(
        model,
        prefill_tp=1,
        decode_tp=1,
        block_size=32,
        max_model_len=1024,
        release_timeout_s=5.0,
        idle_step_wait_ms=10.0,  # the connector's default
        decode_args=("--max-num-seqs", "2"),
        extra_env=WITHOUT_SINGLE_HOST_SETTINGS,
        log_dir=str(tmp_path),
    )
    prompts = [
        " ".join(f"request {index} word {word}" for word in range(50)) for index in range(REQUESTS)
    ]
    with LocalDeployment(spec) as pd:
        name = httpx.get(f"{pd.decode.base_url}/v1/models").json()["data"][0]["id"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            expected = list(
                pool.map(
                    lambda prompt: httpx.post(
                        f"{pd.decode.base_url}/v1/completions",
                        json=body(name, prompt, cache_salt="colocated"),
                        timeout=TIMEOUT,
                    ).json(),
                    prompts,
                )
            )
        before = pd.transfer_totals()

        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            answers = list(
                pool.map(
                    lambda prompt: httpx.post(
                        f"{pd.proxy_url}/v1/completions", json=body(name, prompt), timeout=TIMEOUT
                    ),
                    prompts,
                )
            )

        statuses = [answer.status_code for answer in answers]
        assert statuses == [200] * REQUESTS, [a.text[:300] for a in answers if a.status_code != 200]
        for index, (answer, want) in enumerate(zip(answers, expected, strict=True)):
            assert_same(answer.json(), want, f"request {index} through the proxy")
        assert_clean_transfers(pd, REQUESTS, since=before)
        assert metric(pd.proxy_url, "vam_proxy_hold_renewals_total") > 0  # they were needed
