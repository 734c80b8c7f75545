#!/usr/bin/env python3
"""An upstream that takes its time: every request is answered 200 after SECONDS, so that requests
stay in flight long enough to fill a concurrency limit's slots (envoy/concurrency.yaml).

    python3 envoy/demo/slow-upstream.py 8002 2
"""
import http.server
import sys
import time


class Slow(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(float(sys.argv[2]))
        body = b"done\n"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Slow).serve_forever()
