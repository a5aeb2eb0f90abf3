"""A TCP forwarder to take a broker away from its clients and give it back, as a restart does.

    with TcpProxy(("127.0.0.1", broker_port)) as proxy:   # clients use proxy.port
        proxy.cut()      # every connection reset, new ones refused: the broker is "down"
        proxy.restore()  # listening again on the same port: the broker is "back"
        proxy.lose_produce_responses(1)  # the next Produce is written, its answer never comes

The broker must advertise the proxy's port, or clients reconnect to it directly after the first
metadata request. Tansu's memory storage loses every topic when the process restarts (and this
Tansu build has no persistent storage engine), so restarting the broker process itself cannot
show that a client resumes where it was; cutting the network path can.
"""

from __future__ import annotations

import socket
import struct
import threading

from pipelines.local_broker import free_port


class TcpProxy:
    def __init__(self, target: tuple[str, int], port: int | None = None):
        self.target = target
        self.port = port or free_port()
        self.cuts = 0
        self._lose_produce = 0     # Produce answers still to lose
        self.lost_produce = 0      # Produce answers lost so far
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    def __enter__(self) -> "TcpProxy":
        self.restore()
        return self

    def __exit__(self, *exc):
        self.cut()

    @property
    def up(self) -> bool:
        """Whether the proxy is listening (restored, not cut)."""
        return self._listener is not None

    def restore(self):
        """Listen (again) on :attr:`port` and forward every connection to the target."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._acceptor.start()

    def cut(self):
        """Stop listening and reset every open connection (both sides see the peer vanish)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            # close() alone does not wake the thread blocked in accept() (Linux): shutdown()
            # does, so the join below does not sit out its timeout
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            try:  # SO_LINGER 0: close sends RST, as a dead process's sockets do
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # close() alone does not end the pump thread's recv() on this socket, and the
                # connection lives on (no RST) until that recv returns: SHUT_RD ends it now
                # (and sends nothing; the close that follows sends the RST)
                s.shutdown(socket.SHUT_RD)
            except OSError:
                pass
            s.close()
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
        self.cuts += 1

    def lose_produce_responses(self, count: int) -> None:
        """Lose the broker's answer to the next ``count`` Produce requests: the broker writes
        the records, and instead of its answer the client sees its connection reset (as
        when a broker's ack is lost on the way), so the client retries the request."""
        with self._lock:
            self._lose_produce += count

    def _accept(self, listener: socket.socket):
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by cut()
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # cut while connecting
                    client.close()
                    upstream.close()
                    return
                self._sockets.update((client, upstream))
            produce: set[int] = set()  # correlation ids of this connection's Produce requests
            threading.Thread(target=self._pump, args=(client, upstream, produce, False),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, produce, True),
                             daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, produce: set[int],
              responses: bool):
        """Forward Kafka frames (a 4-byte size, then the frame) from ``source`` to ``sink``:
        requests record the correlation ids of Produce requests (API key 0), responses to
        them may be lost (:meth:`lose_produce_responses`)."""
        pending = bytearray()
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                pending += data
                while len(pending) >= 4:
                    end = 4 + struct.unpack_from(">i", pending)[0]
                    if len(pending) < end:
                        break
                    if not responses and len(pending) >= 12:
                        api_key, _, correlation = struct.unpack_from(">hhi", pending, 4)
                        if api_key == 0:
                            produce.add(correlation)
                    elif responses and self._lose(produce, pending):
                        return self._reset(source, sink)
                    sink.sendall(pending[:end])
                    del pending[:end]
        except OSError:
            pass
        finally:  # one side closed: close both (the other pump then ends too)
            with self._lock:
                self._sockets.difference_update((source, sink))
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _lose(self, produce: set[int], frame: bytearray) -> bool:
        """Whether ``frame`` (a response) answers a Produce request and is to be lost."""
        if len(frame) < 8 or struct.unpack_from(">i", frame, 4)[0] not in produce:
            return False
        with self._lock:
            if not self._lose_produce:
                return False
            self._lose_produce -= 1
            self.lost_produce += 1
        return True

    def _reset(self, *sockets: socket.socket) -> None:
        for s in sockets:
            try:  # RST, as cut() does
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RD)
            except OSError:
                pass
            s.close()
