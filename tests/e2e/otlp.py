"""An OTLP/HTTP trace receiver for tests: what real services export, decoded, in memory.

Services started with ``OTEL_EXPORTER_OTLP_ENDPOINT=<receiver.endpoint>`` export their spans here
exactly as they would to Jaeger (protobuf ``ExportTraceServiceRequest`` on ``POST /v1/traces``).
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Link:
    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Span:
    service: str  # the exporting process's service.name resource attribute
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a trace's root
    attributes: dict[str, Any]
    links: tuple[Link, ...] = field(default=())


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[Span]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        service = str(_attrs(rs.resource.attributes).get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(service=service, name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                                parent_span_id=s.parent_span_id.hex(), attributes=_attrs(s.attributes),
                                links=tuple(Link(ln.trace_id.hex(), ln.span_id.hex(), _attrs(ln.attributes))
                                            for ln in s.links)))
    return out


class OtlpReceiver:
    """Accepts OTLP/HTTP protobuf exports on a free loopback port until ``close``."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self.errors: list[str] = []  # bodies it could not decode: a test should see none
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                try:
                    spans = decode(body)
                except Exception as exc:  # noqa: BLE001 - recorded for the test to assert on
                    with receiver._lock:
                        receiver.errors.append(repr(exc))
                    self.send_response(400)
                    self.end_headers()
                    return
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.requests += 1
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:  # quiet: one line per export is noise
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
