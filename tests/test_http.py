"""The OpenAI-compatible HTTP front end end to end: the official `openai` client against HTTPServer on a loopback port,
over the real Engine with the embedded model. Every test leaves the engine with all its pages free."""

import functools
import http.client
import json
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import openai
import pytest

import hcfjax
from hcfjax.engine import Engine, EngineConfig
from hcfjax.serving.chat_template import ChatTemplate
from hcfjax.serving.http import HTTPServer
from hcfjax.serving.metrics import Metrics
from tests import engine_helpers

MAX_LEN = 256
# one prefill row and one chunk bucket: three step shapes to compile (prefill, prefill + decode, decode)
CONFIG = EngineConfig(
    max_slots=4, max_queue=8, max_model_len=MAX_LEN, token_budget=64, max_prefill_rows=1, min_prefill_bucket=64
)
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
def served(model):
    engine = Engine(model, CONFIG)
    metrics = Metrics(engine)
    server = HTTPServer(engine, metrics=metrics).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0, timeout=120)
    yield server, client
    client.close()
    server.shutdown()
    assert_idle(engine, timeout=0)


@pytest.fixture(scope="module")
def ref(model):
    """Greedy hcfjax.generate of PROMPTS and of the templated CHATS (in that order), one batch."""
    template = ChatTemplate()
    chats = [template.render([{**m, "content": text_of(m)} for m in c]) for c in CHATS]
    return hcfjax.generate(model, PROMPTS + chats, max_new_tokens=N)


def text_of(message) -> str:
    c = message["content"]
    return c if isinstance(c, str) else "".join(p["text"] for p in c)


assert_idle = functools.partial(engine_helpers.assert_idle, timeout=10.0)


def finished(server: HTTPServer, reason: str) -> float:
    return server.service.metrics.registry.get_sample_value("hcfjax_requests_total", {"finish_reason": reason}) or 0


def post(server: HTTPServer, path: str, body: dict | str) -> tuple[int, dict]:
    """POSTs a body (a dict as JSON, a str as it is); -> (status, the answer's JSON)."""
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_concurrent_completions_and_chats_equal_generate(served, ref, model):
    server, client = served

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
    assert results[0][2].prompt_tokens == len(server.engine.tokenize(PROMPTS[0]))
    assert_idle(server.engine)


def test_stop_strings_end_the_request_with_exact_usage(served, model):
    """A stop string across a token boundary: the text ends just before it and the usage counts the tokens up to the
    one that completed it, streamed or not. A stop string that never comes changes nothing."""
    server, client = served
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
    assert_idle(server.engine)


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
def test_bad_parameters_give_openai_errors(served, kind, params, status, param, code):
    server, client = served
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


def test_error_body_and_server_keeps_serving(served):
    server, client = served
    status, body = post(server, "/v1/completions", {"model": "stdlib-v3", "prompt": "x", "top_p": 2})
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
        status, answer = post(server, "/v1/completions", body)
        assert (status, answer["error"]["param"]) == (400, param), answer
    assert server.service.metrics.registry.get_sample_value(
        "hcfjax_rejected_requests_total", {"code": "INVALID_ARGUMENT"}
    )
    r = client.completions.create(model="stdlib-v3", prompt="x = 1", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert_idle(server.engine)


def test_a_huge_top_k_fails_only_its_request(served, ref):
    """top_k beyond int32 (or the vocabulary) is refused at the door: a request decoding beside it goes on."""
    server, client = served
    stream = client.completions.create(model="stdlib-v3", prompt=PROMPTS[0], max_tokens=N, temperature=0, stream=True)
    chunks = iter(stream)
    text = [next(chunks).choices[0].text]  # decoding now
    for top_k in (2**31, 2**31 - 1):
        status, body = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "top_k": top_k})
        assert (status, body["error"]["param"]) == (400, "top_k"), body
    rest = list(chunks)
    assert "".join(text + [c.choices[0].text for c in rest]) == ref.text[0]
    assert rest[-1].choices[0].finish_reason in ("stop", "length")
    assert_idle(server.engine)


def test_invalid_unicode_is_a_400_and_the_connection_serves_on(served):
    """A lone surrogate (valid JSON, not valid text) in a prompt or a chat message: a JSON 400, and the same
    keep-alive connection serves the next request."""
    server, _ = served
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
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
    assert_idle(server.engine)


