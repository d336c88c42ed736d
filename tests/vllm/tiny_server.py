"""A small real HTTP server for the process-lifecycle tests: /health answers 200.

Usage: python tiny_server.py PORT [--child] [--ignore-term] [--fail] [--never-healthy]
`--child` starts a grandchild in the same process group (as vLLM's engine core is), so a stop
that only signals the leader would leave it behind. `--ignore-term` ignores SIGTERM (forces the
SIGKILL path). `--fail` prints 30 numbered lines and exits 3 before listening.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = self.path == "/health" and not NEVER_HEALTHY
        self.send_response(200 if ok else 503)
        self.end_headers()
        self.wfile.write(b"ok" if ok else b"starting")

    def log_message(self, *args: object) -> None:
        pass


NEVER_HEALTHY = "--never-healthy" in sys.argv

if __name__ == "__main__":
    port = int(sys.argv[1])
    if "--fail" in sys.argv:
        for i in range(30):
            print(f"startup line {i}")
        print("ValueError: no such model")
        sys.exit(3)
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--child" in sys.argv:
        preexec = None
        if "--ignore-term" in sys.argv:

            def preexec() -> None:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)

        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=preexec)
    print(f"listening on {port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
