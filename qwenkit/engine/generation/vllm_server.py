"""``qwenkit vllm-serve``: one vLLM engine in its own process, serving a run's ranks (``vllm.mode: server``).

TRL's ``trl vllm-serve`` (``trl/scripts/vllm_serve.py``) in the kit's shape: the engine is the colocated one
(:func:`qwenkit.engine.generation.vllm_engine.start_engine`, built from the run's config by the same
:func:`~qwenkit.engine.generation.vllm_engine.spec_of`, so its replies are colocate's), behind FastAPI and uvicorn
(vLLM ships both), bound to 127.0.0.1 unless ``--host`` says otherwise. Its endpoints:

- ``GET /health/``: up, and the engine it serves (the ranks check it is theirs:
  :func:`qwenkit.engine.generation.vllm_client.mismatch`);
- ``POST /generate/``: token-id requests and their ``SamplingParams`` in, vLLM's replies out
  (:mod:`qwenkit.engine.generation.vllm_requests`' wire);
- ``POST /init_communicator/``: opens the server's end of the weight channel on a free port
  (:mod:`qwenkit.engine.generation.weight_channel`; a new client replaces an old one: a resumed run reconnects);
- ``POST /update_weights/``: receives one push on the channel into the engine (the colocated engine's
  :meth:`~qwenkit.engine.generation.vllm_engine.VllmEngine.load`), and answers how many tensors came.

One call at a time reaches the engine (a lock). :func:`start` is the launcher's: with ``vllm.server_url`` empty it runs
this command on the run's config, on 127.0.0.1 and a free port, on a device the ranks do not use, its output in
``<output_dir>/logs/vllm-server.log``; it waits for ``/health/`` (``vllm.server_timeout_s``), and the server
dies with the launcher (``PR_SET_PDEATHSIG``) or when :meth:`Server.stop` ends it after the run.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import torch

from qwenkit.engine.generation import vllm_engine
from qwenkit.engine.generation.vllm_client import ServerGone, model_config, wait_up
from qwenkit.engine.generation.vllm_requests import from_wire, reply_to_wire, settings_from_wire
from qwenkit.engine.generation.weight_channel import SERVER, Channel
from qwenkit.engine.run.stopping import set_parent_death_signal
from qwenkit.model.paths import load_processor, resolve_path
from qwenkit.rundir import RunDir

log = logging.getLogger(__name__)
LOG_NAME = "vllm-server.log"  # in the run's logs/: the kit's own server's output
STOP_WAIT_S = 30  # after SIGTERM, before SIGKILL


def engine_spec(cfg) -> vllm_engine.EngineSpec:
    """The engine a run's config asks for, as the server runs it: colocate's (no sleep: nothing shares its device)."""
    cfg = vllm_engine.colocated(cfg)
    spec = vllm_engine.spec_of(cfg, load_processor(cfg), str(resolve_path(cfg.model)))
    return dataclasses.replace(spec, sleep=False)


class Served:
    """The engine, its lock and its end of the weight channel (module docstring)."""

    def __init__(self, engine, spec, timeout_s: float):
        self.engine, self.spec, self.timeout_s, self.lock = engine, spec, timeout_s, threading.Lock()
        self.channel: Channel | None = None
        self.opening: threading.Thread | None = None  # the channel being opened (it waits for the client)
        self.failed: BaseException | None = None

    def health(self) -> dict:
        s = self.spec
        return {"status": "ok", "engine": {"dtype": s.dtype, "min_pixels": s.min_pixels, "max_pixels": s.max_pixels,
                                           "max_model_len": s.max_model_len, "model_config": model_config(s.model_dir)}}  # fmt: skip

    def generate(self, body: dict) -> dict:
        requests = [from_wire(r) for r in body["requests"]]
        params = [self.engine.params(**settings_from_wire(p)) for p in body["params"]]
        with self.lock:
            outs = self.engine.generate(requests, params)
        return {"outputs": [reply_to_wire(o) for o in outs]}

    def open(self, backend: str, host: str) -> dict:
        """The server's end of a new weight channel on ``host`` (this server's address as the client reached it): its port."""
        self.channel, self.failed = None, None
        timeout = self.timeout_s
        if backend == "nccl":
            listening = socket.create_server((host, 0))  # the store's socket, its port free (no race)
            port = listening.getsockname()[1]
            target = lambda: Channel.nccl(host, port, SERVER, torch.cuda.current_device(), timeout, listening)  # noqa: E731
        else:
            from torch.distributed import TCPStore

            store = TCPStore(host, 0, 2, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
            port = store.port
            target = lambda: Channel.gloo(store, SERVER, host, timeout)  # noqa: E731

        def opening():
            try:
                self.channel = target()
            except Exception as e:  # noqa: BLE001 - said at the next push
                self.failed = e

        self.opening = threading.Thread(target=opening, daemon=True)
        self.opening.start()
        return {"host": host, "port": port}

    def update(self) -> dict:
        if self.opening is not None:
            self.opening.join()
        if self.channel is None:
            raise RuntimeError(f"no weight channel: /init_communicator/ first ({self.failed or 'never opened'})")
        with self.lock:
            count = self.engine.load(self.channel.receive())
        return {"count": count}


def app(served: Served):
    """The FastAPI app of ``served`` (module docstring)."""
    from fastapi import FastAPI, HTTPException

    api = FastAPI()

    def guarded(fn, *args):
        try:
            return fn(*args)
        except vllm_engine.EngineFailure as e:  # its cause and fix: the client's one line
            raise HTTPException(422, detail=str(e)) from e
        except Exception as e:  # noqa: BLE001 - its traceback here, a line for the client
            log.exception("the server failed")
            raise HTTPException(500, detail=f"{type(e).__name__}: {e} (its traceback is in the server's log)") from e

    @api.get("/health/")
    async def health():
        return served.health()

    @api.post("/generate/")
    def generate(body: dict):
        return guarded(served.generate, body)

    @api.post("/init_communicator/")
    def init_communicator(body: dict):
        return guarded(served.open, body["backend"], body["host"])

    @api.post("/update_weights/")
    def update_weights():
        return guarded(served.update)

    return api


def serve(cfg, host: str, port: int) -> int:
    """``qwenkit vllm-serve``: the engine of ``cfg``, served at ``http://host:port`` until stopped."""
    import uvicorn  # vLLM's dependency: a server needs vLLM

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = engine_spec(cfg)
    served = Served(vllm_engine.start_engine(spec), spec, cfg.vllm.server_timeout_s)
    print(f"qwenkit vllm-serve: serving {spec.model_dir} ({spec.dtype}) at http://{host}:{port}; set "
          f"vllm.mode=server vllm.server_url=http://{host}:{port} in the run", flush=True)  # fmt: skip
    uvicorn.run(app(served), host=host, port=port, log_level="warning")
    return 0


