"""Replace PII and secrets in prompt text with typed placeholders.

    text, counts = scrub("mail me at a@b.com")   # ("mail me at <EMAIL>", {"email": 1})

Structured PII only, each pattern validated where a checksum or numbering plan exists, so a scrubbed prompt still
reads like traffic (order numbers, dates, versions and hashes survive):
- secret: API keys in the formats of OpenAI, Anthropic, AWS, GitHub, GitLab, Slack, Stripe, Google, Hugging Face,
  npm; JWTs; bearer tokens; PEM private keys;
- email; card (14-19 digits in a card layout with an issuer prefix, passing Luhn); iban (ISO 13616 mod-97 check);
- phone: numbers libphonenumber finds valid in their numbering plan, international (+CC) from anywhere, national
  formats of the REGIONS below when written in groups (10+ digits);
- national_id: US SSN (dashed), UK National Insurance number, India Aadhaar (Verhoeff check);
- ip: IPv4 and IPv6.
Not scrubbed: names, postal addresses, dates of birth and free-text identifiers; those need an NER model.
`benchmarks/bench_pii.py` measures recall and precision per type on real prompts with injected PII.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

REGIONS = ("US", "GB", "DE", "FR")  # national phone formats recognised without a +country code

DIGIT = object()  # a rule's precondition: the text holds a decimal digit (what \d matches)
_ANY_DIGIT = re.compile(r"\d")
_SECRET = re.compile(
    # a key holds no quote: a match never runs from one JSON string of a tool field into the next
    r"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----[^\"]*?-----END (?:[A-Z]+ )?PRIVATE KEY-----"
    r"|\b(?:sk-[A-Za-z0-9_-]{16,}|[sr]k_(?:live|test)_[A-Za-z0-9]{16,}|(?:AKIA|ASIA)[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|github_pat_[A-Za-z0-9_]{40,}|glpat-[A-Za-z0-9_-]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35}"
    r"|hf_[A-Za-z]{30,}|npm_[A-Za-z0-9]{36}|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})"
    r"|(?i:bearer\s+)[A-Za-z0-9._~+/-]{20,}=*"
)
_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b")
_CARD = re.compile(r"(?<![+\d])\d(?:[ -]?\d){13,18}\b")
_SSN = re.compile(r"\b(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}\b")
_NINO = re.compile(r"\b(?!BG|GB|NK|KN|TN|NT|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?\d{2} ?\d{2} ?\d{2} ?[A-D]\b")
_AADHAAR = re.compile(r"\b[2-9]\d{3}[ -]?\d{4}[ -]?\d{4}\b")
# a cheap pre-check (most prompts never reach libphonenumber), not inside ids, hashes or times
_PHONE_HINT = re.compile(r"(?<![\w#:.\-])[+(]?\d[\d ().\-]{6,}\d(?![\w:])")
_IPV4 = re.compile(r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)(?!\.?\d)")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")


def luhn_ok(digits: str) -> bool:
    total, parity = 0, len(digits) % 2
    for i, ch in enumerate(digits):
        d = int(ch)
        if i % 2 == parity:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


_D = (
    (0, 1, 2, 3, 4, 5, 6, 7, 8, 9),
    (1, 2, 3, 4, 0, 6, 7, 8, 9, 5),
    (2, 3, 4, 0, 1, 7, 8, 9, 5, 6),
    (3, 4, 0, 1, 2, 8, 9, 5, 6, 7),
    (4, 0, 1, 2, 3, 9, 5, 6, 7, 8),
    (5, 9, 8, 7, 6, 0, 4, 3, 2, 1),
    (6, 5, 9, 8, 7, 1, 0, 4, 3, 2),
    (7, 6, 5, 9, 8, 2, 1, 0, 4, 3),
    (8, 7, 6, 5, 9, 3, 2, 1, 0, 4),
    (9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
)
_P = (
    (0, 1, 2, 3, 4, 5, 6, 7, 8, 9),
    (1, 5, 7, 6, 2, 8, 3, 0, 9, 4),
    (5, 8, 0, 3, 7, 9, 6, 1, 4, 2),
    (8, 9, 1, 6, 0, 4, 3, 5, 2, 7),
    (9, 4, 5, 3, 1, 2, 6, 8, 7, 0),
    (4, 2, 8, 6, 5, 7, 3, 9, 0, 1),
    (2, 7, 9, 3, 8, 0, 6, 4, 1, 5),
    (7, 0, 4, 6, 9, 1, 3, 2, 5, 8),
)


def verhoeff_ok(digits: str) -> bool:
    c = 0
    for i, ch in enumerate(reversed(digits)):
        c = _D[c][_P[i % 8][int(ch)]]
    return c == 0


def iban_ok(s: str) -> bool:
    s = s.replace(" ", "")
    if not 15 <= len(s) <= 34:
        return False
    moved = s[4:] + s[:4]
    return int("".join(str(int(ch, 36)) for ch in moved)) % 97 == 1


def _digits(m: re.Match) -> str:
    return re.sub(r"\D", "", m.group())


_CARD_LAYOUTS = ((4, 6, 5), (4, 6, 4))  # Amex, Diners; otherwise groups of four (the last may be shorter) or one run


def _is_card(groups: list[str]) -> bool:
    """14-19 digits in a card's layout, an issuer prefix (2-6) and the Luhn check."""
    d = "".join(groups)
    sizes = tuple(map(len, groups))
    layout = len(groups) == 1 or sizes in _CARD_LAYOUTS or (all(n == 4 for n in sizes[:-1]) and 1 <= sizes[-1] <= 4)
    return 14 <= len(d) <= 19 and d[0] in "23456" and layout and luhn_ok(d)


