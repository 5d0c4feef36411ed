"""`kkdeploy loadtest --client native`: our HTTP/2 gRPC client in C++ (``serving/csrc/grpc_h2c_client.cc``), driven
through ctypes. Here it talks to a scripted HTTP/2 peer in Python, which checks what the client sends (the preface, its
settings, the request's headers and framing, flow control) and answers with what a server may send (CONTINUATION,
padding, PING, SETTINGS mid-call, GOAWAY, RST_STREAM, silence). Against a real tritonserver the client is compared
with grpcio byte for byte in tests/test_serving_loadtest.py."""

from __future__ import annotations

import socket
import struct
import threading
import time

import hpack
import pytest

from kkdeploy.errors import KKError
from kkdeploy.serving import native_client
from kkdeploy.serving.native_client import GrpcCallError, GrpcH2c, call_status

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST, SETTINGS, PING, GOAWAY, WINDOW, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED = 1, 1, 4, 8
PATH = b"/inference.GRPCInferenceService/ModelInfer"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def grpc_message(body: bytes) -> bytes:
    return b"\0" + struct.pack(">I", len(body)) + body


def block(*fields, huffman=True) -> bytes:
    return hpack.Encoder().encode(list(fields), huffman=huffman)


class Peer:
    """One scripted HTTP/2 server connection at a time: ``script(peer)`` runs on the server side of each accepted
    connection; what it saw is kept for the test to check. ``windows``: the server's first SETTINGS raise the
    streams' window and a WINDOW_UPDATE the connection's, as gRPC servers do; else the defaults stay."""

    def __init__(self, script, windows: int | None = 1 << 24):
        self.windows = windows
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.script, self.seen, self.errors, self.connections = script, [], [], 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self.conn, self.buf = conn, b""
            try:
                assert self.read(24) == PREFACE
                kind, flags, stream, payload = self.frame()
                assert (kind, stream) == (SETTINGS, 0)
                self.seen.append(("settings", dict(struct.unpack(">HI", payload[i:i + 6])
                                                   for i in range(0, len(payload), 6))))
                if self.windows:
                    self.send(frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, self.windows)),
                              frame(WINDOW, 0, 0, struct.pack(">I", self.windows)))
                self.script(self)
            except Exception as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(exc))
            finally:
                conn.close()

    def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            more = self.conn.recv(1 << 20)
            if not more:
                raise EOFError("the client closed the connection")
            self.buf += more
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def frame(self):
        header = self.read(9)
        length = int.from_bytes(header[:3], "big")
        return header[3], header[4], int.from_bytes(header[5:], "big") & 0x7FFFFFFF, self.read(length)

    def send(self, *frames: bytes):
        self.conn.sendall(b"".join(frames))

    def request(self, limit: int | None = None):
        """``(stream, headers, body)`` of the next request; with ``limit``, stops once ``limit`` body bytes came."""
        stream, headers, body = None, None, b""
        while True:
            kind, flags, sid, payload = self.frame()
            if kind == WINDOW and sid == 0:
                self.seen.append(("window", struct.unpack(">I", payload)[0]))
            elif kind in (SETTINGS, PING) and flags & ACK:
                self.seen.append(("ack", kind))
            elif kind == HEADERS:
                stream, headers = sid, hpack.Decoder().decode(payload)
            elif kind == DATA:
                body += payload
                if flags & END_STREAM or (limit is not None and len(body) >= limit):
                    return stream, dict(headers), body


def answer(stream: int, body: bytes, status=("grpc-status", "0"), frame_size: int = 1 << 20) -> list[bytes]:
    message = grpc_message(body)
    return [frame(HEADERS, END_HEADERS, stream, block((":status", "200"), ("content-type", "application/grpc"))),
            *(frame(DATA, 0, stream, message[i:i + frame_size]) for i in range(0, len(message), frame_size)),
            frame(HEADERS, END_HEADERS | END_STREAM, stream, block(status))]


@pytest.fixture(scope="module")
def built():
    try:
        return native_client.library()
    except KKError as exc:
        pytest.fail(f"the native client must compile where the tests run: {exc}")


def test_status_blocks_decode_as_grpc_maps_them():
    assert call_status(block(("grpc-status", "0"))) == ("OK", "")
    assert call_status(block(("grpc-status", "3"), ("grpc-message", "bad%20shape%3A%20x"))) == \
        ("INVALID_ARGUMENT", "bad shape: x")
    assert call_status(block(("grpc-status", "5"), ("grpc-message", "nope"), huffman=False)) == ("NOT_FOUND", "nope")
    assert call_status(block((":status", "404"))) == ("UNIMPLEMENTED", "HTTP status 404 without a gRPC status")
    assert call_status(block(("grpc-status", "99")))[0] == "UNKNOWN(99)"
    assert call_status(b"\xbf\xff\xff\xff")[0] == "INTERNAL"  # an index past any table


