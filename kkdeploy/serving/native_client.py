"""gRPC calls without grpcio's Python: `kkdeploy loadtest --client native`.

Why. On the lent GPU host an empty gRPC call through grpcio took 0.15-0.42 ms, more than Triton spends serving a
batch-1 request there (about 0.3 ms), so a batch-1 latency measured with it is mostly the load generator's.
perf_analyzer, the C++ generator that would not be, cannot be installed on our machines (``loadtest``'s docstring).
``csrc/grpc_h2c_client.cc`` speaks just enough HTTP/2 for one unary call at a time on its own connection, in C++,
called through ctypes (which releases the GIL for the call, so each client thread waits on its own).

What stays in Python, and why it is off the clock. The request is serialized once per payload (``LeanGrpc``). The
answer's status is read from its HPACK header block with ``hpack`` (python-hyper's decoder): the client announces a
0-byte dynamic table, so each block decodes alone, and a block already seen to carry ``grpc-status: 0`` is
recognized by its bytes without decoding again. The message is handed back as bytes and parsed only to be checked,
after the clock, as with grpcio.

The library is compiled here on first use (``$CXX``, else g++, a second or two) and cached like the in-process
backend (``backend_build.compiled_library``).
"""

from __future__ import annotations

import ctypes
import threading
import urllib.parse
from pathlib import Path

from ..errors import KKError
from ..kernels.cuda_build import cxx_compiler
from .backend_build import CSRC, compiled_library

SOURCE = CSRC / "grpc_h2c_client.cc"
LIBRARY_NAME = "libkkdeploy_grpc_h2c.so"
WHAT = "the native gRPC client"
OTHERWISE = "; or load with --client lean"
# gRPC's status codes by number, named as grpcio's StatusCode prints them
STATUS_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
                "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")
# gRPC's mapping of an HTTP status without grpc-status (doc/http-grpc-status-mapping.md)
HTTP_TO_GRPC = {400: "INTERNAL", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "UNIMPLEMENTED",
                429: "UNAVAILABLE", 502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "UNAVAILABLE"}

_loaded: ctypes.CDLL | None = None
_lock = threading.Lock()


class GrpcCallError(RuntimeError):
    """A failed call, worded as ``LeanGrpc`` words grpcio's: ``[StatusCode.NAME] details``."""

    def __init__(self, code: str, details: str):
        super().__init__(f"[StatusCode.{code}] {details}")
        self.code, self.details = code, details


class _Result(ctypes.Structure):
    _fields_ = [("message", ctypes.c_void_p), ("message_len", ctypes.c_uint64),
                ("headers", ctypes.c_void_p), ("headers_len", ctypes.c_uint64),
                ("trailers", ctypes.c_void_p), ("trailers_len", ctypes.c_uint64)]


def library_path(log=None) -> Path:
    """The compiled client, built on first use and cached (a one-line KKError when it cannot be)."""
    cxx = cxx_compiler(WHAT, OTHERWISE)
    flags = ["-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden"]
    return compiled_library(cxx, [SOURCE], flags, [], "grpc-client", LIBRARY_NAME, WHAT, OTHERWISE, log)


def unavailable(build: bool = True) -> str | None:
    """Why the native client cannot run here (no hpack, no compiler, or with ``build`` a failed compile), or None:
    what ``loadtest --client auto`` asks before it picks this client (building it), and ``kkdeploy env`` (not)."""
    try:
        import hpack  # noqa: F401
    except ImportError:
        return "hpack is not installed (pip install 'kkdeploy[serve]')"
    try:
        library_path() if build else cxx_compiler(WHAT, OTHERWISE)
    except KKError as exc:
        return str(exc)
    return None


def library(log=None) -> ctypes.CDLL:
    global _loaded
    with _lock:
        if _loaded is None:
            lib = ctypes.CDLL(str(library_path(log)))
            lib.kk_h2c_new.restype = ctypes.c_void_p
            lib.kk_h2c_new.argtypes = [ctypes.c_char_p, ctypes.c_int]
            lib.kk_h2c_free.argtypes = [ctypes.c_void_p]
            lib.kk_h2c_error.restype = ctypes.c_char_p
            lib.kk_h2c_error.argtypes = [ctypes.c_void_p]
            lib.kk_h2c_call.restype = ctypes.c_int
            lib.kk_h2c_call.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64,
                                        ctypes.c_double, ctypes.POINTER(_Result)]
            _loaded = lib
        return _loaded


def call_status(block: bytes) -> tuple[str, str]:
    """``(status name, message)`` from an answer's last HPACK header block (its trailers, or a trailers-only answer's
    only block). No ``grpc-status`` there is an error named after the HTTP status, as gRPC maps it."""
    try:
        import hpack
    except ImportError:
        raise KKError(f"{WHAT} needs hpack to read answers' status: pip install 'kkdeploy[serve]' (or hpack)"
                      f"{OTHERWISE}") from None
    try:
        fields = dict(hpack.Decoder().decode(block))
    except hpack.HPACKError as exc:
        return "INTERNAL", f"the answer's header block does not decode: {exc}"
    status = fields.get("grpc-status")
    if status is None:
        http = fields.get(":status", "?")
        code = HTTP_TO_GRPC.get(int(http), "UNKNOWN") if http.isdigit() else "UNKNOWN"
        return code, f"HTTP status {http} without a gRPC status"
    number = int(status) if status.isdigit() else -1
    name = STATUS_NAMES[number] if 0 <= number < len(STATUS_NAMES) else f"UNKNOWN({status})"
    return name, urllib.parse.unquote(fields.get("grpc-message", ""))


class GrpcH2c:
    """One HTTP/2 connection to ``host:port`` for unary calls, one at a time (a client per thread), made on the
    first call and remade by the call after a failure."""

    def __init__(self, host: str, port: int):
        self.lib = library()
        self.handle = self.lib.kk_h2c_new(host.encode(), int(port))
        self.result = _Result()
        self.ok_blocks: set[bytes] = set()  # header blocks already read as grpc-status 0

    def unary(self, path: bytes, request: bytes, timeout_s: float, copy: bool = True) -> bytes | memoryview:
        """The answer's message bytes; GrpcCallError for a status other than OK or a transport failure. With
        ``copy=False`` a view of the client's own buffer instead, valid until this connection's next call: the load
        generator parses it before then, and a 256 KB shape-13 answer is not copied once more inside the clock."""
        r = self.result
        rc = self.lib.kk_h2c_call(self.handle, path, request, len(request), float(timeout_s), ctypes.byref(r))
        if rc != 0:
            code = "DEADLINE_EXCEEDED" if rc == -2 else "UNAVAILABLE"
            raise GrpcCallError(code, self.lib.kk_h2c_error(self.handle).decode(errors="replace"))
        if r.trailers:
            block = ctypes.string_at(r.trailers, r.trailers_len)
        elif r.headers:
            block = ctypes.string_at(r.headers, r.headers_len)
        else:
            raise GrpcCallError("INTERNAL", "the stream ended without a header block")
        if block not in self.ok_blocks:
            code, details = call_status(block)
            if code != "OK":
                raise GrpcCallError(code, details)
            self.ok_blocks.add(block)
        if not r.message:
            raise GrpcCallError("INTERNAL", "grpc-status 0 without a response message")
        if copy:
            return ctypes.string_at(r.message, r.message_len)
        return memoryview((ctypes.c_char * r.message_len).from_address(r.message)).cast("B")

    def close(self) -> None:
        if self.handle:
            self.lib.kk_h2c_free(self.handle)
            self.handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
