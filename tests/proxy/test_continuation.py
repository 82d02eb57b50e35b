"""Decode continuing from prefill's token, through the proxy, in front of fake engines.

The fakes generate like a tiny deterministic model (``fake_vllm.TinyEngine``): each token depends
on the whole context, so a decode that continued from anything but the prompt and prefill's token
answers other tokens. Every answer through the proxy is compared with what one fake instance
answers the same request alone (the colocated answer): text, tokens, logprobs with their offsets,
finish reason and usage, streamed and not, completions and chat.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fake_vllm import PARTIAL_CHARACTER_TOKENS, FakeVllm, TinyEngine
from loopback_server import serve_on_loopback

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.proxy import create_app
from vllm_ascend_mooncake.proxy.continuable import (
    FIRST_TOKEN_HEADER,
    OTHER_REASON,
    REASON_LABELS,
    blocker,
)
from vllm_ascend_mooncake.proxy.formats.token_texts import text_shows_whole

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def body_for(path: str, prompt: str = "Hello there", **extra: Any) -> dict[str, Any]:
    if path == CHAT:
        request = {"model": "tiny", "messages": [{"role": "user", "content": prompt}]}
    else:
        request = {"model": "tiny", "prompt": prompt}
    return {**request, "max_tokens": 6, "temperature": 0.0, **extra}


@dataclass
class Engines:
    prefill: FakeVllm
    decode: FakeVllm
    colocated: FakeVllm
    urls: dict[str, str]

    def url(self, fake: FakeVllm) -> str:
        return self.urls[fake.name]


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    fakes = [FakeVllm(name) for name in ("prefill", "decode", "colocated")]
    with ExitStack() as stack:
        urls = {fake.name: stack.enter_context(serve_on_loopback(fake.app())) for fake in fakes}
        yield Engines(*fakes, urls=urls)


@pytest.fixture(autouse=True)
def generating(engines: Engines) -> Iterator[None]:
    for fake in (engines.prefill, engines.decode, engines.colocated):
        fake.reset()
        fake.generates = True
        fake.hands_off_like_the_connector = True
    yield
    for fake in (engines.prefill, engines.decode, engines.colocated):
        fake.stream_gate.set()
        fake.answer_gate.set()


@pytest.fixture
def proxy(engines: Engines) -> Iterator[httpx.Client]:
    app = create_app([engines.url(engines.prefill)], [engines.url(engines.decode)])
    with serve_on_loopback(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def colocated(engines: Engines, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{engines.url(engines.colocated)}{path}", json=body, timeout=30)


def events(response: httpx.Response) -> list[Any]:
    """A stream's events: parsed chunks, and the string ``[DONE]``."""
    parsed = []
    for line in response.text.split("\n\n"):
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            parsed.append(payload if payload == "[DONE]" else json.loads(payload))
    return parsed


def joined(path: str, chunks: list[Any]) -> dict[str, Any]:
    """What a client assembles from a stream: text, logprobs entries, token ids, the finish
    reason, the usage and the prompt token ids."""
    text, logprobs, token_ids = "", [], []
    offsets, finish, usage, prompt_ids = [], None, None, None
    assert chunks[-1] == "[DONE]" and "[DONE]" not in chunks[:-1]
    for chunk in chunks[:-1]:
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage
        prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
        for choice in chunk["choices"]:
            if path == CHAT:
                text += choice["delta"].get("content") or ""
                logprobs += (choice.get("logprobs") or {}).get("content") or []
            else:
                text += choice["text"]
                lp = choice.get("logprobs") or {}
                logprobs += list(
                    zip(lp.get("tokens", []), lp.get("token_logprobs", []), strict=True)
                )
                offsets += lp.get("text_offset", [])
                prompt_ids = choice.get("prompt_token_ids") or prompt_ids
            token_ids += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
    return {
        "text": text,
        "logprobs": logprobs,
        "offsets": offsets,
        "token_ids": token_ids,
        "finish": finish,
        "usage": usage,
        "prompt_ids": prompt_ids,
    }


