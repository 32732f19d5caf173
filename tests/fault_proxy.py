"""A fault-injecting HTTP/1.1 reverse proxy for object-storage tests (standard library only).

It forwards every request to one S3 endpoint (path-style addressing: ``/bucket/key``) and, at a set
rate, answers a GET of an object body with a fault instead:

- ``503``: a ``503 SlowDown`` with the S3 XML error body (the connection stays open);
- ``reset``: the connection is reset (RST) before any response;
- ``truncate``: a 200/206 whose ``Content-Length`` says N but only N // 2 body bytes follow, then
  the connection closes;
- ``drop``: the request is read, then the connection is closed without an answer (after
  ``--drop-delay`` seconds).

Range requests and every other request (HEAD, PUT, listings, multipart uploads) pass through
untouched. Per object key (``bucket/key``) and in total it counts the requests (any method), the
GETs, the body bytes of the server's responses actually written to clients (a truncated body counts
what was sent; the proxy's own 503 bodies do not count), and the faults injected.

Control endpoints, never faulted or counted:

- ``GET /__stats__``: the counters as JSON: ``{"keys": {key: {...}}, "totals": {...}, "config": {...}}``;
- ``POST /__stats__/reset``: zero the counters;
- ``POST /__config__?rate=0.2&kinds=503,reset&seed=1&drop_delay=0.1``: change the fault settings.

Run it as a script: ``python tests/fault_proxy.py --upstream http://127.0.0.1:5000 --rate 0.05``.
It prints ``PORT <n>`` on stdout once it listens; with ``--watch-stdin`` it exits when its stdin
closes, so it never outlives the process that started it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Sequence
from urllib.parse import parse_qs, unquote, urlsplit

FAULT_KINDS = ("503", "reset", "truncate", "drop")
HOP_BY_HOP = frozenset(
    ["connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "expect"]
)
CHUNK = 64 * 1024
SLOWDOWN_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    "<Message>Please reduce your request rate.</Message><Resource>{resource}</Resource>"
    "<RequestId>fault-proxy</RequestId></Error>"
)


def object_key(path: str) -> str | None:
    """``bucket/key`` for a path-style object path, None for the service root or a bucket."""
    bucket, _, key = path.lstrip("/").partition("/")
    return f"{bucket}/{unquote(key)}" if bucket and key else None


def is_object_read(query: str) -> bool:
    """Whether a GET with this query string reads an object's body (not its ACL, tags, parts...)."""
    for name in parse_qs(query, keep_blank_values=True):
        plain = name in ("versionId", "partNumber", "x-id") or name.startswith("response-")
        presigned = name.lower().startswith("x-amz-") or name in ("AWSAccessKeyId", "Signature", "Expires")
        if not (plain or presigned):
            return False
    return True


class FaultPlan:
    """Which fault, if any, the next object read gets: a seeded draw per request, thread-safe."""

    def __init__(self, rate: float, kinds: Sequence[str], seed: int, drop_delay: float) -> None:
        self.lock = threading.Lock()
        self.configure(rate=rate, kinds=kinds, seed=seed, drop_delay=drop_delay)

    def configure(self, rate: float | None = None, kinds: Sequence[str] | None = None, seed: int | None = None,
                  drop_delay: float | None = None) -> None:
        with self.lock:
            if rate is not None:
                if not 0.0 <= rate <= 1.0:
                    raise ValueError(f"fault rate must be within [0, 1], got {rate}")
                self.rate = rate
            if kinds is not None:
                unknown = set(kinds) - set(FAULT_KINDS)
                if unknown:
                    raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(FAULT_KINDS)}")
                self.kinds = tuple(kinds)
            if seed is not None:
                self.random = random.Random(seed)
                self.seed = seed
            if drop_delay is not None:
                self.drop_delay = drop_delay

    def draw(self) -> str | None:
        with self.lock:
            if not self.kinds or self.random.random() >= self.rate:
                return None
            return self.random.choice(self.kinds)

    def as_dict(self) -> dict:
        with self.lock:
            return {"rate": self.rate, "kinds": list(self.kinds), "seed": self.seed, "drop_delay": self.drop_delay}


