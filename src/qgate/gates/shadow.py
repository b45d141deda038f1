"""Shadow-disagreement gate: candidate vs baseline on held-out real traffic, teacher-forced.

    result = shadow_gate(cand_runner, baseline_ref, ShadowConfig())

The baseline answers each shadow prompt greedily; both models then score the same
token sequence (prompt + baseline answer). Per position we measure KL(base || cand)
and whether the top-1 tokens agree. Because greedy decoding follows its own argmax,
the candidate's greedy answer equals the baseline's up to the first answer position
where its argmax differs: that position is the generation's first divergence, with
no second generation pass.

What counts as evidence is decided per position, by the token it predicts: answer tokens
and prompt tokens that came from traffic (message content) are evidence; chat-template
tokens (role markers, a default system prompt) are identical across prompts and are
excluded, as is any position whose whole prefix repeats an earlier prompt's. The gate
decides on answer positions by default (`positions: answer+prompt` adds traffic prompt
tokens); the other class is reported beside it.

Quantiles (p99, p99.9) get a clustered order-statistic interval (stats.quantile_ci), which
is unbounded above when the sample is too small to bound them: such a check cannot pass.

The baseline keeps only its top-k log-probabilities per position (cached by content
hash). KL is computed over those k tokens plus one bucket for the rest: a lower
bound on the full-vocabulary KL, equal to it when the tail holds no mass; the tail
mass is reported so the bound's slack is visible.
"""
from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from qgate.progress import progress

from qgate.artifact import Artifact, sha256_json
from qgate.cache import read_cached, write_cached
from qgate.chat import encode_with_sources
from qgate.errors import ConfigError, InputError
from qgate.gates.result import GateResult
from qgate.gates.stats import cluster_bootstrap, quantile_ci, wilson

TEMPLATE, PROMPT, ANSWER = 0, 1, 2        # token classes: chat template, traffic prompt text, baseline answer
POSITION_SETS = {"answer": (ANSWER,), "answer+prompt": (ANSWER, PROMPT)}


