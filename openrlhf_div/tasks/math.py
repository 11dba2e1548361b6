"""Math: answer extraction, equivalence through ``math-verify`` under a hard time limit, and
prompt templates (Qwen2.5-Math and Llama-3.1-Instruct styles).

Scoring one response against a gold answer string:

1. **Extract** the final answer (:func:`extract_answer`): the last ``\\boxed{...}`` /
   ``\\fbox{...}`` (nested braces handled), else the last "the (final) answer is ..." or
   "Answer: ..." phrase. That is the default, ``extract="strict"``: a response that states no
   final answer scores 0 (``"32 - 30 = 2. I made a mistake."`` is not an answer of 2). With
   ``extract="lenient"`` the last number in the text is the fallback (what many evaluation
   scripts do). Extraction is linear-time and reads only the last
   :data:`~openrlhf_div.tasks.base.MAX_EXTRACT_CHARS` characters of a response.
2. **Fast path** (:func:`quick_equal`): identical after light normalisation -> correct; both
   plain numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``, ``1,000``, integer powers and
   power towers such as ``2^{2^{2^{2^{2}}}}`` up to 2^20 bits) -> compared exactly (relative
   tolerance 1e-9). Most competition answers are integers and never leave here.
3. **math-verify** for everything else (fractions vs decimals, radicals, percentages,
   intervals, sets, LaTeX vs plain, equations like ``x=3``), run in a worker process of a
   :class:`~openrlhf_div.tasks._pool.WorkerPool` with a hard wall-clock limit per check: a
   pathological answer such as ``10^{10^{10}}`` (sympy computes the integer, in C, where no
   signal reaches it) gets its worker killed and scores 0 with reason ``"timeout"``.

Reward: 1.0 when equivalent, else 0.0.
"""
from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from fractions import Fraction
from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .base import RewardResult, Task, extraction_window, register_task

__all__ = ["MathTask", "MathVerifier", "extract_answer", "find_boxed", "quick_equal", "normalize_answer",
           "MATH_TEMPLATES"]

# --------------------------------------------------------------------------- prompt templates
_QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
_LLAMA3_INSTRUCTIONS = (
    "Solve the following math problem efficiently and clearly:\n\n"
    "- For simple problems (2 steps or fewer):\nProvide a concise solution with minimal explanation.\n\n"
    "- For complex problems (3 steps or more):\nUse this step-by-step format:\n\n"
    "## Step 1: [Concise description]\n[Brief explanation and calculations]\n\n"
    "## Step 2: [Concise description]\n[Brief explanation and calculations]\n\n...\n\n"
    "Regardless of the approach, always conclude with:\n\n"
    "Therefore, the final answer is: $\\boxed{answer}$. I hope it is correct.\n\n"
    "Where [answer] is just the final number or expression that solves the problem.\n\n"
    "Problem: {problem}"
)
_DAPO_INSTRUCTIONS = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    "Remember to put your answer on its own line after \"Answer:\"."
)

#: name -> (system message or None, user message with ``{problem}``)
MATH_TEMPLATES: Dict[str, Tuple[Optional[str], str]] = {
    # Qwen2.5-Math's chain-of-thought prompt: a system line asking for \boxed{}.
    "qwen-math": (_QWEN_MATH_SYSTEM, "{problem}"),
    # Llama-3.1-Instruct's MATH evaluation style: instructions in the user turn, boxed answer.
    "llama3": (None, _LLAMA3_INSTRUCTIONS),
    # DAPO-17k's own wrapper ("Answer: ..." on the last line).
    "dapo": (None, _DAPO_INSTRUCTIONS),
    # the bare problem plus a one-line boxed instruction (base models without a chat template)
    "plain": (None, "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."),
}

# --------------------------------------------------------------------------- extraction
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_BARE_BOX_RE = re.compile(r"[^\s$]+")


