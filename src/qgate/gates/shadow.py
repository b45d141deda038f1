"""Shadow-disagreement gate: candidate vs baseline on held-out real traffic, teacher-forced.

    ref, cached = baseline_reference(base_runner, baseline, shadow, cfg, cache_dir)   # once per baseline
    check = run_shadow(cand_runner, ref, cfg)   # check.results, check.scored (coverage, caveat), check.gated

The baseline answers each shadow prompt greedily; both models then score the same
token sequence (prompt + baseline answer). Per position we measure KL(base || cand)
and whether the top-1 tokens agree. Because greedy decoding follows its own argmax,
the candidate's greedy answer equals the baseline's up to the first answer position
where its argmax differs: that position is the generation's first divergence, with
no second generation pass.

What counts as evidence is decided per position, by the token it predicts: answer tokens
and prompt tokens that came from traffic (message content) are evidence; chat-template
tokens (role markers, a default system prompt) are identical across prompts and are
excluded, as is any position whose whole prefix repeats an earlier prompt's (gates/positions.py). The gate
decides on answer positions by default (`positions: answer+prompt` adds traffic prompt
tokens); the other class is reported beside it.

The mean KL and top-1 agreement get a bootstrap-t interval resampling whole prompts
(stats.cluster_bootstrap_t): a few prompts hold most of the disagreement, and an interval that
ignores that skew passes a candidate on its threshold too often. Quantiles (p99, p99.9) get a
clustered order-statistic interval (stats.quantile_ci), which is unbounded above when the sample
is too small to bound them: such a check cannot pass. Each gated check is also held to its threshold on each
traffic route's positions alone (the split's `route` per prompt; gates/routes.py), as a guard that can fail a
candidate the pooled figures would pass, and never passes one. The top-1 threshold is held, the same way, on where
the candidate would end each answer against where the baseline did (gates/answer_ends.py).

A position where the candidate's logits define no distribution (a NaN or +inf logit) scores
KL +inf and never agrees, and `defined_logits` fails the candidate if there is one anywhere.
A prompt longer than `max_prompt_tokens` is scored on its last tokens; the baseline reference records
every prompt's whole length, and the gated checks then carry a caveat saying how many were cut.

The baseline keeps only its top-k log-probabilities per position (cached by content
hash). KL is computed over those k tokens plus one bucket for the rest: a lower
bound on the full-vocabulary KL, equal to it when the tail holds no mass; the tail
mass is reported so the bound's slack is visible. Both models score in length-sorted
batches, and logits are reduced in float32 with a stable log-sum-exp (gates/scoring.py):
the gate costs little more than the candidate's forward passes. The baseline's answers
are generated in batches with its KV cache.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from qgate.artifact import Artifact, sha256_json
from qgate.cache import read_cached_arrays, write_cached
from qgate.calibrate.sample import split_rows
from qgate.chat import encode_with_sources
from qgate.engines.logits import checkpoint_stops
from qgate.engines.protocol import GeneratesScored
from qgate.errors import ConfigError, InputError
from qgate.execute import releases
from qgate.gates.answer_ends import DECISIONS, candidate_decision, decision_guards, first_only
from qgate.gates.kl_checks import KL_THRESHOLDS, QUANTILES, defined_check, kl_top1_checks, route_checks
from qgate.gates.passes import (
    GREEDY_BATCH_ROWS,
    GREEDY_BATCH_TOKENS,
    greedy_answers,
    greedy_scored,
    score_sequences,
    scoring_batches,
    sequences,
    top_k_reference,
)
from qgate.gates.positions import ANSWER, POSITION_SETS, PROMPT, TEMPLATE, coverage, held_prompts, scoring_summary
from qgate.gates.result import SHARE, GateResult, check_threshold_values
from qgate.gates.routes import route_guards
from qgate.gates.scoring import (
    MAX_BATCH_TOKENS,
    SCORING_LIBRARIES,
    UNDEFINED,
    reduce_kl,
)
from qgate.gates.stats import min_effective_n, wilson


@dataclass(frozen=True)
class ShadowConfig:
    max_prompt_tokens: int = 384  # a longer prompt is scored on its last this many tokens, with a caveat
    max_new_tokens: int = 48  # tokens of the baseline's greedy answer to each prompt
    top_k: int = 1024  # baseline log-probs kept per position; KL is exact up to the tail mass left out
    max_prompts: int | None = None  # the first this many shadow prompts; None: all of them
    kl_mean_max: float | None = None  # per-token KL(baseline / candidate), mean; None: reported, not gated
    kl_p99_max: float | None = 0.5  # its 99th percentile, clustered order-statistic CI (passes from 368 positions)
    kl_p999_max: float | None = None  # its 99.9th percentile (passes from 3,688 positions, 10x p99's)
    top1_agreement_min: float | None = 0.9  # share of positions where both models' argmax agree
    identical_generation_min: float | None = None  # share of prompts whose greedy answers are identical
    positions: str = "answer"  # which positions the gated checks score: "answer" or "answer+prompt"
    route_guards: bool = True  # each gated check on each traffic route too, as a guard that can only fail
    end_guards: bool = True  # the top-1 threshold on where answers end too (gates/answer_ends.py), guards likewise
    tool_guards: bool = True  # and on whether answers begin a tool call where the baseline's do, where it calls tools
    VERSION = 8  # of how the checks are computed; what changed in each is in git

    def __post_init__(self):
        check_threshold_values("gates.shadow", self, KL_THRESHOLDS | {"identical_generation_min": SHARE})
        if self.max_new_tokens < 1 or self.max_prompt_tokens < 4 or self.top_k < 2:
            raise ConfigError("gates.shadow: max_new_tokens >= 1, max_prompt_tokens >= 4 and top_k >= 2 are required")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"gates.shadow.max_prompts must be >= 1 or null (every prompt), got {self.max_prompts}")
        if self.positions not in POSITION_SETS:
            raise ConfigError(f"gates.shadow.positions: {self.positions!r} is not one of {sorted(POSITION_SETS)}")

    def reference_key(self) -> dict:  # the fields that change what the baseline computes
        return {
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_new_tokens": self.max_new_tokens,
            "top_k": self.top_k,
            "max_prompts": self.max_prompts,
        }


def unpassable_quantiles(cfg: ShadowConfig, prompts: int) -> list[str]:
    """Why each gated KL quantile of `cfg` can never PASS on a split of `prompts` prompts, whatever the candidate:
    they give at most prompts x the gated tokens per prompt positions (max_new_tokens answer tokens, plus up to
    max_prompt_tokens for answer+prompt), fewer than the effective n a 95% upper bound needs
    (stats.min_effective_n), and clustering only lowers the effective n. [] when each can."""
    prompts = min(prompts, cfg.max_prompts) if cfg.max_prompts else prompts
    per = cfg.max_new_tokens + (cfg.max_prompt_tokens if PROMPT in POSITION_SETS[cfg.positions] else 0)
    out = []
    for name, q in QUANTILES.items():
        if getattr(cfg, f"{name}_max") is not None and prompts * per < (need := min_effective_n(q)):
            out.append(
                f"gates.shadow.{name}_max: p{100 * q:g} needs at least {need} scored positions for its 95% interval to "
                f"have an upper end, and {prompts} prompts give at most {prompts * per} ({per} per prompt)"
            )
    return out


def more_positions_hint(size_flag: str) -> str:
    """What to change when unpassable_quantiles names a check: the split's prompts (`size_flag`), the tokens gated
    per prompt, or the check itself."""
    return (
        f"sample more prompts ({size_flag}; several times the least count, since a prompt's tokens count less than "
        "independent ones), gate more tokens per prompt (gates.shadow.max_new_tokens), or report the quantile (its "
        "threshold null) and gate kl_mean_max"
    )


def load_shadow(shadow: Artifact, cfg: ShadowConfig) -> list[dict]:
    if shadow.kind != "calibration-set" or shadow.meta.get("split") not in ("shadow", "search"):
        raise InputError(
            f"{shadow.path}: --shadow must be the shadow split written by `qgate calibrate sample` "
            "(or its search split: held-out traffic too)"
        )
    rows = split_rows(shadow)
    return rows[: cfg.max_prompts] if cfg.max_prompts else rows


REFERENCE_VERSION = 5  # of what a baseline reference holds and how its log-probs are computed


def baseline_reference(
    runner_factory, baseline: Artifact, shadow: Artifact, cfg: ShadowConfig, cache_dir: Path
) -> tuple[dict, bool]:
    """Baseline answers and top-k log-probs, computed once per (baseline, shadow set, settings, release of torch and
    transformers: an upgrade computes them again, so a candidate is never compared with another library's numbers)."""
    key = sha256_json(
        {
            "baseline": baseline.sha256,
            "shadow": shadow.sha256,
            "cfg": cfg.reference_key(),
            "v": REFERENCE_VERSION,
            "batches": [MAX_BATCH_TOKENS, GREEDY_BATCH_TOKENS, GREEDY_BATCH_ROWS],
            "libs": releases(SCORING_LIBRARIES),
        }
    )
    path = Path(cache_dir) / f"shadow-baseline-{key[:24]}.npz"
    rows = load_shadow(shadow, cfg)
    if (cached := read_cached_arrays(path)) is not None:
        calls = {} if "call_ids" in cached else _calls(baseline, rows)  # a reference cached without them
        return cached | _routes(rows) | _stops(baseline) | calls, True
    runner = runner_factory()
    encoded = [
        encode_with_sources(runner.tokenizer, row["messages"], cfg.max_prompt_tokens, row.get("tools")) for row in rows
    ]
    t0 = time.perf_counter()
    prompts = [e.ids for e in encoded]
    if isinstance(runner, GeneratesScored):  # answers and scores in one pass: prefill + KV-cached decode steps
        answers, idx, lp = [], [], []
        for ans, (top_i, top_l) in greedy_scored(runner, prompts, cfg.max_new_tokens, cfg.top_k):
            answers.append(ans)
            idx.append(top_i)
            lp.append(top_l)
        gen_s = time.perf_counter() - t0
        top_idx, top_lp = np.concatenate(idx), np.concatenate(lp)
    else:
        answers = greedy_answers(runner, prompts, cfg.max_new_tokens, "shadow: baseline answers")
        gen_s = time.perf_counter() - t0
        top_idx, top_lp = top_k_reference(
            runner, [p + a for p, a in zip(prompts, answers, strict=True)], cfg.top_k, "shadow: baseline scoring"
        )
    seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
    _check_defined(baseline, top_lp, [len(s) - 1 for s in seqs])
    classes = [
        np.array([PROMPT if f else TEMPLATE for f in src] + [ANSWER] * len(a), np.int8)
        for (_, src, _), a in zip(encoded, answers, strict=True)
    ]
    ref = {
        "tokens": np.concatenate([np.asarray(s, np.int32) for s in seqs]),
        "seq_lens": np.array([len(s) for s in seqs], np.int32),
        "prompt_lens": np.array([len(e.ids) for e in encoded], np.int32),
        "prompt_tokens": np.array([e.tokens for e in encoded], np.int32),  # before the cut to max_prompt_tokens
        "top_idx": top_idx,
        "top_lp": top_lp,
        "prompt_of": np.concatenate([np.full(len(s) - 1, i, np.int32) for i, s in enumerate(seqs)]),
        "token_class": np.concatenate(classes),
        "seconds": np.array(time.perf_counter() - t0),
        "generate_seconds": np.array(gen_s),  # with greedy_scored: answers and scores together
        "score_seconds": np.array(time.perf_counter() - t0 - gen_s),
    } | _calls(baseline, rows)
    buf = io.BytesIO()
    # not compressed: top-k log-probs barely compress, and zlib costs a large share of the reference's time
    np.savez(buf, **ref)
    write_cached(path, buf.getvalue())
    return ref | _routes(rows) | _stops(baseline), False


def _routes(rows: list[dict]) -> dict:
    """`prompt_route`: each shadow prompt's traffic route ("" where its row names none), read from the split beside
    the cached reference rather than stored in it."""
    return {"prompt_route": np.array([str(row.get("route") or "") for row in rows])}


def _stops(baseline: Artifact) -> dict:
    """`stop_ids`: the token ids that ended the baseline's answers (its generation config's eos ids), read from its
    files beside the cached reference: they are part of its sha256, which keys the cache."""
    return {"stop_ids": np.array(sorted(checkpoint_stops(baseline.path)), np.int64)}


def _calls(baseline: Artifact, rows: list[dict]) -> dict:
    """`call_ids`: the tokens that begin a tool call in the baseline's chat template (gates/tool_calls.py), and
    `call_first_only`: whether a call begins only at an answer's first token (a JSON call), where a shadow request
    offers tools. Kept in the cached reference: a JSON call's ids take decoding the whole vocabulary, and the
    template and the requests are part of the baseline's and the split's sha256, which key the cache."""
    if not any(row.get("tools") for row in rows):
        return {}
    from qgate.gates.tool_calls import call_ids, call_start
    from qgate.trust import load_tokenizer

    tok = load_tokenizer(baseline.path)
    start = call_start(tok)
    return {"call_ids": np.array(call_ids(tok, start), np.int64), "call_first_only": np.array(start.first_only)}


def _check_defined(baseline: Artifact, top_lp: np.ndarray, positions: list[int]) -> None:
    """InputError unless the baseline's logits define a distribution at every shadow position: a reference of NaN
    log-probs would make every candidate's comparison meaningless. positions: how many each prompt has, in order."""
    bad = np.flatnonzero(np.isnan(top_lp).any(-1))
    if len(bad):
        ends = np.cumsum(positions)
        i = int(np.searchsorted(ends, bad[0], side="right"))
        raise InputError(
            f"{baseline.path}: the baseline's logits define no distribution at {len(bad)} of {len(top_lp)} "
            f"shadow positions (NaN or +inf logits), the first at shadow prompt {i}, position "
            f"{int(bad[0] - (ends[i - 1] if i else 0))}",
            hint="the baseline is broken, not the candidate: look for NaN or inf in its weights "
            "(safetensors' tensors) and gate against a baseline that scores",
        )


def candidate_metrics(
    runner, ref: dict, desc: str = "shadow: candidate", served: bool = True, warm_up: bool = False, passes: int = 1
) -> dict:
    """Per-position KL, tail mass, top-1 agreement and whether the candidate's logits defined no distribution there
    (its KL is then +inf: gates/scoring.reduce_logits); per-prompt first divergence; `score_seconds`, the scoring's
    time, and `warm_up_seconds`. served: an engine that scores answers as it serves them (ScoresServed) does so;
    False scores every position teacher-forced, as the baseline. warm_up: the widest batch is scored once, untimed,
    before the timed pass, so score_seconds times warm kernels and memory (a runner's first forward pays for CUDA's
    lazy module loading, cuBLAS handles and the allocator's growth): the perf check divides two such times.
    passes: the same scoring is run and timed this many times in all (`score_passes`, the first is `score_seconds`;
    the metrics are the first's), so the perf check reads the time's spread from them."""
    seqs = sequences(ref)
    starts = np.concatenate([[0], np.cumsum(ref["seq_lens"] - 1)])  # sequence i's positions in ref's arrays
    stop_ids = ref.get("stop_ids", np.zeros(0, np.int64))
    call_ids = ref.get("call_ids", np.zeros(0, np.int64))
    call_span = slice(0, 1) if first_only(ref, DECISIONS["tool"]) else slice(None)  # a JSON call: the first token

    def per_sequence(i: int, cand_top1: np.ndarray, kl: np.ndarray, p_tail: np.ndarray) -> tuple:
        a, b, p = int(starts[i]), int(starts[i + 1]), int(ref["prompt_lens"][i])
        answer = np.asarray(seqs[i][p:])  # baseline's greedy answer
        at_answer = cand_top1[p - 1 : p - 1 + len(answer)]
        miss = np.nonzero(at_answer != answer)[0]
        return (
            kl,
            p_tail,
            cand_top1 == ref["top_idx"][a:b, 0],
            cand_top1 == UNDEFINED,
            int(miss[0]) if len(miss) else len(answer),
            len(answer),
            *candidate_decision(at_answer, answer, stop_ids),
            *candidate_decision(at_answer[call_span], answer[call_span], call_ids),
        )

    # the baseline's top-k ids and log-probs per position, [T - 1, k] per sequence
    ids, lps = ([ref[key][starts[i] : starts[i + 1]] for i in range(len(seqs))] for key in ("top_idx", "top_lp"))
    prompt_lens = ref["prompt_lens"] if served else None
    tw = time.perf_counter()
    if warm_up:
        widest = max(scoring_batches(runner, seqs), key=lambda b: len(b) * max(len(seqs[i]) for i in b))
        score_sequences(
            runner,
            [seqs[i] for i in widest],
            f"{desc}, warm-up",
            reduce_kl,
            prompt_lens=None if prompt_lens is None else [prompt_lens[i] for i in widest],
            rows=([ids[i] for i in widest], [lps[i] for i in widest]),
        )
    warm_s = time.perf_counter() - tw
    times, rows = [], []
    for k in range(passes):
        ts = time.perf_counter()
        scored = score_sequences(
            runner,
            seqs,
            desc if k == 0 else f"{desc}, timing pass {k + 1}/{passes}",
            reduce_kl,
            prompt_lens=prompt_lens,
            rows=(ids, lps),
        )
        scored = [per_sequence(i, *r) for i, r in enumerate(scored)]
        times.append(time.perf_counter() - ts)
        rows = rows or scored
    kls, tails, agree, undefined, first_div, gen_lens, stops_early, stops_at_end, calls_spurious, calls_at_first = zip(
        *rows, strict=True
    )
    return {
        "kl": np.concatenate(kls),
        "tail": np.concatenate(tails),
        "agree": np.concatenate(agree),
        "undefined": np.concatenate(undefined),
        "first_div": np.array(first_div),
        "gen_lens": np.array(gen_lens),
        "stops_early": np.array(stops_early),  # per prompt: the candidate would end its answer before the baseline
        "stops_at_end": np.array(stops_at_end),  # per prompt: it ends where the baseline's answer ends on a stop token
        "calls_spurious": np.array(
            calls_spurious
        ),  # per prompt: it would begin a tool call where the baseline does not
        "calls_at_first": np.array(calls_at_first),  # per prompt: it begins the baseline's first tool call
        "score_seconds": times[0],
        "score_passes": times,
        "warm_up_seconds": warm_s if warm_up else 0.0,
    }


@dataclass(frozen=True)
class ShadowCheck:
    results: list[GateResult]  # defined_logits, the gated KL and top-1 checks, report-only classes, generation
    scored: dict  # what was scored: positions per class, prompts, coverage and its caveat
    gated: np.ndarray  # bool per position: the positions the checks decided on
    metrics: dict  # candidate_metrics: per-position KL, top-1 agreement, timings


def run_shadow(runner, ref: dict, cfg: ShadowConfig, desc: str = "shadow: candidate") -> ShadowCheck:
    """The shadow gate: the candidate scored on the baseline reference's sequences, and its checks."""
    m = candidate_metrics(runner, ref, desc)
    results, scored, gated = shadow_gate(m, ref, cfg)
    return ShadowCheck(results, scored, gated, m)


def shadow_gate(m: dict, ref: dict, cfg: ShadowConfig) -> tuple[list[GateResult], dict, np.ndarray]:
    """The gated checks on cfg.positions, report-only figures for the other classes, what was scored (with its
    coverage), and the mask of gated positions. The gated checks carry the coverage caveat when prompts were cut."""
    clusters = ref["prompt_of"]
    masks, scored = scoring_summary(ref, cfg.positions)
    scored |= coverage(ref, cfg.max_prompt_tokens, cfg.max_new_tokens)
    ev = {"tail_mass_mean": float(m["tail"].mean()), "tail_mass_max": float(m["tail"].max()), "scored": scored}
    results = [defined_check(m, ref)] + kl_top1_checks(m, clusters, masks["gated"], cfg, evidence=ev)
    if cfg.route_guards and "prompt_route" in ref:
        results += route_guards(ref["prompt_route"][clusters], masks["gated"], route_checks(m, clusters, cfg))
    kinds = tuple(k for k, on in (("stop", cfg.end_guards), ("tool", cfg.tool_guards)) if on)
    results += decision_guards(ref, m, cfg.top1_agreement_min, kinds)
    for part in ("answer", "prompt"):  # the classes the gate did not decide on alone, reported beside it
        if part != cfg.positions:
            results += kl_top1_checks(m, clusters, masks[part], None, prefix=f"{part}.")
    held = held_prompts(ref)
    first_div, gen_lens = m["first_div"][held], m["gen_lens"][held]
    ident = int(np.sum(first_div >= gen_lens))
    results.append(
        GateResult.check(
            "shadow",
            "identical_generation",
            ident / len(first_div),
            cfg.identical_generation_min,
            True,
            len(first_div),
            wilson(ident, len(first_div)),
            evidence={
                "first_divergence_mean": float(first_div.mean()),
                "first_divergence_median": float(np.median(first_div)),
                "answer_tokens_mean": float(gen_lens.mean()),
            },
        )
    )
    if caveat := scored["caveat"]:
        results = [
            replace(r, evidence=r.evidence | {"caveat": caveat})
            if r.threshold is not None and r.metric != "defined_logits"
            else r
            for r in results
        ]
    return results, scored, masks["gated"]