@dataclasses.dataclass
class Server:
    """A server the launcher started (:func:`start`)."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _server_child() -> None:
    """The server's own process group (a terminal's Ctrl-C reaches the launcher only, which stops the ranks first)
    and SIGTERM when the launcher dies."""
    os.setpgid(0, 0)
    set_parent_death_signal(signal.SIGTERM)


def server_devices(nproc: int, env: dict[str, str]) -> dict[str, str]:
    """CUDA: the first visible device after the ranks' ``nproc`` as the server's only one (prespawn checked one is
    left); CPU: nothing to choose (the server shares the host's cores)."""
    if not torch.cuda.is_available():
        return {}
    visible = env.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(torch.cuda.device_count()))).split(",")
    return {"CUDA_VISIBLE_DEVICES": visible[nproc]}


def start(cfg, config_path: Path, env: dict[str, str], port: int) -> Server:
    """The run's own server (module docstring) on 127.0.0.1:``port``, up; raises
    :class:`~qwenkit.engine.generation.vllm_client.ServerGone` naming its log when it dies or is not up within
    ``vllm.server_timeout_s``."""
    url = f"http://127.0.0.1:{port}"
    run = RunDir(cfg.train.output_dir)
    run.logs.mkdir(parents=True, exist_ok=True)
    log_path = run.logs / LOG_NAME
    cmd = [sys.executable, "-m", "qwenkit.cli", "vllm-serve", "--config", str(config_path), "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    with open(log_path, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**env, **server_devices(cfg.parallel.nproc, env)},
                                preexec_fn=_server_child)  # fmt: skip
    server = Server(url, proc, log_path)
    note = f"its log is {log_path}"
    try:
        wait_up(url, cfg.vllm.server_timeout_s, note, alive=lambda: proc.poll() is None)
    except ServerGone as e:
        server.stop()
        died = proc.returncode is not None and proc.returncode != -signal.SIGTERM
        raise ServerGone(f"the vLLM server the run starts (`{' '.join(cmd[2:])}`) "
                         f"{f'exited with {proc.returncode}' if died else 'did not come up'} before the ranks started; "
                         f"{note} (its last line: {_last_line(log_path)})") from e  # fmt: skip
    return server


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "empty"


__all__ = ["LOG_NAME", "Served", "Server", "app", "engine_spec", "serve", "server_devices", "start"]