def _card(m: re.Match) -> str:
    """The candidate may have swallowed neighbouring numbers ("step 2 4111 1111 1111 1111"): try every run of its
    digit groups, longest first, and replace the first that is a card."""
    text = m.group()
    groups = [(g.start(), g.end()) for g in re.finditer(r"\d+", text)]
    for size in range(len(groups), 0, -1):
        for i in range(len(groups) - size + 1):
            start, end = groups[i][0], groups[i + size - 1][1]
            if _is_card(re.findall(r"\d+", text[start:end])):
                return text[:start] + "<CARD>" + text[end:]
    return text


def _iban(m: re.Match) -> str:
    """The longest prefix of the candidate that passes the check ("IBAN DE89 3704 0044 0532 0130 00 I sent" ends
    before " I")."""
    text = m.group()
    cut = len(text)
    while cut >= 15:
        if iban_ok(text[:cut]):
            return "<IBAN>" + text[cut:]
        cut = text.rfind(" ", 0, cut)
    return text


def _aadhaar(m: re.Match) -> str:
    return "<NATIONAL_ID>" if verhoeff_ok(_digits(m)) else m.group()


def _ipv6(m: re.Match) -> str:
    if m.group().count(":") < 2:
        return m.group()
    try:
        ipaddress.IPv6Address(m.group())
    except ValueError:
        return m.group()
    return "<IP>"


def _looks_like_phone(raw: str) -> bool:
    """Beyond a valid numbering plan: international (+CC), or written as a phone number is (10+ digits in groups of
    2+ digits). Bare digit runs are order numbers; `1 2 3 4` is a list."""
    if raw.startswith("+"):
        return True
    groups = re.findall(r"\d+", raw)
    return sum(map(len, groups)) >= 10 and len(groups) >= 2 and all(len(g) >= 2 for g in groups)


def _phone_at(text: str, region_numbers) -> tuple[int, int] | None:
    """The longest run of `text`'s digit groups (with a leading + or parenthesis) that is a valid phone number."""
    import phonenumbers

    groups = [(g.start(), g.end()) for g in re.finditer(r"\d+", text)]
    starts = [0] + [i for i, (a, _) in enumerate(groups) if i and a > 0 and text[a - 1] in "+("]
    # from the candidate's start and from each + or (: the longest run of groups that is valid, so a number written
    # next to other numbers ("+44 20 7946 0958 12", "(646) 256-5787 5th") still ends where its numbering plan says
    for i in starts:
        for j in range(min(len(groups), i + 7), i, -1):
            start, end = groups[i][0], groups[j - 1][1]
            if start > 0 and text[start - 1] in "+(":
                start -= 1
            raw = text[start:end] + (")" if text[start] == "(" and ")" not in text[start:end] else "")
            if not _looks_like_phone(raw):
                continue
            for region in region_numbers:
                try:
                    n = phonenumbers.parse(raw, region)
                except phonenumbers.NumberParseException:
                    continue
                if phonenumbers.is_valid_number(n):
                    return start, end
    return None


def _phones(text: str) -> tuple[str, int]:
    hits = 0

    def sub(m: re.Match) -> str:
        nonlocal hits
        cand = m.group()
        span = _phone_at(cand, REGIONS)
        if span is None:
            return cand
        hits += 1
        rest = _phones(cand[span[1] :])[0] if span[1] < len(cand) else ""
        return cand[: span[0]] + "<PHONE>" + rest

    text = _PHONE_HINT.sub(sub, text)
    return text, hits


