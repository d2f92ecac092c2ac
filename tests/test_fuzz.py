"""Property-based fuzzing (hypothesis) of the servers' input surfaces, over one live engine with the embedded model:
the OpenAI HTTP bodies, the gRPC GenerateRequest and the `hcfjax client` CLI's numeric options. Every input gets an
answer that says what was wrong (HTTP 4xx with OpenAI's error object, a gRPC INVALID_ARGUMENT, exit code 2 with a
message) or a generation, never a server error or a dropped connection; afterwards the servers still serve and the
engine holds no request and every KV page is free.

Generations are kept to a few tokens (max_tokens is drawn small whenever it is valid), and the runs are derandomized
so a CI failure reproduces."""

import functools
import http.client
import json
import types

import grpc
import jax.numpy as jnp
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hcfjax
from hcfjax import cli
from hcfjax.engine import Engine, EngineConfig
from hcfjax.serving import client
from hcfjax.serving import hcfjax_pb2 as pb
from hcfjax.serving.http import HTTPServer
from hcfjax.serving.server import Server
from tests import engine_helpers

MAX_LEN = 128
CONFIG = EngineConfig(
    max_slots=2, max_queue=4, max_model_len=MAX_LEN, token_budget=64, max_prefill_rows=1, min_prefill_bucket=64
)
FUZZ = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)
INT32, UINT32 = 2**31, 2**32
ERROR_KEYS = {"message", "type", "param", "code"}

assert_idle = functools.partial(engine_helpers.assert_idle, timeout=10.0)


@pytest.fixture(scope="module")
def served():
    """One engine behind both servers, as `hcfjax serve --port --http-port` runs it."""
    model = hcfjax.load(dtype=jnp.float32)
    engine = Engine(model, CONFIG)
    grpc_server = Server(engine).start()
    http_server = HTTPServer(engine, model_name="stdlib-v3").start()
    channel, stub = client.connect("127.0.0.1", grpc_server.port, ready_timeout=10)
    yield types.SimpleNamespace(
        engine=engine,
        vocab=model.cfg.vocab_size,
        http_port=http_server.port,
        grpc_port=grpc_server.port,
        channel=channel,
        stub=stub,
    )
    channel.close()
    http_server.shutdown(stop_engine=False)
    grpc_server.shutdown()
    assert_idle(engine, timeout=0)


# -- values ------------------------------------------------------------------------------------------------------
# text with anything Unicode has, lone surrogates too (JSON carries them escaped: "\ud800")
any_char = st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr))
any_text = st.text(any_char, max_size=12)
valid_chars = st.characters(exclude_categories=("Cs",))
valid_text = st.text(valid_chars, min_size=1, max_size=12)
huge_int = st.one_of(st.sampled_from([-1, 0, INT32 - 1, INT32, UINT32 - 1, UINT32, 2**63, 2**64, -(2**63)]),
                     st.integers(-(2**70), 2**70))  # fmt: skip
odd_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),  # json.dumps writes NaN / Infinity
    st.sampled_from([-0.0, 1e-300, 1e308, 2.0000001, 0.9999999]),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "0.5"]),  # as strings
)
junk = st.one_of(
    st.none(),
    st.booleans(),
    huge_int,
    odd_float,
    any_text,
    st.just(""),
    st.lists(st.integers(-3, 3), max_size=3),
    st.lists(any_text, max_size=2),
    st.dictionaries(any_text, st.integers(), max_size=2),
)
junk_but_null = junk.filter(lambda v: v is not None)  # null max_tokens is valid: up to the context's end (slow)
small_tokens = st.integers(1, 3)


