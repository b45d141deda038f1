"""Leaf-by-leaf differences between two served files, for the contract gate.

    diffs, n = json_diffs({"a": {"b": 1}}, {"a": {"b": 2}})   # [(("a", "b"), 1, 2)], 1 leaf compared
    pairs, n = file_diffs(lambda top: ("tokenizer", "tokenizer"), "tokenizer.json", base / "tokenizer.json", cand / f)

JSON is compared key by key and list item by list item, text files line by line, anything else by content; a value
one side lacks is MISSING. Token ids compare as sets, and booleans never equal numbers.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MISSING = "<absent>"
SHOW = 5  # differences listed one by one under one parent key; more are summarized with their count


def read_json(path: Path) -> dict:
    """A JSON file's object, or {} where the file is absent."""
    return json.loads(path.read_text()) if path.exists() else {}


def difference(facet: str, key: str, file: str, base, cand) -> dict:
    """One difference as the report records it: its key (`facet.key`), the file it is in, and both values."""
    return {"key": f"{facet}.{key}" if key else facet, "file": file, "baseline": base, "candidate": cand}


def same(a, b, key: str) -> bool:
    """JSON equality, with token ids compared as sets (an id or a list of them) and booleans never equal to numbers."""
    if key.endswith("token_id") and a is not MISSING and b is not MISSING:
        return _ids(a) == _ids(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _ids(v) -> list | None:
    if v is None:
        return None
    return sorted(v) if isinstance(v, list) else [v]


def json_diffs(a, b, path: tuple = ()) -> tuple[list[tuple[tuple, object, object]], int]:
    """Every leaf where two JSON values differ, as (path parts, baseline value, candidate value), nested keys and
    list items (int parts) included; and the number of leaves compared."""
    if isinstance(a, dict) and isinstance(b, dict):
        out, n = [], 0
        for k in sorted(a.keys() | b.keys(), key=str):
            d, m = json_diffs(a.get(k, MISSING), b.get(k, MISSING), path + (k,))
            out += d
            n += m
        return out, max(n, 1)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and a != b:
        out, n = [], 0
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d, m = json_diffs(x, y, path + (i,))
            out += d
            n += m
        return out, n
    if isinstance(a, list) and isinstance(b, list) and a == b:
        return [], max(len(a), 1)
    name = str(path[-1]) if path else ""
    return ([] if same(a, b, name) else [(path, a, b)]), 1


def dotted(parts) -> str:
    """('model', 'merges', 17) -> 'model.merges[17]'."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def leaves(obj, path: str = ""):
    """(dotted path, value) of every leaf of a JSON object; lists are leaves."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    else:
        yield path, obj


def file_diffs(
    prefix_of, file: str, bpath: Path, cpath: Path, skip: tuple[str, ...] = ()
) -> tuple[list[tuple[str, dict]], int]:
    """(facet, difference) pairs for one file served by both: JSON compared key by key, merges.txt line by line, a
    binary file by content; a file one side lacks is one difference. prefix_of(top-level key) -> (facet, key prefix)."""
    if not bpath.exists() and not cpath.exists():
        return [], 0
    if bpath.exists() != cpath.exists():
        facet, prefix = prefix_of("")
        side = {True: "present", False: "absent"}
        return [
            (facet, {"key": prefix, "file": file, "baseline": side[bpath.exists()], "candidate": side[cpath.exists()]})
        ], 1
    if cpath.suffix == ".json":
        diffs, n = json_diffs(read_json(bpath), read_json(cpath))
    elif cpath.suffix == ".txt":
        bl, cl = bpath.read_text().splitlines(), cpath.read_text().splitlines()
        diffs = [((f"line{i + 1}",), x, y) for i, (x, y) in enumerate(zip(bl, cl, strict=False)) if x != y]
        diffs += [
            ((f"line{i + 1}",), (bl + [MISSING] * len(cl))[i], (cl + [MISSING] * len(bl))[i])
            for i in range(min(len(bl), len(cl)), max(len(bl), len(cl)))
        ]
        n = max(len(bl), len(cl))
    else:
        h = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (bpath, cpath)]
        diffs, n = ([(("sha256",), h[0], h[1])] if h[0] != h[1] else []), 1
    out = []
    for parts, b, c in diffs:
        if parts[0] in skip:
            continue
        facet, key = prefix_of(str(parts[0]))
        full, parent = dotted((key, *parts)), dotted((key, *parts[:-1]))
        out.append((facet, {"key": full, "parent": parent, "file": file, "baseline": b, "candidate": c}))
    return out, n
