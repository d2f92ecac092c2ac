"""KV transports (hcfjax/pd/transport.py): exact round trips, merging, discard, timeouts and failures, for every
kind that runs on CPU, and the jax kind across two processes."""

import ctypes
import hashlib
import socket
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax.pd.transport import KINDS, Piece, TransferError, make_transport

L, P, PS, D = 5, 3, 4, 24  # layers, pages, page size, C + R


def bf16_cache(seed: int) -> tuple[np.ndarray, None]:
    return np.asarray(jax.random.normal(jax.random.key(seed), (L, P, PS, D), jnp.bfloat16)), None


def int8_cache(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(-127, 128, (L, P, PS, D), dtype=np.int8), rng.random((L, P, 2, PS), dtype=np.float32)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check_taken(rx, key, kv, scale, kind):
    got_kv, got_scale = rx.take(key, timeout=5)
    assert isinstance(got_kv, jax.Array if kind == "jax" else np.ndarray)
    assert same_bits(got_kv, kv)
    assert (got_scale is None) if scale is None else same_bits(got_scale, scale)


def pieces(key, kv, scale, bounds, as_jax=False):
    """Pieces of layers [bounds[i], bounds[i + 1])."""
    put = jnp.asarray if as_jax else (lambda x: x)
    return [
        Piece(key, (l0, l1), put(kv[l0:l1]), None if scale is None else put(scale[l0:l1]), L)
        for l0, l1 in zip(bounds[:-1], bounds[1:], strict=True)
    ]


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def ends(kind):
    t = make_transport(kind, timeout=3.0)
    rx, tx = t.receiver(), t.sender()
    yield t, rx, tx
    tx.close()
    rx.close()


def free_port_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("mode", ["whole", "layerwise"])
def test_round_trip_exact(ends, kind, mode):
    """bf16 and int8 (+ scales) caches of several keys arrive bit-exactly, whole or in layer groups of 1-3 sent
    out of order and interleaved across keys; some pieces are jax arrays."""
    _, rx, tx = ends
    caches = {"a": bf16_cache(0), "b": int8_cache(1), "c": bf16_cache(2), "d": int8_cache(3)}
    bounds = {"whole": [[0, L]] * 4, "layerwise": [[0, 1, 3, 4, 5], [0, 3, 5], [0, 2, 3, 5], [0, 1, 2, 3, 4, 5]]}[mode]
    todo = [p for (k, (kv, sc)), b in zip(caches.items(), bounds, strict=True) for p in pieces(k, kv, sc, b, k in "cd")]
    for i in np.random.default_rng(0).permutation(len(todo)):
        tx.send(rx.address, todo[i])
    for key in "dcba":
        tx.flush(key, timeout=5)
    for key, (kv, scale) in caches.items():
        check_taken(rx, key, kv, scale, kind)
    assert tx.stats["pieces"] == len(todo) and tx.stats["failed"] == 0
    assert rx.stats["bytes"] == sum(kv.nbytes + (0 if sc is None else sc.nbytes) for kv, sc in caches.values())


@pytest.mark.parametrize("merge", [True, False])
def test_padding_pages_are_cut_on_the_host(kind, merge):
    """A piece gathered past its pages (a prefill worker's power of two) arrives as its pages only, whole, in layer
    groups or page by page, and only they are sent; a device link (jax) refuses the padding."""
    t = make_transport(kind, merge=merge, timeout=3.0)
    rx, tx = t.receiver(), t.sender()
    try:
        padded = {"a": bf16_cache(6), "b": int8_cache(7)}  # P pages, of which the first P - 1 are the key's
        for key, (kv, sc) in padded.items():
            for part in pieces(key, kv, sc, [0, 2, 5], as_jax=key == "b"):
                part.pages = P - 1
                if kind == "jax":
                    with pytest.raises(ValueError, match="padding pages need a host link"):
                        tx.send(rx.address, part)
                else:
                    tx.send(rx.address, part)
        if kind == "jax":
            return
        for key, (kv, sc) in padded.items():
            tx.flush(key, timeout=5)
            check_taken(rx, key, kv[:, : P - 1], None if sc is None else sc[:, : P - 1], kind)
        cut = sum(kv[:, : P - 1].nbytes + (0 if sc is None else sc[:, : P - 1].nbytes) for kv, sc in padded.values())
        assert rx.stats["bytes"] == cut
        with pytest.raises(ValueError, match="pages"):
            tx.send(rx.address, Piece("c", (0, 1), padded["a"][0][:1], None, 1, pages=P + 1))
    finally:
        tx.close()
        rx.close()


def test_merging_sends_fewer_larger_messages(kind):
    """merge=True coalesces what is queued together; merge=False sends each (layer, page) alone. Same data."""
    caches = {"a": bf16_cache(4), "b": int8_cache(5)}
    stats = {}
    for merge in (True, False):
        t = make_transport(kind, merge=merge, timeout=3.0)
        rx, tx = t.receiver(), t.sender()
        todo = [p for k, (kv, sc) in caches.items() for p in pieces(k, kv, sc, [0, 2, 5])]
        for p in todo:
            tx.send(rx.address, p)
        for key, (kv, scale) in caches.items():
            tx.flush(key, timeout=5)
            check_taken(rx, key, kv, scale, kind)
        stats[merge] = tx.stats
        tx.close()
        rx.close()
    assert stats[False]["messages"] == 2 * L * P  # every (layer, page) of both keys
    assert 1 <= stats[True]["messages"] <= len(todo)
    assert stats[True]["bytes"] == stats[False]["bytes"]


def test_failed_computation_fails_its_key_only(ends, kind):
    """A piece whose computation failed ends its key with TransferError; the destination's thread lives on."""
    from jax.experimental.transfer import make_error_array

    _, rx, tx = ends
    aval = jax.ShapeDtypeStruct(
        (1, P, PS, D), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
    )
    tx.send(rx.address, Piece("bad", (0, 1), make_error_array(aval, "prefill failed"), None, 1))
    with pytest.raises(TransferError, match="prefill failed"):
        tx.flush("bad", timeout=5)
    kv, sc = bf16_cache(13)
    for p in pieces("good", kv, sc, [0, 5]):
        tx.send(rx.address, p)
    tx.flush("good", timeout=5)
    check_taken(rx, "good", kv, sc, kind)


def test_discard_drops_early_and_late_pieces(ends, kind):
    _, rx, tx = ends
    (kv, sc), (kv2, sc2) = int8_cache(6), bf16_cache(7)
    first, rest = pieces("x", kv, sc, [0, 2, 5])
    tx.send(rx.address, first)
    tx.flush("x", timeout=5)
    rx.discard("x")
    tx.send(rx.address, rest)
    for p in pieces("y", kv2, sc2, [0, 5]):
        tx.send(rx.address, p)
    tx.flush("x", timeout=5)  # dropped pieces are still acknowledged
    tx.flush("y", timeout=5)
    with pytest.raises(TimeoutError):
        rx.take("x", timeout=0.1)
    assert rx.stats["dropped"] == 1
    check_taken(rx, "y", kv2, sc2, kind)


def test_take_times_out_on_a_partial_key(ends):
    _, rx, tx = ends
    kv, sc = bf16_cache(8)
    tx.send(rx.address, pieces("p", kv, sc, [0, 3, 5])[0])
    tx.flush("p", timeout=5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        rx.take("p", timeout=0.2)
    assert time.monotonic() - t0 < 2
    with pytest.raises(TimeoutError):
        rx.take("never", timeout=0.05)


def test_flush_to_a_dead_address_raises_quickly(kind):
    """Nothing listens there: TransferError, fast; afterwards nothing of the key stays queued."""
    t = make_transport(kind, timeout=3.0)
    tx = t.sender()
    dead = "inprocess:404" if kind == "inprocess" else free_port_address()
    kv, sc = bf16_cache(9)
    for p in pieces("k", kv, sc, [0, 1, 2, 5]):
        tx.send(dead, p)
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        tx.flush("k", timeout=10)
    assert time.monotonic() - t0 < 2
    assert not tx._keys and not any(tx._queues.values())
    tx.flush("k", timeout=0.1)  # nothing left to wait for
    tx.close()


@jax.jit
def slow(x):  # ~0.1-1 s on CPU
    return jax.lax.fori_loop(0, 300, lambda i, x: jnp.tanh(x @ x.T) * 0.5 + x * 0.5, x).reshape(1, 16, 16, 256)


def slow_computation():
    """A compiled computation whose call returns a not-yet-ready [1, 16, 16, 256] array."""
    x = jax.random.normal(jax.random.key(0), (256, 256))
    jax.block_until_ready(slow(x))
    return lambda: slow(x)


def test_send_does_not_wait_for_the_computation(ends, kind):
    """send() hands a still-computing array to the background thread; flush delivers its final value."""
    _, rx, tx = ends
    y = slow_computation()()
    assert not y.is_ready()
    tx.send(rx.address, Piece("slow", (0, 1), y, None, 1))
    assert not y.is_ready()
    tx.flush("slow", timeout=10)
    got, _ = rx.take("slow", timeout=5)
    assert same_bits(got, y)


def test_receiver_closed_mid_transfer_fails_flush(ends, kind):
    """Layerwise: the first layer has landed, the second is still computing when the receiver goes away."""
    _, rx, tx = ends
    run = slow_computation()
    tx.send(rx.address, Piece("m", (0, 1), np.zeros((1, 16, 16, 256), np.float32), None, 2))
    tx.send(rx.address, Piece("m", (1, 2), run(), None, 2))
    deadline = time.monotonic() + 5
    while tx.stats["pieces"] < 1 and time.monotonic() < deadline:  # the first layer acknowledged
        time.sleep(0.001)
    rx.close()
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        tx.flush("m", timeout=10)
    assert time.monotonic() - t0 < 4
    assert tx.stats == dict(messages=1, bytes=16 * 16 * 256 * 4, pieces=1, failed=1)


def test_jax_sender_releases_unpulled_arrays():
    """A message never pulled (the peer took it and went silent) is held by the transfer server only until its
    deadline: the sender sweeps it, and the memory comes back."""

    libc = ctypes.CDLL("libc.so.6")

    def rss() -> int:
        libc.malloc_trim(0)  # memory freed but kept by the allocator goes back; memory still held cannot
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    server = socket.create_server(("127.0.0.1", 0))
    tx = make_transport("jax", timeout=0.3).sender()
    x = jnp.ones((1, 16, 1024, 1024), jnp.float32).block_until_ready()  # 64 MiB
    tx.send(f"127.0.0.1:{server.getsockname()[1]}", Piece("u", (0, 1), x, None, 1))
    before = rss()
    del x
    with pytest.raises(TransferError):
        tx.flush("u", timeout=5)
    deadline = time.monotonic() + 15  # (the sweep runs on the sender's thread: a loaded machine delays it)
    while rss() > before - (48 << 20) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rss() <= before - (48 << 20)
    tx.close()
    server.close()


@pytest.mark.parametrize("kind", ["socket", "jax"])
@pytest.mark.parametrize("behaviour", ["silent", "hang-up"])
def test_peer_that_never_acks(kind, behaviour):
    """A peer that reads and never answers (no ack) or hangs up mid-message: TransferError within the timeout."""
    server = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve():
        conn, _ = server.accept()
        conn.recv(16)
        if behaviour == "hang-up":
            conn.close()
        else:
            held.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    tx = make_transport(kind, timeout=0.5).sender()
    kv, sc = int8_cache(10)
    tx.send(f"127.0.0.1:{server.getsockname()[1]}", Piece("s", (0, L), kv, sc, L))
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        tx.flush("s", timeout=5)
    assert time.monotonic() - t0 < 2
    tx.close()
    server.close()
    for c in held:
        c.close()


CHILD = textwrap.dedent("""
    import hashlib, os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from hcfjax.pd.transport import make_transport
    rx = make_transport("jax", timeout=5.0).receiver()
    print(rx.address, flush=True)
    for key in sys.stdin.readline().split():
        kv, scale = rx.take(key, timeout=20)
        assert isinstance(kv, jax.Array) and kv.devices() == {jax.devices()[0]}
        h = hashlib.sha256(np.asarray(kv).tobytes())
        if scale is not None:
            h.update(np.asarray(scale).tobytes())
        print(key, h.hexdigest(), flush=True)
    sys.stdin.readline()
""")


def test_jax_transport_across_processes():
    """The real use: a receiver in another process pulls bf16 and int8 caches layer by layer onto its device; once
    that process is killed, flush raises instead of hanging."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = child.stdout.readline().strip()
        assert address, "receiver process did not start"
        caches = {"a": bf16_cache(11), "b": int8_cache(12)}
        child.stdin.write("a b\n")
        child.stdin.flush()
        tx = make_transport("jax", timeout=3.0).sender()
        for p in [p for k, (kv, sc) in caches.items() for p in pieces(k, kv, sc, [0, 1, 2, 3, 4, 5], as_jax=True)]:
            tx.send(address, p)
        for key, (kv, scale) in caches.items():
            tx.flush(key, timeout=20)
            h = hashlib.sha256(kv.tobytes())
            if scale is not None:
                h.update(scale.tobytes())
            assert child.stdout.readline().split() == [key, h.hexdigest()]
        child.kill()
        child.wait()
        tx.send(address, pieces("late", *caches["a"], [0, 5])[0])
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            tx.flush("late", timeout=10)
        assert time.monotonic() - t0 < 4
        tx.close()
    finally:
        child.kill()
        child.wait()