def fields(vocab: int) -> dict:
    """Each field of the OpenAI bodies: (values the server accepts, values of the wrong type or range)."""
    ids = st.integers(0, vocab - 1)
    unit = st.floats(0.05, 1.0)
    return {
        "prompt": (
            st.one_of(
                valid_text,
                st.lists(ids, min_size=1, max_size=8),
                st.lists(valid_text, min_size=1, max_size=1),
                st.lists(st.lists(ids, min_size=1, max_size=4), min_size=1, max_size=1),
            ),
            st.one_of(
                any_text,
                st.lists(st.integers(-3, vocab + 3), max_size=8),
                st.lists(valid_text, min_size=2, max_size=3),  # a batch of prompts
                st.lists(st.lists(st.one_of(ids, junk), max_size=2), max_size=2),  # nested deeper, mixed types
                st.lists(st.booleans(), min_size=1, max_size=3),
                st.just([5] * (MAX_LEN + 4)),  # longer than the context
                st.just("word " * 4 * MAX_LEN),
                junk,
            ),
        ),
        "max_tokens": (small_tokens, st.one_of(huge_int, junk_but_null, st.just(MAX_LEN))),
        "model": (st.just("stdlib-v3"), st.one_of(any_text, junk_but_null)),
        "temperature": (st.floats(0, 2), st.one_of(st.floats(-1, 3).filter(lambda t: not 0 <= t <= 2), junk)),
        "top_p": (unit, st.one_of(st.floats(-0.5, 1.5), junk)),
        "min_p": (st.floats(0, 0.9), st.one_of(st.floats(-0.5, 1.5), junk)),
        "top_k": (st.integers(0, vocab), st.one_of(st.integers(vocab + 1, vocab + 2), huge_int, junk)),
        "seed": (st.integers(0, UINT32 - 1), st.one_of(huge_int, junk)),
        "stop": (
            st.one_of(valid_text, st.lists(valid_text, max_size=4)),
            st.one_of(st.lists(any_text, max_size=20), st.lists(junk, max_size=2), junk, st.just("s" * 300)),
        ),
        "stream": (st.booleans(), junk_but_null),
        "stream_options": (
            st.fixed_dictionaries({"include_usage": st.booleans()}),
            st.one_of(st.fixed_dictionaries({"include_usage": junk}), junk_but_null),
        ),
        "n": (st.just(1), st.one_of(st.sampled_from([2, 0, -1]), junk_but_null)),
        "logprobs": (st.sampled_from([None, False]), st.one_of(st.just(True), st.integers(1, 5), junk)),
        "stop_token_ids": (
            st.lists(ids, max_size=3),
            st.one_of(st.lists(st.integers(-2, vocab + 2), max_size=3), junk),
        ),
        "ignore_eos": (st.booleans(), junk_but_null),
        "frequency_penalty": (st.just(0.0), junk),
        "logit_bias": (st.just({}), junk),
    }


def chat_fields(vocab: int) -> dict:
    role = st.sampled_from(["system", "user", "assistant"])
    text_part = st.fixed_dictionaries({"type": st.just("text"), "text": valid_text})
    good = st.fixed_dictionaries({"role": role, "content": st.one_of(valid_text, st.lists(text_part, max_size=2))})
    bad_part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(any_text, junk)}),
        st.dictionaries(any_text, junk, max_size=2),
    )
    bad = st.one_of(
        st.fixed_dictionaries({"role": st.one_of(any_text, junk), "content": valid_text}),
        st.fixed_dictionaries({"role": role, "content": st.one_of(any_text, st.lists(bad_part, max_size=2), junk)}),
        st.dictionaries(any_text, junk, max_size=2),
        junk,
    )
    chat = {k: v for k, v in fields(vocab).items() if k != "prompt"}
    chat["messages"] = (
        st.lists(good, min_size=1, max_size=3),
        st.one_of(st.lists(st.one_of(good, bad), min_size=1, max_size=3), st.just([]), junk),
    )
    chat["max_completion_tokens"] = (st.one_of(st.none(), small_tokens), st.one_of(huge_int, junk_but_null))
    chat["tools"] = (st.sampled_from([None, []]), st.one_of(st.just([{"type": "function"}]), junk_but_null))
    chat["response_format"] = (st.just({"type": "text"}), st.one_of(st.just({"type": "json_object"}), junk_but_null))
    return chat


@st.composite
def bodies(draw, fields: dict, required: tuple[str, ...]):
    """A body of valid values for the required fields and some of the others, then 0 to 2 fields given a wrong value
    (the prompt or messages, now and then, left out), and maybe unknown fields."""
    optional = [k for k in fields if k not in required]
    names = list(required) + draw(st.lists(st.sampled_from(optional), unique=True, max_size=len(optional)))
    body = {k: draw(fields[k][0]) for k in names}
    for k in draw(st.lists(st.sampled_from(list(fields)), unique=True, max_size=2)):
        if k in ("prompt", "messages") and draw(st.integers(0, 5)) == 0:
            body.pop(k)
        else:
            body[k] = draw(fields[k][1])
    if draw(st.integers(0, 3)) == 0:
        body |= draw(st.dictionaries(st.text(max_size=6).map(lambda k: "x_" + k), junk, max_size=2))
    return body


def completion_bodies(vocab: int):
    return bodies(fields(vocab), ("prompt", "max_tokens"))


def chat_bodies(vocab: int):
    return bodies(chat_fields(vocab), ("messages", "max_tokens"))