def find_boxed(text: str) -> List[str]:
    """Contents of every ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (nested braces, escaped
    ``\\{``/``\\}`` inside), plus the brace-less form ``\\boxed 5``, in the order the boxes
    open. Unclosed boxes are skipped. One pass over the text (linear time): a stack of open
    braces remembers which of them opened a box."""
    out: List[Tuple[int, str]] = []
    starts: Dict[int, int] = {}  # position of a box's "{" -> its order key
    for m in _BOX_RE.finditer(text):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            starts[i] = m.start()
        elif i > m.end():  # "\boxed 5": up to whitespace or '$'
            mm = _BARE_BOX_RE.match(text, i)
            if mm:
                out.append((m.start(), mm.group(0)))
    if starts:
        stack: List[int] = []
        j, n = 0, len(text)
        while j < n:
            ch = text[j]
            if ch == "\\":
                j += 2  # skip the escaped character (\{ \} \\)
                continue
            if ch == "{":
                stack.append(j)
            elif ch == "}" and stack:
                i = stack.pop()
                if i in starts:
                    out.append((starts[i], text[i + 1:j]))
            j += 1
    out.sort(key=lambda t: t[0])
    return [c for _, c in out]


_PHRASE_RE = re.compile(
    r"(?:final\s+answer|the\s+answer)\s*(?:is|was|:|=)\s*:?\s*(.+)"
    r"|^[ \t>*#]*\**answer\**\s*:\s*(.+)$",
    re.IGNORECASE | re.MULTILINE,
)
_NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


_HOPE = "i hope it is correct"


def _clean(ans: str) -> str:
    s = ans.strip()
    tail = s[:-1] if s.endswith(".") else s
    if tail[-len(_HOPE):].lower() == _HOPE:  # not a regex: "\s*...$" is quadratic on long spaces
        s = tail[:-len(_HOPE)].strip()
    for _ in range(3):
        s = s.strip().rstrip(".").strip()
        if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
            s = s.strip("$").strip()
        elif s.startswith("\\(") and s.endswith("\\)"):
            s = s[2:-2].strip()
        elif s.startswith("\\[") and s.endswith("\\]"):
            s = s[2:-2].strip()
        elif s.startswith("**") and s.endswith("**") and len(s) > 4:
            s = s[2:-2].strip()
    return s


def extract_answer(text: str, last_number: bool = True) -> Tuple[Optional[str], str]:
    """``(answer, method)`` with method ``"boxed"``, ``"phrase"``, ``"last_number"`` (only with
    ``last_number=True``) or ``"none"`` (answer ``None``). Reads the last
    :data:`~openrlhf_div.tasks.base.MAX_EXTRACT_CHARS` characters of ``text``."""
    if not text:
        return None, "none"
    text = extraction_window(text)
    boxed = find_boxed(text)
    if boxed:
        return _clean(boxed[-1]), "boxed"
    phrases = list(_PHRASE_RE.finditer(text))
    if phrases:
        m = phrases[-1]
        raw = m.group(1) if m.group(1) is not None else m.group(2)
        raw = raw.strip()
        # a phrase answer runs to the end of its sentence: cut at ". " followed by a capital
        raw = re.split(r"\.\s+(?=[A-Z])", raw, maxsplit=1)[0]
        cleaned = _clean(raw)
        if cleaned:
            return cleaned, "phrase"
    if last_number:
        nums = _NUMBER_RE.findall(text)
        if nums:
            return nums[-1].replace(" ", ""), "last_number"
    return None, "none"


# --------------------------------------------------------------------------- fast equivalence
_NORM_SUBS = [
    (re.compile(r"\\left|\\right|\\displaystyle|\\!|\\,|\\;|\\:|\\ "), ""),
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\^\{?\\circ\}?"), ""),
    (re.compile(r"\s+"), ""),
]


def normalize_answer(s: str) -> str:
    """Light, meaning-preserving normalisation for string comparison (spacing, ``\\left``,
    ``\\dfrac``, degree signs, surrounding ``$``, trailing period)."""
    s = _clean(s)
    for pat, rep in _NORM_SUBS:
        s = pat.sub(rep, s)
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    return s.rstrip(".")


_PLAIN_NUM = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)$")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_SLASH_FRAC = re.compile(r"^([+-]?\d+)/(\d+)$")
_TEX_FRAC = re.compile(r"^([+-]?)\\frac\{?([+-]?\d+)\}?\{?(\d+)\}?$")


def _as_number(s: str) -> Optional[Fraction]:
    """A plain number as an exact Fraction, or None if ``s`` is anything else."""
    if len(s) > 60:
        return None
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if _PLAIN_NUM.match(s):
        return Fraction(s)
    m = _SLASH_FRAC.match(s)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    m = _TEX_FRAC.match(s)
    if m and int(m.group(3)) != 0:
        v = Fraction(int(m.group(2)), int(m.group(3)))
        return -v if m.group(1) == "-" else v
    return None


