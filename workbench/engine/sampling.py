"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeded.

The filters run in transformers' order (repetition penalty, temperature, top-k, top-p, min-p) on the
device that holds the logits. The draw uses the exponential-race trick (``argmax(p / q)`` with
``q ~ Exp(1)``), which needs no host round trip: the only sync per step is the caller reading the
one token id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.core.errors import WorkbenchError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    ``temperature`` 0 (or ``greedy``) takes the argmax. ``top_k`` 0, ``top_p`` 1.0, ``min_p`` 0.0 and
    ``repetition_penalty`` 1.0 switch the filter off. ``seed`` None draws from a fresh random seed.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise WorkbenchError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise WorkbenchError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise WorkbenchError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise WorkbenchError(f"min-p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise WorkbenchError(f"repetition penalty must be > 0, got {self.repetition_penalty}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on every token already in the sequence.

    logits: [V] or [B, V] float; seen: bool mask of the same shape. A seen token's logit is divided
    by ``penalty`` when positive and multiplied by it when negative (as transformers does).
    """
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits (ties with the k-th kept), set the rest to -inf. logits: [..., V]."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the most likely tokens until their probability mass reaches ``p``.

    A token is kept when the mass of the strictly more likely tokens (in sorted order) is below
    ``p``; the most likely token is always kept. logits: [..., V].
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top token's probability. logits: [..., V]."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def filter_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """All of ``params``' filters in transformers' order; returns float32 logits [..., V] with -inf holes.

    ``seen``: bool mask [..., V] of tokens already in the sequence (for the repetition penalty).
    Temperature is applied here, so ``softmax`` of the result is the distribution that is sampled.
    """
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.is_greedy:
        return logits
    if params.temperature != 1.0:
        logits = logits / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return min_p_filter(logits, params.min_p)


class Sampler:
    """Picks next tokens for one sequence and keeps its state on the logits' device.

    State: the seeded ``torch.Generator`` and the mask of tokens seen so far (prompt + generated) for
    the repetition penalty. ``sample`` returns a device tensor [1]; reading it is the caller's sync.
    """

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device | str = "cpu"):
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)
        self._seen: torch.Tensor | None = None
        if params.repetition_penalty != 1.0:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)

    def observe(self, token_ids: torch.Tensor) -> None:
        """Mark tokens as part of the sequence (prompt tokens, then each sampled token). ids: [N] long."""
        if self._seen is not None:
            ids = token_ids.to(self.device).reshape(-1).clamp(0, self.vocab_size - 1)
            self._seen.index_fill_(0, ids, True)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Pick the next token from logits [V] (only the first ``vocab_size`` entries count); returns [1] long."""
        logits = logits.reshape(-1)[: self.vocab_size]
        filtered = filter_logits(logits, self.params, self._seen)
        if self.params.is_greedy:
            token = torch.argmax(filtered, dim=-1, keepdim=True)
        else:
            probs = torch.softmax(filtered, dim=-1)
            race = torch.empty_like(probs).exponential_(1.0, generator=self.generator)
            token = torch.argmax(probs / race, dim=-1, keepdim=True)
        self.observe(token)
        return token
