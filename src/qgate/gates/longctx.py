"""Long-context gate: the candidate's perplexity on long documents against the baseline's, window by window out to
the context the model is served with.

    ref, hit = baseline_long_reference(runner_factory, baseline, LongContextConfig(), cache_dir)
    results, coverage = long_context_gate(candidate_runner, ref, LongContextConfig(), shadow_tokens=432)

The shadow gate's evidence covers prompts of at most `max_prompt_tokens` plus the answer; a model is served with
contexts up to its `max_position_embeddings`. Damage that grows with context (a changed rope, KV-cache quantization
error accumulating over many attended tokens) shows beyond what the shadow prompts reach, so this gate scores long
documents: real long conversations (default: the shipped ShareGPT set, `scripts/extract_long_documents.py`), rendered
with the baseline's chat template and cut at the served context. Both models score the same tokens teacher-forced, and
each document's own tokens (message content; chat-template tokens excluded) are split by position into doubling
windows ending at the served context C: (0, C/8], (C/8, C/4], (C/4, C/2], (C/2, C] by default. One check per window:
the relative increase of the candidate's mean negative log-likelihood over the baseline's on those tokens (perplexity
ratio minus one, in log terms), with a t interval over documents that holds its level with few of them
(`stats.ratio_of_sums_ci`). PASS when the interval lies below `max_nll_increase`, FAIL when wholly above, INCONCLUSIVE
otherwise. A window fewer than two documents reach is not scored, and every check carries a caveat when the documents
stop short of the served context.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qgate.artifact import Artifact, sha256_file, sha256_json
from qgate.cache import read_cached_arrays, write_cached
from qgate.device import out_of_memory
from qgate.engines.protocol import LogitsInBlocks
from qgate.errors import ConfigError, InputError, in_one_line
from qgate.execute import releases
from qgate.gates.result import POSITIVE, GateResult, check_threshold_values
from qgate.gates.scoring import SCORING_LIBRARIES, reduce_logits, split_sequences
from qgate.gates.stats import ratio_of_sums_ci
from qgate.progress import progress

DOCUMENTS = Path(__file__).parent / "tasks" / "data" / "sharegpt_long.jsonl"
MIN_DOCUMENTS = 2  # a window fewer documents reach has no interval over documents


@dataclass(frozen=True)
class LongContextConfig:
    documents: str | None = None  # JSONL of {"messages": [...]} or {"text": "..."}; None: the shipped set
    max_documents: int = 8  # the longest first; each costs one forward per model at up to C tokens
    context_tokens: int | None = None  # the served context C; None: the baseline's max_position_embeddings
    windows: int = 4  # doubling windows ending at C: (0, C/8], (C/8, C/4], (C/4, C/2], (C/2, C]
    max_nll_increase: float | None = 0.05  # per window: PASS needs the 95% CI of the relative NLL increase below it
    VERSION = 2  # of how the checks are computed; what changed in each is in git

    def __post_init__(self):
        check_threshold_values("gates.long_context", self, {"max_nll_increase": POSITIVE})
        if self.max_documents < MIN_DOCUMENTS:
            raise ConfigError(f"gates.long_context.max_documents must be >= {MIN_DOCUMENTS}, got {self.max_documents}")
        if not 1 <= self.windows <= 12:
            raise ConfigError(f"gates.long_context.windows must be 1..12, got {self.windows}")
        if self.context_tokens is not None and self.context_tokens < 2**self.windows:
            raise ConfigError(
                f"gates.long_context.context_tokens {self.context_tokens} is too short for "
                f"{self.windows} doubling windows"
            )
        if self.documents is not None and not Path(self.documents).is_file():
            raise ConfigError(
                f"gates.long_context.documents: {self.documents} is not a file",
                hint='a JSONL file of {"messages": [...]} or {"text": "..."} lines',
            )

    def path(self) -> Path:
        return Path(self.documents) if self.documents else DOCUMENTS


def served_context(baseline: Artifact, cfg: LongContextConfig) -> int:
    """C: the configured serving limit, or the baseline's max_position_embeddings."""
    if cfg.context_tokens is not None:
        return cfg.context_tokens
    c = json.loads((baseline.path / "config.json").read_text()).get("max_position_embeddings")
    if not isinstance(c, int) or c < 2**cfg.windows:
        raise InputError(
            f"{baseline.path}/config.json: no usable max_position_embeddings ({c!r})",
            hint="set gates.long_context.context_tokens to the context the model is served with",
        )
    return c


