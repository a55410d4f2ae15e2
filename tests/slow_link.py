"""A loopback TCP proxy standing for a slow or broken network path to a server (Redis).

`SlowLink(port, first_bytes_delay_s)` listens on a free loopback port and forwards each
connection to `127.0.0.1:port`, holding the first bytes a client sends on a new connection for
`first_bytes_delay_s` (a connect + TLS handshake that takes that long; later bytes pass at
once). `freeze()` stops forwarding in both directions on every connection, new ones included,
as a network partition would (the kernel still accepts connections); `thaw()` resumes it.
Threads, not asyncio: the clients under test may be blocking ones on the test's own thread.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class SlowLink:
    """Proxy to 127.0.0.1:`port`; `url` is the redis:// URL through it. Stop with `close`."""

    def __init__(self, port: int, first_bytes_delay_s: float = 0.0) -> None:
        self.first_bytes_delay_s = first_bytes_delay_s
        self.num_connections = 0
        self._target = ("127.0.0.1", port)
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        """Stop listening and drop every connection."""
        self._closed = True
        self._flowing.set()
        with self._lock:
            sockets, self._sockets = [self._listener, *self._sockets], []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def __enter__(self) -> SlowLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        self._flowing.wait()  # frozen: the connection is accepted, nothing answers
        try:
            upstream = socket.create_connection(self._target)
        except OSError:
            client.close()  # the server is down: the client sees its connection closed
            return
        with self._lock:
            self.num_connections += 1
            self._sockets += [client, upstream]
        threading.Thread(target=self._pump, args=(upstream, client, 0.0), daemon=True).start()
        self._pump(client, upstream, self.first_bytes_delay_s)

    def _pump(self, src: socket.socket, dst: socket.socket, first_delay_s: float) -> None:
        delay = first_delay_s
        try:
            while data := src.recv(65536):
                if delay:
                    time.sleep(delay)
                    delay = 0.0
                self._flowing.wait()
                if self._closed:
                    return
                dst.sendall(data)
        except OSError:
            pass  # either side closed
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
