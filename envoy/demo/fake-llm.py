#!/usr/bin/env python3
"""A stand-in for an LLM API behind envoy/llm-gateway.yaml, for trying it on one machine.

Every request gets a small JSON answer whose cost, in LLM tokens, is in the response header
x-tokens-used: the request's x-demo-tokens header, else 600. Envoy charges that to the tenant's
token budget once the response is done.

    python3 envoy/demo/fake-llm.py 8000
"""
import http.server
import json
import sys


class FakeLlm(http.server.BaseHTTPRequestHandler):
    def answer(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        tokens = self.headers.get("x-demo-tokens", "600")
        body = json.dumps({"choices": [{"text": "ok"}], "usage": {"total_tokens": int(tokens)}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.send_header("x-tokens-used", tokens)
        self.end_headers()
        self.wfile.write(body)

    do_GET = answer
    do_POST = answer

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    http.server.ThreadingHTTPServer(("127.0.0.1", port), FakeLlm).serve_forever()
