"""The one module-path rule behind every config key that names modules (shard/recompute patterns,
LoRA targets and saved modules, parameter groups)."""

from qwenkit.model.modules import module_path, path_match, prefix_match


def test_a_pattern_matches_whole_paths_with_star_for_one_segment():
    assert path_match("model.language_model.layers.3", "model.language_model.layers.*")
    assert not path_match("model.language_model.layers.3.mlp", "model.language_model.layers.*")  # not a prefix
    assert not path_match("model.language_model", "model.language_model.layers.*")
    assert path_match("model.visual.blocks.10.attn", "model.visual.blocks.*.attn")
    assert not path_match("model.visual.blocks.10.attn", "model.visual.*")


def test_a_parameter_group_takes_the_parameters_under_its_modules():
    assert prefix_match("model.visual.merger.mlp.0.weight", "model.visual.merger") == 3
    assert prefix_match("model.visual.blocks.2.norm1.weight", "model.visual.blocks.*") == 4
    assert prefix_match("model.visual.mergers.x", "model.visual.merger") == 0  # segments, not characters
    assert prefix_match("model", "model.visual") == 0


def test_the_recompute_wrappers_segment_is_not_part_of_the_path():
    wrapped = "model.language_model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight"
    assert module_path(wrapped) == "model.language_model.layers.0.mlp.up_proj.weight"