def test_a_text_that_cannot_fit_is_not_tokenized(served):
    server, _ = served
    door = server.engine.door
    counting = engine_helpers.CountingTokenizer(door.tokenizer)
    door.tokenizer = counting
    try:
        status, body = post(server, "/v1/completions", {"prompt": "x" * (door.max_prompt_chars + 1)})
    finally:
        door.tokenizer = counting.tokenizer
    assert (status, body["error"]["param"], body["error"]["code"]) == (400, "prompt", "context_length_exceeded")
    assert counting.encoded == 0


def test_disconnect_mid_stream_aborts_and_frees_pages(served):
    server, client = served
    before = finished(server, "abort")
    stream = client.completions.create(model="stdlib-v3", prompt="x = 1", stream=True, **LONG)
    chunks = iter(stream)
    next(chunks), next(chunks)  # decoding now
    assert server.engine.snapshot()["free_pages"] < server.engine.snapshot()["total_pages"]
    stream.close()
    assert_idle(server.engine, timeout=5)
    assert finished(server, "abort") == before + 1


def test_disconnect_while_waiting_for_a_whole_answer_aborts(served):
    server, client = served
    before = finished(server, "abort")
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=1.0).completions.create(model="stdlib-v3", prompt="x = 2", **LONG)
    assert_idle(server.engine, timeout=5)
    assert finished(server, "abort") == before + 1


def test_full_queue_is_429(served):
    server, client = served
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
    assert_idle(server.engine)


def test_models_and_health(served):
    server, client = served
    (m,) = client.models.list().data
    assert (m.id, m.object, m.owned_by, m.model_extra["max_model_len"]) == ("stdlib-v3", "model", "hcfjax", MAX_LEN)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as r:
        assert (r.status, json.loads(r.read())) == (200, {"status": "ok"})


