"""Answer metrics against values computed by hand from each benchmark's definition."""

from __future__ import annotations

import re
import sys

import pytest

from qwenkit import config as qconfig
from qwenkit.engine.generation import answers


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        ("They are red.", "They are red.", 1.0),
        ("  they   ARE red.\n", "They are red.", 1.0),  # case and whitespace runs
        ("They are red", "They are red.", 0.0),  # punctuation counts
        ("", "", 1.0),
        ("A\tcircle.", "a circle.", 1.0),
    ],
)
def test_exact_normalises_case_and_whitespace_only(prediction, reference, expected):
    assert answers.exact(prediction, reference) == expected


@pytest.mark.parametrize(
    ("answer", "normalised"),
    [
        # VQA evaluation (Antol et al. 2015, vqaEval.py processPunctuation/processDigitArticle), by hand:
        ("Two dogs.", "2 dogs"),  # number word -> digit, final period dropped, lower case
        ("The man's hat", "man's hat"),  # article dropped; the apostrophe is not in the punctuation list
        ("black-and-white", "black and white"),  # '-' touches no space: becomes a space
        ("yes !", "yes"),  # '!' touches a space: deleted
        ("1,000", "1000"),  # a digit,digit comma: every mark is deleted
        ("3.5 meters", "3.5 meters"),  # a period before a digit stays
        ("dont know", "don't know"),  # contraction gets its apostrophe
        ("an apple\tand a pear", "apple and pear"),
        ("None", "0"),
    ],
)
def test_vqa_normalisation_by_hand(answer, normalised):
    assert answers.vqa_normalise(answer) == normalised


def test_normalized_match():
    assert answers.normalized("Two", "2") == 1.0
    assert answers.normalized("the Red car.", "red car") == 1.0
    assert answers.normalized("red cars", "red car") == 0.0


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        # ChartQA relaxed accuracy (Masry et al. 2022, §5): |p - r| / |r| <= 5%
        ("105", "100", 1.0),  # 5% exactly
        ("105.1", "100", 0.0),  # 5.1%
        ("95", "100", 1.0),
        ("-10.4", "-10", 1.0),  # 4% of |r|
        ("12%", "0.12", 1.0),  # a percentage reads as a fraction
        ("0.5", "0", 0.0),  # r = 0: no relative error, string match
        ("0", "0", 1.0),
        ("Yes", "yes", 1.0),  # not numbers: case-insensitive string match
        ("ten", "10", 0.0),
    ],
)
def test_relaxed_accuracy_by_hand(prediction, reference, expected):
    assert answers.relaxed(prediction, reference) == expected


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        # ANLS (Biten et al. 2019, eq. 1): NL = lev / max(len); 1 - NL if NL < 0.5 else 0
        ("kitten", "sitting", 1 - 3 / 7),  # lev 3 (k->s, e->i, +g), max length 7
        ("Invoice", "invoice", 1.0),  # lower-cased first
        ("abcd", "abxy", 0.0),  # lev 2 / 4 = 0.5: not below the threshold
        ("abcde", "abxye", 1 - 2 / 5),  # 0.4 < 0.5
        ("", "total", 0.0),
        ("  total  due ", "total due", 1.0),  # whitespace collapsed
    ],
)
def test_anls_by_hand(prediction, reference, expected):
    assert answers.anls(prediction, reference) == pytest.approx(expected)


def test_levenshtein_by_hand():
    assert answers.levenshtein("kitten", "sitting") == 3
    assert answers.levenshtein("", "abc") == 3 and answers.levenshtein("flaw", "lawn") == 2


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        ("B", "B", 1.0), ("(B) a red square", "B", 1.0), ("b. red", "(B)", 1.0), ("B: red", "B.", 1.0),
        ("(b)", "B", 1.0), ("B. a cat", "B", 1.0),  # the leading option, whatever follows it (the article a)
        ("C", "B", 0.0), ("Blue.", "B", 0.0),  # a word starting with B is not the option
        # else MMBench's can_infer_option (VLMEvalKit): the one capital letter standing alone
        ("The answer is B", "B", 1.0), ("The answer is B.", "(B)", 1.0), ("I think it is (B).", "B", 1.0),
        ("The answer is C", "B", 0.0), ("Either A or B", "B", 0.0),  # another option; two options: none
        ("the answer is b", "B", 0.0),  # lower case inside a sentence is a word, not an option
        ("I", "I", 1.0), ("I think so", "I", 1.0),  # option I: the pronoun counts only then
    ],
)  # fmt: skip
def test_multiple_choice_rows_are_scored_by_the_letter(prediction, reference, expected):
    metrics = answers.resolve(list(qconfig.EVAL_METRICS))
    assert answers.score(metrics, prediction, reference) == dict.fromkeys(qconfig.EVAL_METRICS, expected)


def test_a_reference_that_starts_with_a_letter_word_is_not_a_choice():
    assert answers.option_letter("A circle.") is None
    assert answers.resolve(["exact"])["exact"]("a circle.", "A circle.") == 1.0


