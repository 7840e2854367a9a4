"""A small S3-compatible object store in the test process, for Tansu's S3 storage engine
(tests/kafka_broker.py): the objects the broker writes, where a test can delete a
partition's oldest record batches as Kafka's retention deletes a partition's oldest segments.

What Tansu's S3 client (the object_store crate) asks of it, and nothing more: path-style
PUT (with If-Match / If-None-Match, which Tansu's metadata updates rely on), GET and HEAD
(with a byte range), ListObjectsV2 by prefix, DELETE. Requests are not authenticated.
"""

from __future__ import annotations

import hashlib
import threading
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

_MS = timedelta(milliseconds=1)


class _Object:
    def __init__(self, body: bytes, after: datetime | None):
        self.body = body
        self.etag = '"' + hashlib.md5(body).hexdigest() + '"'  # noqa: S324 (S3's ETag)
        # a millisecond after the last write at least: Tansu takes a partition's newest
        # batch by its LastModified, so two writes in one millisecond must not tie
        now = datetime.now(UTC)
        self.modified = now if after is None or now > after + _MS else after + _MS


class S3Store:
    """Started on a free loopback port in a thread; ``stop`` ends it."""

    def __init__(self, bucket: str = "tansu"):
        self.bucket = bucket
        self.objects: dict[str, _Object] = {}
        self.last: datetime | None = None
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def env(self) -> dict[str, str]:
        """The environment of a process whose S3 client uses this store."""
        return {"AWS_ENDPOINT": self.endpoint, "AWS_ALLOW_HTTP": "true",
                "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_REGION": "us-east-1"}

    def start(self) -> S3Store:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def keys(self, prefix: str = "") -> list[str]:
        with self.lock:
            return sorted(k for k in self.objects if k.startswith(prefix))

    def delete(self, keys: list[str]) -> None:
        with self.lock:
            for key in keys:
                del self.objects[key]


def _handler(store: S3Store):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the broker's own log says enough
            pass

        def _key(self) -> tuple[str, str, dict]:
            url = urlsplit(self.path)
            bucket, _, key = unquote(url.path).lstrip("/").partition("/")
            return bucket, key, parse_qs(url.query)

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
                  head: bool = False) -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, status: int, code: str, head: bool = False) -> None:
            self._send(status, f"<Error><Code>{code}</Code></Error>".encode(),
                       {"Content-Type": "application/xml"}, head)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def do_PUT(self) -> None:
            _, key, _ = self._key()
            body = self._body()
            with store.lock:
                found = store.objects.get(key)
                if self.headers.get("If-None-Match") == "*" and found is not None:
                    return self._error(412, "PreconditionFailed")
                match = self.headers.get("If-Match")
                if match is not None and (found is None or found.etag != match):
                    return self._error(412 if found is not None else 404,
                                       "PreconditionFailed" if found else "NoSuchKey")
                store.objects[key] = obj = _Object(body, store.last)
                store.last = obj.modified
            self._send(200, headers={"ETag": obj.etag})

        def do_GET(self, head: bool = False) -> None:
            bucket, key, query = self._key()
            if not key:
                return self._list(query, head)
            with store.lock:
                found = store.objects.get(key)
            if found is None:
                return self._error(404, "NoSuchKey", head)
            match = self.headers.get("If-Match")
            if match is not None and match != found.etag:
                return self._error(412, "PreconditionFailed", head)
            if self.headers.get("If-None-Match") == found.etag:
                return self._send(304, headers={"ETag": found.etag}, head=True)
            headers = {"ETag": found.etag, "Last-Modified": format_datetime(found.modified, True),
                       "Content-Type": "application/octet-stream"}
            body, status = found.body, 200
            wanted = self.headers.get("Range")
            if wanted and wanted.startswith("bytes="):
                first, _, last = wanted[6:].partition("-")
                start = int(first) if first else max(0, len(body) - int(last))
                end = min(len(body) - 1, int(last)) if first and last else len(body) - 1
                headers["Content-Range"] = f"bytes {start}-{end}/{len(body)}"
                body, status = body[start:end + 1], 206
            self._send(status, body, headers, head)

        def do_HEAD(self) -> None:
            self.do_GET(head=True)

        def do_DELETE(self) -> None:
            _, key, _ = self._key()
            with store.lock:
                store.objects.pop(key, None)
            self._send(204)

        def _list(self, query: dict, head: bool) -> None:
            prefix = query.get("prefix", [""])[0]
            after = query.get("start-after", [""])[0]
            with store.lock:
                found = sorted((k, o) for k, o in store.objects.items()
                               if k.startswith(prefix) and k > after)
            # milliseconds, as S3 lists them: Tansu orders batches by their LastModified
            items = "".join(
                f"<Contents><Key>{escape(k)}</Key><LastModified>"
                f"{o.modified.strftime('%Y-%m-%dT%H:%M:%S.%f')[:-3]}Z</LastModified>"
                f"<ETag>{escape(o.etag)}</ETag><Size>{len(o.body)}</Size>"
                "<StorageClass>STANDARD</StorageClass></Contents>" for k, o in found)
            body = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>'
                    f"<Name>{store.bucket}</Name><Prefix>{escape(prefix)}</Prefix>"
                    f"<KeyCount>{len(found)}</KeyCount><MaxKeys>100000</MaxKeys>"
                    f"<IsTruncated>false</IsTruncated>{items}</ListBucketResult>").encode()
            self._send(200, body, {"Content-Type": "application/xml"}, head)

    return Handler
