#!/usr/bin/env python3
"""A stand-in for an LLM API, for trying tollgate's LLM gateways on one machine.

Every request gets a small OpenAI-style chat completion, with no model behind it:

* for envoy/llm-gateway.yaml (a token budget charged after the response), its cost in LLM tokens
  is in the response header x-tokens-used: the request's x-demo-tokens header, else 600;
* for envoy/llm-budgets.yaml (money budgets), it names the request's `model` as the one that
  served it, and its `usage` says what it used, from the request's
  JSON body: prompt_tokens = the body's length in bytes, a quarter of them cached
  (prompt_tokens_details.cached_tokens), completion_tokens = half of max_completion_tokens or
  max_tokens (100 without either). With "stream": true the answer is server-sent events, the
  usage in the last one before [DONE], as OpenAI streams it with stream_options.include_usage.
  With "fail": <status> it answers that status and an error, with no usage (as a provider's
  error answer, which it does not bill).

    python3 envoy/demo/fake-llm.py 8000
"""
import http.server
import json
import sys


def usage(body, request):
    limit = request.get("max_completion_tokens") or request.get("max_tokens") or 200
    prompt = len(body)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": limit // 2,
        "total_tokens": prompt + limit // 2,
        "prompt_tokens_details": {"cached_tokens": prompt // 4},
    }


class FakeLlm(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def answer(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            request = json.loads(body) if body else {}
        except ValueError:
            request = {}
        used = usage(body, request)
        if isinstance(request.get("fail"), int):
            data = json.dumps({"error": {"message": "the stand-in failed as asked"}}).encode()
            self.send_response(request["fail"])
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if request.get("stream"):
            model = request.get("model")
            events = [
                {"model": model, "choices": [{"delta": {"content": "ok"}}]},
                {"model": model, "choices": [], "usage": used},
            ]
            data = ("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n").encode()
            kind = "text/event-stream"
        else:
            answer = {
                "object": "chat.completion",
                "model": request.get("model"),
                "choices": [{"message": {"content": "ok"}}],
                "usage": used,
            }
            data = json.dumps(answer).encode()
            kind = "application/json"
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.send_header("x-tokens-used", self.headers.get("x-demo-tokens", "600"))
        self.end_headers()
        self.wfile.write(data)

    do_GET = answer
    do_POST = answer

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    http.server.ThreadingHTTPServer(("127.0.0.1", port), FakeLlm).serve_forever()
