"""The OpenAI-compatible HTTP front end end to end: the official `openai` client against a loopback port, over two
deployments of the embedded model (tests/http_helpers.py): HTTPServer over an Engine in this process, and `hcfjax
serve --role router --http-port` over a prefill and a decode worker process. Every test leaves the engine (the
workers) with all its pages free."""

import http.client
import json
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import openai
import pytest

import hcfjax
from hcfjax.engine import Engine, EngineConfig
from hcfjax.frontdoor import FrontDoor
from hcfjax.serving.chat_template import ChatTemplate
from hcfjax.serving.http import HTTPServer
from tests import engine_helpers
from tests.http_helpers import CONFIG, MAX_LEN, Colocated, PDDeployment, health, post, raw_post

N = 16  # new tokens of the compared generations
PROMPTS = ["def fibonacci(n):", "class LRUCache:"]
CHATS = [
    [{"role": "user", "content": "import os"}],
    [{"role": "system", "content": "Python only."}, {"role": "user", "content": [{"type": "text", "text": "for i"}]}],
]
LONG = dict(max_tokens=200, extra_body={"ignore_eos": True})  # seconds of decoding on CPU: still running when we act


@pytest.fixture(scope="module")
def model():
    return hcfjax.load(dtype=jnp.float32)


@pytest.fixture(scope="module")
def colocated(model):
    deployment = Colocated(model)
    yield deployment
    deployment.close()


@pytest.fixture(scope="module")
def pd():
    deployment = PDDeployment()
    yield deployment
    deployment.close()


