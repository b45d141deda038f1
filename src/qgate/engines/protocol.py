"""What the gates ask of a model they score: one Runner interface, and the optional abilities some runners add.

    runner = load_runner(artifact)               # engines/runners.py: a checkpoint, or an engine by its backend row
    if isinstance(runner, Generates): answers = runner.greedy_batch(prompts, 64)

Every runner takes token ids from the checkpoint's own tokenizer and returns float32 logits on the host or the device
it runs on (engines/logits.py). The abilities are checked with isinstance, never with hasattr.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Runner(Protocol):
    tokenizer: Any
    batch_tokens: int | None  # the token budget of one batch (a GPU's, from its free memory); None: the gates' default

    def logits(self, ids: Sequence[int]) -> Any:
        """[len(ids), vocab]: the logits after each position."""

    def logits_batch(self, seqs: Sequence[Sequence[int]], keep_last: int | None = None) -> list:
        """Per sequence, as `logits` (its last keep_last positions only, when given), each row computed as if alone."""


@runtime_checkable
class LogitsInBlocks(Protocol):
    """Scores one long sequence without holding its [T, V] logits at once: at 32,768 tokens and a 128,256-token
    vocabulary they take 16.8 GB in float32."""

    def logits_blocks(self, seq: Sequence[int]) -> Iterator:
        """`logits(seq)` as blocks [n_i, V] of consecutive positions, in order, from one forward; the sequence
        attends causally with no mask built."""


@runtime_checkable
class ScoresContinuations(Protocol):
    """Scores several continuations of one context from the context's KV cache (every runner qgate builds)."""

    # one forward holds a call's contexts and continuations, and logits_batch's sequences end to end: RunnerLM
    # budgets them by real tokens together
    packs_contexts: bool

    def continuation_logits(
        self, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], prefix: Sequence[int] = ()
    ) -> list[list]:
        """For each (context, continuations), per continuation the logits that predict its tokens, every context
        following `prefix`: the prefix and each context are computed once."""


@runtime_checkable
class Generates(Protocol):
    """Greedy decoding with a KV cache: the runner can answer prompts, not only score them."""

    def greedy(self, ids: Sequence[int], max_new_tokens: int) -> list[int]: ...

    def greedy_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]: ...


@runtime_checkable
class GeneratesScored(Protocol):
    """Greedy answers and the reduced logits of every position in one pass (prefill, then KV-cached decode steps)."""

    def greedy_scored(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, reduce, prefill_tokens: int = 1024
    ) -> list[tuple[list[int], tuple]]: ...


@runtime_checkable
class ScoresServed(Protocol):
    """Scores a prompt + answer the way the engine serves it: the prompt prefilled, the answer decoded step by step."""

    def served_logits_batch(self, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list: ...
