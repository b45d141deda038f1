"""An HTTP proxy on localhost that injects the faults a job meets between it and a server, seeded.

    with FaultProxy("http://127.0.0.1:5000", rate=0.2, seed=7, stall_s=3.0) as proxy:
        os.environ["MLFLOW_TRACKING_URI"] = proxy.url
        ...
    proxy.counts   # {"forwarded": 212, "drop_before": 11, "drop_after": 9, "500": 10, "503": 12, "stall": 8}

Each request is read whole, then, with probability `rate`, one fault out of `kinds`:
- drop_before: the connection is closed without an answer; the server never sees the request;
- drop_after: the request reaches the server, which acts on it, and the answer is dropped: a client that retries a
  non-idempotent call (a POST that creates something) makes it twice;
- 500 / 503: an error answer in place of the server's;
- stall: nothing for `stall_s` seconds (past the client's timeout), then the connection is closed.
Otherwise the request is forwarded and the server's answer returned. `paths` limits the faults to those URL paths
(query strings aside), `max_faults` their number, and `once_per_path` to the first request to each URL. The fault
drawn for the n-th request depends only on the seed and n.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("drop_before", "drop_after", "500", "503", "stall")
HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        rate: float = 0.2,
        seed: int = 0,
        stall_s: float = 3.0,
        kinds: tuple[str, ...] = KINDS,
        paths: tuple[str, ...] = (),
        max_faults: int | None = None,
        once_per_path: bool = False,
    ):
        u = urlsplit(upstream)
        self.host, self.port = u.hostname, u.port
        self.rate, self.stall_s, self.kinds, self.paths, self.max_faults = rate, stall_s, kinds, paths, max_faults
        self.once_per_path, self.faulted_paths = once_per_path, set()
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.counts: dict[str, int] = {k: 0 for k in ("forwarded", *kinds)}
        self.log: list[tuple[str, str, str]] = []  # (method, path, what happened)
        self.enabled = True
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FaultProxy:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def faults(self) -> int:
        return sum(v for k, v in self.counts.items() if k != "forwarded")

    def _draw(self, path: str) -> str | None:
        with self.lock:
            hit, kind = self.rng.random() < self.rate, self.rng.choice(self.kinds)
            if self.max_faults is not None and self.faults >= self.max_faults:
                return None
        if not self.enabled or not hit or (self.paths and path.split("?")[0] not in self.paths):
            return None
        with self.lock:
            if self.once_per_path and path in self.faulted_paths:
                return None
            self.faulted_paths.add(path)
        return kind

    def _note(self, method: str, path: str, what: str) -> None:
        with self.lock:
            self.counts[what] += 1
            self.log.append((method, path, what))

    def _forward(self, method: str, path: str, headers, body: bytes):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        fwd = {k: v for k, v in headers.items() if k.lower() not in HOP | {"content-length"}}  # Host kept: it is signed
        fwd["Content-Length"] = str(len(body))
        conn.request(method, path, body=body, headers=fwd)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, resp.reason, [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP], data

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reply(self, status: int, reason: str, headers, data: bytes) -> None:
                self.send_response(status, reason)
                for k, v in headers:
                    if k.lower() != "content-length" or self.command == "HEAD":  # HEAD: the size of what GET gives
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _any(self) -> None:
                method, path, body = self.command, self.path, self._body()
                kind = proxy._draw(path)
                if kind is None:
                    proxy._note(method, path, "forwarded")
                    self._reply(*proxy._forward(method, path, self.headers, body))
                    return
                proxy._note(method, path, kind)
                if kind in ("500", "503"):
                    msg = b'{"error_code": "INTERNAL_ERROR", "message": "injected fault"}'
                    self._reply(int(kind), "Injected", [("Content-Type", "application/json")], msg)
                    return
                if kind == "drop_after":
                    proxy._forward(method, path, self.headers, body)
                elif kind == "stall":
                    time.sleep(proxy.stall_s)
                self.close_connection = True
                self.connection.shutdown(2)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _any

        return Handler
