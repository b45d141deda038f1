"""Words as the traffic profile counts them: lowercased \\w+ runs and single other characters, model-independent.

    words("Hi, there!")                                          # ["hi", ",", "there", "!"]
    counts, [bag] = batch_words(pa.array(["Hi, there!", "ok"]))  # the same over a column of ASCII texts, at once
    counts, bags = text_words(texts, weights)                    # any text; bag j counts text i weights[i, j] times
    bag_counter(bag)                                             # Counter({"hi": 1, ",": 1, ...}): bag rows are (w, n)

`words` is the definition; `batch_words` (ASCII, over pyarrow buffers) and `text_words` (any text, over code points)
give exactly its counts and bags of words (the tests hold them equal on hostile text), tens of times faster per
word. A bag stays a pyarrow table of (word, count) rows until the sketch it feeds sums its rows (sketches.HeavyHitters):
turning each block's words into Python strings cost more than counting them.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

import numpy as np

_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _class_of(ch: str) -> int:
    """1 for a word character (re's \\w), 0 for whitespace (\\s), 2 for any other: a token of its own. Counting
    over these classes gives `words()` exactly."""
    return 1 if re.match(r"\w", ch) else 0 if re.match(r"\s", ch) else 2


# per ASCII byte (batch_words reads ASCII only: the upper half is never indexed)
_CLASS = np.array([_class_of(chr(b)) for b in range(128)] + [0] * 128, dtype=np.uint8)


def batch_words(texts, weights: np.ndarray | None = None) -> tuple[np.ndarray, list]:
    """`words()` of every text in a pyarrow array of ASCII strings, at once: (count per text, [bag]), a bag being a
    `word_table`. With `weights` (int [texts, k]), k bags: bag j counts text i's words weights[i, j] times (a distinct
    text stands for its repeats); without, one bag of all the words. Vectorized: the classes of the bytes give each
    text's count, and the words split from one buffer in which every non-word byte is a space."""
    import pyarrow as pa
    import pyarrow.compute as pc

    low = pc.ascii_lower(texts)
    n = len(low)
    if n == 0:
        return np.zeros(0, np.int64), [word_table({}) for _ in range(1 if weights is None else weights.shape[1])]
    off = np.frombuffer(low.buffers()[1], np.int32, n + 1, low.offset * 4).astype(np.int64)
    data = low.buffers()[2]
    body = np.frombuffer(data, np.uint8)[off[0] : off[-1]] if data is not None else np.zeros(0, np.uint8)
    off -= off[0]
    counts, word, other = _token_starts(_CLASS[body], off[:-1], np.diff(off))
    spaced = pa.StringArray.from_buffers(
        n, pa.py_buffer(off.astype(np.int32)), pa.py_buffer(np.where(word, body, np.uint8(32)).tobytes())
    )
    return counts, _bags(
        pc.ascii_split_whitespace(spaced),
        body[other],
        np.searchsorted(off, np.flatnonzero(other), side="right") - 1,
        weights,
    )