class Counters:
    """Requests, GETs, body bytes sent and faults injected, per object key and in total."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.keys: dict[str, dict] = {}
            self.totals = self._blank()

    @staticmethod
    def _blank() -> dict:
        return {"requests": 0, "gets": 0, "bytes": 0, "faults": {}}

    def _rows(self, key: str | None) -> list[dict]:
        rows = [self.totals]
        if key is not None:
            rows.append(self.keys.setdefault(key, self._blank()))
        return rows

    def request(self, key: str | None, method: str) -> None:
        with self.lock:
            for row in self._rows(key):
                row["requests"] += 1
                row["gets"] += method == "GET"

    def sent(self, key: str | None, nbytes: int) -> None:
        with self.lock:
            for row in self._rows(key):
                row["bytes"] += nbytes

    def fault(self, key: str | None, kind: str) -> None:
        with self.lock:
            for row in self._rows(key):
                row["faults"][kind] = row["faults"].get(kind, 0) + 1

    def as_dict(self) -> dict:
        with self.lock:
            return json.loads(json.dumps({"keys": self.keys, "totals": self.totals}))


class ProxyServer(ThreadingHTTPServer):
    """One thread per client connection; each keeps its own keep-alive connection upstream."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], upstream: str, plan: FaultPlan, verbose: bool = False) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http:// URL, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.plan = plan
        self.counters = Counters()
        self.verbose = verbose
        super().__init__(address, ProxyHandler)


