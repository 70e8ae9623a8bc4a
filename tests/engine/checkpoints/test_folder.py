"""qwenkit.engine.checkpoints.folder: a checkpoint folder without torch: which folders count, pruning, and
integrity (sizes and CRC-32s against zlib's, per rank's share) naming the damaged file."""

import json
import zlib

from qwenkit.engine.checkpoints import folder as ckpt


def test_only_marked_directories_count(tmp_path):
    root = ckpt.checkpoint_root(tmp_path)
    for name, complete in [("step-00000002", True), ("step-00000010", True), ("step-00000011", False)]:
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / ckpt.COMPLETE).write_text("{}")
    (root / ".tmp-step-00000012").mkdir()
    assert ckpt.latest(root).name == "step-00000010"  # numeric order, unmarked and temp skipped
    assert ckpt.resolve(tmp_path).name == "step-00000010"


def _complete(root, step, files: dict[str, bytes]):
    """A checkpoint folder of ``files`` with the COMPLETE.json a save writes (sizes and zlib's CRC-32s)."""
    path = ckpt.step_dir(root, step)
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    listed = {name: [len(data), zlib.crc32(data)] for name, data in files.items()}
    (path / ckpt.COMPLETE).write_text(json.dumps({"step": step, "files": listed}))
    return path


def test_pruning_never_removes_the_checkpoint_written_or_a_newer_one(tmp_path):
    root = ckpt.checkpoint_root(tmp_path)
    for step in (10, 20, 25, 30):
        _complete(root, step, {})
    written = ckpt.step_dir(root, 25)  # a save of step 25 next to a step-30 checkpoint
    assert ckpt.prunable(root, written, keep_last=1) == [ckpt.step_dir(root, 10), ckpt.step_dir(root, 20)]
    assert ckpt.prunable(root, written, keep_last=2) == [ckpt.step_dir(root, 10)]
    assert ckpt.prunable(root, ckpt.step_dir(root, 10), keep_last=1) == []
    ckpt.prune(ckpt.step_dir(root, 10))
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-00000020", "step-00000025", "step-00000030"]


def test_check_files_names_the_missing_truncated_or_damaged_file(tmp_path):
    files = {"__0_0.distcp": bytes(range(256)) * 40_000, "rank-00000.pt": b"rng", "train_state.pt": b"step"}
    path = _complete(tmp_path, 4, files)
    assert ckpt.crc32_file(path / "__0_0.distcp") == zlib.crc32(files["__0_0.distcp"])  # read in 8 MB chunks
    assert ckpt.check_files(path, checksums=True) is None
    data = bytearray(files["__0_0.distcp"])
    data[5_000_000] ^= 1  # one flipped bit, the size unchanged
    (path / "__0_0.distcp").write_bytes(bytes(data))
    assert ckpt.check_files(path) is None  # sizes alone cannot see it
    assert "__0_0.distcp fails its checksum" in ckpt.check_files(path, checksums=True)
    # rank 1 of 2 checks every second file from the second (rank-00000.pt): not the damaged one
    assert ckpt.check_files(path, checksums=True, rank=1, world_size=2) is None
    (path / "train_state.pt").write_bytes(b"st")
    assert ckpt.check_files(path).endswith("train_state.pt is 2 bytes, 4 were saved (truncated or replaced)")
    (path / "rank-00000.pt").unlink()
    assert ckpt.check_files(path).endswith("rank-00000.pt is missing")
    (path / ckpt.COMPLETE).write_text("")
    assert ckpt.check_files(path).endswith("COMPLETE.json is empty")