def _token_starts(cls: np.ndarray, begin: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From the classes of a run of characters holding texts at [begin, begin + lens): tokens per text, and the
    word and other-character masks. A token starts at a word's first character and at every other character."""
    word = cls == 1
    first = word.copy()
    first[1:] &= ~word[:-1]
    inside = begin[begin < len(cls)]
    first[inside] = word[inside]  # a word at a text's start begins there, whatever precedes it
    other = cls == 2
    tokens = np.flatnonzero(first | other)
    return np.searchsorted(tokens, begin + lens) - np.searchsorted(tokens, begin), word, other


def _bags(split, marks: np.ndarray, mark_text: np.ndarray, weights: np.ndarray | None) -> list:
    """Word counts of the words in `split` (a list array: each text's words) and of the other characters (`marks`:
    their code points, `mark_text`: the text each is in), each text counted weights[i, j] times in bag j (once, in
    one bag, without weights). A bag is a `word_table`. One group-by over every word occurrence sums all the bags'
    weights at once (a distinct text stands for its repeats, as a shared system prompt does)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if weights is None:
        weights = np.ones((len(split), 1), np.int64)
    parent = pc.list_parent_indices(split).to_numpy()
    columns = {"w": pc.list_flatten(split)} | {f"n{j}": weights[parent, j] for j in range(weights.shape[1])}
    sums = (
        pa.table(columns)
        .group_by("w", use_threads=False)
        .aggregate([(f"n{j}", "sum") for j in range(weights.shape[1])])
    )
    uniq, inv = np.unique(marks, return_inverse=True)
    chars = pa.array([chr(m) for m in uniq.tolist()], pa.string())
    schema = pa.schema([("w", pa.string()), ("n", pa.int64())])
    bags = []
    for j, w in enumerate(weights.T):
        bag = pa.concat_tables(
            [
                pa.table({"w": sums["w"], "n": sums[f"n{j}_sum"]}).cast(schema),
                pa.table(
                    {"w": chars, "n": np.bincount(inv, weights=w[mark_text], minlength=len(uniq)).astype(np.int64)}
                ),
            ]
        )
        # "": between adjacent spaces
        bags.append(bag.filter(pc.and_(pc.not_equal(bag["w"], ""), pc.not_equal(bag["n"], 0))))
    return bags


def word_table(counts: dict):
    """A bag of words as the vectorized counters give it: a pyarrow table of (w, n) rows, a word possibly in more
    than one row (its count is their sum)."""
    import pyarrow as pa

    return pa.table({"w": pa.array(list(counts), pa.string()), "n": pa.array(list(counts.values()), pa.int64())})


def bag_counter(bag) -> Counter:
    """A bag (`word_table`) as a Counter of words, zero counts left out."""
    out: Counter = Counter()
    for w, n in zip(bag["w"].to_pylist(), bag["n"].to_pylist(), strict=True):
        out[w] += n
    return +out


@functools.lru_cache(maxsize=1)
def _bmp_classes() -> np.ndarray:
    """_class_of for every code point below 0x10000, built once per process from what re's \\w and \\s are made of
    (str.isalnum() or "_", and str.isspace(): the tests check the two agree everywhere)."""
    chars = [chr(c) for c in range(0x10000)]
    return np.array([1 if ch.isalnum() or ch == "_" else 0 if ch.isspace() else 2 for ch in chars], np.uint8)


def text_words(texts: list[str], weights: np.ndarray | None = None) -> tuple[np.ndarray, list]:
    """`batch_words` for any text (not only ASCII): the code points of the lowercased texts, classed by `_class_of`
    (a table below 0x10000, each distinct code point above asked once), counted the same way."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not texts:
        return np.zeros(0, np.int64), [word_table({}) for _ in range(1 if weights is None else weights.shape[1])]
    low = [t.lower() for t in texts]
    lens = np.array([len(t) for t in low], dtype=np.int64)
    begin = np.concatenate(([0], np.cumsum(lens + 1)[:-1]))  # the texts joined by newlines (a word boundary)
    cp = np.frombuffer("\n".join(low).encode("utf-32-le"), np.uint32)
    cls = _bmp_classes()[np.minimum(cp, 0xFFFF)]
    astral = np.flatnonzero(cp > 0xFFFF)  # beyond the Basic Multilingual Plane (emoji, rare scripts): asked one by one
    if len(astral):
        uniq, inv = np.unique(cp[astral], return_inverse=True)
        cls[astral] = np.array([_class_of(chr(c)) for c in uniq.tolist()], np.uint8)[inv]
    counts, word, other = _token_starts(cls, begin, lens)
    spaced = np.where(word, cp, np.uint32(32)).tobytes().decode("utf-32-le")
    arr = pa.array([spaced[b : b + n] for b, n in zip(begin.tolist(), lens.tolist(), strict=True)], pa.string())
    # only spaces separate the words here; utf8_split_whitespace would also do, but in pyarrow 25 it sometimes returns
    # words with a space inside (a fuzz test caught it): the literal split is exact, and _bags drops its "" pieces
    return counts, _bags(
        pc.split_pattern(arr, " "), cp[other], np.searchsorted(begin, np.flatnonzero(other), side="right") - 1, weights
    )
