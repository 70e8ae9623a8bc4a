"""qwenkit.notebooks.experts: notebook 02's MoE figures drawn from a MoE run's files alone; none for a dense run."""

from __future__ import annotations

from qwenkit import config as qconfig
from qwenkit.engine.run import expert_load, train
from qwenkit.notebooks import experts


def test_a_moe_run_draws_its_expert_load_and_a_dense_run_draws_nothing(tmp_path):
    moe, dense = tmp_path / "moe", tmp_path / "dense"
    for run_dir, name in ((moe, "qwen3_vl_moe"), (dense, "qwen2_5_vl")):
        train.run(qconfig.load(overrides=[f"model.name={name}", "train.steps=2", "train.warmup_steps=0", "train.resume=none",
                                          "data.tiny_samples=4", "checkpoint.save_final=false", f"train.output_dir={run_dir}"]))  # fmt: skip
    assert experts.figures(dense) == []
    balance, share = experts.figures(moe)
    lines = {t.name: list(t.x) for t in balance.data}
    assert len(lines) == len(expert_load.read(moe)[-1]["fractions"]) > 0
    assert all(steps == [1, 2] for steps in lines.values())
    last = expert_load.read(moe)[-1]
    assert last["step"] == 2 and [list(row) for row in share.data[0].z] == last["fractions"]