def same_answer(path: str, got: httpx.Response, want: httpx.Response, streamed: bool) -> None:
    assert got.status_code == want.status_code == 200, got.text
    if streamed:
        assert joined(path, events(got)) == joined(path, events(want))
        return
    got_json, want_json = got.json(), want.json()
    assert got_json["choices"] == want_json["choices"]
    assert got_json["usage"] == want_json["usage"]
    assert got_json.get("prompt_token_ids") == want_json.get("prompt_token_ids")


OPTIONS = {
    "plain": {},
    "logprobs": {"logprobs": 2},
    "token ids": {"return_token_ids": True},
    "usage": {"stream_options": {"include_usage": True}},
    "min_tokens": {"min_tokens": 3, "ignore_eos": True},
}


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("option", OPTIONS)
def test_the_joined_answer_equals_the_colocated_one(
    engines: Engines, proxy: httpx.Client, path: str, streamed: bool, option: str
) -> None:
    extra = dict(OPTIONS[option])
    if option == "logprobs" and path == CHAT:
        extra = {"logprobs": True, "top_logprobs": 2}
    if option == "usage" and not streamed:
        extra = {}
    body = body_for(path, stream=streamed, **extra)

    # The first request teaches the proxy where prefill holds KV; the second streams its
    # prefill leg under a transfer id of the proxy's.
    for _ in range(2):
        same_answer(path, proxy.post(path, json=body), colocated(engines, path, body), streamed)

    whole_leg, streamed_leg = engines.prefill.generation_requests()
    for leg in (whole_leg, streamed_leg):
        assert leg.body["max_tokens"] == 1 and leg.body["return_token_ids"] is True
        assert leg.body["kv_transfer_params"]["hold_if_stopped"] is False
    assert whole_leg.body["stream"] is False
    assert streamed_leg.body["stream"] is True
    transfer_id = streamed_leg.body["kv_transfer_params"]["transfer_id"]
    _, decode_leg = engines.decode.generation_requests()
    assert decode_leg.body["kv_transfer_params"]["remote_request_id"] == transfer_id
    assert decode_leg.body["max_tokens"] == body["max_tokens"] - 1
    assert engines.decode.bad_continuations == []
    if path == COMPLETIONS:
        # decode's prompt: prefill's prompt token ids and its token
        prompt = TinyEngine.tokenize(body["prompt"])
        assert decode_leg.body["prompt"][: len(prompt)] == prompt
        assert len(decode_leg.body["prompt"]) == len(prompt) + 1
    else:
        assert "prompt_token_ids" in decode_leg.body["kv_transfer_params"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_the_first_token_reaches_the_client_before_decode_answers(
    engines: Engines, proxy: httpx.Client, path: str
) -> None:
    engines.decode.answer_gate.clear()
    body = body_for(path, stream=True)
    with proxy.stream("POST", path, json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        if path == CHAT:  # the role chunk, then the token
            first = next(line for line in lines if line.startswith("data: "))
        chunk = json.loads(first[len("data: ") :])
        one = {**body, "stream": False, "max_tokens": 1}
        want = colocated(engines, path, one).json()["choices"][0]
        if path == CHAT:
            assert chunk["choices"][0]["delta"]["content"] == want["message"]["content"]
        else:
            assert chunk["choices"][0]["text"] == want["text"]
        assert len(engines.decode.generation_requests()) == 1  # asked, not answered yet
        engines.decode.answer_gate.set()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_one_token_answers_never_ask_decode_nor_hold_kv(
    engines: Engines, proxy: httpx.Client, path: str, streamed: bool
) -> None:
    body = body_for(path, max_tokens=1, stream=streamed, logprobs=2 if path != CHAT else True)
    if streamed:
        body["stream_options"] = {"include_usage": True}
    teach_prefill_address(engines, proxy, path)
    same_answer(path, proxy.post(path, json=body), colocated(engines, path, body), streamed)
    assert engines.decode.generation_requests() == []
    (prefill_leg,) = engines.prefill.generation_requests()
    assert "kv_transfer_params" not in prefill_leg.body and prefill_leg.body["stream"] is True


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_an_answer_that_ends_at_its_first_token_comes_from_prefill_alone(
    engines: Engines, proxy: httpx.Client, path: str, streamed: bool
) -> None:
    """The first token is EOS: prefill's answer is the whole answer, prefill holds nothing."""
    body = body_for(path, prompt="EOS please", stream=streamed)
    want = colocated(engines, path, body)
    same_answer(path, proxy.post(path, json=body), want, streamed)  # a whole prefill leg
    (whole_leg,) = engines.prefill.generation_requests()
    teach_prefill_address(engines, proxy, path)
    # Streamed legs; an answer that held nothing leaves the proxy knowing where prefill is.
    for _ in range(2):
        same_answer(path, proxy.post(path, json=body), want, streamed)
    assert engines.decode.generation_requests() == []
    streamed_legs = engines.prefill.generation_requests()
    for leg in (whole_leg, *streamed_legs):
        assert leg.body["kv_transfer_params"]["hold_if_stopped"] is False
    assert [leg.body["stream"] for leg in streamed_legs] == [True, True]


def teach_prefill_address(engines: Engines, proxy: httpx.Client, path: str) -> None:
    """One request, so the proxy learns where prefill holds KV (its later prefill legs are
    streamed); the fakes then forget it."""
    assert proxy.post(path, json=body_for(path, prompt="teach")).is_success
    for fake in (engines.prefill, engines.decode):
        fake.received.clear()


def partial_character_prompt() -> str:
    """A prompt whose first generated token is part of a character."""
    for i in range(10_000):
        prompt = f"p{i}"
        if TinyEngine.next_token(TinyEngine.tokenize(prompt), False) in PARTIAL_CHARACTER_TOKENS:
            return prompt
    raise AssertionError("no prompt found")


@pytest.mark.parametrize("path", [COMPLETIONS])
def test_a_first_token_that_is_part_of_a_character_is_sampled_again_by_decode(
    engines: Engines, proxy: httpx.Client, path: str
) -> None:
    """vLLM's detokenizer would start decode's text with the prompt (token_texts.py)."""
    body = body_for(path, prompt=partial_character_prompt(), stream=True)
    same_answer(path, proxy.post(path, json=body), colocated(engines, path, body), True)
    (decode_leg,) = engines.decode.generation_requests()
    assert decode_leg.body["prompt"] == body["prompt"]  # the client's prompt, not token ids
    assert engines.decode.bad_continuations == []
    metrics = proxy.get("/metrics").text
    assert 'vam_proxy_decode_first_tokens_total{reason="partial character"} 1.0' in metrics


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_whole_token_of_a_text_prompt_is_not_asked_about(
    engines: Engines, proxy: httpx.Client, path: str
) -> None:
    """Prefill's text of its token shows it whole (text_shows_whole): no /detokenize question
    on the way to the first token; the answer is colocated's, continued on decode."""
    body = body_for(path, stream=True)
    same_answer(path, proxy.post(path, json=body), colocated(engines, path, body), True)
    assert [r for r in engines.prefill.received if r.path == "/detokenize"] == []
    (decode_leg,) = engines.decode.generation_requests()
    assert "prompt_token_ids" in decode_leg.body["kv_transfer_params"] or isinstance(
        decode_leg.body.get("prompt"), list
    )  # continued from prefill's token
    assert engines.decode.bad_continuations == []


def test_text_shows_whole_only_for_one_token_of_a_text_prompt() -> None:
    text_prompt, ids_prompt, chat = {"prompt": "Hi"}, {"prompt": [1, 2, 3]}, {"messages": []}
    assert text_shows_whole("w7 ", 1, text_prompt)
    assert text_shows_whole("w7 ", 1, chat)
    assert not text_shows_whole("w7 ", 1, ids_prompt)  # may end inside a character
    assert not text_shows_whole("w7 w8 ", 2, text_prompt)  # says nothing of the last alone
    assert not text_shows_whole("", 1, text_prompt)  # held back: part of a character, or empty
    assert not text_shows_whole("a\ufffd", 1, text_prompt)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_prefill_that_stops_one_prompt_token_short_has_decode_sample_the_first_token(
    engines: Engines, proxy: httpx.Client, path: str
) -> None:
    """A hybrid model's prefill computes the prompt but its last token: its sampled token
    answers nothing, whole legs or streamed (whose params the proxy makes itself, so it goes by
    what the instance's earlier answer said)."""
    engines.prefill.says_prompt_prefix = True
    body = body_for(path, stream=True)
    want = colocated(engines, path, body)
    same_answer(path, proxy.post(path, json=body), want, True)  # a whole prefill leg
    same_answer(path, proxy.post(path, json=body), want, True)  # a streamed one
    legs = engines.decode.generation_requests()
    assert len(legs) == 2
    for leg in legs:
        assert leg.body.get("prompt", leg.body.get("messages")) == body.get(
            "prompt", body.get("messages")
        )  # the client's prompt: decode samples the first token
        assert leg.body["kv_transfer_params"]["remote_prompt_prefix"] is True
    metrics = proxy.get("/metrics").text
    assert 'vam_proxy_decode_first_tokens_total{reason="prompt prefix"} 2.0' in metrics


BLOCKED = {
    "n": ({"n": 2}, "n"),
    "seed": ({"seed": 3, "temperature": 0.8}, "seed"),
    "stop string": ({"stop": ["ab"]}, "stop"),
    "frequency penalty": ({"frequency_penalty": 0.5}, "frequency_penalty"),
    "echo": ({"echo": True}, "echo"),
    "structured output": ({"response_format": {"type": "json_object"}}, "response_format"),
    "unknown": ({"vllm_xargs": {"a": 1}}, "other"),
}


@pytest.mark.parametrize("case", BLOCKED)
def test_requests_decode_could_not_continue_exactly_keep_decodes_first_token(
    engines: Engines, proxy: httpx.Client, case: str
) -> None:
    extra, reason = BLOCKED[case]
    body = body_for(COMPLETIONS, **extra)
    assert proxy.post(COMPLETIONS, json=body).status_code == 200
    (decode_leg,) = engines.decode.generation_requests()
    assert decode_leg.body["prompt"] == body["prompt"]
    assert decode_leg.body["max_tokens"] == body["max_tokens"]
    (prefill_leg,) = engines.prefill.generation_requests()
    assert "return_token_ids" not in prefill_leg.body
    metrics = proxy.get("/metrics").text
    assert f'vam_proxy_decode_first_tokens_total{{reason="{reason}"}} 1.0' in metrics


def test_blockers_of_chat_requests() -> None:
    chat = body_for(CHAT)
    assert blocker(CHAT, chat) is None
    assert blocker(CHAT, {**chat, "tools": [{"type": "function"}]}) == "tools"
    assert blocker(CHAT, {**chat, "tool_choice": "auto"}) == "tool_choice"
    image = {"type": "image_url", "image_url": {"url": "x"}}
    media = [{"role": "user", "content": [{"type": "text", "text": "a"}, image]}]
    assert blocker(CHAT, {**chat, "messages": media}) == "messages"
    no_limit = {key: value for key, value in chat.items() if key != "max_tokens"}
    assert blocker(CHAT, no_limit) == "no max_tokens"
    assert blocker(CHAT, {**no_limit, "max_completion_tokens": 4}) is None
    assert blocker(COMPLETIONS, {**body_for(COMPLETIONS), "stop": ["\n", "."]}) is None
    assert blocker(COMPLETIONS, {**body_for(COMPLETIONS), "prompt": ["a", "b"]}) == "prompt"
    assert blocker("/v1/responses", chat) == "path"


def test_the_client_header_and_the_proxy_flag_keep_decodes_first_token(
    engines: Engines, proxy: httpx.Client
) -> None:
    body = body_for(COMPLETIONS)
    assert proxy.post(COMPLETIONS, json=body, headers={FIRST_TOKEN_HEADER: "decode"}).is_success
    (decode_leg,) = engines.decode.generation_requests()
    assert decode_leg.body["prompt"] == body["prompt"]

    app = create_app(
        [engines.url(engines.prefill)], [engines.url(engines.decode)], first_token="decode"
    )
    with serve_on_loopback(app) as url:
        assert httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=30).is_success
    assert engines.decode.generation_requests()[-1].body["prompt"] == body["prompt"]
    with pytest.raises(ValueError, match="first_token"):
        create_app(["http://a:1"], ["http://b:2"], first_token="both")


def test_a_chat_decode_that_ignores_the_prompt_token_ids_fails_the_request_visibly(
    engines: Engines, proxy: httpx.Client
) -> None:
    """vLLM before 0.30 renders the messages itself: its answer would repeat the first token."""
    engines.decode.ignores_prompt_token_ids = True
    body = body_for(CHAT)
    whole = proxy.post(CHAT, json=body)
    assert whole.status_code == 502
    assert "--first-token decode" in whole.json()["error"]["message"]

    streamed = events(proxy.post(CHAT, json={**body, "stream": True}))
    assert streamed[1]["choices"][0]["delta"]["content"]  # prefill's token went out first
    assert "--first-token decode" in streamed[-2]["error"]["message"]
    assert streamed[-1] == "[DONE]"


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_chat_requests_keep_decodes_first_token_where_vllm_cannot_take_prompt_ids(
    engines: Engines, proxy: httpx.Client, streamed: bool
) -> None:
    """A prefill that says its vLLM (0.23) renders chat messages itself: its decode, the same
    release, could not continue from forwarded prompt ids, so decode samples the first token."""
    engines.prefill.says_chat_prompt_ids = False
    engines.decode.ignores_prompt_token_ids = True
    body = body_for(CHAT, stream=streamed)
    for _ in range(2):  # a whole prefill leg, then a streamed one
        same_answer(CHAT, proxy.post(CHAT, json=body), colocated(engines, CHAT, body), streamed)
    for decode_leg in engines.decode.generation_requests():
        assert "prompt_token_ids" not in decode_leg.body["kv_transfer_params"]
    metrics = proxy.get("/metrics").text
    assert 'reason="chat on vLLM before 0.30"} 2.0' in metrics


def test_a_decode_error_after_the_first_token_ends_the_stream_with_it(
    engines: Engines, proxy: httpx.Client
) -> None:
    engines.decode.canned_answer = (
        503,
        json.dumps({"error": {"message": "decode is full", "code": 503}}).encode(),
        "application/json",
    )
    streamed = events(proxy.post(COMPLETIONS, json=body_for(COMPLETIONS, stream=True)))
    assert streamed[0]["choices"][0]["text"]
    assert streamed[1]["error"] == {"message": "decode is full", "type": "DecodeError", "code": 503}
    assert streamed[2] == "[DONE]"
    # not streamed: decode's error reaches the client unchanged
    assert proxy.post(COMPLETIONS, json=body_for(COMPLETIONS)).status_code == 503


@pytest.mark.parametrize("leg", ["whole", "streamed"])
def test_a_prefill_error_reaches_the_client_before_anything_streams(
    engines: Engines, proxy: httpx.Client, leg: str
) -> None:
    if leg == "streamed":
        teach_prefill_address(engines, proxy, COMPLETIONS)
    engines.prefill.canned_answer = (400, b'{"error": {"message": "bad"}}', "application/json")
    response = proxy.post(COMPLETIONS, json=body_for(COMPLETIONS, stream=True))
    assert response.status_code == 400 and response.json() == {"error": {"message": "bad"}}
    assert engines.decode.generation_requests() == []
    (prefill_leg,) = engines.prefill.generation_requests()
    assert prefill_leg.body["stream"] is (leg == "streamed")


def test_a_client_leaving_mid_stream_frees_the_decode(
    engines: Engines, proxy: httpx.Client
) -> None:
    engines.decode.stream_gate.clear()
    with proxy.stream("POST", COMPLETIONS, json=body_for(COMPLETIONS, stream=True)) as stream:
        next(stream.iter_raw())
    proxy.close()  # the client hangs up while decode is still streaming
    engines.decode.stream_gate.set()
    with httpx.Client(base_url=proxy.base_url, timeout=20) as observer:
        wait_until(
            lambda: observer.get("/ready").json()["decode"][0]["in_flight"] == 0,
            "the proxy stops counting the abandoned decode stream",
        )


def test_client_chosen_names_never_become_metric_labels(
    engines: Engines, proxy: httpx.Client
) -> None:
    """Unknown parameters and header values are the client's to pick: each as a label would be
    a series kept for the proxy's life (issue #43: 300 requests, 301 series, +160 MiB)."""
    for index in range(3):
        body = {**body_for(COMPLETIONS), f"unknown_{index}_" + "x" * 1000: 1}
        assert proxy.post(COMPLETIONS, json=body).status_code == 200
    header = {FIRST_TOKEN_HEADER: "y" * 1000}
    assert proxy.post(COMPLETIONS, json=body_for(COMPLETIONS), headers=header).is_success
    from prometheus_client.parser import text_string_to_metric_families

    (family,) = [
        family
        for family in text_string_to_metric_families(proxy.get("/metrics").text)
        if family.name == "vam_proxy_decode_first_tokens"
    ]
    counts = {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert counts == {OTHER_REASON: 4.0}
    assert set(counts) <= REASON_LABELS | {OTHER_REASON}


def test_a_client_leaving_while_prefill_streams_its_first_token_frees_the_prefill(
    engines: Engines, proxy: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """The streamed prefill leg (issue #43): a hang-up while prefill computes used to leave
    the prefill counted busy for good (+1 in flight per hang-up)."""
    teach_prefill_address(engines, proxy, CHAT)
    engines.prefill.stream_gate.clear()  # the role chunk comes, the token does not
    payload = json.dumps(body_for(CHAT, stream=True)).encode()
    host, port = proxy.base_url.host, proxy.base_url.port
    with caplog.at_level(logging.INFO, logger="vllm_ascend_mooncake.proxy.app"):
        with socket.create_connection((host, port)) as client:
            client.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(payload), payload)
            )
            wait_until(
                lambda: engines.prefill.generation_requests(), "the streamed prefill leg arrives"
            )
        wait_until(
            lambda: "the client left before its answer" in caplog.text,
            "the proxy sees the client leave while prefill computes",
        )
    engines.prefill.stream_gate.set()
    wait_until(
        lambda: proxy.get("/ready").json()["prefill"][0]["in_flight"] == 0,
        "the proxy stops counting the abandoned prefill leg",
        timeout_s=10,
    )
    assert engines.decode.generation_requests() == []


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_flags_are_read_as_vllm_reads_them(
    engines: Engines, proxy: httpx.Client, path: str, streamed: bool
) -> None:
    """vLLM takes "true", 1, "yes" ... as true and "false", 0, "no" ... as false (pydantic's
    lax bool); so does the proxy, for stream, return_token_ids and include_usage alike."""
    spellings = ["true", 1, "Yes"] if streamed else ["false", 0, "no"]
    for spelling in spellings:
        body = body_for(
            path,
            stream=spelling,
            return_token_ids="false",
            stream_options={"include_usage": "1"} if streamed else None,
        )
        want = {**body, "stream": streamed, "return_token_ids": False}
        if streamed:
            want["stream_options"] = {"include_usage": True}
        for _ in range(2):  # a whole prefill leg, then a streamed one
            got = proxy.post(path, json=body)
            same_answer(path, got, colocated(engines, path, want), streamed)
        if streamed:
            assert events(got)[-2]["usage"]


def prompt_of(path: str, tokens: int) -> str:
    """A prompt (a completion's, or a chat message's content) of ``tokens`` tokens."""
    rendered = len(TinyEngine.tokenize(TinyEngine.render([{"role": "user", "content": ""}])))
    return "x" * (tokens - (rendered if path == CHAT else 1))


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_prompt_one_token_short_of_max_model_len_is_answered_by_prefills_token(
    engines: Engines, proxy: httpx.Client, path: str, streamed: bool
) -> None:
    """Issue #43 (e): vLLM clamps the answer to the one token the context leaves, and refuses
    a prompt that fills it; the continued decode leg's prompt (the prompt and prefill's token)
    would fill it, so the proxy answers prefill's token, as one colocated instance does."""
    max_model_len = 48
    for fake in (engines.prefill, engines.decode, engines.colocated):
        fake.max_model_len = max_model_len
    body = body_for(path, prompt=prompt_of(path, max_model_len - 1), stream=streamed)
    if streamed:
        body["stream_options"] = {"include_usage": True}
    want = colocated(engines, path, body)
    for _ in range(2):  # a whole prefill leg, then a streamed one
        same_answer(path, proxy.post(path, json=body), want, streamed)
    assert engines.decode.generation_requests() == []
    assert len(engines.prefill.generation_requests()) == 2
    # min_tokens the context cannot give: decode answers vLLM's refusal, as colocated does
    short = {**body, "min_tokens": 2, "ignore_eos": True}
    refused = proxy.post(path, json=short)
    assert refused.status_code == colocated(engines, path, short).status_code == 400
    # a prompt that leaves room for two tokens still continues
    room = body_for(path, prompt=prompt_of(path, max_model_len - 2), stream=streamed)
    same_answer(path, proxy.post(path, json=room), colocated(engines, path, room), streamed)
    assert engines.decode.generation_requests()[-1].body["max_tokens"] == room["max_tokens"] - 1


ENDINGS = {
    # (path, prompt, prefill ignores return_token_ids, how prefill's stream ends early)
    "no token ids, held": (COMPLETIONS, "Hello there", True, None),
    "no token ids, ended by its token": (COMPLETIONS, "EOS please", True, None),
    "no token ids, chat ended by its token": (CHAT, "EOS please", True, None),
    "cut short": (CHAT, "Hello there", False, "cut"),
    "error event": (CHAT, "Hello there", False, "error"),
}


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_streamed_prefill_leg_without_token_ids_sends_decode_only_to_a_held_transfer(
    engines: Engines, proxy: httpx.Client, ending: str
) -> None:
    """Issue #43 (f): a streamed prefill leg that ended without token ids (vLLM ignored
    return_token_ids, its stream broke off, or it sent an error event) sent decode to read the
    proxy's transfer id, which prefill held only when its one token was length-capped: decode
    then waited for KV nobody held. Now decode reads only a transfer prefill held, else
    computes the prompt itself (or the client gets prefill's error)."""
    path, prompt, ignores_token_ids, ends_early = ENDINGS[ending]
    teach_prefill_address(engines, proxy, path)
    engines.prefill.held.clear()
    engines.prefill.ignores_return_token_ids = ignores_token_ids
    engines.prefill.stream_ends_early = ends_early
    body = body_for(path, prompt=prompt, stream=True)
    response = proxy.post(path, json=body)
    if ending == "error event":
        assert response.status_code == 502
        assert "the engine failed" in response.json()["error"]["message"]
        assert engines.decode.generation_requests() == []
    else:
        same_answer(path, response, colocated(engines, path, body), True)
    (prefill_leg,) = engines.prefill.generation_requests()
    assert prefill_leg.body["stream"] is True
    for decode_leg in engines.decode.generation_requests():
        params = decode_leg.body.get("kv_transfer_params") or {}
        if params.get("do_remote_prefill"):
            assert params["remote_request_id"] in engines.prefill.held, params
        elif ending == "no token ids, held":
            raise AssertionError("prefill held the KV: decode reads it")
