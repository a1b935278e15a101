"""The scores of the public VQA benchmarks, written from their definitions (each takes the model's
answer and the item's accepted answers and gives a score in [0, 1]):

* ``anls`` (DocVQA, InfographicVQA): 1 - NL, the normalised Levenshtein distance to the closest
  accepted answer, where NL < 0.5; 0 otherwise (Biten et al., 2019).
* ``vqa`` (VQAv2, TextVQA): min(#humans who gave the answer / 3, 1) after the VQA normalisation
  (lower case, punctuation, articles, number words). The official script also averages this over
  the ten leave-one-out subsets of the ten human answers; we use the formula as the paper states it.
* ``relaxed`` (ChartQA): right when equal as text, or, both numbers, within 5% of the target.
* ``choice`` (MMBench, Video-MME, ...): right when the option letter the answer gives is the key.
"""

from __future__ import annotations

import re
import string

METRICS = ("anls", "vqa", "relaxed", "choice")
ANLS_THRESHOLD = 0.5
RELAXED_TOLERANCE = 0.05
LETTERS = string.ascii_uppercase

_NUMBER_WORDS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
                 "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = {"a", "an", "the"}


def levenshtein(a: str, b: str) -> int:
    """Edits (insert, delete, substitute) that turn ``a`` into ``b``."""
    if len(a) < len(b):
        a, b = b, a
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ca != cb))
    return row[-1]


def anls(prediction: str, answers: list[str], threshold: float = ANLS_THRESHOLD) -> float:
    """Best over the answers of 1 - NL (0 where NL >= threshold); case and outer spaces ignored."""
    got = " ".join(prediction.lower().split())
    best = 0.0
    for answer in answers:
        want = " ".join(str(answer).lower().split())
        longest = max(len(got), len(want))
        distance = levenshtein(got, want) / longest if longest else 0.0
        best = max(best, 1.0 - distance if distance < threshold else 0.0)
    return best


def vqa_normalise(text: str) -> str:
    """The VQA evaluation's answer form: lower case, punctuation dropped (a decimal point kept),
    number words as digits, articles dropped."""
    text = re.sub(r"(?<!\d)\.|\.(?!\d)", " ", text.lower().replace("\n", " "))
    text = re.sub(r"[^\w\s.]", lambda m: "" if m.group() == "'" else " ", text)
    words = [_NUMBER_WORDS.get(w, w) for w in text.split() if w not in _ARTICLES]
    return " ".join(words)


def vqa_accuracy(prediction: str, answers: list[str]) -> float:
    """min(#human answers equal to the prediction / 3, 1), both normalised."""
    got = vqa_normalise(prediction)
    return min(sum(vqa_normalise(str(a)) == got for a in answers) / 3, 1.0)


def _number(text: str) -> float | None:
    """``12``, ``1,204.5``, ``45%`` (0.45, as ChartQA's evaluator reads a percentage) or None."""
    text = text.strip().replace(",", "")
    scale = 1.0
    if text.endswith("%"):
        text, scale = text[:-1], 0.01
    try:
        return float(text) * scale
    except ValueError:
        return None


def relaxed_accuracy(prediction: str, answers: list[str], tolerance: float = RELAXED_TOLERANCE) -> float:
    """1 when the prediction equals an answer (case and outer spaces ignored), or both are numbers
    and |prediction - answer| <= tolerance x |answer| (exact where the answer is 0); else 0."""
    got = prediction.strip().rstrip(".").strip()
    for answer in answers:
        want = str(answer).strip()
        a, b = _number(got), _number(want)
        if a is not None and b is not None:
            if abs(a - b) <= tolerance * abs(b):
                return 1.0
        elif got.lower() == want.lower():
            return 1.0
    return 0.0


def option_letter(prediction: str, options: list[str]) -> str | None:
    """The option the answer picks: a leading letter among the options' ("B", "(B)", "B. cat",
    "Answer: B"), else the option whose text the answer is; None when it names none."""
    letters = LETTERS[: len(options)]
    text = prediction.strip()
    lead = re.match(r"\(?([A-Za-z])\)?(?=$|[\s.,:)])", text)  # "B", "(B)", "B. cat"; "b" only alone ("a cat" is no pick)
    said = re.search(r"(?i:answer)\s*(?i:is)?\s*:?\s*\(?([A-Z])\)?(?=$|[\s.,:)])", text)  # "The answer is B"
    for found in (lead, said):
        if found and found.group(1).upper() in letters and (found.group(1).isupper() or len(text) <= 3):
            return found.group(1).upper()
    plain = text.lower().rstrip(".")
    for letter, option in zip(letters, options):
        if plain == option.lower().strip().rstrip("."):
            return letter
    return None


def choice_accuracy(prediction: str, options: list[str], key: str) -> float:
    """1 when the option the answer picks is ``key`` (a letter), else 0."""
    return float(option_letter(prediction, options) == key.strip().upper())


def score(metric: str, prediction: str, answers: list[str], options: list[str] | None = None) -> float:
    """``metric``'s score of ``prediction``; for ``choice`` the answers hold the key letter."""
    if metric == "anls":
        return anls(prediction, answers)
    if metric == "vqa":
        return vqa_accuracy(prediction, answers)
    if metric == "relaxed":
        return relaxed_accuracy(prediction, answers)
    if metric == "choice":
        return choice_accuracy(prediction, options or [], answers[0])
    raise ValueError(f"unknown metric '{metric}'; choose from: {', '.join(METRICS)}")
