"""Replace PII and secrets in prompt text with typed placeholders.

    text, counts = scrub("mail me at a@b.com")   # ("mail me at <EMAIL>", {"email": 1})

Patterns are conservative: a scrubbed prompt should still read like traffic.
Credit-card candidates must pass the Luhn check, so order numbers survive.
"""
from __future__ import annotations

import re
from collections import Counter

_SECRET = re.compile(
    r"\b(?:sk-[A-Za-z0-9_-]{16,}|sk_(?:live|test)_[A-Za-z0-9]{16,}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|xox[abpr]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35})\b"
    r"|(?i:bearer\s+)[A-Za-z0-9._~+/-]{20,}=*"
)
_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
_CARD = re.compile(r"\b\d(?:[ -]?\d){12,18}\b")
_PHONE = re.compile(r"(?<![\w.])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,4}(?![\w.])")
_IPV4 = re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")


def _luhn(digits: str) -> bool:
    total, parity = 0, len(digits) % 2
    for i, ch in enumerate(digits):
        d = int(ch)
        if i % 2 == parity:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card(m: re.Match) -> str:
    digits = re.sub(r"\D", "", m.group())
    return "<CARD>" if 13 <= len(digits) <= 19 and _luhn(digits) else m.group()


RULES = (  # order matters: secrets and emails before digit patterns eat their parts
    ("secret", _SECRET, "<SECRET>"),
    ("email", _EMAIL, "<EMAIL>"),
    ("card", _CARD, _card),
    ("phone", _PHONE, "<PHONE>"),
    ("ipv4", _IPV4, "<IP>"),
)


def scrub(text: str) -> tuple[str, Counter]:
    counts: Counter = Counter()
    for name, pattern, repl in RULES:
        hits = 0

        def sub(m: re.Match, repl=repl) -> str:
            nonlocal hits
            out = repl(m) if callable(repl) else repl
            hits += out != m.group()
            return out

        text = pattern.sub(sub, text)
        if hits:
            counts[name] += hits
    return text, counts