def test_a_call_speaks_http2_as_grpc_does_and_survives_what_servers_send(built):
    """The request: preface, SETTINGS (table 0, no push, widest windows), a WINDOW_UPDATE opening the connection,
    HPACK headers gRPC needs, one length-prefixed message. The answer arrives in pieces: a server SETTINGS mid-call
    (acknowledged), its headers split over CONTINUATION, a PING (answered), the message over three padded frames,
    then the trailers; a second call reuses the connection on the next odd stream."""
    body = bytes(range(256)) * 300  # 76.8 KB: more than one default frame and window

    def script(peer):
        for _ in range(2):
            stream, headers, got = peer.request()
            peer.seen.append(("request", stream, headers, got))
            head = block((":status", "200"), ("content-type", "application/grpc"))
            msg = grpc_message(body[::-1])
            thirds = [msg[: len(msg) // 3], msg[len(msg) // 3: 2 * len(msg) // 3], msg[2 * len(msg) // 3:]]
            padded = [bytes([7]) + part + b"\0" * 7 for part in thirds]
            peer.send(frame(SETTINGS, 0, 0, struct.pack(">HI", 0x5, 1 << 15)),
                      frame(HEADERS, 0, stream, head[:3]), frame(CONTINUATION, END_HEADERS, stream, head[3:]),
                      frame(PING, 0, 0, b"12345678"),
                      *(frame(DATA, PADDED, stream, p) for p in padded),
                      frame(HEADERS, END_HEADERS | END_STREAM, stream, block(("grpc-status", "0"))))
            kind, flags, _, payload = peer.frame()  # the SETTINGS ACK comes first, then the PING's
            assert (kind, flags) == (SETTINGS, ACK)
            kind, flags, _, payload = peer.frame()
            assert (kind, flags, payload) == (PING, ACK, b"12345678")

    peer = Peer(script)
    client = GrpcH2c("127.0.0.1", peer.port)
    assert client.unary(PATH, body, 5.0) == body[::-1]
    assert client.unary(PATH, body[:10], 5.0) == body[::-1]
    client.close()
    peer.thread.join(0.5)
    assert not peer.errors, peer.errors
    settings = peer.seen[0][1]
    assert settings == {0x1: 0, 0x2: 0, 0x4: 0x7FFFFFFF, 0x5: 1 << 20}
    requests = [s for s in peer.seen if s[0] == "request"]
    assert [r[1] for r in requests] == [1, 3]
    headers = requests[0][2]
    assert (headers[":method"], headers[":scheme"], headers[":path"]) == ("POST", "http", PATH.decode())
    assert headers["content-type"] == "application/grpc" and headers["te"] == "trailers"
    assert headers[":authority"] == f"127.0.0.1:{peer.port}"
    assert requests[0][3] == grpc_message(body) and requests[1][3] == grpc_message(body[:10])
    assert ("window", 0x7FFFFFFF - 65535) in peer.seen
    assert peer.connections == 1


def test_a_request_waits_for_the_servers_window(built):
    """A 200 KB request against the default 65,535-byte windows: the client sends no more than the window allows,
    then goes on when the server's WINDOW_UPDATEs come (connection and stream). The 1 MB answer comes in frames of
    300 KB, each read into place."""
    body = b"x" * 200_000

    def script(peer):
        stream, _, got = peer.request(limit=65535)
        time.sleep(0.2)  # a client that ignored the window would have sent more by now
        peer.conn.settimeout(0.05)
        try:
            peer.buf += peer.conn.recv(1 << 20)
        except OSError:
            pass
        peer.conn.settimeout(None)
        peer.seen.append(("before update", len(got), len(peer.buf)))
        peer.send(frame(WINDOW, 0, 0, struct.pack(">I", 1 << 20)), frame(WINDOW, 0, stream, struct.pack(">I", 1 << 20)))
        rest = b""
        while True:
            kind, flags, sid, payload = peer.frame()
            if kind == DATA:
                rest += payload
                if flags & END_STREAM:
                    break
        peer.seen.append(("whole", got + rest == grpc_message(body)))
        peer.send(*answer(stream, big, frame_size=300_000))  # frames larger than what one read takes

    big = bytes(range(251)) * 4000  # about 1 MB back, read from the socket straight into the answer
    peer = Peer(script, windows=None)
    client = GrpcH2c("127.0.0.1", peer.port)
    view = client.unary(PATH, body, 5.0, copy=False)  # the load generator's way: a view, valid until the next call
    assert isinstance(view, memoryview) and view == big
    peer.thread.join(0.5)
    assert not peer.errors, peer.errors
    before = next(s for s in peer.seen if s[0] == "before update")
    assert before[1] == 65535 and before[2] == 0  # exactly the window, and nothing beyond it until the update
    assert ("whole", True) in peer.seen


def test_errors_are_grpcs_words_and_the_next_call_reconnects(built):
    """A status answer (trailers only), RST_STREAM, GOAWAY and a silent server each fail that call with grpcio's
    wording; after a broken connection the next call opens a fresh one."""
    plan = iter(["status", "rst", "goaway", "ok", "silent"])

    def script(peer):
        while True:
            step = next(plan)
            stream, _, _ = peer.request()
            if step == "status":
                peer.send(frame(HEADERS, END_HEADERS | END_STREAM, stream,
                                block((":status", "200"), ("grpc-status", "5"), ("grpc-message", "unknown%20model"))))
            elif step == "rst":
                peer.send(frame(RST, 0, stream, struct.pack(">I", 2)))
                return
            elif step == "goaway":
                peer.send(frame(GOAWAY, 0, 0, struct.pack(">II", stream, 0) + b"shutting down"))
                return
            elif step == "ok":
                peer.send(*answer(stream, b"fine"))
            else:
                time.sleep(1.0)
                return

    peer = Peer(script)
    client = GrpcH2c("127.0.0.1", peer.port)
    with pytest.raises(GrpcCallError, match=r"^\[StatusCode.NOT_FOUND\] unknown model$"):
        client.unary(PATH, b"a", 5.0)
    with pytest.raises(GrpcCallError, match=r"UNAVAILABLE.*RST_STREAM, HTTP/2 error code 2"):
        client.unary(PATH, b"b", 5.0)
    with pytest.raises(GrpcCallError, match=r"UNAVAILABLE.*GOAWAY, HTTP/2 error code 0\): shutting down"):
        client.unary(PATH, b"c", 5.0)
    assert client.unary(PATH, b"d", 5.0) == b"fine"
    began = time.monotonic()
    with pytest.raises(GrpcCallError, match=r"^\[StatusCode.DEADLINE_EXCEEDED\] no answer within the deadline$"):
        client.unary(PATH, b"e", 0.2)
    assert time.monotonic() - began < 0.8
    assert peer.connections == 3  # the first for the status and the reset, then after each broken one
    assert not peer.errors, peer.errors
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now
    with pytest.raises(GrpcCallError, match=rf"UNAVAILABLE\] cannot connect to 127.0.0.1:{port}"):
        GrpcH2c("127.0.0.1", port).unary(PATH, b"", 1.0)


def test_a_connection_the_server_left_is_replaced_without_failing_a_call(built):
    """A server that closes an idle connection, or says GOAWAY while it sits idle, costs the next call nothing: the
    client notices before sending and opens a fresh connection. A stream the server refused unseen (GOAWAY naming an
    earlier last stream, or RST_STREAM with REFUSED_STREAM) is sent once more, on a fresh connection."""
    plan = iter(["ok-then-close", "goaway-idle", "goaway-unseen", "ok", "refused", "ok"])

    def script(peer):
        while True:
            step = next(plan, None)
            if step is None:
                return
            stream, _, got = peer.request()
            peer.seen.append((step, stream, got))
            if step == "ok-then-close":
                peer.send(*answer(stream, b"1"))
                return  # the server closes the connection after answering
            if step == "goaway-idle":
                peer.send(*answer(stream, b"2"), frame(GOAWAY, 0, 0, struct.pack(">II", stream, 0)))
                time.sleep(0.3)  # the client reads the GOAWAY before its next request; nothing more comes here
                return
            if step == "goaway-unseen":
                peer.send(frame(GOAWAY, 0, 0, struct.pack(">II", stream - 1, 0)))  # the last one it took: none
                return
            if step == "refused":
                peer.send(frame(RST, 0, stream, struct.pack(">I", 7)))
                time.sleep(0.3)  # the client leaves this connection for a fresh one
                return
            peer.send(*answer(stream, got[5:]))

    peer = Peer(script)
    client = GrpcH2c("127.0.0.1", peer.port)
    assert client.unary(PATH, b"a", 5.0) == b"1"
    time.sleep(0.2)  # the close has arrived
    assert client.unary(PATH, b"b", 5.0) == b"2"
    time.sleep(0.1)  # the GOAWAY has arrived
    assert client.unary(PATH, b"c", 5.0) == b"c"  # refused unseen on connection 3, answered on connection 4
    assert client.unary(PATH, b"d", 5.0) == b"d"  # refused with RST_STREAM, sent again on a fresh connection
    peer.thread.join(0.5)
    assert not peer.errors, peer.errors
    assert [s[0] for s in peer.seen if isinstance(s[0], str) and s[0] not in ("settings", "ack", "window")] == \
        ["ok-then-close", "goaway-idle", "goaway-unseen", "ok", "refused", "ok"]
    assert peer.connections == 5
