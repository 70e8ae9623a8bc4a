"""The weight push's wire between the trainer's rank 0 and a vLLM server (``vllm.mode: server``).

TRL's server mode: a process group of two, beside the trainer's own, the server rank 0 (it hosts the group's
store), the trainer's rank 0 rank 1, the sender. On CPU a gloo group (torch's ``ProcessGroupGloo`` on its own
``TCPStore``); on CUDA vLLM's ``PyNcclCommunicator`` over its ``StatelessProcessGroup``, as TRL's
``VLLMClient.init_communicator``. A push is the tensors of
:func:`~qwenkit.engine.generation.push_tensors.checkpoint_tensors` one after another, each after a header (its
dtype, shape and name's length, then the name's bytes, then the tensor's bytes: any dtype, on either backend), then
an end header: the server feeds them to the same
``reload_weights`` as the colocated engine (:meth:`qwenkit.engine.generation.vllm_engine.VllmEngine.load`), one
tensor held at a time on each side.
"""

from __future__ import annotations

import datetime
import math

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)  # fmt: skip
MAX_DIMS = 8
END = -1  # a header's dtype index: the push is over
SERVER, SENDER = 0, 1  # the ranks of the group of two


class Channel:
    """One end of the group of two (module docstring); ``device``: where its tensors travel from."""

    def __init__(self, broadcast, device: str, keep=None):
        self._broadcast, self.device, self._keep = broadcast, device, keep  # keep: the store, alive with the group

    @classmethod
    def gloo(cls, store, rank: int, host: str, timeout_s: float) -> Channel:
        """A gloo group of two on ``store`` (collective: both ends call it), its sockets on ``host``'s interface."""
        from torch.distributed import PrefixStore, ProcessGroupGloo
        from torch.distributed.distributed_c10d import BroadcastOptions

        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = datetime.timedelta(seconds=timeout_s)
        group = ProcessGroupGloo(PrefixStore("qwenkit-weights", store), rank, 2, options)

        def broadcast(tensor: torch.Tensor, src: int) -> None:
            how = BroadcastOptions()
            how.rootRank = src
            group.broadcast([tensor], how).wait()

        return cls(broadcast, "cpu", keep=(store, group))

    @classmethod
    def nccl(cls, host: str, port: int, rank: int, device: int | str, timeout_s: float, listening=None) -> Channel:
        """vLLM's NCCL communicator between the two ends (TRL's), on ``device``; the server's end hosts the store
        (``listening``: its socket, bound already to ``port``)."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=2, store_timeout=int(timeout_s),
                                             listen_socket=listening)  # fmt: skip
        comm = PyNcclCommunicator(group, device=device)
        return cls(lambda tensor, src: comm.broadcast(tensor, src=src), str(comm.device), keep=comm)

    def send(self, tensors) -> int:
        """Each ``(name, tensor)`` of ``tensors``, then the end header; returns how many went."""
        count = 0
        for name, tensor in tensors:
            raw = torch.tensor(list(name.encode()), dtype=torch.uint8)
            self._header(DTYPES.index(tensor.dtype), tuple(tensor.shape), len(raw))
            self._broadcast(raw.to(self.device), SENDER)
            self._broadcast(tensor.to(self.device).contiguous().reshape(-1).view(torch.uint8), SENDER)  # its bytes
            count += 1
        self._header(END, (), 0)
        return count

    def receive(self):
        """The ``(name, tensor)`` pairs :meth:`send` sends, up to its end header (the server's end)."""
        while True:
            header = torch.zeros(3 + MAX_DIMS, dtype=torch.int64, device=self.device)
            self._broadcast(header, SENDER)
            dtype, ndim, length, *shape = header.tolist()
            if dtype == END:
                return
            raw = torch.empty(length, dtype=torch.uint8, device=self.device)
            self._broadcast(raw, SENDER)
            shape, kind = shape[:ndim], DTYPES[dtype]
            data = torch.empty(math.prod(shape) * kind.itemsize, dtype=torch.uint8, device=self.device)
            self._broadcast(data, SENDER)
            yield bytes(raw.tolist()).decode(), data.view(kind).reshape(shape)

    def _header(self, dtype: int, shape: tuple[int, ...], length: int) -> None:
        if len(shape) > MAX_DIMS:
            raise ValueError(f"a pushed tensor has {len(shape)} dimensions, the weight channel carries {MAX_DIMS} at most")
        padded = [*shape, *[0] * (MAX_DIMS - len(shape))]
        self._broadcast(torch.tensor([dtype, len(shape), length, *padded], dtype=torch.int64, device=self.device), SENDER)


__all__ = ["Channel", "DTYPES", "SENDER", "SERVER"]
