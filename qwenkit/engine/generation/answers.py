"""How a generated answer is scored against its reference: the metrics VLM benchmarks use.

Every metric is ``score(prediction, reference) -> float`` in ``[0, 1]`` per row; a run's value
is the mean over its rows. Chosen per run by ``train.eval_metrics`` (``qwenkit eval --metric``),
names listed in :data:`qwenkit.config.EVAL_METRICS`:

- ``exact``: equal after lower-casing and collapsing whitespace (qwenkit's original metric).
- ``normalized``: equal after the VQA evaluation's answer normalisation (Antol et al., VQA, ICCV
  2015; the official script ``vqaEval.py`` of github.com/GT-Vision-Lab/VQA,
  ``processPunctuation`` and ``processDigitArticle``): punctuation deleted where it touches a
  space (or anywhere, in a text with a digit,digit comma), else replaced by a space; a period
  not before a digit dropped, lower case, number words ``zero``..``ten``
  (and ``none``) to digits, the articles ``a``, ``an``, ``the`` dropped, common contractions
  written with their apostrophe (``dont`` -> ``don't``; the script's table is longer). With one
  reference per row the VQA "min(#humans/3, 1)" consensus reduces to this equality.
- ``relaxed``: ChartQA's relaxed accuracy (Masry et al., ChartQA, ACL Findings 2022, §5; the
  ``relaxed_correctness`` of google-research/pix2struct): when both parse as numbers (``12%``
  as 0.12) and the reference is not 0, correct when ``|p - r| / |r| <= 0.05``; otherwise a
  case-insensitive string match.
- ``anls``: DocVQA's Average Normalized Levenshtein Similarity (Biten et al., Scene Text VQA,
  ICCV 2019, eq. 1; Mathew et al., DocVQA, WACV 2021): ``1 - lev(p, r) / max(|p|, |r|)`` on
  lower-cased, whitespace-collapsed strings, 0 when that distance is ``>= 0.5``.
- ``module:function``: a user's ``function(prediction: str, reference: str) -> float``,
  importable from ``PYTHONPATH``, reported under the function's name. What it returns goes
  through :func:`user_score` (a finite number in ``[0, 1]``, numpy scalars too; else, or when it
  raises, one line naming the metric and the row).

**Multiple-choice rows** (the reference is an option letter alone: ``B``, ``(B)``, ``B.``) are
scored by the letter by every built-in metric: 1 when the option the prediction names is that
letter, else 0. The option named is the one the reply starts with (``B``, ``(b) red``, ``B. a
cat``, ``b:``), else the one capital letter standing alone as a word in it (``The answer is B``,
``I pick (B).``): MMBench's rule (Liu et al., MMBench, ECCV 2024; ``can_infer_option`` of
open-compass/VLMEvalKit: marks ``.()[],:;!*#{}`` become spaces, and exactly one option letter
may stand alone). The row does not list its options, so every capital letter counts as one but
the pronoun ``I`` (unless the reference is ``I``); two different letters (``A or C``) name none.
A user metric gets the strings as they are.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from typing import Any

from qwenkit.config import load_user_metric
from qwenkit.errors import OwnShareError

Metric = Callable[[str, str], float]

# ---------------------------------------------------------------------------------------------
# exact


def collapse(text: str) -> str:
    """Lower case, runs of whitespace become one space, no leading or trailing space."""
    return " ".join(text.lower().split())


def exact(prediction: str, reference: str) -> float:
    return float(collapse(prediction) == collapse(reference))


# ---------------------------------------------------------------------------------------------
# normalized: the VQA evaluation's answer processing

_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!"]
_COMMA_BETWEEN_DIGITS = re.compile(r"(\d)(,)(\d)")
_PERIOD_NOT_BEFORE_DIGIT = re.compile(r"\.(?!\d)")  # "3.5" keeps its point, "end." loses it
_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
            "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}  # fmt: skip
_ARTICLES = {"a", "an", "the"}
_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldnt": "couldn't", "couldve": "could've",
    "didnt": "didn't", "doesnt": "doesn't", "dont": "don't", "hadnt": "hadn't", "hasnt": "hasn't",
    "havent": "haven't", "hes": "he's", "im": "i'm", "isnt": "isn't", "itd": "it'd", "itll": "it'll",
    "ive": "i've", "lets": "let's", "mightnt": "mightn't", "mustnt": "mustn't", "shant": "shan't",
    "shes": "she's", "shouldnt": "shouldn't", "shouldve": "should've", "thats": "that's",
    "theres": "there's", "theyd": "they'd", "theyll": "they'll", "theyre": "they're", "theyve": "they've",
    "wasnt": "wasn't", "werent": "weren't", "whats": "what's", "wheres": "where's", "whos": "who's",
    "wont": "won't", "wouldnt": "wouldn't", "wouldve": "would've", "youd": "you'd", "youll": "you'll",
    "youre": "you're", "youve": "you've",
}  # fmt: skip


def vqa_normalise(text: str) -> str:
    """The VQA evaluation's processing of an answer (see the module docstring)."""
    text = text.replace("\n", " ").replace("\t", " ").strip()
    # processPunctuation: a mark touching a space (or any text with a digit,digit comma) is
    # deleted, elsewhere it becomes a space ("black-and-white" -> "black and white")
    given, glued = text, bool(_COMMA_BETWEEN_DIGITS.search(text))
    for p in _PUNCT:
        text = text.replace(p, "" if glued or p + " " in given or " " + p in given else " ")
    text = _PERIOD_NOT_BEFORE_DIGIT.sub("", text)
    # processDigitArticle
    words = [_NUMBERS.get(w, w) for w in text.lower().split()]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words if w not in _ARTICLES)