# -- HTTP --------------------------------------------------------------------------------------------------------
class Connection:
    """One keep-alive HTTP connection, as a client library holds it: a request after a refusal goes on it too."""

    def __init__(self, port: int):
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, path: str, data: bytes) -> tuple[int, str, bytes]:
        self.conn.request("POST", path, data, {"Content-Type": "application/json"})
        r = self.conn.getresponse()  # a dropped connection raises here
        body = r.read()
        if (r.getheader("connection") or "").lower() == "close":
            self.conn.close()
        return r.status, r.getheader("content-type") or "", body


def check_answer(status: int, content_type: str, body: bytes, what) -> None:
    """200 with a completion or a stream that ends with [DONE], or a 4xx with OpenAI's error object."""
    if status == 200 and content_type.startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]
        assert events[-1] == "[DONE]", (what, events[-3:])
        assert all("error" not in json.loads(e) for e in events[:-1]), (what, events)
        return
    answer = json.loads(body)
    if status == 200:
        assert answer["choices"][0]["finish_reason"] in ("stop", "length"), (what, answer)
        return
    assert 400 <= status < 500, (what, status, answer)
    assert set(answer) == {"error"} and set(answer["error"]) == ERROR_KEYS, (what, answer)
    error = answer["error"]
    assert isinstance(error["message"], str) and error["message"], (what, answer)
    assert error["param"] is None or isinstance(error["param"], str), (what, answer)


def fuzz_endpoint(served, path: str, bodies) -> None:
    conn = Connection(served.http_port)

    @FUZZ
    @given(bodies)
    def run(body):
        data = json.dumps(body).encode()  # ensure_ascii: a lone surrogate goes as "\ud800"
        status, content_type, answer = conn.post(path, data)
        check_answer(status, content_type, answer, body)

    run()
    health = Connection(served.http_port)
    health.conn.request("GET", "/health")
    assert health.conn.getresponse().status == 200
    assert_idle(served.engine)


def test_completion_bodies(served):
    fuzz_endpoint(served, "/v1/completions", completion_bodies(served.vocab))


def test_chat_bodies(served):
    fuzz_endpoint(served, "/v1/chat/completions", chat_bodies(served.vocab))


def test_raw_bodies(served):
    """Bodies that are not an object: any JSON value, invalid JSON, bytes that are not UTF-8."""
    conn = Connection(served.http_port)
    bodies = st.one_of(
        junk.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=40),
        st.text(any_char, max_size=20).map(lambda s: s.encode("utf-8", "surrogatepass")),
    )

    @FUZZ
    @given(bodies, st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def run(data, path):
        status, content_type, answer = conn.post(path, data)
        assert status == 400, (data, status, answer)
        check_answer(status, content_type, answer, data)

    run()
    assert_idle(served.engine)


# -- gRPC --------------------------------------------------------------------------------------------------------
int32 = st.integers(-INT32, INT32 - 1)
double = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1))
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


def grpc_fields(vocab: int) -> dict:
    """GenerateRequest's fields: (values the server accepts, others the message can hold)."""
    ids = st.integers(0, vocab - 1)
    return {
        "text": (valid_text, st.one_of(st.just(""), st.just("word " * 4 * MAX_LEN))),
        "token_ids": (
            st.lists(ids, min_size=1, max_size=8),
            st.one_of(st.lists(st.one_of(ids, int32), max_size=8), st.just([3] * (MAX_LEN + 1))),
        ),
        "max_new_tokens": (small_tokens, st.one_of(st.sampled_from([0, -1, MAX_LEN, INT32 - 1]), int32)),
        "temperature": (st.floats(0, 2), double),
        "top_k": (st.integers(0, vocab), int32),
        "top_p": (st.one_of(st.none(), st.floats(0.05, 1)), double),
        "min_p": (st.floats(0, 0.9), double),
        "seed": (st.integers(0, UINT32 - 1), st.sampled_from([0, UINT32 - 1])),  # the proto's uint32 is all valid
        "stop_token_ids": (st.lists(ids, max_size=3), st.lists(int32, min_size=1, max_size=3)),
        "ignore_eos": (st.booleans(), st.booleans()),
        "stop": (
            st.lists(st.text(valid_chars, min_size=1, max_size=8), max_size=4),
            st.one_of(st.lists(st.text(valid_chars, max_size=300), max_size=20), st.just(["s"] * 17)),
        ),
        "request_id": (
            st.one_of(st.just(""), st.text(valid_chars, min_size=1, max_size=20)),
            st.one_of(st.text(valid_chars, min_size=250, max_size=300), st.just("x" * 10_000)),
        ),
    }


SAMPLING = ("temperature", "top_k", "top_p", "min_p")