@dataclass(frozen=True)
class ShadowConfig:
    max_prompt_tokens: int = 384
    max_new_tokens: int = 48
    top_k: int = 1024               # baseline log-probs kept per position; KL is exact up to the tail mass left out
    max_prompts: int | None = None
    kl_mean_max: float | None = None
    kl_p99_max: float | None = 0.5
    kl_p999_max: float | None = None
    top1_agreement_min: float | None = 0.9
    identical_generation_min: float | None = None
    positions: str = "answer"       # which positions the gated checks score: "answer" or "answer+prompt"
    VERSION = 2

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.max_prompt_tokens < 4 or self.top_k < 2:
            raise ConfigError("gates.shadow: max_new_tokens >= 1, max_prompt_tokens >= 4 and top_k >= 2 are required")
        if self.positions not in POSITION_SETS:
            raise ConfigError(f"gates.shadow.positions: {self.positions!r} is not one of {sorted(POSITION_SETS)}")

    def reference_key(self) -> dict:  # the fields that change what the baseline computes
        return {"max_prompt_tokens": self.max_prompt_tokens, "max_new_tokens": self.max_new_tokens,
                "top_k": self.top_k, "max_prompts": self.max_prompts}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """float64: per-token KL of near-identical models is ~1e-6 nats, below float32 cancellation error."""
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[T, V] logits -> the k most likely ids and their log-probs per position, top-1 first: [T, k] each."""
    logp = _log_softmax(logits)
    k = min(k, logp.shape[-1])
    top = np.argpartition(-logp, k - 1, axis=-1)[:, :k]
    top_lp = np.take_along_axis(logp, top, axis=-1)
    order = np.argsort(-top_lp, axis=-1)
    return np.take_along_axis(top, order, axis=-1).astype(np.int32), np.take_along_axis(top_lp, order, axis=-1).astype(np.float32)


def rescore_reference(runner, ref: dict, top_k: int, desc: str = "shadow: reference") -> dict:
    """The same token sequences as `ref`, with `runner` as the reference model (its top-k log-probs)."""
    idx, lp, start = [], [], 0
    for n in progress(ref["seq_lens"], desc, unit="prompt"):
        top_i, top_l = _top_k(runner.logits(ref["tokens"][start:start + n].tolist())[:-1], top_k)
        idx.append(top_i)
        lp.append(top_l)
        start += n
    return ref | {"top_idx": np.concatenate(idx), "top_lp": np.concatenate(lp)}


def load_shadow(shadow: Artifact, cfg: ShadowConfig) -> list[dict]:
    if shadow.kind != "calibration-set" or shadow.meta.get("split") != "shadow":
        raise InputError(f"{shadow.path}: --shadow must be the shadow split written by `qgate calibrate sample`")
    rows = [json.loads(x) for x in (shadow.path / "data.jsonl").read_text().splitlines() if x.strip()]
    return rows[: cfg.max_prompts] if cfg.max_prompts else rows


def baseline_reference(runner_factory, baseline: Artifact, shadow: Artifact, cfg: ShadowConfig, cache_dir: Path) -> tuple[dict, bool]:
    """Baseline answers and top-k log-probs, computed once per (baseline, shadow set, settings)."""
    key = sha256_json({"baseline": baseline.sha256, "shadow": shadow.sha256, "cfg": cfg.reference_key(), "v": 2})
    path = Path(cache_dir) / f"shadow-baseline-{key[:24]}.npz"
    if (data := read_cached(path)) is not None:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}, True
    runner = runner_factory()
    rows = load_shadow(shadow, cfg)
    seqs, prompt_lens, idx, lp, prompt_of, classes = [], [], [], [], [], []
    t0, score_s = time.perf_counter(), 0.0
    for i, row in enumerate(progress(rows, "shadow: baseline answers", unit="prompt")):
        ids, from_traffic = encode_with_sources(runner.tokenizer, row["messages"], cfg.max_prompt_tokens)
        answer = runner.greedy(ids, cfg.max_new_tokens)
        seq = ids + answer
        classes.append(np.array([PROMPT if f else TEMPLATE for f in from_traffic] + [ANSWER] * len(answer), np.int8))
        ts = time.perf_counter()
        logits = runner.logits(seq)
        score_s += time.perf_counter() - ts
        top_i, top_l = _top_k(logits[:-1], cfg.top_k)               # position t predicts seq[t+1]
        idx.append(top_i)
        lp.append(top_l)
        seqs.append(np.asarray(seq, np.int32))
        prompt_lens.append(len(ids))
        prompt_of.append(np.full(len(seq) - 1, i, np.int32))
    ref = {
        "tokens": np.concatenate(seqs), "seq_lens": np.array([len(s) for s in seqs], np.int32),
        "prompt_lens": np.array(prompt_lens, np.int32), "top_idx": np.concatenate(idx), "top_lp": np.concatenate(lp),
        "prompt_of": np.concatenate(prompt_of), "token_class": np.concatenate(classes),
        "seconds": np.array(time.perf_counter() - t0),
        "score_seconds": np.array(score_s),
    }
    buf = io.BytesIO()
    np.savez_compressed(buf, **ref)
    write_cached(path, buf.getvalue())
    return ref, False


def candidate_metrics(runner, ref: dict, desc: str = "shadow: candidate") -> dict:
    """Per-position KL, tail mass, top-1 agreement; per-prompt first divergence."""
    kls, tails, agree, first_div, gen_lens = [], [], [], [], []
    start, pos, score_s = 0, 0, 0.0
    for n, p in progress(list(zip(ref["seq_lens"], ref["prompt_lens"])), desc, unit="prompt"):
        seq = ref["tokens"][start:start + n]
        ti, tl = ref["top_idx"][pos:pos + n - 1], ref["top_lp"][pos:pos + n - 1]   # [T-1, k]
        ts = time.perf_counter()
        logits = runner.logits(seq.tolist())
        score_s += time.perf_counter() - ts
        lq = _log_softmax(logits[:-1])                                             # [T-1, V]
        pk = np.exp(tl.astype(np.float64))
        lq_k = np.take_along_axis(lq, ti, axis=-1).astype(np.float64)
        p_tail = np.clip(1 - pk.sum(-1), 0, 1)
        q_tail = np.clip(1 - np.exp(lq_k).sum(-1), 1e-12, 1)
        kl = (pk * (tl - lq_k)).sum(-1) + np.where(p_tail > 1e-12, p_tail * (np.log(np.maximum(p_tail, 1e-12)) - np.log(q_tail)), 0.0)
        kls.append(np.maximum(kl, 0.0))
        tails.append(p_tail)
        cand_top1 = lq.argmax(-1)                                                  # [T-1]
        agree.append(cand_top1 == ti[:, 0])
        answer = seq[p:]                                # baseline's greedy answer
        cand_next = cand_top1[p - 1:p - 1 + len(answer)]
        miss = np.nonzero(cand_next != answer)[0]
        first_div.append(int(miss[0]) if len(miss) else len(answer))
        gen_lens.append(len(answer))
        start += n
        pos += n - 1
    return {"kl": np.concatenate(kls), "tail": np.concatenate(tails), "agree": np.concatenate(agree),
            "first_div": np.array(first_div), "gen_lens": np.array(gen_lens), "score_seconds": score_s}


def position_classes(ref: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per scored position (t predicts token t+1 of its sequence): the class of the predicted token, and whether
    the position's whole prefix (tokens 0..t+1) is new, i.e. not already scored in an earlier prompt."""
    cls, first = [], []
    seen: set[int] = set()
    start = 0
    for n in ref["seq_lens"]:
        seq, c = ref["tokens"][start:start + n].tolist(), ref["token_class"][start:start + n]
        cls.append(c[1:])
        h, new = hash((seq[0],)), np.zeros(n - 1, bool)
        for t in range(1, n):
            h = hash((h, seq[t]))
            new[t - 1] = h not in seen
            seen.add(h)
        first.append(new)
        start += n
    return np.concatenate(cls), np.concatenate(first)


