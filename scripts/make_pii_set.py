"""Build the labeled PII set: real demo prompts with synthetic PII (and hard negatives) injected at word boundaries.

    .venv/bin/python scripts/make_pii_set.py            # writes data/pii/labeled.jsonl (seeded, reproducible)

Each row: {"prompt": line index into data/demo/traffic.jsonl, "text": ..., "pii": [{"type", "value"}], "negatives":
[...]}. Values are generated valid (Luhn, mod-97, Verhoeff, numbering plans) in the formats people paste: spaced,
dashed, compact, national and international. Hard negatives look like PII and are not: order numbers, dates, versions,
hashes, UUIDs, prices, times, ISBNs.
"""

from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from qgate.calibrate.scrub import iban_ok, luhn_ok, verhoeff_ok  # noqa: E402
from qgate.calibrate.scrub_eval import demo_prompts  # noqa: E402

R = random.Random(20261122)
PER_TYPE = 300


HEX = "0123456789abcdef"


def _alnum(n, chars=string.ascii_letters + string.digits):
    return "".join(R.choice(chars) for _ in range(n))


def email():
    first = R.choice(["jane", "j.doe", "max.mustermann", "li.wei", "ana-maria", "o'neil", "dev+ops", "x_1"])
    first = first.replace("'", "")
    dom = R.choice(["example.com", "corp.co.uk", "mail.example.de", "uni-bonn.de", "startup.io", "gov.in"])
    return f"{first}{R.randint(0, 999)}@{dom}"


def phone():
    """A number valid in its numbering plan (libphonenumber), in a format people write."""
    import phonenumbers

    while True:
        raw = _phone_form()
        try:
            if phonenumbers.is_valid_number(
                phonenumbers.parse(
                    raw,
                    "US"
                    if not raw.startswith(("+", "0"))
                    else {"020": "GB", "07": "GB", "030": "DE", "01": "FR", "06": "FR"}.get(
                        raw[:3], {"07": "GB", "01": "FR", "06": "FR"}.get(raw[:2], "ZZ")
                    ),
                )
            ):
                return raw
        except phonenumbers.NumberParseException:
            pass


def _phone_form():
    d = lambda n: "".join(R.choice(string.digits) for _ in range(n))  # noqa: E731
    area = R.choice(["212", "415", "646", "312", "617"])
    forms = [
        lambda: f"({area}) {R.randint(200, 999)}-{d(4)}",
        lambda: f"{area}-{R.randint(200, 999)}-{d(4)}",
        lambda: f"+1 {area} {R.randint(200, 999)} {d(4)}",
        lambda: f"{area}.{R.randint(200, 999)}.{d(4)}",
        lambda: f"+1{area}{R.randint(200, 999)}{d(4)}",
        lambda: f"+44 20 7{d(3)} {d(4)}",
        lambda: f"020 7{d(3)} {d(4)}",
        lambda: f"07{R.choice('4579')}{d(2)} {d(6)}",
        lambda: f"+49 30 {d(8)}",
        lambda: f"030 {d(8)}",
        lambda: f"+49 151 {d(8)}",
        lambda: f"+33 1 {d(2)} {d(2)} {d(2)} {d(2)}",
        lambda: f"01 {d(2)} {d(2)} {d(2)} {d(2)}",
        lambda: f"06 {d(2)} {d(2)} {d(2)} {d(2)}",
        lambda: f"+91 9{d(4)} {d(5)}",
        lambda: f"+81 3-{d(4)}-{d(4)}",
        lambda: f"+61 2 {d(4)} {d(4)}",
    ]
    return R.choice(forms)()


def _luhn_complete(prefix, length):
    body = prefix + "".join(R.choice(string.digits) for _ in range(length - len(prefix) - 1))
    return next(body + c for c in string.digits if luhn_ok(body + c))


def card():
    kind = R.choice(["visa", "mc", "amex", "visa19"])
    num = {
        "visa": lambda: _luhn_complete("4", 16),
        "mc": lambda: _luhn_complete(str(R.randint(51, 55)), 16),
        "amex": lambda: _luhn_complete(R.choice(["34", "37"]), 15),
        "visa19": lambda: _luhn_complete("4", 19),
    }[kind]()
    sep = R.choice(["", " ", "-"])
    if kind == "amex":
        return sep.join([num[:4], num[4:10], num[10:]])
    return sep.join(num[i : i + 4] for i in range(0, len(num), 4))


IBAN_LEN = {"DE": 22, "GB": 22, "FR": 27, "NL": 18, "ES": 24, "IT": 27, "CH": 21}


def iban():
    cc = R.choice(sorted(IBAN_LEN))
    n = IBAN_LEN[cc] - 4
    bban = (
        (_alnum(4, string.ascii_uppercase) + "".join(R.choice(string.digits) for _ in range(n - 4)))
        if cc in ("GB", "NL")
        else "".join(R.choice(string.digits) for _ in range(n))
    )
    for ck in range(2, 99):
        s = f"{cc}{ck:02d}{bban}"
        if iban_ok(s):
            break
    return " ".join(s[i : i + 4] for i in range(0, len(s), 4)) if R.random() < 0.5 else s