@st.composite
def generate_requests(draw, vocab: int):
    """A valid GenerateRequest, then 0 to 2 of its fields given a value the server may refuse."""
    spec = grpc_fields(vocab)
    prompt = draw(st.sampled_from(["text", "token_ids"])) if draw(st.integers(0, 9)) else None
    names = [k for k in spec if k not in ("text", "token_ids")] + ([prompt] if prompt else [])
    values = {k: draw(spec[k][0]) for k in names}
    for k in draw(st.lists(st.sampled_from(names), unique=True, max_size=2)):
        values[k] = draw(spec[k][1])
    sampling = pb.SamplingParams(**{k: values.pop(k) for k in SAMPLING})
    request = pb.GenerateRequest(sampling=sampling, **{k: v for k, v in values.items() if k != "token_ids"})
    if prompt == "token_ids":
        request.token_ids.ids.extend(values["token_ids"])
    return request


def test_generate_requests(served):
    @FUZZ
    @given(generate_requests(served.vocab))
    def run(request):
        try:
            chunks = list(served.stub.Generate(request, timeout=60))
        except grpc.RpcError as e:
            assert e.code() in ALLOWED, (request, e.code(), e.details())
            assert e.details(), request
            return
        assert chunks[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), request

    run()
    health = health_pb2_grpc.HealthStub(served.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    assert_idle(served.engine)


def test_generate_text_not_utf8(served):
    """A GenerateRequest whose text is not valid UTF-8 (a message the Python client cannot make; other clients
    can): INVALID_ARGUMENT, not a server error."""
    text = b"ab\xed\xa0\x80\xff"
    message = bytes([0x0A, len(text)]) + text + pb.GenerateRequest(max_new_tokens=1).SerializeToString()
    with pytest.raises(grpc.RpcError) as e:
        list(raw_generate(served.channel)(message, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert_idle(served.engine)


def raw_generate(channel):
    """Generate with the request message as bytes, sent as they are."""
    return channel.unary_stream("/hcfjax.v1.Generation/Generate", request_serializer=lambda b: b,
                                response_deserializer=pb.GenerateResponse.FromString)  # fmt: skip


def test_generate_message_bytes(served):
    """A valid message's bytes with some flipped, cut short or followed by junk: whatever parses is served or
    refused as any request is, what does not parse is INVALID_ARGUMENT."""
    send = raw_generate(served.channel)
    base = pb.GenerateRequest(text="def f():", max_new_tokens=2, stop=["x"], request_id="r").SerializeToString()

    @FUZZ
    @given(st.lists(st.tuples(st.integers(0, len(base) - 1), st.integers(0, 255)), max_size=3),
           st.integers(0, len(base)), st.binary(max_size=8))  # fmt: skip
    def run(flips, cut, tail):
        data = bytearray(base)
        for i, b in flips:
            data[i] = b
        message = bytes(data[:cut]) + tail
        try:
            list(send(message, timeout=60))
        except grpc.RpcError as e:
            assert e.code() in ALLOWED, (message, e.code(), e.details())

    run()
    assert_idle(served.engine)


# -- the CLI -----------------------------------------------------------------------------------------------------
def option_values(draw_int: bool):
    numbers = st.one_of(huge_int, st.integers(-3, 3)) if draw_int else st.one_of(st.floats(), huge_int)
    return st.one_of(numbers.map(str), st.sampled_from(["nan", "inf", "-inf", "1e400", "", "1.5", "0x10", "五"]))


def test_client_numeric_options(served, capsys):
    """`hcfjax client` against the live server with fuzzed numbers: a generation (exit 0), the server's refusal
    (exit 1, its status and message) or a value the request cannot hold (exit 2, a message); never a traceback."""
    ints = ["--seed", "--top-k", "--max-new-tokens"]
    floats = ["--temperature", "--top-p", "--min-p"]

    @FUZZ
    @given(st.dictionaries(st.sampled_from(ints), option_values(True), max_size=3),
           st.dictionaries(st.sampled_from(floats), option_values(False), max_size=3))  # fmt: skip
    def run(int_options, float_options):
        int_options.setdefault("--max-new-tokens", "2")
        argv = ["client", "--port", str(served.grpc_port), "--prompt", "x", "--timeout", "60"]
        argv += [f"{k}={v}" for k, v in (int_options | float_options).items()]
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse: not a number
            code = e.code
        err = capsys.readouterr().err
        assert "Traceback" not in err, (argv, err)
        assert code in (0, 1, 2), (argv, code, err)
        if code == 2:
            assert "error" in err, (argv, err)
        if code == 1:
            assert err.startswith(("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")), (argv, err)

    run()
    assert_idle(served.engine)
