"""A small HTTP/1.1 file server for remote-set tests (standard library only), on 127.0.0.1.

It serves the files under one folder: ``HEAD`` and ``GET``, single ``Range: bytes=a-b`` requests
(``206`` with ``Content-Range``), an ``ETag`` (the content's SHA-1: a file rewritten in place gets
another) and ``Content-Length`` on every answer; a folder or a missing file is a ``404``.  Made
``writable``, it also stores the body of a ``PUT`` or ``POST`` (chunked or not) at its path, as
fsspec's HTTP file system uploads.

What a test can ask of it:

- ``require_query(name, value)``: every request must carry ``?name=value`` (a presigned URL's
  signature), else ``403``;
- ``fault(kind, times, match="", skip=0)``: the next ``times`` requests of a path containing
  ``match`` (after ``skip`` of them answered as usual) get one of these faults:

  - ``"503"``: a 503 answer, to a HEAD or a GET;
  - ``"stall"`` (a GET): the headers, then no byte until the server stops or ``stall_s`` pass;
  - ``"cut"`` (a GET): the headers of the whole answer, half the body, then the connection closes;
  - ``"halfway"`` (a GET): half the body, then nothing until the server stops or ``stall_s`` pass;
  - ``"drip"`` (a GET): a byte every ``drip_s`` seconds, which no stall timeout sees, until the
    body is sent, the server stops or ``stall_s`` pass;
  - ``"change"`` (a GET): half the body, then the file is rewritten in place (a byte of each half
    flipped, the second 10 bytes before its end) and the rest of the body is the new content's;
- ``send_length = False``: no ``Content-Length`` (a body then ends when the connection closes);
- ``gets(match)``, ``faults``: the GETs answered for paths containing ``match``, the faults sent;
- ``authorizations``: the ``Authorization`` header of each request (None where it had none).

Use it as a context manager: ``with HTTPFileServer(folder) as server: server.url("set.zip")``.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple
from urllib.parse import parse_qs, unquote, urlsplit

FAULT_KINDS = ("503", "stall", "cut", "halfway", "drip", "change")


class HTTPFileServer(ThreadingHTTPServer):
    """Files under ``root`` over HTTP on 127.0.0.1 (a free port), each connection on a thread."""

    daemon_threads = True

    def __init__(self, root: "str | os.PathLike[str]", stall_s: float = 30.0, writable: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = os.path.realpath(root)
        self.stall_s, self.writable, self.send_length = stall_s, writable, True
        self.drip_s = 0.05
        self.lock = threading.Lock()
        self.required: Optional[Tuple[str, str]] = None
        self.planned: List[Dict[str, object]] = []
        self.faults: List[Tuple[str, str]] = []  # (kind, path) of each fault sent
        self.served: List[Tuple[str, str, int]] = []  # (method, path, status) of each answer
        self.authorizations: List[Optional[str]] = []
        self.stopping = threading.Event()
        self.thread: Optional[threading.Thread] = None

    # ---- what a test asks ----
    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def url(self, name: str = "") -> str:
        """The http:// URL of ``name`` (a path under the root)."""
        return f"http://127.0.0.1:{self.port}/{name}"

    def require_query(self, name: str, value: str) -> None:
        """Answer 403 to every request without ``?name=value``."""
        with self.lock:
            self.required = (name, value)

    def fault(self, kind: str, times: int = 1, match: str = "", skip: int = 0) -> None:
        """The next ``times`` requests (GETs but for a 503) of a path with ``match`` in it, after ``skip``
        of them, get the fault ``kind``."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"no fault {kind!r}: one of {FAULT_KINDS}")
        with self.lock:
            self.planned.append({"kind": kind, "times": times, "match": match, "skip": skip})

    def gets(self, match: str = "") -> int:
        """GETs answered (a body or a fault) for paths that contain ``match``."""
        with self.lock:
            return sum(1 for method, path, _ in self.served if method == "GET" and match in path)

    def draw(self, method: str, path: str) -> Optional[str]:
        with self.lock:
            for plan in self.planned:
                if method == "HEAD" and plan["kind"] != "503":
                    continue
                if plan["match"] in path and int(plan["skip"]) > 0:  # type: ignore[call-overload]
                    plan["skip"] = int(plan["skip"]) - 1  # type: ignore[call-overload]
                    continue
                if plan["match"] in path and int(plan["times"]) > 0:  # type: ignore[call-overload]
                    plan["times"] = int(plan["times"]) - 1  # type: ignore[call-overload]
                    self.faults.append((str(plan["kind"]), path))
                    return str(plan["kind"])
        return None

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that went away (a timed-out read, a closed session) is no error of the server's."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)  # type: ignore[arg-type]

    # ---- running ----
    def __enter__(self) -> "HTTPFileServer":
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()
        if self.thread is not None:
            self.thread.join(10)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HTTPFileServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self.answer(body=False)

    def do_GET(self) -> None:
        self.answer(body=True)

    def do_PUT(self) -> None:
        data = self.read_body()
        path = unquote(urlsplit(self.path).path)
        file = os.path.realpath(os.path.join(self.server.root, path.lstrip("/")))
        if not self.server.writable or not file.startswith(self.server.root + os.sep):
            return self.plain(403, "not writable\n", path)
        os.makedirs(os.path.dirname(file), exist_ok=True)
        with open(f"{file}.part", "wb") as handle:
            handle.write(data)
        os.replace(f"{file}.part", file)
        self.plain(201, "stored\n", path)

    do_POST = do_PUT

    def read_body(self) -> bytes:
        if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = []
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(parts)
            parts.append(self.rfile.read(size))
            self.rfile.readline()

    def answer(self, body: bool) -> None:
        with self.server.lock:
            self.server.authorizations.append(self.headers.get("Authorization"))
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        required = self.server.required
        if required is not None and parse_qs(parts.query).get(required[0]) != [required[1]]:
            return self.plain(403, "signature missing or wrong\n", path)
        file = os.path.realpath(os.path.join(self.server.root, path.lstrip("/")))
        if not file.startswith(self.server.root + os.sep) or not os.path.isfile(file):
            return self.plain(404, "no such file\n", path)
        with open(file, "rb") as handle:
            data = handle.read()
        start, end, status = 0, len(data), 200
        wanted = self.headers.get("Range")
        if wanted:
            match = re.fullmatch(r"bytes=(\d*)-(\d*)", wanted.strip())
            if match is None or not (match.group(1) or match.group(2)):
                return self.plain(416, "bad range\n", path)
            if match.group(1):
                start = int(match.group(1))
                end = min(len(data), int(match.group(2)) + 1) if match.group(2) else len(data)
            else:
                start = max(0, len(data) - int(match.group(2)))
            if start >= len(data) and len(data):
                return self.plain(416, "range beyond the file\n", path)
            status = 206
        fault = self.server.draw(self.command, path)
        if fault == "503":
            return self.plain(503, "slow down\n", path)
        self.send_response(status)
        if self.server.send_length:
            self.send_header("Content-Length", str(end - start))
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        self.server.served.append((self.command, path, status))
        if not body:
            return
        if fault == "stall":
            self.wfile.flush()
            self.server.stopping.wait(self.server.stall_s)
            self.close_connection = True
            return
        if fault == "change":
            half = start + (end - start) // 2
            self.wfile.write(data[start:half])
            self.wfile.flush()
            changed = bytearray(data)
            for k in (len(data) // 4, len(data) - 10):  # a sample and, in a zip, its end record
                changed[k] ^= 0xFF
            with open(file, "r+b") as handle:
                handle.write(changed)
            self.wfile.write(bytes(changed[half:end]))
            return
        if fault in ("halfway", "drip"):
            self.send_slowly(data[start:end], fault)
            return
        if fault == "cut":
            self.wfile.write(data[start:start + (end - start) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(data[start:end])

    def send_slowly(self, body: bytes, fault: str) -> None:
        """Half ``body`` then nothing ("halfway"), or a byte every ``drip_s`` ("drip"); never past ``stall_s``."""
        self.close_connection = True
        if fault == "halfway":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.server.stopping.wait(self.server.stall_s)
            return
        ends = time.monotonic() + self.server.stall_s
        for k in range(len(body)):
            if self.server.stopping.wait(self.server.drip_s) or time.monotonic() > ends:
                return
            self.wfile.write(body[k:k + 1])
            self.wfile.flush()

    def plain(self, status: int, text: str, path: str) -> None:
        payload = text.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.server.served.append((self.command, path, status))
        if self.command != "HEAD":
            self.wfile.write(payload)