@pytest.fixture(params=["colocated", "pd"])
def backend(request):
    """Each deployment, started once for the file (the PD processes on the first test that asks for them)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def ref(model):
    """Greedy hcfjax.generate of PROMPTS and of the templated CHATS (in that order), one batch."""
    template = ChatTemplate()
    chats = [template.render([{**m, "content": text_of(m)} for m in c]) for c in CHATS]
    return hcfjax.generate(model, PROMPTS + chats, max_new_tokens=N)


def text_of(message) -> str:
    c = message["content"]
    return c if isinstance(c, str) else "".join(p["text"] for p in c)


def finished(backend, reason: str) -> float:
    return backend.counter("hcfjax_requests_total", {"finish_reason": reason})


def rejected(backend, code: str) -> float:
    return backend.counter("hcfjax_rejected_requests_total", {"code": code})


def test_concurrent_completions_and_chats_equal_generate(backend, ref, model):
    client = backend.client

    def completion(i, stream):
        if not stream:
            r = client.completions.create(model="stdlib-v3", prompt=PROMPTS[i], max_tokens=N, temperature=0)
            return r.choices[0].text, r.choices[0].finish_reason, r.usage
        chunks = list(
            client.completions.create(
                model="stdlib-v3",
                prompt=PROMPTS[i],
                max_tokens=N,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
        return "".join(c.choices[0].text for c in chunks[:-1]), chunks[-2].choices[0].finish_reason, chunks[-1].usage

    def chat(i, stream):
        if not stream:
            r = client.chat.completions.create(model="stdlib-v3", messages=CHATS[i], max_tokens=N, temperature=0)
            assert r.choices[0].message.role == "assistant"
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
        chunks = list(client.chat.completions.create(messages=CHATS[i], model="stdlib-v3", max_tokens=N, temperature=0,
                                                     stream=True))  # fmt: skip
        assert chunks[0].choices[0].delta.role == "assistant" and all(c.usage is None for c in chunks)
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason, None

    jobs = [(completion, i, s) for i in range(2) for s in (False, True)]
    jobs += [(chat, i, s) for i in range(2) for s in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: j[0](j[1], j[2]), jobs))
    for (fn, i, stream), (text, finish, usage) in zip(jobs, results, strict=True):
        k = i if fn is completion else len(PROMPTS) + i
        what = (fn.__name__, i, stream)
        assert text == ref.text[k], what
        tokens = ref.tokens[k]
        assert finish == ("stop" if tokens[-1] in model.cfg.eos_token_ids else "length"), what
        if usage is not None:
            assert usage.completion_tokens == len(tokens), what
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            assert usage.model_extra["speculative"] == {"draft_tokens": 0, "accepted_draft_tokens": 0}
    assert results[0][2].prompt_tokens == len(FrontDoor(model.cfg, model.tokenizer, MAX_LEN).encode(PROMPTS[0]))
    backend.assert_idle()


def test_stop_strings_end_the_request_with_exact_usage(backend, model):
    """A stop string across a token boundary: the text ends just before it and the usage counts the tokens up to the
    one that completed it, streamed or not. A stop string that never comes changes nothing."""
    client = backend.client
    ref = hcfjax.generate(model, PROMPTS[0], max_new_tokens=N, stop_token_ids=[])
    stop, n, expected = engine_helpers.stop_across_tokens(model.tokenizer, ref.tokens[0])
    args = dict(model="stdlib-v3", prompt=PROMPTS[0], max_tokens=N, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(stop=["@@never@@", stop], **args)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (expected, "stop", n)
    chunks = list(client.completions.create(stop=stop, stream=True, stream_options={"include_usage": True}, **args))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == expected
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == n
    r = client.completions.create(stop="@@never@@", **args)
    assert (r.choices[0].text, r.usage.completion_tokens) == (ref.text[0], N)
    backend.assert_idle()


BAD = [
    ("completion", dict(prompt=""), 400, "prompt", None),
    ("completion", dict(prompt=[]), 400, "prompt", None),
    ("completion", dict(prompt=["a", "b"]), 400, "prompt", None),
    ("completion", dict(prompt=[5, 99999]), 400, "prompt", None),
    ("completion", dict(prompt="word " * 400), 400, "prompt", "context_length_exceeded"),
    ("completion", dict(max_tokens=0), 400, "max_tokens", None),
    ("completion", dict(max_tokens=MAX_LEN), 400, "max_tokens", "context_length_exceeded"),
    ("completion", dict(temperature=-1), 400, "temperature", None),
    ("completion", dict(temperature=2.5), 400, "temperature", None),
    ("completion", dict(temperature="hot"), 400, "temperature", None),
    ("completion", dict(top_p=0), 400, "top_p", None),
    ("completion", dict(top_p=1.5), 400, "top_p", None),
    ("completion", dict(n=2), 400, "n", None),
    ("completion", dict(seed=-1), 400, "seed", None),
    ("completion", dict(stop=[""]), 400, "stop", None),
    ("completion", dict(stop=["s"] * 17), 400, "stop", None),
    ("completion", dict(stop="s" * 300), 400, "stop", None),
    ("completion", dict(prompt="x" * 20_000), 400, "prompt", "context_length_exceeded"),
    ("completion", dict(extra_body={"top_k": -1}), 400, "top_k", None),
    ("completion", dict(extra_body={"top_k": 2**31}), 400, "top_k", None),
    ("completion", dict(extra_body={"top_k": 5000}), 400, "top_k", None),  # beyond the vocabulary
    ("completion", dict(seed=2**32), 400, "seed", None),
    ("completion", dict(extra_body={"stop_token_ids": [-1]}), 400, "stop_token_ids", None),
    ("completion", dict(logprobs=2), 400, "logprobs", None),
    ("completion", dict(model="gpt-4"), 404, "model", "model_not_found"),
    ("chat", dict(messages=[]), 400, "messages", None),
    ("chat", dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages", None),
    ("chat", dict(messages=[{"role": "user", "content": "hi " * 300}]), 400, "messages", "context_length_exceeded"),
    ("chat", dict(frequency_penalty=0.5), 400, "frequency_penalty", None),
    ("chat", dict(max_completion_tokens=MAX_LEN), 400, "max_completion_tokens", "context_length_exceeded"),
    ("chat", dict(n=3), 400, "n", None),
]


@pytest.mark.parametrize("kind,params,status,param,code", BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_parameters_give_openai_errors(backend, kind, params, status, param, code):
    client = backend.client
    if kind == "completion":
        create, args = client.completions.create, dict(model="stdlib-v3", prompt="x = 1", max_tokens=2)
    else:
        create, args = client.chat.completions.create, dict(model="stdlib-v3", messages=CHATS[0], max_tokens=2)
    with pytest.raises(openai.APIStatusError) as e:
        create(**(args | params))
    assert e.value.status_code == status
    body = e.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["message"], body
    assert (body["param"], body["code"]) == (param, code), body
    assert body["type"] == ("invalid_request_error")
    assert "max_new_tokens" not in body["message"]  # the engine's name for max_tokens stays inside


def test_error_body_and_server_keeps_serving(backend):
    client = backend.client
    before = rejected(backend, "INVALID_ARGUMENT")
    status, body = post(backend.port, "/v1/completions", {"model": "stdlib-v3", "prompt": "x", "top_p": 2})
    assert status == 400
    assert body == {"error": {"message": "top_p must be in (0, 1], got 2.0", "type": "invalid_request_error",
                              "param": "top_p", "code": None}}  # fmt: skip
    for body, param in [
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),  # types are not coerced
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": [True, False]}, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ('{"prompt": "x", ', None),  # not JSON: no character offset as the param
    ]:
        status, answer = post(backend.port, "/v1/completions", body)
        assert (status, answer["error"]["param"]) == (400, param), answer
    assert rejected(backend, "INVALID_ARGUMENT") == before + 7
    r = client.completions.create(model="stdlib-v3", prompt="x = 1", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    backend.assert_idle()


def test_a_huge_top_k_fails_only_its_request(backend, ref):
    """top_k beyond int32 (or the vocabulary) is refused at the door: a request decoding beside it goes on."""
    client = backend.client
    stream = client.completions.create(model="stdlib-v3", prompt=PROMPTS[0], max_tokens=N, temperature=0, stream=True)
    chunks = iter(stream)
    text = [next(chunks).choices[0].text]  # decoding now
    for top_k in (2**31, 2**31 - 1):
        status, body = post(backend.port, "/v1/completions", {"prompt": "x", "max_tokens": 4, "top_k": top_k})
        assert (status, body["error"]["param"]) == (400, "top_k"), body
    rest = list(chunks)
    assert "".join(text + [c.choices[0].text for c in rest]) == ref.text[0]
    assert rest[-1].choices[0].finish_reason in ("stop", "length")
    backend.assert_idle()


def test_invalid_unicode_is_a_400_and_the_connection_serves_on(backend):
    """A lone surrogate (valid JSON, not valid text) in a prompt or a chat message: a JSON 400, and the same
    keep-alive connection serves the next request."""
    conn = http.client.HTTPConnection("127.0.0.1", backend.port, timeout=30)
    headers = {"Content-Type": "application/json"}
    try:
        for path, body, param in [
            ("/v1/completions", '{"prompt": "\\ud800abc", "max_tokens": 2}', "prompt"),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\udfff"}]}', "messages"),
            ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "stop": ["\\ud800"]}', "stop"),
        ]:
            conn.request("POST", path, body, headers)
            r = conn.getresponse()
            error = json.loads(r.read())["error"]
            assert (r.status, error["param"], error["type"]) == (400, param, "invalid_request_error"), error
            assert "UTF-8" in error["message"]
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x = 1", "max_tokens": 2}), headers)
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] >= 1
    finally:
        conn.close()
    backend.assert_idle()


def test_a_body_not_sent_as_json_says_so(backend):
    """curl's -d without -H sends a form's Content-Type, which FastAPI does not read as JSON: the 400 says why."""
    conn = http.client.HTTPConnection("127.0.0.1", backend.port, timeout=30)
    try:
        for headers, said in [
            ({"Content-Type": "application/x-www-form-urlencoded"}, "'application/x-www-form"),
            ({}, "without a Content-Type"),
        ]:
            conn.request("POST", "/v1/completions", '{"prompt": "x", "max_tokens": 2}', headers)
            r = conn.getresponse()
            error = json.loads(r.read())["error"]
            assert r.status == 400 and "must be JSON sent as application/json" in error["message"], error
            assert said in error["message"], error
    finally:
        conn.close()


def test_disconnect_mid_stream_aborts_and_frees_pages(backend):
    before = finished(backend, "abort")
    stream = backend.client.completions.create(model="stdlib-v3", prompt="x = 1", stream=True, **LONG)
    chunks = iter(stream)
    next(chunks), next(chunks)  # decoding now
    assert backend.pages_in_use()
    stream.close()
    backend.assert_idle(timeout=5)
    assert finished(backend, "abort") == before + 1


def test_disconnect_while_waiting_for_a_whole_answer_aborts(backend):
    before = finished(backend, "abort")
    with pytest.raises(openai.APITimeoutError):
        backend.client.with_options(timeout=1.0).completions.create(model="stdlib-v3", prompt="x = 2", **LONG)
    backend.assert_idle(timeout=5)
    assert finished(backend, "abort") == before + 1


def test_full_queue_is_429(backend):
    client = backend.client
    streams, refused = [], None
    try:
        for i in range(CONFIG.max_slots + CONFIG.max_queue + 1):
            try:
                streams.append(client.completions.create(model="stdlib-v3", prompt=f"x = {i}", stream=True, **LONG))
            except openai.RateLimitError as e:
                refused = e
                break
        assert refused is not None and len(streams) >= CONFIG.max_queue
        assert refused.status_code == 429 and refused.body["type"] == "rate_limit_error"
        assert refused.body["code"] == "queue_full" and "max_queue" in refused.body["message"]
    finally:
        for s in streams:
            s.close()
    backend.assert_idle()


def test_models_and_health(backend):
    (m,) = backend.client.models.list().data
    assert (m.id, m.object, m.owned_by, m.model_extra["max_model_len"]) == ("stdlib-v3", "model", "hcfjax", MAX_LEN)
    assert health(backend.port) == (200, {"status": "ok"})
    if backend.kind == "pd":  # the router's /health before its workers were up (PDDeployment starts it first)
        assert backend.health_before_workers == (503, {"status": "not_ready"})


HEAD = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_a_body_over_the_limit_is_413_before_it_is_read(backend):
    """A 30 MB Content-Length is refused from its header. The body is never sent whole: an answer arriving at all
    shows the server did not wait for it."""
    before = rejected(backend, "RESOURCE_EXHAUSTED")
    status, body = raw_post(backend.port, HEAD + f"Content-Length: {30 << 20}\r\n\r\n", [b'{"prompt": "' + b"x" * 1000])
    assert (status, body["error"]["code"], body["error"]["type"]) == (413, "body_too_large", "invalid_request_error")
    assert rejected(backend, "RESOURCE_EXHAUSTED") == before + 1


# Colocated only, from here to the last test: these count the tokenizer calls of the engine in this process or serve
# it through a second front end (the guards and the front door they check are the same code behind the router).


def test_a_text_that_cannot_fit_is_not_tokenized(colocated):
    door = colocated.engine.door
    counting = engine_helpers.CountingTokenizer(door.tokenizer)
    door.tokenizer = counting
    try:
        status, body = post(colocated.port, "/v1/completions", {"prompt": "x" * (door.max_prompt_chars + 1)})
    finally:
        door.tokenizer = counting.tokenizer
    assert (status, body["error"]["param"], body["error"]["code"]) == (400, "prompt", "context_length_exceeded")
    assert counting.encoded == 0


def test_a_chunked_body_is_413_once_it_passes_the_limit(colocated):
    """On a second front end with a limit of 1000 bytes: a chunked body is refused as soon as it passes the limit
    (the rest is never sent), one under the limit is served."""
    small = HTTPServer(colocated.engine, metrics=colocated.metrics, max_body_bytes=1000).start()
    before = rejected(colocated, "RESOURCE_EXHAUSTED")
    try:
        chunk = b"200\r\n" + b" " * 0x200 + b"\r\n"  # whitespace: valid JSON, were the body ever complete
        status, body = raw_post(small.port, HEAD + "Transfer-Encoding: chunked\r\n\r\n", [chunk] * 3)
        assert (status, body["error"]["code"]) == (413, "body_too_large"), body
        assert "1000 bytes" in body["error"]["message"]
        status, body = post(small.port, "/v1/completions", {"prompt": "x = 1", "max_tokens": 2})  # under the limit
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
    finally:
        small.shutdown(stop_engine=False)
    assert rejected(colocated, "RESOURCE_EXHAUSTED") == before + 1
    colocated.assert_idle()


def test_api_key_on_a_second_front_end_of_the_same_engine(colocated):
    """Without the key: 401 before the body is read (a 30 MB one that never comes) or checked (no detailed 400)."""
    second = HTTPServer(colocated.engine, metrics=colocated.metrics, api_key="sesame").start()
    url = f"http://127.0.0.1:{second.port}/v1"
    before = rejected(colocated, "UNAUTHENTICATED")
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert e.value.body["code"] == "invalid_api_key"
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {30 << 20}\r\n\r\n"
        status, body = raw_post(second.port, head, [b'{"prompt": '])
        assert (status, body["error"]["code"]) == (401, "invalid_api_key"), body
        assert post(second.port, "/v1/completions", {"prompt": "x", "top_p": 2})[0] == 401
        assert health(second.port)[0] == 200  # probes need no key
        good = openai.OpenAI(base_url=url, api_key="sesame", max_retries=0)
        assert good.completions.create(model="stdlib-v3", prompt="x = 1", max_tokens=2).usage.completion_tokens >= 1
    finally:
        second.shutdown(stop_engine=False)
    assert rejected(colocated, "UNAUTHENTICATED") == before + 3
    assert colocated.engine.snapshot()["steps"] > 0 and colocated.server.service.stopping is False
    colocated.assert_idle()


def test_stopped_engine_is_503(model):
    engine = Engine(model, EngineConfig(max_slots=1, max_model_len=64, token_budget=16))
    engine.shutdown()
    server = HTTPServer(engine).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="stdlib-v3", prompt="x = 1", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "shutting_down"
    finally:
        server.shutdown()


def test_shutdown_ends_open_streams(backend):
    """Last of the tests that serve: shuts the deployment's HTTP front end down (the router's on SIGTERM) while a
    stream is open."""
    stream = backend.client.completions.create(model="stdlib-v3", prompt="x = 3", stream=True, **LONG)
    chunks = iter(stream)
    next(chunks)
    backend.shut_down()
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in chunks:
            pass
    backend.assert_idle()


def test_chat_template_from_the_checkpoint(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    conf = {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(conf))
    t = ChatTemplate.for_checkpoint(tmp_path)
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>[user] hi"
    assert ChatTemplate.for_checkpoint(hcfjax.DEFAULT_MODEL).is_default
    rendered = ChatTemplate().render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert rendered == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


def test_serve_needs_a_port(capsys):
    from hcfjax import cli

    assert cli.main(["serve"]) == 2
    assert "--http-port" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["serve", "--http-port", "0"])
    assert (args.http_port, args.port) == (0, None)
