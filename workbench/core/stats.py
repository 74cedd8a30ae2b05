"""ExpertStats: how often the router of each layer picks each routed expert.

Counts are kept per layer ([layers, experts], float64), never pooled across layers: real models are
skewed per layer, and a layer's hot experts say nothing about another layer's. Besides the all-time
counts there is a decayed "recent" view (exponential, with a half-life counted in tokens) so that a
live chat can show what the current conversation uses.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .errors import WorkbenchError

STATS_FORMAT = "workbench.expert_stats"
STATS_VERSION = 1


class ExpertStats:
    """Routing counts of ``n_layers`` layers x ``n_experts`` routed experts, ``top_k`` picks per token.

    ``counts[l, e]``: how many times layer ``l`` picked expert ``e`` (float64; rows of dense layers stay
    zero). ``recent[l, e]``: the same, decayed with a half-life of ``half_life`` tokens. ``tokens``:
    tokens seen (all-time).
    """

    def __init__(self, n_layers: int, n_experts: int, top_k: int = 1, half_life: float = 256.0):
        if n_layers < 1 or n_experts < 1 or top_k < 1:
            raise ValueError(f"need layers, experts, top_k >= 1; got {n_layers}, {n_experts}, {top_k}")
        self.top_k = int(top_k)
        self.half_life = float(half_life)
        self.counts = np.zeros((n_layers, n_experts), dtype=np.float64)
        self.recent = np.zeros((n_layers, n_experts), dtype=np.float64)
        self.tokens = 0.0

    @classmethod
    def for_spec(cls, spec, half_life: float = 256.0) -> ExpertStats:
        """Empty stats shaped for a ModelSpec (``n_layers`` x ``n_experts``, ``n_experts_active`` picks)."""
        return cls(spec.n_layers, max(1, spec.n_experts), max(1, spec.n_experts_active), half_life)

    @property
    def shape(self) -> tuple[int, int]:
        return self.counts.shape  # type: ignore[return-value]

    @property
    def n_layers(self) -> int:
        return self.counts.shape[0]

    @property
    def n_experts(self) -> int:
        return self.counts.shape[1]

    # -- accumulate ------------------------------------------------------------------------------

    def add(self, counts: np.ndarray, tokens: float | None = None) -> None:
        """Add a batch of counts ``[layers, experts]`` covering ``tokens`` tokens.

        ``tokens`` defaults to the busiest layer's picks / ``top_k``. The recent view decays by
        ``0.5 ** (tokens / half_life)`` before the batch is added.
        """
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != self.counts.shape:
            raise ValueError(f"counts of shape {counts.shape} do not match stats of shape {self.shape}")
        if np.any(counts < 0) or not np.all(np.isfinite(counts)):
            raise ValueError("routing counts must be finite and non-negative")
        if tokens is None:
            tokens = float(counts.sum(axis=1).max()) / self.top_k
        self.counts += counts
        self.recent *= 0.5 ** (tokens / self.half_life) if self.half_life > 0 else 0.0
        self.recent += counts
        self.tokens += tokens

    def add_selections(self, selected: np.ndarray) -> None:
        """Add the picks of some tokens: ``selected[t, l, j]`` is the expert index of token ``t``'s
        ``j``-th pick in layer ``l`` (-1 for none, e.g. a dense layer). Shape ``[tokens, layers, top_k]``."""
        sel = np.asarray(selected)
        if sel.ndim != 3 or sel.shape[1] != self.n_layers:
            raise ValueError(f"selections must be [tokens, {self.n_layers}, top_k], got {sel.shape}")
        batch = np.zeros_like(self.counts)
        for layer in range(self.n_layers):
            ix = sel[:, layer, :].ravel()
            ix = ix[ix >= 0]
            if ix.size and ix.max() >= self.n_experts:
                raise ValueError(f"expert index {int(ix.max())} out of range in layer {layer}")
            batch[layer] = np.bincount(ix, minlength=self.n_experts)
        self.add(batch, tokens=float(sel.shape[0]))

    def merge(self, other: ExpertStats) -> ExpertStats:
        """A new ExpertStats holding both (counts and recent views summed)."""
        if other.shape != self.shape:
            raise ValueError(f"cannot merge stats of shape {other.shape} into {self.shape}")
        out = ExpertStats(self.n_layers, self.n_experts, self.top_k, self.half_life)
        out.counts = self.counts + other.counts
        out.recent = self.recent + other.recent
        out.tokens = self.tokens + other.tokens
        return out

    def copy(self) -> ExpertStats:
        return self.merge(ExpertStats(self.n_layers, self.n_experts, self.top_k, self.half_life))

    # -- views -----------------------------------------------------------------------------------

    def frequencies(self, recent: bool = False) -> np.ndarray:
        """Share of each layer's picks per expert, ``[layers, experts]``; every row sums to 1.
        A layer without counts gets the uniform distribution."""
        c = self.recent if recent else self.counts
        total = c.sum(axis=1, keepdims=True)
        uniform = np.full_like(c, 1.0 / self.n_experts)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total > 0, c / np.where(total > 0, total, 1.0), uniform)

    def selection_probs(self, recent: bool = False, top_k: int | None = None) -> np.ndarray:
        """Probability that a token picks expert ``e`` in layer ``l``: ``min(1, top_k * share)``,
        ``[layers, experts]``. Each row sums to ``top_k`` (before clipping)."""
        k = self.top_k if top_k is None else top_k
        return np.minimum(1.0, k * self.frequencies(recent))

    def coverage(self, layer: int, recent: bool = False) -> np.ndarray:
        """Coverage curve of one layer, ``[experts]``: element ``k-1`` is the share of the layer's picks
        served by its ``k`` most used experts (1.0 at the end)."""
        f = np.sort(self.frequencies(recent)[layer])[::-1]
        return np.cumsum(f)

    def coverage_curves(self, recent: bool = False) -> np.ndarray:
        """Coverage curves of every layer, ``[layers, experts]`` (row ``l`` is ``coverage(l)``)."""
        f = -np.sort(-self.frequencies(recent), axis=1)
        return np.cumsum(f, axis=1)

    def experts_for_coverage(self, layer: int, share: float, recent: bool = False) -> int:
        """How many of layer ``layer``'s hottest experts serve at least ``share`` (0..1) of its picks."""
        cov = self.coverage(layer, recent)
        return int(min(len(cov), np.searchsorted(cov, share - 1e-12) + 1))

    def hottest(self, layer: int, recent: bool = False) -> np.ndarray:
        """Expert indices of one layer, most picked first (ties: lower index first)."""
        f = self.frequencies(recent)[layer]
        return np.argsort(-f, kind="stable")

    def entropy(self, recent: bool = False) -> np.ndarray:
        """Normalised entropy per layer, ``[layers]``: 1.0 = flat routing, 0.0 = one expert takes all."""
        f = self.frequencies(recent)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.where(f > 0, f * np.log(f), 0.0).sum(axis=1)
        return h / math.log(self.n_experts) if self.n_experts > 1 else np.zeros(self.n_layers)

    def gini(self, recent: bool = False) -> np.ndarray:
        """Gini coefficient of each layer's pick shares, ``[layers]``: 0 = flat, ->1 = concentrated."""
        f = np.sort(self.frequencies(recent), axis=1)
        n = self.n_experts
        idx = np.arange(1, n + 1)
        return ((2 * idx - n - 1) * f).sum(axis=1) / (n * np.maximum(f.sum(axis=1), 1e-300))

    def has_counts(self, layer: int | None = None) -> bool:
        return bool(self.counts.sum() > 0 if layer is None else self.counts[layer].sum() > 0)

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format": STATS_FORMAT,
            "version": STATS_VERSION,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "half_life": self.half_life,
            "tokens": self.tokens,
            "counts": _rows(self.counts),
            "recent": _rows(self.recent),
        }

    @classmethod
    def from_json(cls, obj: dict) -> ExpertStats:
        """Inverse of ``to_json``; raises WorkbenchError on a malformed document."""
        try:
            s = cls(int(obj["n_layers"]), int(obj["n_experts"]), int(obj.get("top_k", 1)),
                    float(obj.get("half_life", 256.0)))
            counts = np.asarray(obj["counts"], dtype=np.float64)
            recent = np.asarray(obj.get("recent", obj["counts"]), dtype=np.float64)
        except (KeyError, TypeError, ValueError) as e:
            raise WorkbenchError(f"expert stats are malformed: {e}") from None
        if counts.shape != s.shape or recent.shape != s.shape:
            raise WorkbenchError(f"expert stats say {s.shape} but hold counts of shape {counts.shape}")
        if np.any(counts < 0) or not np.all(np.isfinite(counts)):
            raise WorkbenchError("expert stats hold negative or non-finite counts")
        s.counts, s.recent, s.tokens = counts, recent, float(obj.get("tokens", 0.0))
        return s

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> ExpertStats:
        """Read stats written by ``save`` (or the ``stats`` entry of a project file)."""
        try:
            obj = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise WorkbenchError(f"no expert stats file at {path}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WorkbenchError(f"cannot read expert stats from {path}: {e}") from None
        if isinstance(obj, dict) and "stats" in obj and "counts" not in obj:
            obj = obj["stats"]
        if not isinstance(obj, dict):
            raise WorkbenchError(f"{path} does not hold expert stats")
        return cls.from_json(obj)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertStats):
            return NotImplemented
        return (self.shape == other.shape and self.top_k == other.top_k and self.tokens == other.tokens
                and np.array_equal(self.counts, other.counts) and np.array_equal(self.recent, other.recent))

    def __repr__(self) -> str:
        return f"ExpertStats({self.n_layers} layers x {self.n_experts} experts, {self.tokens:g} tokens)"


def _rows(a: np.ndarray) -> list[list[float | int]]:
    """Rows for JSON: whole numbers as ints (compact), others as floats (exact repr round trip)."""
    return [[int(v) if float(v).is_integer() and abs(v) < 2**53 else float(v) for v in row] for row in a]