def test_builtin_names_are_the_schemas():
    assert tuple(answers.BUILTIN) == qconfig.EVAL_METRICS


def test_user_metric_is_imported_and_reported_under_its_name(tmp_path, monkeypatch):
    (tmp_path / "my_scores.py").write_text("def length_ratio(p, r):\n    return len(p) / max(len(r), 1)\n"
                                           "NOT_A_FUNCTION = 3\n")  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    metrics = answers.resolve(["exact", "my_scores:length_ratio"])
    assert list(metrics) == ["exact", "length_ratio"]
    assert answers.score(metrics, "ab", "abcd") == {"exact": 0.0, "length_ratio": 0.5}
    assert qconfig.load(overrides=["train.eval_metrics=[anls, my_scores:length_ratio]"]).train.eval_metrics
    with pytest.raises(qconfig.ConfigError) as e:
        qconfig.load(overrides=["train.eval_metrics=[exact, nope_module:f, my_scores:missing, my_scores:NOT_A_FUNCTION, vqa]"])
    for part in ("'nope_module:f' does not import", "'my_scores:missing' does not import", "is a int, not a function",
                 "'vqa' is neither a built-in metric"):  # fmt: skip
        assert part in str(e.value)
    with pytest.raises(qconfig.ConfigError, match="exact given twice"):
        qconfig.load(overrides=["train.eval_metrics=[exact, exact]"])
    with pytest.raises(qconfig.ConfigError, match="at least one metric"):
        qconfig.load(overrides=["train.eval_metrics=[]"])
    sys.modules.pop("my_scores", None)


@pytest.mark.parametrize("returned, said", [
    ("'many'", "eval metric 'f' returned 'many' (str) on eval row 3; it must return a float"),
    ("float('nan')", "eval metric 'f' returned nan on eval row 3; a score must be a finite number in [0, 1]"),
    ("float('inf')", "eval metric 'f' returned inf on eval row 3; a score must be a finite number in [0, 1]"),
    ("7.0", "eval metric 'f' returned 7.0 on eval row 3; a score must be a finite number in [0, 1]"),
    ("-0.5", "eval metric 'f' returned -0.5 on eval row 3; a score must be a finite number in [0, 1]"),
    ("None", "eval metric 'f' returned None (NoneType) on eval row 3; it must return a float"),
    ("[1.0]", "eval metric 'f' returned [1.0] (list) on eval row 3; it must return a float"),
    ("{}['key']", "eval metric 'f' raised KeyError: 'key' on eval row 3"),
])  # fmt: skip
def test_a_user_metric_that_fails_or_returns_no_score_is_named_with_the_row(tmp_path, monkeypatch, returned, said):
    (tmp_path / "bad_scores.py").write_text(f"def f(p, r):\n    return {returned}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("bad_scores", None)
    with pytest.raises(answers.UserFunctionError) as e:
        answers.score(answers.resolve(["bad_scores:f"]), "a", "b", "eval row 3")
    assert str(e.value) == said


def test_numpy_and_torch_scalars_and_bools_are_scores():
    import numpy as np
    import torch

    for value in (np.float32(1.0), np.float64(0.25), np.int64(1), np.bool_(True), True, 0, torch.tensor(0.5)):
        assert answers.user_score(lambda p, r, v=value: v, "eval metric 'f'", "a row", "p", "r") == float(value)
    # GRPO's rewards: any finite number, the same messages
    assert answers.user_score(lambda: -3.5, "reward function 'r'", "rollout 1", bounds=None) == -3.5
    with pytest.raises(answers.UserFunctionError, match=r"reward function 'r' returned nan on rollout 1; .* finite number$"):
        answers.user_score(lambda: np.float32("nan"), "reward function 'r'", "rollout 1", bounds=None)


@pytest.mark.parametrize("source, said", [
    ("x = 1 / 0\n", "'broken_on_import:f' does not import (ZeroDivisionError: division by zero)"),
    ("def f(p, r)\n    return 1.0\n", "'broken_on_import:f' does not import (SyntaxError: "),
])  # fmt: skip
def test_a_metric_module_that_fails_on_import_is_one_line_naming_it(tmp_path, monkeypatch, capsys, source, said):
    from qwenkit import cli

    (tmp_path / "broken_on_import.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("broken_on_import", None)
    with pytest.raises(qconfig.ConfigError, match=re.escape(f"train.eval_metrics: {said}")):
        qconfig.load(overrides=["train.eval_metrics=[broken_on_import:f]"])
    assert cli.main(["eval", str(tmp_path), "--metric", "broken_on_import:f"]) == 2
    err = capsys.readouterr().err
    assert f"qwenkit eval: --metric: {said}" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_eval_settings_are_checked():
    with pytest.raises(qconfig.ConfigError) as e:
        qconfig.load(overrides=["train.eval_batch_size=0", "train.eval_temperature=-1", "train.eval_top_p=0"])
    for key in ("train.eval_batch_size", "train.eval_temperature", "train.eval_top_p"):
        assert key in str(e.value)