def secret():
    return R.choice(
        [
            lambda: "sk-" + _alnum(48),
            lambda: "sk-proj-" + _alnum(60, string.ascii_letters + string.digits + "_-"),
            lambda: "sk-ant-api03-" + _alnum(80, string.ascii_letters + string.digits + "_-"),
            lambda: "AKIA" + _alnum(16, string.ascii_uppercase + string.digits),
            lambda: "ghp_" + _alnum(36),
            lambda: "github_pat_" + _alnum(82, string.ascii_letters + string.digits + "_"),
            lambda: "glpat-" + _alnum(20),
            lambda: "xoxb-" + _alnum(12, string.digits) + "-" + _alnum(24),
            lambda: "AIza" + _alnum(35, string.ascii_letters + string.digits + "_-"),
            lambda: "sk_live_" + _alnum(24),
            lambda: "hf_" + _alnum(34, string.ascii_letters),
            lambda: "npm_" + _alnum(36),
            lambda: (
                "eyJhbGciOiJIUzI1NiJ9.eyJ" + _alnum(30) + "." + _alnum(43, string.ascii_letters + string.digits + "_-")
            ),
            lambda: "Bearer " + _alnum(40),
        ]
    )()


def ip():
    if R.random() < 0.5:
        return ".".join(str(R.randint(1, 254)) for _ in range(4))
    groups = [f"{R.randint(0, 0xFFFF):x}" for _ in range(8)]
    if R.random() < 0.5:
        i = R.randint(1, 5)
        return ":".join(groups[:i]) + "::" + ":".join(groups[i + 2 :])
    return ":".join(groups)


def national_id():
    kind = R.choice(["ssn", "nino", "aadhaar"])
    if kind == "ssn":
        return (
            f"{R.choice([R.randint(1, 665), R.randint(667, 899)]):03d}-{R.randint(1, 99):02d}-{R.randint(1, 9999):04d}"
        )
    if kind == "nino":
        first, second = R.choice("ABCEGHJKLMNPRSTWXYZ"), R.choice("ABCEGHJKLMNPRSTWXYZ")
        if first + second in ("BG", "GB", "NK", "KN", "TN", "NT", "ZZ"):
            first = "A"
        d = "".join(R.choice(string.digits) for _ in range(6))
        return R.choice(
            [f"{first}{second}{d}{R.choice('ABCD')}", f"{first}{second} {d[:2]} {d[2:4]} {d[4:]} {R.choice('ABCD')}"]
        )
    while True:
        d = str(R.randint(2, 9)) + "".join(R.choice(string.digits) for _ in range(11))
        if verhoeff_ok(d):
            return R.choice([d, f"{d[:4]} {d[4:8]} {d[8:]}"])


GENERATORS = {
    "email": email,
    "phone": phone,
    "card": card,
    "iban": iban,
    "secret": secret,
    "ip": ip,
    "national_id": national_id,
}


def negative():
    d = lambda n: "".join(R.choice(string.digits) for _ in range(n))  # noqa: E731
    return R.choice(
        [
            lambda: f"order #{d(10)}",
            lambda: f"invoice {d(13)}",
            lambda: f"{R.randint(2000, 2030)}-{R.randint(1, 12):02d}-{R.randint(1, 28):02d}",
            lambda: f"v{R.randint(0, 9)}.{R.randint(0, 30)}.{R.randint(0, 99)}",
            lambda: f"commit {_alnum(40, '0123456789abcdef')}",
            lambda: "-".join(
                [_alnum(8, HEX), _alnum(4, HEX), "4" + _alnum(3, HEX), "a" + _alnum(3, HEX), _alnum(12, HEX)]
            ),
            lambda: f"${R.randint(1, 99999)}.{d(2)}",
            lambda: f"{R.randint(0, 23):02d}:{R.randint(0, 59):02d}:{R.randint(0, 59):02d}",
            lambda: f"ISBN 978-{d(1)}-{d(3)}-{d(5)}-{d(1)}",
            lambda: f"{d(3)} {d(3)} {d(3)}",
            lambda: "1 2 3 4 5 6 7 8 9 10",
            lambda: f"x = {R.randint(1, 999)} * {R.randint(1, 999)} + {R.randint(1, 99999)}",
            lambda: f"port {R.randint(1024, 65535)}",
            lambda: f"{R.randint(1, 9)}.{d(6)}e-{R.randint(1, 9)}",
            lambda: f"item {d(4)}-{d(4)}",
            lambda: "1.2.3.4.5",
            lambda: f"SKU {_alnum(2, string.ascii_uppercase)}{d(6)}",
            lambda: f"ticket JIRA-{d(5)}",
            lambda: f"#{_alnum(6, '0123456789abcdef')}",
        ]
    )()


def _inject(text: str, value: str) -> str:
    words = text.split(" ")
    i = R.randint(0, len(words))
    return " ".join(words[:i] + [value] + words[i:])


def main() -> None:
    prompts = demo_prompts()
    rows = []
    for kind, gen in GENERATORS.items():
        for _ in range(PER_TYPE):
            v, i = gen(), R.randrange(len(prompts))
            rows.append(
                {"prompt": i, "text": _inject(prompts[i], v), "pii": [{"type": kind, "value": v}], "negatives": []}
            )
    for _ in range(PER_TYPE * 2):  # hard negatives only
        negs, i = [negative() for _ in range(R.randint(1, 3))], R.randrange(len(prompts))
        text = prompts[i]
        for n in negs:
            text = _inject(text, n)
        rows.append({"prompt": i, "text": text, "pii": [], "negatives": negs})
    R.shuffle(rows)
    out = ROOT / "data/pii/labeled.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
