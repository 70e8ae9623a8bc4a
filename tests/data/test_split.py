"""qwenkit.data.split: the held-out split (data.eval_fraction) is disjoint, deterministic, the same on every
rank and seeded; data.eval_path and the tiny default's held-out set."""

from qwenkit import config as qconfig
from qwenkit import data


def _keys(dataset) -> set[tuple[int, int]]:
    return {(s.source, s.row) for s in dataset.samples}


def test_eval_fraction_split_is_disjoint_deterministic_and_seeded(processor):
    cfg = qconfig.load(overrides=["data.eval_fraction=0.25", "train.seed=7", "data.tiny_samples=16"])
    full, _ = data.read_dataset(cfg.data, processor)
    bundle = data.build(cfg, processor)
    train_rows, eval_rows = _keys(bundle.dataset), _keys(bundle.eval_dataset)
    assert len(eval_rows) == 4 and not train_rows & eval_rows and train_rows | eval_rows == _keys(full)
    assert bundle.sampler.num_samples == len(bundle.dataset) == 12  # the sampler only sees training rows
    again = data.build(cfg, processor, rank=1, world_size=2)  # same split on every rank
    assert _keys(again.eval_dataset) == eval_rows
    other = data.build(qconfig.load(overrides=["data.eval_fraction=0.25", "train.seed=8", "data.tiny_samples=16"]), processor)
    assert _keys(other.eval_dataset) != eval_rows


def test_eval_path_and_tiny_held_out_set(processor, tmp_path):
    from qwenkit.model.tiny.data import EVAL_SEED, write_dataset

    cfg = qconfig.load(overrides=["data.tiny_samples=16", "data.tiny_eval_samples=6"])
    bundle = data.build(cfg, processor)
    assert len(bundle.eval_dataset) == 6 and len(bundle.dataset) == 16
    train_images = {str(bundle.dataset.image_refs(i)[0].path) for i in range(len(bundle.dataset))}
    eval_images = {str(bundle.eval_dataset.image_refs(i)[0].path) for i in range(6)}
    assert not train_images & eval_images and f"-s{EVAL_SEED}-" in next(iter(eval_images))
    path = write_dataset(tmp_path, n=3, seed=5)
    bundle = data.build(qconfig.load(overrides=["data.tiny_samples=16", f"data.eval_path={path}"]), processor)
    assert len(bundle.eval_dataset) == 3 and len(bundle.dataset) == 16
    assert data.build(qconfig.load(overrides=["data.tiny_samples=16"]), processor).eval_dataset is None