def normalized(prediction: str, reference: str) -> float:
    return float(vqa_normalise(prediction) == vqa_normalise(reference))


# ---------------------------------------------------------------------------------------------
# relaxed: ChartQA

RELAXED_TOLERANCE = 0.05


def _number(text: str) -> float | None:
    text = text.strip()
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        return None


def relaxed(prediction: str, reference: str) -> float:
    p, r = _number(prediction), _number(reference)
    if p is not None and r:  # a reference of 0 has no relative error: string match, as ChartQA does
        return float(abs(p - r) / abs(r) <= RELAXED_TOLERANCE)
    return float(prediction.strip().lower() == reference.strip().lower())


# ---------------------------------------------------------------------------------------------
# anls: DocVQA

ANLS_THRESHOLD = 0.5


def levenshtein(a: str, b: str) -> int:
    """Edits (insert, delete, substitute one character) that turn ``a`` into ``b``."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def anls(prediction: str, reference: str) -> float:
    p, r = collapse(prediction), collapse(reference)
    if not p and not r:
        return 1.0
    distance = levenshtein(p, r) / max(len(p), len(r))
    return 1.0 - distance if distance < ANLS_THRESHOLD else 0.0


# ---------------------------------------------------------------------------------------------
# multiple choice, and the registry

_OPTION = re.compile(r"^\(?([A-Z])\)?[.:]?$")  # a reference that is an option letter alone
_CHOSEN = re.compile(r"^\s*\(?([A-Za-z])(?:\)|[.:](?!\w)|\s|$)")  # the option a prediction starts with


def option_letter(reference: str) -> str | None:
    """The option letter a multiple-choice reference names, or None for any other reference."""
    m = _OPTION.match(reference.strip())
    return m.group(1) if m else None


_MARKS = str.maketrans(dict.fromkeys(".()[],:;!*#{}", " "))  # VLMEvalKit's can_infer_option


def chosen_letter(prediction: str, reference_letter: str = "A") -> str | None:
    """The option letter ``prediction`` names: the one it starts with, else its one capital
    letter standing alone as a word (``I`` only when ``reference_letter`` is ``I``); None if none or two."""
    m = _CHOSEN.match(prediction)
    if m and (m.group(1).upper() != "I" or reference_letter == "I"):  # "I think it is B": the pronoun is no option
        return m.group(1).upper()
    alone = {w for w in prediction.translate(_MARKS).split() if len(w) == 1 and w.isupper()}
    if reference_letter != "I":
        alone.discard("I")
    return alone.pop() if len(alone) == 1 else None


# the names the config check accepts are the schema's (EVAL_METRICS); a test keeps the two equal
BUILTIN: dict[str, Metric] = {"exact": exact, "normalized": normalized, "relaxed": relaxed, "anls": anls}


def _by_letter(metric: Metric) -> Metric:
    def score(prediction: str, reference: str) -> float:
        letter = option_letter(reference)
        if letter is None:
            return metric(prediction, reference)
        return float(chosen_letter(prediction, letter) == letter)

    return score


def resolve(names: list[str]) -> dict[str, Metric]:
    """``{reported name: metric}`` for ``train.eval_metrics``: built-ins (multiple-choice rows by
    the letter) or ``module:function`` reported as ``function``."""
    out: dict[str, Metric] = {}
    for name in names:
        if name in BUILTIN:
            out[name] = _by_letter(BUILTIN[name])
        else:
            fn = load_user_metric(name)
            out[fn.__name__] = fn
    return out


def score(metrics: dict[str, Metric], prediction: str, reference: str, where: str = "a row") -> dict[str, float]:
    """Every metric's value for one row (``where``: the row, for the messages), each through :func:`user_score`."""
    return {name: user_score(metric, f"eval metric {name!r}", where, prediction, reference) for name, metric in metrics.items()}


class UserFunctionError(OwnShareError):
    """A user's scoring function raised, or returned what is not a score; names the function and the row."""


def user_score(fn: Callable[..., Any], what: str, where: str, *args, bounds: tuple[float, float] | None = (0.0, 1.0),
               **kwargs) -> float:  # fmt: skip
    """``fn(*args, **kwargs)`` as a float: the one check of what a user's scoring function returns,
    for eval metrics and GRPO's reward functions alike (``bounds=None``: any finite number).

    A real number (``bool``, ``int``, ``float``, a numpy or torch scalar) that is finite and within
    ``bounds``; anything else, or an exception, is a :class:`UserFunctionError` naming ``what``
    (``"eval metric 'f'"``) and ``where`` (the row): a NaN or a 7.0 never becomes a mean.
    """
    try:
        value = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a user's function may fail in any way: say which and where
        raise UserFunctionError(f"{what} raised {type(e).__name__}: {e} on {where}") from e
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        value = value.item()  # numpy and torch scalars (np.float32(1.0), np.bool_, a 0-d tensor)
    if not isinstance(value, numbers.Real):  # bool is an int: a match counts 1
        raise UserFunctionError(f"{what} returned {value!r} ({type(value).__name__}) on {where}; it must return a float")
    value = float(value)
    low, high = bounds if bounds is not None else (-math.inf, math.inf)
    if not math.isfinite(value) or not low <= value <= high:
        within = f" in [{low:g}, {high:g}]" if bounds is not None else ""
        raise UserFunctionError(f"{what} returned {value!r} on {where}; a score must be a finite number{within}")
    return value
