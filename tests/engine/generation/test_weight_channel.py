"""qwenkit.engine.generation.weight_channel on gloo, without vLLM: the tensors one end sends (dtypes, shapes, names as
a push has them) arrive at the other equal, bit for bit, in order, up to the end header."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
from torch.distributed import TCPStore

from qwenkit.engine.generation.weight_channel import DTYPES, SENDER, SERVER, Channel


def _pair() -> tuple[Channel, Channel]:
    """The server's end and the sender's, on 127.0.0.1 (the server hosts the store on a free port)."""
    store = TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    ends = {}
    opening = threading.Thread(target=lambda: ends.setdefault("server", Channel.gloo(store, SERVER, "127.0.0.1", 30)))
    opening.start()
    client = TCPStore("127.0.0.1", store.port, 2, False, timeout=datetime.timedelta(seconds=30))
    sender = Channel.gloo(client, SENDER, "127.0.0.1", 30)
    opening.join()
    return ends["server"], sender


def test_what_is_sent_arrives_equal_and_in_order():
    server, sender = _pair()
    torch.manual_seed(0)
    tensors = [(f"model.layers.{i}.{dtype}".replace("torch.", ""), (torch.randn(3, 5, 2) * 10).to(dtype))
               for i, dtype in enumerate(DTYPES)]  # fmt: skip
    tensors += [("lm_head.weight", torch.randn(7, 4)), ("a.scalar", torch.tensor(2.5)), ("ünïcode.bias", torch.randn(1))]
    got = []
    receiving = threading.Thread(target=lambda: got.extend(server.receive()))
    receiving.start()
    assert sender.send(iter(tensors)) == len(tensors)
    receiving.join(30)
    assert not receiving.is_alive()
    assert [n for n, _ in got] == [n for n, _ in tensors]
    for (_, a), (_, b) in zip(got, tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    again = []  # a second push on the same channel
    receiving = threading.Thread(target=lambda: again.extend(server.receive()))
    receiving.start()
    assert sender.send(iter(tensors[:2])) == 2
    receiving.join(30)
    assert [n for n, _ in again] == [n for n, _ in tensors[:2]]


def test_a_tensor_of_too_many_dimensions_is_refused_naming_it():
    server, sender = _pair()
    with pytest.raises(ValueError, match="9 dimensions, the weight channel carries 8 at most"):
        sender.send(iter([("w", torch.zeros([1] * 9))]))