def window_edges(context: int, windows: int) -> list[int]:
    """[0, C/2^(w-1), ..., C/2, C]: doubling windows that end at the served context."""
    return [0] + [context >> (windows - 1 - i) for i in range(windows)]


def load_documents(path: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise InputError(f"{path}:{i}: not JSON ({e})") from e
        if not (isinstance(row, dict) and (isinstance(row.get("messages"), list) or isinstance(row.get("text"), str))):
            raise InputError(f'{path}:{i}: a long-context document is {{"messages": [...]}} or {{"text": "..."}}')
        rows.append(row)
    if len(rows) < MIN_DOCUMENTS:
        raise InputError(f"{path}: {len(rows)} document(s); the long-context gate needs at least {MIN_DOCUMENTS}")
    return rows


def encode_documents(tokenizer, rows: list[dict], context: int, limit: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """The `limit` longest documents as token ids cut at `context`, each with its mask of document tokens (message
    content or text, not chat-template tokens)."""
    from qgate.chat import encode_with_sources

    encoded = []
    for row in rows:
        if "messages" in row:
            ids, own, _ = encode_with_sources(tokenizer, row["messages"], 10**9, row.get("tools"))
        else:
            ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
            own = [True] * len(ids)
        encoded.append((ids[:context], np.asarray(own[:context], bool)))
    encoded.sort(key=lambda e: -len(e[0]))
    kept = encoded[:limit]
    return [ids for ids, _ in kept], [own for _, own in kept]


def nll(runner, seq: list[int]) -> np.ndarray:
    """Negative log-likelihood of seq[1:] given its prefix, per position (float64; +inf where the logits define no
    distribution), reduced block by block. A runner that gives its logits in blocks (LogitsInBlocks) never holds the
    document's [T, V]; any other gives them as one block."""
    targets = np.asarray(seq[1:], np.int64)[:, None]
    picked, a = [np.zeros(0)], 0  # a one-token sequence predicts nothing
    try:
        blocks = runner.logits_blocks(seq) if isinstance(runner, LogitsInBlocks) else runner.logits_batch([seq])
        for block in blocks:
            n = min(len(block), len(targets) - a)  # the last position predicts nothing
            if n > 0:
                picked.append(reduce_logits(block[:n], targets[a : a + n])[1][:, 0])
            a += len(block)
    except Exception as e:
        if not out_of_memory(e):
            raise
        raise ConfigError(
            f"long context: a document of {len(seq):,} tokens does not fit in the memory of the device that scores it "
            f"({in_one_line(e)})",
            hint="lower gates.long_context.context_tokens, where every document is cut (by default the baseline's "
            "max_position_embeddings), or score on a device with more free memory",
        ) from e
    return -np.concatenate(picked)


LONG_REFERENCE_VERSION = 2


def baseline_long_reference(
    runner_factory, baseline: Artifact, cfg: LongContextConfig, cache_dir: Path
) -> tuple[dict, bool]:
    """The baseline's per-position NLL on the documents, computed once per (baseline, documents, settings)."""
    context = served_context(baseline, cfg)
    key = sha256_json(
        {
            "baseline": baseline.sha256,
            "documents": sha256_file(cfg.path()),
            "context": context,
            "max_documents": cfg.max_documents,
            "v": LONG_REFERENCE_VERSION,
            "libs": releases(SCORING_LIBRARIES),
        }
    )
    path = Path(cache_dir) / f"long-baseline-{key[:24]}.npz"
    if (cached := read_cached_arrays(path)) is not None:
        return cached, True
    runner = runner_factory()
    seqs, own = encode_documents(runner.tokenizer, load_documents(cfg.path()), context, cfg.max_documents)
    t0 = time.perf_counter()
    base = [nll(runner, s) for s in progress(seqs, f"long context: baseline ({len(seqs)} documents)", unit="doc")]
    bad = [i for i, b in enumerate(base) if not np.isfinite(b).all()]
    if bad:
        raise InputError(
            f"{baseline.path}: the baseline's logits define no distribution in long-context document {bad[0]}",
            hint="the baseline is broken, not the candidate: look for NaN or inf in its weights",
        )
    ref = {
        "tokens": np.concatenate([np.asarray(s, np.int32) for s in seqs]),
        "lens": np.array([len(s) for s in seqs], np.int32),
        "own": np.concatenate(own),
        "base_nll": np.concatenate(base),
        "context": np.array(context),
        "seconds": np.array(time.perf_counter() - t0),
    }
    buf = io.BytesIO()
    np.savez(buf, **ref)
    write_cached(path, buf.getvalue())
    return ref, False


def long_context_gate(runner, ref: dict, cfg: LongContextConfig, shadow_tokens: int) -> tuple[list[GateResult], dict]:
    """One check per window that MIN_DOCUMENTS documents reach, and what the documents covered: the served context,
    how far the documents reach, how far the shadow evidence reaches (`shadow_tokens`), and the windows not scored.
    With no window scored, one NaN `nll_increase` row saying why (ERROR where max_nll_increase is set)."""
    t0 = time.perf_counter()
    seqs = split_sequences(ref["tokens"], ref["lens"])
    cand = [nll(runner, s) for s in progress(seqs, f"long context: candidate ({len(seqs)} documents)", unit="doc")]
    context = int(ref["context"])
    doc = np.concatenate([np.full(len(s) - 1, i, np.int32) for i, s in enumerate(seqs)])
    pos = np.concatenate([np.arange(2, len(s) + 1) for s in seqs])  # the predicted token's 1-based position
    own = np.concatenate([o[1:] for o in np.split(ref["own"], np.cumsum(ref["lens"])[:-1])])
    base_nll, cand_nll = ref["base_nll"], np.concatenate(cand)
    reach = int(ref["lens"].max())
    coverage = {
        "served_context": context,
        "documents": len(seqs),
        "longest_document_tokens": reach,
        "documents_reaching_context": int(np.sum(ref["lens"] >= context)),
        "shadow_tokens": shadow_tokens,
        "windows_not_scored": [],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    caveat = None
    if reach < context:
        caveat = (
            f"the documents reach {reach} of the {context} tokens the model is served with: contexts beyond "
            f"{reach} tokens are not evidenced"
        )
        coverage["caveat"] = caveat
    edges, results = window_edges(context, cfg.windows), []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        m = own & (pos > lo) & (pos <= hi)
        docs_in = len(np.unique(doc[m]))
        if docs_in < MIN_DOCUMENTS:
            coverage["windows_not_scored"].append(f"{lo + 1}-{hi}: {docs_in} document(s) reach it")
            continue
        ratio, ci_lo, ci_hi, interval = ratio_of_sums_ci(cand_nll[m], base_nll[m], doc[m])
        per_doc = {
            int(d): float(cand_nll[m & (doc == d)].sum() / base_nll[m & (doc == d)].sum() - 1)
            for d in np.unique(doc[m])
        }
        ev = {
            "window": [lo + 1, hi],
            "documents": docs_in,
            "base_nll_mean": float(base_nll[m].mean()),
            "cand_nll_mean": float(cand_nll[m].mean()),
            "per_document": per_doc,
            "tokens": int(m.sum()),
            "interval": interval,
            "n_counts": "documents",  # the interval's evidence grows with documents, not with their tokens
        }
        if caveat:
            ev["caveat"] = caveat
        results.append(
            GateResult.check(
                "long_context",
                f"nll_increase.{lo + 1}-{hi}",
                ratio - 1,
                cfg.max_nll_increase,
                False,
                docs_in,
                (ci_lo - 1, ci_hi - 1),
                evidence=ev,
            )
        )
    if not results:  # a NaN row: an error where the threshold is set, as for any check with nothing to measure
        why = f"no window is reached by {MIN_DOCUMENTS} or more documents ({'; '.join(coverage['windows_not_scored'])})"
        results.append(
            GateResult.check(
                "long_context", "nll_increase", float("nan"), cfg.max_nll_increase, False, 0, evidence={"error": why}
            )
        )
    return results, coverage