class ProxyHandler(BaseHTTPRequestHandler):
    """Forwards one client connection's requests upstream, injecting faults into object reads."""

    protocol_version = "HTTP/1.1"
    server: ProxyServer
    _upstream: http.client.HTTPConnection | None = None

    def do_GET(self) -> None:
        self.handle_request()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def log_message(self, format: str, *args) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def finish(self) -> None:
        super().finish()
        if self._upstream is not None:
            self._upstream.close()

    # -- one request -------------------------------------------------------------------------

    def handle_request(self) -> None:
        path, _, query = self.path.partition("?")
        body, rechunked = self.read_body()
        if path.startswith("/__"):
            self.control(path, query)
            return
        key = object_key(path)
        self.server.counters.request(key, self.command)
        fault = None
        if self.command == "GET" and key is not None and is_object_read(query):
            fault = self.server.plan.draw()
        if fault == "503":
            self.server.counters.fault(key, fault)
            self.send_slowdown(path)
            return
        if fault in ("reset", "drop"):
            self.server.counters.fault(key, fault)
            self.hang_up(reset=fault == "reset")
            return
        try:
            response = self.forward(body, rechunked)
        except OSError as exc:
            self.send_plain(502, f"fault proxy: upstream {self.server.upstream} failed: {exc}\n")
            return
        self.relay(response, key, truncate=fault == "truncate")

    def read_body(self) -> tuple[bytes | None, bool]:
        """The request body (de-chunked when sent chunked) and whether it was chunked."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers: dropped, as every proxy may
                    return b"".join(parts), True
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = self.headers.get("Content-Length")
        return (self.rfile.read(int(length)) if length else None), False

    def forward(self, body: bytes | None, rechunked: bool) -> http.client.HTTPResponse:
        """Send this request upstream (reconnecting once if a kept-alive connection went stale)."""
        headers = [(name, value) for name, value in self.headers.items() if name.lower() not in HOP_BY_HOP]
        if rechunked:
            headers.append(("Content-Length", str(len(body or b""))))
        for attempt in range(2):
            reused = self._upstream is not None and self._upstream.sock is not None
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.server.upstream, timeout=60)
            try:
                self._upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    self._upstream.putheader(name, value)
                self._upstream.endheaders(body)
                return self._upstream.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._upstream.close()
                self._upstream = None
                if not reused or attempt:
                    raise
        raise AssertionError("unreachable")

    def relay(self, response: http.client.HTTPResponse, key: str | None, truncate: bool) -> None:
        """Copy the upstream response to the client, cut short when `truncate` and it has a body."""
        status = response.status
        has_body = self.command != "HEAD" and status >= 200 and status not in (204, 304)
        length_header = response.getheader("Content-Length")
        buffered = None
        if has_body and length_header is None:  # chunked or close-delimited upstream: re-frame it
            buffered = response.read()
        length = len(buffered) if buffered is not None else int(length_header or 0)
        cut = truncate and status in (200, 206) and length > 0
        self.send_response_only(status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_BY_HOP and not (has_body and name.lower() == "content-length"):
                self.send_header(name, value)
        if has_body:
            self.send_header("Content-Length", str(length))
        if cut:
            self.server.counters.fault(key, "truncate")
            self.send_header("Connection", "close")
        self.end_headers()
        if not has_body:
            response.read()
            return
        todo = length // 2 if cut else length
        if buffered is not None:
            self.send_body(key, buffered[:todo])
        else:
            while todo > 0:
                chunk = response.read(min(CHUNK, todo))
                if not chunk:
                    break
                if not self.send_body(key, chunk):
                    break
                todo -= len(chunk)
        if todo or cut:
            self.close_connection = True  # the client cannot tell where this body ended: no reuse
            self.drop_upstream()

    def send_body(self, key: str | None, data: bytes) -> bool:
        """Write body bytes to the client and count them; False if the client has gone."""
        try:
            self.wfile.write(data)
        except OSError:
            self.close_connection = True
            return False
        self.server.counters.sent(key, len(data))
        return True

    # -- faults and control ------------------------------------------------------------------

    def send_slowdown(self, path: str) -> None:
        self.send_plain(503, SLOWDOWN_XML.format(resource=path), content_type="application/xml")

    def hang_up(self, reset: bool) -> None:
        """Close the client connection without answering: with an RST (`reset`) or a FIN."""
        self.close_connection = True
        if reset:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.rfile.close()  # the socket's last reader: now close() really closes, and sends the RST
            self.connection.close()
        else:
            time.sleep(self.server.plan.as_dict()["drop_delay"])

    def control(self, path: str, query: str) -> None:
        server = self.server
        if path == "/__stats__" and self.command == "GET":
            answer = server.counters.as_dict()
        elif path == "/__stats__/reset" and self.command == "POST":
            server.counters.reset()
            answer = server.counters.as_dict()
        elif path == "/__config__" and self.command == "POST":
            fields = {name: values[-1] for name, values in parse_qs(query).items()}
            try:
                server.plan.configure(
                    rate=float(fields["rate"]) if "rate" in fields else None,
                    kinds=[k for k in fields["kinds"].split(",") if k] if "kinds" in fields else None,
                    seed=int(fields["seed"]) if "seed" in fields else None,
                    drop_delay=float(fields["drop_delay"]) if "drop_delay" in fields else None,
                )
            except ValueError as exc:
                self.send_plain(400, f"{exc}\n")
                return
            answer = {}
        else:
            self.send_plain(404, f"no control endpoint {self.command} {path}\n")
            return
        answer["config"] = server.plan.as_dict()
        self.send_plain(200, json.dumps(answer), content_type="application/json")

    def send_plain(self, status: int, text: str, content_type: str = "text/plain") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def drop_upstream(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None


def _exit_when_stdin_closes() -> None:
    sys.stdin.buffer.read()
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="the S3 endpoint to forward to, http://host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 (the default): any free port")
    parser.add_argument("--rate", type=float, default=0.0, help="chance per object GET of a fault, 0..1")
    parser.add_argument("--kinds", default=",".join(FAULT_KINDS), help="comma-separated: " + ",".join(FAULT_KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drop-delay", type=float, default=0.0, help="seconds a dropped request is held open")
    parser.add_argument("--watch-stdin", action="store_true", help="exit when stdin closes")
    parser.add_argument("--verbose", action="store_true", help="log each request to stderr")
    args = parser.parse_args(argv)
    try:
        plan = FaultPlan(args.rate, [k for k in args.kinds.split(",") if k], args.seed, args.drop_delay)
        server = ProxyServer((args.host, args.port), args.upstream, plan, verbose=args.verbose)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"PORT {server.server_address[1]}", flush=True)
    if args.watch_stdin:
        threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
