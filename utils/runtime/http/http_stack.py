"""HTTP/1.1 for `--serve`: uvicorn (h11) on its own thread and event loop, with the limits a server kept for weeks needs.

Framing (keep-alive, chunked bodies, pipelining, header limits) is h11's through uvicorn; what is ours:
  - the listening socket is bound here, before the model loads, so a busy port is one `error: port:` line
    and `--port 0` knows its port at once;
  - a malformed request (h11 refuses it) is answered in the API's JSON error shape, not uvicorn's
    plain-text 400, and a header value holding a NUL byte names its header (RFC 9110 5.5);
  - a client has `client_timeout` seconds to finish its request's headers (uvicorn only times out an
    idle keep-alive connection: a client sending a byte a second would otherwise hold its
    connection forever); it is dropped with one log line;
  - uvicorn's own log records go to the job's log as one line each (the access log is ours:
    http_api.AccessLog).
No thread per connection: every connection is a coroutine on the one event loop; the model runs on
the job's main thread (utils/runtime/engine/rank_loop.py), which the endpoints only hand jobs to.
"""
from __future__ import annotations

import asyncio
import http
import json
import logging
import socket
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 32 << 10           # the request line and headers together; more is refused (431)
KEEPALIVE_IDLE_S = 30                 # an idle keep-alive connection is closed after this long
STARTUP_TIMEOUT_S = 30.0


class _RecordingConnection(h11.Connection):
    """h11's connection, remembering why it refused the peer's bytes (uvicorn keeps only a generic text)."""
    refusal = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refusal = exc
            raise


def nul_header(head: bytes):
    """The name of the first header whose value holds a NUL byte in a request head, else None."""
    for line in head.split(b"\r\n")[1:]:
        name, colon, value = line.partition(b":")
        if colon and b"\0" in value:
            return name.strip().decode("latin-1")
    return None


class ServerProtocol(H11Protocol):
    """uvicorn's h11 protocol with our answers to a malformed request and our deadline for its headers.
    `config.connection_log` (a one-line logger) and `config.header_timeout` are set by HttpServer."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.conn = _RecordingConnection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.head = bytearray()                 # the bytes of a request whose headers are not complete yet
        self.header_deadline = None

    # ------------------------------------------------------------ the headers' deadline

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if (end if end >= 0 else len(self.head)) > MAX_HEADER_BYTES:   # h11 counts only an unfinished head
                self.conn.refusal = h11.RemoteProtocolError("headers too long", error_status_hint=431)
                self.send_400_response("headers too long")
                return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:        # a whole request line and headers arrived
            self.head.clear()
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self.header_deadline = self.loop.call_later(self.config.header_timeout, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_too_slow(self) -> None:
        self.header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.head:               # it began a request and did not finish its headers in time
            self.config.connection_log(f"http {self._client()} timed out after {self.config.header_timeout:g} s "
                                       f"with its request's headers unfinished ({len(self.head)} bytes); dropped")
        self.transport.close()

    def _client(self) -> str:
        return self.client[0] if self.client else "?"

    # ------------------------------------------------------------ a malformed request, in our JSON

    def send_400_response(self, msg: str) -> None:
        refusal = self.conn.refusal
        status = getattr(refusal, "error_status_hint", 400) or 400
        name = nul_header(bytes(self.head))
        if name is not None:
            message = f"{ascii(name)[1:-1]}: the header's value holds a NUL byte; send it without one (RFC 9110 5.5)"
        elif status == 431:
            message = f"request: its headers exceed {MAX_HEADER_BYTES} bytes; send fewer or shorter headers"
        else:
            detail = str(refusal) if refusal is not None else msg
            message = f"request: not a well-formed HTTP/1.1 request ({detail}); send one"
        self.config.connection_log(f"http {self._client()} {status} {message}")
        self.config.count_refusal(status)
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": status}}).encode()
        # written as bytes, not through h11: no request was parsed for h11 to answer
        self.transport.write(f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json"
                             f"\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        self._disarm_header_deadline()
        self.transport.close()


class _OneLine(logging.Handler):
    """uvicorn's log records as one line each in the job's log (a traceback's last line only)."""

    def __init__(self, log):
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f": {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        if record.levelno >= logging.WARNING and "Invalid HTTP request" not in text:   # ours is send_400_response's
            self.log("http server: " + " ".join(text.split())[:500])


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening socket (OSError when the address is taken or not ours)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


class HttpServer:
    """An ASGI app served by uvicorn on a thread of its own, on a socket bound at construction."""

    def __init__(self, app, host: str, port: int, log, client_timeout: float, count_refusal=lambda status: None):
        self.sock = listening_socket(host, port)
        self.server_address = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, http=ServerProtocol, ws="none", lifespan="off", log_config=None,
                                access_log=False, timeout_keep_alive=KEEPALIVE_IDLE_S, server_header=False,
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_graceful_shutdown=5)
        config.connection_log, config.header_timeout, config.count_refusal = log, client_timeout, count_refusal
        uvicorn_log = logging.getLogger("uvicorn")
        uvicorn_log.handlers, uvicorn_log.propagate = [_OneLine(log)], False
        self.server = uvicorn.Server(config)
        self.loop = None
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)

    def _run(self) -> None:
        async def serve():
            self.loop = asyncio.get_running_loop()
            await self.server.serve(sockets=[self.sock])
        asyncio.run(serve())

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError("the HTTP server did not start")

    def stop_accepting(self) -> None:
        """New connections are refused from now on; those open are served on."""
        if self.loop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(lambda: [server.close() for server in self.server.servers])

    def close(self, timeout: float = 10.0) -> None:
        """Close every connection (a response being written gets timeout_graceful_shutdown) and the thread."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.sock.close()
