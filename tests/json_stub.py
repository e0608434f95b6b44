"""A loopback HTTP server answering every GET or POST with `answer(path) -> (status, document)`
as JSON, in a background thread (tests of clients that follow redirects and retries)."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Callable


def json_server(answer: Callable[[str], tuple[int, object]]) -> tuple[http.server.ThreadingHTTPServer, str]:
    """The running server (call `shutdown()` when done) and its address host:port."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            status, doc = answer(self.path)
            raw = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        do_GET = do_POST = _answer

        def log_message(self, *a) -> None:
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"127.0.0.1:{srv.server_address[1]}"
