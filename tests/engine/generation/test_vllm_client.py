"""qwenkit.engine.generation.vllm_client without vLLM: what a rank says when the server cannot be reached, answers
nothing within vllm.server_timeout_s, or says it failed (one line each, naming the URL); and the check that a server
serves this run's engine. Against small HTTP servers of the standard library; the server itself is
tests/engine/generation/test_vllm_server.py's."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qwenkit.engine.generation import vllm_client
from qwenkit.engine.generation.vllm_engine import EngineSpec

NOTE = "what to do"


def _serve(handler) -> tuple[str, ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


class _Slow(BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(3)

    def log_message(self, *a):
        pass


class _Refuses(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.dumps({"detail": "vLLM has no memory left for its KV cache; raise vllm.cpu_kv_cache_gib"}).encode()
        self.send_response(422)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_a_closed_port_is_one_line_naming_the_url_and_what_to_do():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(vllm_client.ServerGone) as e:
        vllm_client.wait_up(url, 1.0, NOTE)
    assert time.monotonic() - start < 10  # retried for the timeout, then given up
    said = str(e.value)
    assert "\n" not in said and said.startswith(f"the vLLM server at {url} cannot be reached (") and said.endswith(NOTE)


def test_no_answer_within_the_timeout_is_one_line_not_a_hang():
    url, server = _serve(_Slow)
    try:
        with pytest.raises(vllm_client.ServerGone, match=r"answered nothing on /health/ for vllm\.server_timeout_s=1 s"):
            vllm_client.call(url, "/health/", None, 1.0, NOTE)
    finally:
        server.shutdown()


def test_a_failure_the_server_reports_is_its_line():
    url, server = _serve(_Refuses)
    try:
        with pytest.raises(vllm_client.ServerRefused, match=r"failed on /generate/: vLLM has no memory left for its KV"):
            vllm_client.call(url, "/generate/", {"requests": []}, 5.0, NOTE)
    finally:
        server.shutdown()


def test_a_server_of_another_engine_is_named(tiny_path):
    spec = EngineSpec(str(tiny_path), "float32", 2048, 0, 100, 1000, 0.3, 1.0, False)
    served = {"dtype": "float32", "min_pixels": 100, "max_pixels": 1000, "max_model_len": 4096,
              "model_config": vllm_client.model_config(str(tiny_path))}  # fmt: skip
    assert vllm_client.model_config(str(tiny_path)) and vllm_client.mismatch(served, spec) is None
    off = vllm_client.mismatch({**served, "dtype": "bfloat16", "max_model_len": 1024, "model_config": "0" * 16}, spec)
    assert "dtype 'bfloat16' (this run: 'float32')" in off and "max_model_len 1024 (this run needs 2048)" in off
    assert "model_config '0000000000000000'" in off