def scoring_summary(ref: dict, cfg: ShadowConfig) -> tuple[dict[str, np.ndarray], dict]:
    """Masks of the gated, answer and traffic-prompt positions (repeated prefixes dropped), and what was scored."""
    cls, new = position_classes(ref)
    masks = {"gated": np.isin(cls, POSITION_SETS[cfg.positions]) & new, "answer": (cls == ANSWER) & new,
             "prompt": (cls == PROMPT) & new}
    info = {"positions": cfg.positions, "total_positions": int(len(cls)), "answer_positions": int(np.sum(cls == ANSWER)),
            "traffic_prompt_positions": int(np.sum(cls == PROMPT)), "template_positions_excluded": int(np.sum(cls == TEMPLATE)),
            "repeated_prefix_excluded": int(np.sum(np.isin(cls, (ANSWER, PROMPT)) & ~new)),
            "gated_positions": int(masks["gated"].sum()), "unique_positions": int(new.sum()),
            "prompts": int(len(ref["seq_lens"]))}
    return masks, info


def kl_top1_checks(m: dict, clusters: np.ndarray, mask: np.ndarray, cfg, prefix: str = "",
                   evidence: dict | None = None, gate: str = "shadow") -> list[GateResult]:
    """kl_mean, kl_p99, kl_p999 and top1_agreement over the masked positions. Thresholds are read from cfg's
    kl_mean_max, kl_p99_max, kl_p999_max and top1_agreement_min; report-only when cfg is None."""
    kl, agree, cl = m["kl"][mask], m["agree"][mask].astype(float), clusters[mask]
    n = int(mask.sum())
    if n == 0:
        return [GateResult.could_not_run(gate, f"{prefix}{x}", "no positions of this kind were scored")
                for x in ("kl_mean", "kl_p99", "top1_agreement")] if cfg else []
    thr = (lambda name: getattr(cfg, name)) if cfg else (lambda name: None)
    out = [GateResult.check(gate, f"{prefix}kl_mean", float(kl.mean()), thr("kl_mean_max"), False, n,
                            cluster_bootstrap(kl, cl, np.mean), evidence=evidence)]
    for q, name in ((0.99, "kl_p99"), (0.999, "kl_p999")):
        lo, hi, ev = quantile_ci(kl, cl, q)
        out.append(GateResult.check(gate, f"{prefix}{name}", float(np.quantile(kl, q)), thr(f"{name}_max"), False, n,
                                    (lo, hi), evidence=ev))
    out.append(GateResult.check(gate, f"{prefix}top1_agreement", float(agree.mean()), thr("top1_agreement_min"), True, n,
                                cluster_bootstrap(agree, cl, np.mean), evidence={"flip_rate": float(1 - agree.mean())}))
    return out


def shadow_gate(m: dict, ref: dict, cfg: ShadowConfig) -> tuple[list[GateResult], dict, np.ndarray]:
    """The gated checks on cfg.positions, report-only figures for the other classes, what was scored, and the
    mask of gated positions."""
    clusters = ref["prompt_of"]
    masks, scored = scoring_summary(ref, cfg)
    ev = {"tail_mass_mean": float(m["tail"].mean()), "tail_mass_max": float(m["tail"].max()), "scored": scored}
    results = kl_top1_checks(m, clusters, masks["gated"], cfg, evidence=ev)
    for part in ("answer", "prompt"):   # the classes the gate did not decide on alone, reported beside it
        if part != cfg.positions:
            results += kl_top1_checks(m, clusters, masks[part], None, prefix=f"{part}.")
    ident = int(np.sum(m["first_div"] >= m["gen_lens"]))
    results.append(GateResult.check("shadow", "identical_generation", ident / len(m["first_div"]), cfg.identical_generation_min,
                                    True, len(m["first_div"]), wilson(ident, len(m["first_div"])),
                                    evidence={"first_divergence_mean": float(m["first_div"].mean()),
                                              "first_divergence_median": float(np.median(m["first_div"])),
                                              "answer_tokens_mean": float(m["gen_lens"].mean())}))
    return results, scored, masks["gated"]
