"""The smallest engine the supervisor can run (a `custom` engine in tests): an HTTP server whose `/health`
answers 503 while it "loads" (``--load-s``), then 200. At start it writes what it was started with (its
devices, replica id, node, CPUs) as JSON to ``--env-file``, so a test can tell the binding reached it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--load-s", type=float, default=0.5)
    parser.add_argument("--env-file", required=True)
    args = parser.parse_args()
    started = time.monotonic()
    seen = {
        k: os.environ.get(k)
        for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HETSCHED_REPLICA_ID", "HETSCHED_NODE")
    }
    seen["cpus"] = sorted(os.sched_getaffinity(0))  # type: ignore[assignment]
    seen["pid"] = os.getpid()  # type: ignore[assignment]
    with open(args.env_file, "w") as out:
        json.dump(seen, out)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                loaded = time.monotonic() - started >= args.load_s
                self._answer(200 if loaded else 503, b"")
            elif self.path == "/metrics":
                self._answer(200, METRICS.encode())
            else:
                self._answer(404, b"")

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()


if __name__ == "__main__":
    main()