def raw_post(port: int, head: str, body_parts: list[bytes]) -> tuple[int, dict]:
    """Sends a request's head and the given body bytes, never the rest of the body, then reads the answer: one that
    comes proves the server answered without reading the body whole (the socket's timeout fails the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode())
        for part in body_parts:
            sock.sendall(part)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < content_length(answer):
            data = sock.recv(65536)
            assert data, answer
            answer += data
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.partition(b"\r\n\r\n")[2])


def content_length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def rejected(server: HTTPServer, code: str) -> float:
    return server.service.metrics.registry.get_sample_value("hcfjax_rejected_requests_total", {"code": code}) or 0


def test_a_body_over_the_limit_is_413_before_it_is_read(served):
    """A 30 MB Content-Length is refused from its header; a chunked body as soon as it passes the limit. Neither
    body is sent whole: an answer arriving at all shows the server did not wait for it."""
    server, _ = served
    before = rejected(server, "RESOURCE_EXHAUSTED")
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    status, body = raw_post(server.port, head + f"Content-Length: {30 << 20}\r\n\r\n", [b'{"prompt": "' + b"x" * 1000])
    assert (status, body["error"]["code"], body["error"]["type"]) == (413, "body_too_large", "invalid_request_error")
    small = HTTPServer(server.engine, metrics=server.service.metrics, max_body_bytes=1000).start()
    try:
        chunk = b"200\r\n" + b" " * 0x200 + b"\r\n"  # whitespace: valid JSON, were the body ever complete
        status, body = raw_post(small.port, head + "Transfer-Encoding: chunked\r\n\r\n", [chunk] * 3)
        assert (status, body["error"]["code"]) == (413, "body_too_large"), body
        assert "1000 bytes" in body["error"]["message"]
        status, body = post(small, "/v1/completions", {"prompt": "x = 1", "max_tokens": 2})  # under the limit
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
    finally:
        small.shutdown(stop_engine=False)
    assert rejected(server, "RESOURCE_EXHAUSTED") == before + 2
    assert_idle(server.engine)


def test_api_key_on_a_second_front_end_of_the_same_engine(served):
    """Without the key: 401 before the body is read (a 30 MB one that never comes) or checked (no detailed 400)."""
    server, _ = served
    second = HTTPServer(server.engine, metrics=server.service.metrics, api_key="sesame").start()
    url = f"http://127.0.0.1:{second.port}/v1"
    before = rejected(server, "UNAUTHENTICATED")
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert e.value.body["code"] == "invalid_api_key"
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {30 << 20}\r\n\r\n"
        status, body = raw_post(second.port, head, [b'{"prompt": '])
        assert (status, body["error"]["code"]) == (401, "invalid_api_key"), body
        assert post(second, "/v1/completions", {"prompt": "x", "top_p": 2})[0] == 401
        with urllib.request.urlopen(f"http://127.0.0.1:{second.port}/health", timeout=10) as r:
            assert r.status == 200  # probes need no key
        good = openai.OpenAI(base_url=url, api_key="sesame", max_retries=0)
        assert good.completions.create(model="stdlib-v3", prompt="x = 1", max_tokens=2).usage.completion_tokens >= 1
    finally:
        second.shutdown(stop_engine=False)
    assert rejected(server, "UNAUTHENTICATED") == before + 3
    assert server.engine.snapshot()["steps"] > 0 and server.service.stopping is False
    assert_idle(server.engine)


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


def test_chat_template_from_the_checkpoint(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    conf = {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(conf))
    t = ChatTemplate.for_checkpoint(tmp_path)
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>[user] hi"
    assert ChatTemplate.for_checkpoint(hcfjax.DEFAULT_MODEL).is_default
    rendered = ChatTemplate().render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert rendered == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


def test_the_same_api_over_a_generation_service(served, ref):
    """hcfjax.serving.remote (what `--role router --http-port` serves through): HTTP over the gRPC Generation service
    of the same engine gives the same greedy text, refuses as the engine does (param and code), and a client that
    disconnects mid-stream has its request cancelled upstream, which frees its pages. /health follows the upstream's
    readiness (a router's: some prefill and some decode worker up)."""
    from hcfjax.serving.remote import RemoteEngine, load_front
    from hcfjax.serving.server import Server

    server, _ = served
    grpc_server = Server(server.engine).start()
    upstream_ready = [False]
    remote = RemoteEngine(f"127.0.0.1:{grpc_server.port}", load_front(), MAX_LEN, ready=lambda: upstream_ready[0])
    http = HTTPServer(remote).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="none", max_retries=0, timeout=120)
    try:
        with pytest.raises(urllib.error.HTTPError) as down:
            urllib.request.urlopen(f"http://127.0.0.1:{http.port}/health", timeout=10)
        assert (down.value.code, json.loads(down.value.read())) == (503, {"status": "not_ready"})
        upstream_ready[0] = True
        with urllib.request.urlopen(f"http://127.0.0.1:{http.port}/health", timeout=10) as up:
            assert up.status == 200
        r = client.completions.create(model="stdlib-v3", prompt=PROMPTS[0], max_tokens=N, temperature=0)
        assert r.choices[0].text == ref.text[0] and r.usage.completion_tokens == len(ref.tokens[0])
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="stdlib-v3", prompt=PROMPTS[0], max_tokens=MAX_LEN)
        assert (bad.value.code, bad.value.param) == ("context_length_exceeded", "max_tokens")
        stream = client.completions.create(model="stdlib-v3", prompt="x = 3", stream=True, **LONG)
        chunks = iter(stream)
        next(chunks), next(chunks)  # decoding now
        assert server.engine.snapshot()["free_pages"] < server.engine.snapshot()["total_pages"]
        stream.close()
        assert_idle(server.engine, timeout=5)
    finally:
        client.close()
        http.shutdown()
        grpc_server.shutdown(stop_engine=False)


def test_shutdown_ends_open_streams(served):
    """Last: shuts the module's server down while a stream is open."""
    server, client = served
    stream = client.completions.create(model="stdlib-v3", prompt="x = 3", stream=True, **LONG)
    chunks = iter(stream)
    next(chunks)
    server.shutdown()
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in chunks:
            pass
    assert_idle(server.engine, timeout=0)


def test_serve_needs_a_port(capsys):
    from hcfjax import cli

    assert cli.main(["serve"]) == 2
    assert "--http-port" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["serve", "--http-port", "0"])
    assert (args.http_port, args.port) == (0, None)