# Every literal a _SECRET alternative starts with (checked with `in`, far cheaper than the regex on text without any).
_SECRET_HINTS = (
    "-----BEGIN ",
    "sk-",
    "sk_live_",
    "sk_test_",
    "rk_live_",
    "rk_test_",
    "AKIA",
    "ASIA",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "github_pat_",
    "glpat-",
    "xoxa-",
    "xoxb-",
    "xoxp-",
    "xoxr-",
    "xoxs-",
    "AIza",
    "hf_",
    "npm_",
    "eyJ",
)


def _may_hold_secret(text: str) -> bool:
    return any(h in text for h in _SECRET_HINTS) or "bearer" in text.lower()


# order matters: secrets and emails before digit patterns eat their parts; IBANs before cards; IPs before phones
RULES = (
    # (type, pattern, replacement, what a text must hold for the rule to match at all: DIGIT, a substring or a test)
    ("secret", _SECRET, "<SECRET>", _may_hold_secret),
    ("email", _EMAIL, "<EMAIL>", "@"),
    ("iban", _IBAN, _iban, DIGIT),
    ("card", _CARD, _card, DIGIT),
    ("national_id", _SSN, "<NATIONAL_ID>", DIGIT),
    ("national_id", _NINO, "<NATIONAL_ID>", DIGIT),
    ("national_id", _AADHAAR, _aadhaar, DIGIT),
    ("ip", _IPV4, "<IP>", DIGIT),
    ("ip", _IPV6, _ipv6, ":"),
    ("phone", None, _phones, DIGIT),
)
TYPES = tuple(dict.fromkeys(rule[0] for rule in RULES))

# What a text must hold for each rule to change it, as RE2 patterns (pyarrow.compute runs them over a whole batch of
# texts at once; only the rules whose hint a text matches run on it, and texts no hint matches skip `scrub`). Each is a
# necessary condition of its rule: its pattern with the lookarounds and word boundaries dropped (RE2 has none) and
# Python's Unicode \d spelled \p{Nd}. A rule sees the text earlier rules rewrote, but a replacement (<EMAIL>,
# <CARD>, ...) holds no digit, @, colon or secret prefix and splits the runs around it, so a hint that does not match
# the original text does not match the rewritten one either (the tests hold scrub with hints equal to scrub without).
_ND = r"\p{Nd}"
RULE_HINTS = (  # aligned with RULES
    "|".join(re.escape(h) for h in _SECRET_HINTS) + "|(?i:bearer)",  # secret
    "@",  # email
    rf"[A-Z]{{2}}{_ND}{{2}}",  # iban
    rf"{_ND}(?:[ -]?{_ND}){{13}}",  # card
    rf"{_ND}{{3}}-{_ND}{{2}}-{_ND}{{4}}",  # ssn
    rf"[A-Z]{{2}} ?{_ND}{{2}} ?{_ND}{{2}} ?{_ND}{{2}} ?[A-D]",  # nino
    rf"[2-9]{_ND}{{3}}[ -]?{_ND}{{4}}[ -]?{_ND}{{4}}",  # aadhaar
    rf"{_ND}\.{_ND}+\.{_ND}+\.{_ND}",  # ipv4
    ":[0-9A-Fa-f]{0,4}:",  # ipv6
    rf"{_ND}[{_ND} ().\-]{{6,}}{_ND}",  # phone (_PHONE_HINT)
)
HINT = "|".join(f"(?:{h})" for h in RULE_HINTS)


def rule_hints(texts) -> list[tuple[bool, ...]]:
    """For each text in a pyarrow string array, which rules may change it (RULE_HINTS), as `scrub(rules=...)` takes."""
    import pyarrow.compute as pc

    cols = [pc.match_substring_regex(texts, h).to_pylist() for h in RULE_HINTS]
    return list(zip(*cols, strict=True)) if len(texts) else []


def _may_match(needs, text: str, has_digit: bool) -> bool:
    """Whether `text` holds what a rule's pattern needs (RULES' last column) to match at all."""
    if needs is DIGIT:
        return has_digit
    return needs(text) if callable(needs) else needs in text


def scrub(text: str, prefilter: bool = True, rules: tuple[bool, ...] | None = None) -> tuple[str, Counter]:
    """`prefilter=False` runs every rule on every text: the same result, slower (the tests hold the two equal).
    `rules`: which of RULES to run (from `rule_hints`); the others cannot change this text."""
    counts: Counter = Counter()
    has_digit = _ANY_DIGIT.search(text) is not None  # two thirds of real prompts have none: seven rules skipped
    for i, (name, pattern, repl, needs) in enumerate(RULES):
        if prefilter and ((rules is not None and not rules[i]) or not _may_match(needs, text, has_digit)):
            continue
        if pattern is None:
            text, hits = repl(text)
        else:
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