_INT_RE = re.compile(r"[+-]?\d+")
_MAX_POWER_BITS = 1 << 20  # 2^{2^{20}} has a million bits: computed exactly in ~10 ms


def _int_power(s: str) -> Optional[int]:
    """The value of an integer or an integer power tower (``2^{2^{16}}``, ``10^5``, ``(-3)^{3}``)
    when it has at most 2^20 bits; ``None`` for anything else or anything bigger (left to
    math-verify, under its time limit). The size is bounded before anything is computed."""
    s = s.strip()
    if len(s) > 200:
        return None
    if _INT_RE.fullmatch(s):
        return int(s)
    if s.startswith("{") and s.endswith("}") or s.startswith("(") and s.endswith(")"):
        inner = s[1:-1]
        if inner.count("{") == inner.count("}") and inner.count("(") == inner.count(")"):
            return _int_power(inner)
    m = re.fullmatch(r"(\d+|\([+-]?\d+\)|\{[+-]?\d+\})\^(.+)", s)
    if not m:
        return None
    base = int(m.group(1).strip("(){}"))
    exp_s = m.group(2)
    if not (exp_s.startswith("{") and exp_s.endswith("}")) and not re.fullmatch(r"\d", exp_s):
        return None  # "2^10" means 2^1 followed by 0 in LaTeX: only one digit binds without braces
    exp = _int_power(exp_s)
    if exp is None or exp < 0:
        return None
    if abs(base) > 1 and exp * max(1, abs(base).bit_length()) > _MAX_POWER_BITS:
        return None
    return base ** exp


def quick_equal(pred: str, gold: str) -> Optional[bool]:
    """Decide cheaply when possible: True if equal after normalisation, a definite answer if both
    are plain numbers (|a - b| <= 1e-9 max(1, |b|)), else None (ask math-verify)."""
    p, g = normalize_answer(pred), normalize_answer(gold)
    if p == g and p:
        return True
    # "1, 100" is a list of two answers, never the number 1100: only a comma with no space
    # after it may be a thousands separator
    a = _as_number(p) if ", " not in pred else None
    b = _as_number(g) if ", " not in gold else None
    if a is not None and b is not None:
        return abs(a - b) <= Fraction(1, 10**9) * max(1, abs(b))
    if "^" in p or "^" in g:  # integer powers and power towers, compared exactly
        ia = _int_power(p) if a is None else (int(a) if a.denominator == 1 else None)
        ib = _int_power(g) if b is None else (int(b) if b.denominator == 1 else None)
        if ia is not None and ib is not None:
            return ia == ib
    return None


# --------------------------------------------------------------------------- math-verify (worker side)
_MV_READY = False


def _mv_setup() -> None:
    global _MV_READY
    if not _MV_READY:
        # we enforce time limits ourselves; silence math-verify's "timeout is disabled" warnings
        for name in ("math_verify", "math_verify.parser", "math_verify.grader", "math_verify.utils"):
            logging.getLogger(name).setLevel(logging.ERROR)
        _MV_READY = True


@lru_cache(maxsize=4096)
def _mv_parse(s: str):
    from math_verify import parse

    s = s.strip()
    parsed = parse(f"${s}$", parsing_timeout=None)
    if not parsed:
        parsed = parse(s, parsing_timeout=None)
    return parsed


def mv_equal(pred: str, gold: str) -> bool:
    """math-verify equivalence of two extracted answers (no time limit of its own: call it
    through :class:`MathVerifier`). Gold parses are cached (n samples share one gold)."""
    _mv_setup()
    from math_verify import verify

    g = _mv_parse(gold)
    p = _mv_parse(pred)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=None))


def warmup() -> None:
    """Run a few checks so math-verify's lazy grammar and caches are built (worker start-up)."""
    for p, g in (("\\frac{1}{2}", "0.5"), ("(0,1]", "(0,1]"), ("x+1", "1+x"), ("\\sqrt{2}", "2^{1/2}")):
        mv_equal(p, g)


# --------------------------------------------------------------------------- verifier (parent side)
_PRELOAD = ["openrlhf_div.tasks._preload"]


