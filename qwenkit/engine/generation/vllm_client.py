"""A vLLM server as the ranks' engine (``vllm.mode: server``): TRL's ``VLLMClient``, behind the colocated
engine's interface (``push``, ``generate``, ``params``), so rollouts and evaluation take either.

- **Requests.** Every rank sends its own requests (its prompts, as it would give its colocated engine:
  :func:`qwenkit.engine.generation.vllm_requests.request`), one HTTP call per ``generate``: a completion depends on
  its seed alone (:func:`~qwenkit.engine.rollouts.completion.completion_seed`), not on the batch it shares, so the
  server's outputs are colocate's. Requests and replies cross as :func:`~qwenkit.engine.generation.vllm_requests.to_wire`
  and :func:`~qwenkit.engine.generation.vllm_requests.reply_to_wire` write them.
- **Weights.** A push is collective as colocate's (every rank gathers each tensor); rank 0 alone sends them over the
  weight channel (:mod:`qwenkit.engine.generation.weight_channel`) while the server's ``/update_weights/`` call loads
  them, then tells every rank how many the server loaded, so no rank samples before the push is in.
- **The server checked.** At the first call the server must answer ``/health/`` within ``vllm.server_timeout_s`` and
  serve this run's engine (the model's ``config.json``, dtype, pixel bounds, a ``max_model_len`` at least this run's):
  another one is one line naming both.
- **Its failures** (it died, is unreachable, stopped answering for ``vllm.server_timeout_s``) are one line
  (:class:`ServerGone`) naming the URL and what to do; no call waits longer than that timeout.
"""

from __future__ import annotations

import datetime
import hashlib
import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch import nn

from qwenkit.engine.generation.push_tensors import checkpoint_tensors, hf_tensors
from qwenkit.engine.generation.vllm_requests import reply_from_wire, to_wire
from qwenkit.engine.generation.weight_channel import SENDER, Channel
from qwenkit.errors import EveryRank, KnownCause

COMPARED = ("dtype", "min_pixels", "max_pixels", "model_config")  # what a server must serve as this run asks


class ServerGone(KnownCause):
    """The vLLM server died, cannot be reached, or stopped answering: its URL and what to do."""


class ServerGoneEveryRank(ServerGone, EveryRank):
    """:class:`ServerGone` in a push: rank 0 met it and told every rank (rank 0 says it)."""


class ServerRefused(KnownCause):
    """The server answered that it failed (vLLM's known failure, or its own error: its log has the traceback)."""


def model_config(model_dir: str) -> str:
    """A digest of the model directory's ``config.json``: the same model on both ends, wherever it lies."""
    path = Path(model_dir) / "config.json"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else ""


def gone(url: str, why: str, note: str) -> ServerGone:
    return ServerGone(f"the vLLM server at {url} {why}; {note}")


def call(url: str, path: str, body: dict | None, timeout_s: float, note: str) -> dict:
    """``POST`` ``body`` (``GET`` when None) to the server's ``path``; its JSON reply. Raises :class:`ServerGone`
    when it cannot be reached or answers nothing within ``timeout_s``, :class:`ServerRefused` when it says it failed."""
    data = None if body is None else json.dumps(body).encode()
    ask = urllib.request.Request(f"{url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(ask, timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as e:
        said = e.read().decode(errors="replace")
        try:
            said = json.loads(said).get("detail", said)
        except ValueError:
            pass
        raise ServerRefused(f"the vLLM server at {url} failed on {path}: {said}") from e
    except TimeoutError as e:
        raise gone(url, f"answered nothing on {path} for vllm.server_timeout_s={timeout_s:g} s", note) from e
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError) as e:
        why = getattr(e, "reason", None) or e
        raise gone(url, f"cannot be reached ({type(why).__name__}: {why})" if isinstance(e, urllib.error.URLError)
                   else f"stopped answering ({type(e).__name__}: {e})", note) from e  # fmt: skip


def wait_up(url: str, timeout_s: float, note: str, alive=lambda: True) -> dict:
    """The server's ``/health/`` once it answers, retried for up to ``timeout_s`` (TRL's ``check_server``) while
    ``alive()`` (a server the kit started: its process lives)."""
    start = time.monotonic()
    while True:
        try:
            return call(url, "/health/", None, max(1.0, min(timeout_s, 10.0)), note)
        except ServerGone:
            if time.monotonic() - start >= timeout_s or not alive():
                raise
        time.sleep(0.5)


