"""A TCP proxy on 127.0.0.1 for fault-injection tests: it forwards bytes to a target server and can be
taken down (every open connection closed, new ones refused) and brought back up on the same port,
which to a client is the server going away and returning while the server keeps its data.

It also reads HTTP/1.x request lines (``METHOD /path HTTP/1.1``) in what clients send and calls
``on_request(method, path)`` for each, before the bytes that hold it are forwarded. The hook may call
``stop()`` or ``outage(seconds)``: the request whose line made it do so is then never forwarded, so
everything before it finished and nothing after it reaches the server.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable

_REQUEST_LINE = re.compile(rb"(GET|PUT|POST|HEAD|DELETE|PATCH|OPTIONS) (\S+) HTTP/1\.[01]\r\n")
_TAIL = 8192  # bytes kept to find request lines split across two reads


class TcpProxy:
    """``TcpProxy(host, port)``: ``start()``, ``stop()``, ``outage(s)``, ``close()``; ``url``, ``is_up``."""

    def __init__(self, target_host: str, target_port: int, *,
                 on_request: Callable[[str, str], None] | None = None) -> None:
        self.target = (target_host, target_port)
        self.on_request = on_request
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request line seen
        self.outages = 0
        self._lock = threading.RLock()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._outage: threading.Thread | None = None
        self._closed = threading.Event()
        self._up = threading.Event()
        with socket.socket() as probe:  # a free port, kept across stop()/start()
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def is_up(self) -> bool:
        return self._up.is_set()

    def wait_up(self, timeout: float) -> bool:
        return self._up.wait(timeout)

    # ---- up and down ------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._listener is not None or self._closed.is_set():
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            self._listener = listener
            self._up.set()
        threading.Thread(target=self._accept, args=(listener,), name="tcp-proxy-accept", daemon=True).start()

    def stop(self) -> None:
        """Refuse new connections and cut every open one (both ends)."""
        with self._lock:
            self._up.clear()
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            _close(listener)
        for conn in conns:
            _close(conn)

    def outage(self, seconds: float, while_down: Callable[[], None] | None = None) -> None:
        """``stop()`` now and ``start()`` again `seconds` later, or once `while_down()` (called on
        the outage's own thread right after the stop) has returned, whichever is later."""
        with self._lock:
            self.outages += 1
            self.stop()
            self._outage = threading.Thread(target=self._outage_then_start, args=(seconds, while_down),
                                            name="tcp-proxy-outage", daemon=True)
            self._outage.start()

    def _outage_then_start(self, seconds: float, while_down: Callable[[], None] | None) -> None:
        t = time.monotonic()
        try:
            if while_down is not None:
                while_down()
        finally:
            if not self._closed.wait(max(0.0, seconds - (time.monotonic() - t))):
                self.start()

    def close(self) -> None:
        """Down for good (an outage in progress does not bring it back)."""
        self._closed.set()
        self.stop()

    def __enter__(self) -> TcpProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- forwarding -------------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # the listener was closed: down
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    _close(client)
                    _close(upstream)
                    continue
                self._conns.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        tail = b""
        try:
            while data := src.recv(65536):
                if from_client:
                    buffer = tail + data
                    for match in _REQUEST_LINE.finditer(buffer):
                        if match.end() > len(tail):  # not seen in an earlier read
                            self._seen(match.group(1).decode(), match.group(2).decode("latin-1"))
                    tail = buffer[-_TAIL:]
                    with self._lock:
                        if src not in self._conns:  # the hook took the proxy down: drop this request
                            break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            _close(src)
            _close(dst)

    def _seen(self, method: str, path: str) -> None:
        self.requests.append((method, path))
        if self.on_request is not None:
            self.on_request(method, path)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