class MathVerifier:
    """Equivalence of (pred, gold) answer strings with a hard time limit per check.

    ``mode="process"`` (default): math-verify runs in a shared :class:`WorkerPool`; a check
    longer than ``timeout`` seconds is stopped (soft limit, then SIGKILL at ``timeout + 1``).
    ``mode="inline"``: in this process under a ``SIGALRM`` limit when called from the main
    thread (fast, but cannot stop a hang inside C code); from other threads it falls back to
    the pool, since signals only reach the main thread.
    """

    def __init__(self, timeout: float = 5.0, num_workers: Optional[int] = None, mode: str = "process",
                 cache_size: int = 100_000):
        if mode not in ("process", "inline"):
            raise ValueError(f"MathVerifier mode must be 'process' or 'inline', got {mode!r}")
        if not timeout or timeout <= 0:
            raise ValueError(f"MathVerifier needs a positive timeout, got {timeout!r}")
        self.timeout = float(timeout)
        self.num_workers = num_workers
        self.mode = mode
        self.cache_size = int(cache_size)
        self._cache: "OrderedDict[Tuple[str, str], bool]" = OrderedDict()
        self._lock = threading.Lock()
        self._warm = False

    @property
    def pool(self):
        from ._pool import shared_pool

        # the initializer warms workers when the fork server could not preload (spawn, or a
        # server started earlier by other code); with the preload it is a no-op in effect
        return shared_pool("math-verify", self.num_workers, preload=_PRELOAD,
                           initializer="openrlhf_div.tasks.math:warmup")

    def check_many(self, pairs: Sequence[Tuple[str, str]]) -> List[Tuple[bool, str]]:
        """``[(equal, reason)]``; reason ``"ok"``, ``"timeout"``, ``"crash"`` or an error.

        Identical pairs in one call are checked once (the samples of a prompt often share an
        answer), and definite outcomes are remembered in an LRU cache across calls (timeouts
        and errors are not: they may depend on the machine's load)."""
        if not pairs:
            return []
        todo: List[Tuple[str, str]] = []
        with self._lock:
            for pair in dict.fromkeys(pairs):
                if pair in self._cache:
                    self._cache.move_to_end(pair)
                else:
                    todo.append(pair)
        fresh = dict(zip(todo, self._check_uncached(todo))) if todo else {}
        out = []
        with self._lock:
            for pair in pairs:
                if pair in fresh:
                    res = fresh[pair]
                    if res[1] == "ok":
                        self._cache[pair] = res[0]
                        while len(self._cache) > self.cache_size:
                            self._cache.popitem(last=False)
                    out.append(res)
                else:
                    out.append((self._cache.get(pair, False), "ok"))
        return out

    def _check_uncached(self, pairs: Sequence[Tuple[str, str]]) -> List[Tuple[bool, str]]:
        if self.mode == "inline" and threading.current_thread() is threading.main_thread():
            from ._pool import SoftTimeout, soft_time_limit

            if not self._warm:  # import + build math-verify's grammar outside any time limit
                warmup()
                self._warm = True
            out = []
            for p, g in pairs:
                try:
                    with soft_time_limit(self.timeout):
                        out.append((mv_equal(p, g), "ok"))
                except SoftTimeout:
                    out.append((False, "timeout"))
                except Exception as exc:  # noqa: BLE001
                    out.append((False, f"verifier error: {type(exc).__name__}"))
            return out
        res = self.pool.run("openrlhf_div.tasks.math:mv_equal", [(p, g) for p, g in pairs], timeout=self.timeout)
        return [(bool(r.value), "ok") if r.ok else (False, r.error) for r in res]

    def equal(self, pred: str, gold: str) -> bool:
        return self.check_many([(pred, gold)])[0][0]


# --------------------------------------------------------------------------- the task
def gold_answer(label: Any) -> str:
    """The gold answer string from a label (a string, a number, or a solution with \\boxed{})."""
    if isinstance(label, dict):
        for key in ("answer", "ground_truth", "label"):
            if key in label:
                return gold_answer(label[key])
        raise ValueError(f"math label dict has no 'answer' key: {sorted(label)}")
    if isinstance(label, (list, tuple)):
        return ", ".join(gold_answer(x) for x in label)
    s = str(label).strip()
    boxed = find_boxed(s)
    return _clean(boxed[-1]) if boxed else _clean(s)


