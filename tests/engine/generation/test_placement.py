"""Where generation's weights come from (qwenkit.engine.generation.placement): the sizes the ``auto`` rule adds up,
and the rule itself (the copy's and lockstep's replies against each other: test_generate.py and test_evaluate.py)."""

import torch

from qwenkit.engine.generation import placement
from qwenkit.engine.generation.sampling import Sampling


def test_the_copy_and_kv_cache_sizes_by_hand():
    from types import SimpleNamespace

    text = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, hidden_size=64, num_attention_heads=4)
    config = SimpleNamespace(get_text_config=lambda: text)
    # keys and values x 2 layers x 2 KV heads x 16 dims x 3 rows x 10 positions x 4 bytes
    assert placement.kv_cache_bytes(config, batch_size=3, tokens=10, element_size=4) == 2 * 2 * 2 * 16 * 3 * 10 * 4
    text.head_dim = None  # older configs: hidden size / attention heads
    assert placement.kv_cache_bytes(config, batch_size=1, tokens=1, element_size=2) == 2 * 2 * 2 * 16 * 1 * 1 * 2
    layer = torch.nn.BatchNorm1d(3)  # weight, bias (3 fp32 each); running mean, var (3 fp32), batches seen (1 int64)
    assert placement.copy_bytes(layer) == 4 * 4 * 3 + 8


def test_auto_gathers_only_when_the_copy_kv_cache_and_margin_fit(monkeypatch):
    assert placement.copy_fits(copy=100, kv_cache=10, free=135) and not placement.copy_fits(copy=100, kv_cache=10, free=134)
    model = torch.nn.Linear(4, 4)
    model.config = None  # an explicit setting is not measured
    assert placement.choose_generation("lockstep", model, Sampling(8), 10, "cpu")[0] == "lockstep"
    assert placement.choose_generation("gather", model, Sampling(8), 10, "cpu")[0] == "gather"
