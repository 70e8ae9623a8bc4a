"""Notebook 02's held-out rows before and after training: paired answers, scores, the gallery."""

import pytest

from qwenkit.notebooks import gallery, results


def _eval_jsonl(path, generated):
    rows = [{"index": i, "prompt": f"user: <image> colour {i}?", "images": [str(img)], "reference": "red",
             "generated": g, "scores": {"exact": float(g == "red"), "anls": 0.75 if g == "rex" else float(g == "red")}}
            for i, (img, g) in enumerate(generated)]  # fmt: skip
    results.write_jsonl(rows, path)


def test_eval_samples_pair_the_untrained_and_trained_answers_and_the_gallery_shows_them(tmp_path):
    from PIL import Image

    image = tmp_path / "im.png"
    Image.new("RGB", (32, 32), "red").save(image)
    run = tmp_path / "run"
    _eval_jsonl(run / "eval" / "step-000000.jsonl", [(image, "blue"), ("embedded:0", "<b>")])
    _eval_jsonl(run / "eval" / "step-000004.jsonl", [(image, "green"), ("embedded:0", "x")])
    _eval_jsonl(run / "eval" / "step-000012.jsonl", [(image, "red"), ("embedded:0", "red")])
    rows = gallery.save_eval_samples(tmp_path / "out", run)
    assert [(r["untrained"], r["trained"], r["untrained_step"], r["trained_step"]) for r in rows] == [
        ("blue", "red", 0, 12), ("<b>", "red", 0, 12)]  # fmt: skip
    assert [r["trained_match"] for r in rows] == [True, True] and not any(r["untrained_match"] for r in rows)
    with pytest.raises(FileNotFoundError, match="no step-"):
        gallery.save_eval_samples(tmp_path / "out", tmp_path / "no-eval")
    # the gallery is a notebook display object; make test-compat installs no notebook stack
    pytest.importorskip("IPython", reason="IPython (notebooks extra) is not installed")
    page = gallery.gallery(tmp_path / "out").data
    assert page.count("<tr>") == 3 and "untrained (step 0)" in page and "trained (step 12)" in page
    assert page.count("data:image/png;base64,") == 1 and "<code>embedded:0</code>" in page  # a missing file: its label
    assert "&lt;b&gt;" in page and "<b>" not in page  # answers are escaped


def test_scores_before_and_after_and_the_rows_that_changed(tmp_path):
    run = tmp_path / "run"
    # rows: wrong -> right, right -> wrong, right -> right, near (anls 0.75: right by anls only) -> wrong
    _eval_jsonl(run / "eval" / "step-000000.jsonl", [("a.png", "blue"), ("b.png", "red"), ("c.png", "red"), ("d.png", "rex")])
    _eval_jsonl(run / "eval" / "step-000008.jsonl", [("a.png", "red"), ("b.png", "green"), ("c.png", "red"), ("d.png", "x")])
    gallery.save_eval_samples(tmp_path / "out", run)
    table = {r["metric"]: r for r in gallery.score_rows(tmp_path / "out")}
    assert table["exact"] == {"metric": "exact", "untrained": 2 / 4, "trained": 2 / 4, "wrong -> right": 1,
                              "right -> wrong": 1, "rows": 4}  # fmt: skip
    assert table["anls"]["untrained"] == (0 + 1 + 1 + 0.75) / 4 and table["anls"]["right -> wrong"] == 2
    pytest.importorskip("IPython", reason="IPython (notebooks extra) is not installed")
    page = gallery.gallery(tmp_path / "out", changed=True).data
    assert page.count("<tr>") == 3 and "2 of 2 rows that changed" in page  # by the first metric, exact
    assert "a.png" in page and "b.png" in page and "c.png" not in page and "d.png" not in page


def test_generations_written_before_scores_read_as_exact_matches():
    assert gallery.row_scores({"match": True}) == {"exact": 1.0}