def mismatch(served: dict, spec) -> str | None:
    """Which of the engine's settings the server does not serve as ``spec`` asks, or None."""
    wanted = {"dtype": spec.dtype, "min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels,
              "model_config": model_config(spec.model_dir)}  # fmt: skip
    off = [f"{k} {served.get(k)!r} (this run: {v!r})" for k, v in wanted.items() if served.get(k) != v]
    if served.get("max_model_len", 0) < spec.max_model_len:
        off.append(f"max_model_len {served.get('max_model_len')} (this run needs {spec.max_model_len})")
    return "; ".join(off) or None


class ServedEngine:
    """The server at ``spec.server_url`` as this rank's engine (module docstring)."""

    def __init__(self, spec):
        self.spec, self.url, self.timeout = spec, spec.server_url, spec.server_timeout_s
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        served = wait_up(self.url, self.timeout, spec.server_note)["engine"]
        if (off := mismatch(served, spec)) is not None:
            raise ServerRefused(f"the vLLM server at {self.url} serves another engine than this run's: {off}; start it "
                                "with this run's config (`qwenkit vllm-serve --config ...`)")  # fmt: skip
        self.channel: Channel | None = None  # rank 0's end of the weight channel, made at the first push

    def push(self, model: nn.Module) -> int:
        """``model``'s weights into the server (collective, module docstring); returns how many tensors went."""
        said: int | str = 0
        if self.rank == 0:
            tensors = checkpoint_tensors(model, getattr(torch, self.spec.dtype))
            try:
                said = self._send(tensors)
            except ServerGone as e:
                said = str(e)
                for _ in tensors:  # the other ranks gather every tensor still: take part to the end
                    pass
        else:
            for _ in hf_tensors(model):
                pass
        if self.world_size > 1:
            box = [said]
            dist.broadcast_object_list(box, src=0)
            said = box[0]
        if isinstance(said, str):
            raise ServerGoneEveryRank(said)
        return said

    def _send(self, tensors) -> int:
        if self.channel is None:
            self.channel = self._connect()
        with ThreadPoolExecutor(1) as pool:  # the server loads while this rank sends
            loading = pool.submit(call, self.url, "/update_weights/", {}, self.timeout, self.spec.server_note)
            try:
                self.channel.send(tensors)
            except (RuntimeError, OSError) as e:  # gloo / NCCL: the other end closed, or a timeout
                self.channel = None
                try:
                    loading.result()
                except ServerGone as gone_:
                    raise gone_ from e
                raise gone(self.url, f"stopped taking the weights ({type(e).__name__}: {e})", self.spec.server_note) from e
            return loading.result()["count"]

    def _connect(self) -> Channel:
        """Rank 0's end of the weight channel: the server opens its end on a port of its choosing (TRL's
        ``init_communicator``); gloo's sockets on this host's address towards the server."""
        cuda = torch.cuda.is_available()
        where = urlsplit(self.url)
        with socket.create_connection((where.hostname, where.port), timeout=self.timeout) as s:
            there, here = s.getpeername()[0], s.getsockname()[0]  # the server's address and this host's, towards it
        asked = {"backend": "nccl" if cuda else "gloo", "host": there}
        port = call(self.url, "/init_communicator/", asked, self.timeout, self.spec.server_note)["port"]
        if cuda:
            return Channel.nccl(there, port, SENDER, torch.cuda.current_device(), self.timeout)
        from torch.distributed import TCPStore
        store = TCPStore(there, port, 2, False, timeout=datetime.timedelta(seconds=self.timeout))
        return Channel.gloo(store, SENDER, here, self.timeout)

    def generate(self, requests: list[dict], params: list[dict]) -> list:
        """The server's replies (:class:`~qwenkit.engine.generation.vllm_requests.Reply`) to this rank's requests."""
        body = {"requests": [to_wire(r) for r in requests], "params": params}
        return [reply_from_wire(r) for r in call(self.url, "/generate/", body, self.timeout, self.spec.server_note)["outputs"]]

    @staticmethod
    def params(**settings) -> dict:
        """vLLM's ``SamplingParams`` keyword arguments, built on the server."""
        return settings


__all__ = ["ServedEngine", "ServerGone", "ServerRefused", "call", "mismatch", "model_config", "wait_up"]
