"""Domain labels of training rows: code, math or chat, named by the source or found by a rule.

A source's `domain` is a fixed label (a code prompt set is all `code`) or `auto`: each
conversation is classified by `classify`, a cheap, documented rule rather than a model, so a run
can count and cap its mixture without a download:

- `code`: a fenced code block (```), or at least `CODE_HITS` programming markers (a `def`,
  `class`, `import`, `#include`, `function`/`=>`, `SELECT .. FROM`, `console.log`, a line ending
  in `{` or `;`, a trace-back line, ...);
- `math`: LaTeX math (`$..$`, `\\frac`, `\\sqrt`, `\\int`, `\\sum`, `\\begin{equation}`, ...), or at
  least `MATH_HITS` arithmetic expressions / equations between numbers (`3 * 4 = 12`, `x^2`);
- `chat`: everything else.

Code wins over math (a program that computes a sum is code). Every turn is read, answers
included: a short question whose answer is a program is a code conversation.
"""

from __future__ import annotations

import re

AUTO = "auto"
DOMAINS = ("code", "math", "chat")
CODE_HITS = 3
MATH_HITS = 3

FENCE = re.compile(r"^\s*```", re.MULTILINE)
CODE_MARKERS = re.compile(
    r"^\s*(def|class|import|from \S+ import|#include|public (static )?\w+|package \w+|using \w+;)\b"
    r"|\bfunction\s*\w*\s*\(|\)\s*=>|\bconsole\.log\(|\bSELECT\b[\s\S]{1,200}?\bFROM\b"
    r"|\breturn\b[^\n]*;\s*$|[;{]\s*$|^\s*}\s*$|Traceback \(most recent call last\)"
    r"|\b\w+\.\w+\([^()\n]*\)",
    re.MULTILINE,
)
LATEX = re.compile(
    # inline math holds a backslash, ^, _ or = (a price such as "$5 or $10" does not)
    r"\$(?!\s)[^$\n]{0,200}[\\^_=][^$\n]{0,200}(?<!\s)\$"
    r"|\\(frac|sqrt|int|sum|prod|lim|cdot|times|leq|geq|neq|alpha|beta|theta|pi)\b"
    r"|\\begin\{(equation|align)",
)
EQUATION = re.compile(
    r"\d\s*[-+*/×÷^]\s*\(?\d[\d.]*\)?\s*=\s*-?\d|\b[a-z]\s*\^\s*\d|\b\d+[a-z]\s*[-+=]\s*\d"
)


def classify(turns: list[dict]) -> str:
    """`code`, `math` or `chat` for a conversation (see the module docstring for the rule)."""
    text = "\n".join(t["content"] for t in turns)
    if FENCE.search(text) or _hits(CODE_MARKERS, text, CODE_HITS):
        return "code"
    if LATEX.search(text) or _hits(EQUATION, text, MATH_HITS):
        return "math"
    return "chat"


def _hits(pattern: re.Pattern, text: str, needed: int) -> bool:
    """Whether `pattern` occurs at least `needed` times (stops counting there)."""
    for n, _ in enumerate(pattern.finditer(text), start=1):
        if n >= needed:
            return True
    return False


def label(spec_domain: str, turns: list[dict]) -> str:
    """The row's domain: the source's fixed label, or the rule's under `auto`."""
    return classify(turns) if spec_domain == AUTO else spec_domain


def cap_rows(rows: list[dict], caps: dict[str, int | None]) -> tuple[list[dict], dict[str, int]]:
    """The first rows of each domain up to its cap (`None` or absent: no cap), order kept;
    returns the kept rows and how many of each domain the caps left out."""
    kept, seen, left_out = [], {}, {}
    for row in rows:
        domain = row["domain"]
        seen[domain] = seen.get(domain, 0) + 1
        cap = caps.get(domain)
        if cap is not None and seen[domain] > cap:
            left_out[domain] = left_out.get(domain, 0) + 1
            continue
        kept.append(row)
    return kept, dict(sorted(left_out.items()))


def counts(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in rows:
        out[row["domain"]] = out.get(row["domain"], 0) + 1
    return dict(sorted(out.items()))