class MathTask(Task):
    """Math word problems with a gold answer string.

    Options: ``template`` (one of :data:`MATH_TEMPLATES`), ``timeout`` (seconds per
    math-verify check, default 5), ``num_workers`` (verifier processes), ``timeout_mode``
    (``"process"`` or ``"inline"``, see :class:`MathVerifier`), ``max_answer_chars`` (longer
    extracted answers score 0 without a check), ``extract`` (``"strict"``, the default:
    ``\\boxed{}`` or an explicit final-answer phrase only; ``"lenient"``: the last number in the
    response as a fallback).
    """

    name = "math"

    def __init__(self, template: str = "qwen-math", timeout: float = 5.0, num_workers: Optional[int] = None,
                 timeout_mode: str = "process", max_answer_chars: int = 1000, extract: str = "strict"):
        if template not in MATH_TEMPLATES:
            raise ValueError(f"unknown math template {template!r}; choose one of {sorted(MATH_TEMPLATES)}")
        if extract not in ("strict", "lenient"):
            raise ValueError(f"math option extract={extract!r}: choose 'strict' (\\boxed{{}} or a final-answer "
                             "phrase only) or 'lenient' (the last number as a fallback)")
        self.extract = extract
        self.template = template
        self.max_answer_chars = int(max_answer_chars)
        self.verifier = MathVerifier(timeout=timeout, num_workers=num_workers, mode=timeout_mode)

    def prompt(self, example: Dict[str, Any]) -> List[Dict[str, str]]:
        system, user = MATH_TEMPLATES[self.template]
        problem = example["prompt"] if isinstance(example, dict) else str(example)
        msgs = [{"role": "system", "content": system}] if system else []
        msgs.append({"role": "user", "content": user.replace("{problem}", problem)})
        return msgs

    def _prepare(self, response: str, label: Any) -> Tuple[Optional[RewardResult], str, str, str]:
        gold = gold_answer(label)
        ans, method = extract_answer(response or "", last_number=self.extract == "lenient")
        if ans is None:
            return RewardResult(0.0, False, "no answer found", {"answer": None, "method": method}), "", gold, method
        if len(ans) > self.max_answer_chars:
            return (RewardResult(0.0, False, "answer too long", {"answer": ans[:80], "method": method}),
                    ans, gold, method)
        q = quick_equal(ans, gold)
        if q is not None:
            return (RewardResult(float(q), q, "ok" if q else "wrong answer", {"answer": ans, "method": method}),
                    ans, gold, method)
        return None, ans, gold, method

    def grading(self) -> str:
        if self.extract == "strict":
            return "math, strict: the answer is the last \\boxed{} or an explicit final-answer phrase"
        return "math, lenient: the last \\boxed{}, else a final-answer phrase, else the last number"

    def score(self, response: str, label: Any) -> RewardResult:
        return self.score_batch([response], [label])[0]

    def score_batch(self, responses: Sequence[str], labels: Sequence[Any]) -> List[RewardResult]:
        if len(responses) != len(labels):
            raise ValueError(f"score_batch: {len(responses)} responses but {len(labels)} labels")
        out: List[Optional[RewardResult]] = [None] * len(responses)
        slow: List[Tuple[int, str, str, str]] = []
        for i, (r, lab) in enumerate(zip(responses, labels)):
            try:
                res, ans, gold, method = self._prepare(r, lab)
            except Exception as exc:  # noqa: BLE001 - never raise from a verifier
                out[i] = RewardResult(0.0, False, f"verifier error: {type(exc).__name__}: {exc}")
                continue
            if res is not None:
                out[i] = res
            else:
                slow.append((i, ans, gold, method))
        if slow:
            try:
                checks = self.verifier.check_many([(a, g) for _, a, g, _ in slow])
            except Exception as exc:  # noqa: BLE001
                checks = [(False, f"verifier error: {type(exc).__name__}: {exc}")] * len(slow)
            for (i, ans, _, method), (eq, why) in zip(slow, checks):
                reason = ("ok" if eq else "wrong answer") if why == "ok" else why
                out[i] = RewardResult(float(eq), bool(eq), reason, {"answer": ans, "method": method})
        return out  # type: ignore[return-value]


register_task("math", MathTask)
