"""A TCP proxy on 127.0.0.1 in front of a real server, whose `cut(seconds)` is an outage: open
connections are reset and new ones refused (nothing listens) for that long, then it listens
again on the same port. Used to take the S3 endpoint (moto's server) away mid-run."""
import socket
import struct
import threading
import time

from _s3_server import free_port


class TcpProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1", port: int | None = None):
        self.target = ("127.0.0.1", int(target_port))
        self.host = host  # the address it listens on (tests/cluster: every address of its host)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._conns: set = set()
        self._lock = threading.Lock()
        self._listener = None
        self.cuts: list = []  # (start, end) of each outage, time.time()

    def __enter__(self) -> "TcpProxy":
        self._listen()
        return self

    def __exit__(self, *exc) -> None:
        self._close_all()

    def _listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by cut() or exit
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _close_all(self) -> None:
        if self._listener is not None:
            # shutdown first: close() alone leaves the socket listening while the accept thread
            # is blocked in accept() on it (Linux), so one connection got through the outage and
            # the restore's bind failed (EADDRINUSE) when none came: the outage never ended
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:  # a reset, as when the server goes away
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass

    def cut(self, seconds: float) -> None:
        """Reset every connection and refuse new ones for `seconds` (returns at once)."""
        start = time.time()
        self._close_all()

        def restore() -> None:
            time.sleep(seconds)
            self._listen()
            self.cuts.append((start, time.time()))

        threading.Thread(target=restore, daemon=True).start()
