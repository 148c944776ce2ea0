"""Tokenizer parameters, vocabulary layout and the quantizers shared by every path.

Token layout (ids in this order, see docs/ecg_tokenizer.md):

==============  ===============================================================
specials        ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<sep>`` 3 (beat separator)
beat tokens     scheme ``annotation``: one per label class, or one per
                (label class, RR bin) when ``rr_bins > 0`` (``N|rr03``, ``N|rr?``);
                scheme ``samples``: one per label class (``N`` ... ``<unlabeled>``);
                never in a ``samples`` record stream, only as the answer of a
                beat-classification prompt (after the beat's own tokens)
RR tokens       scheme ``samples`` with ``rr_bins > 0``: ``rr00`` ... and ``rr?`` (unknown)
sample tokens   scheme ``samples``: ``q000`` ... one per quantization level
rhythm tokens   ``(AFIB`` ... ``(OTHER`` (prompts only; rhythms are shard metadata)
task tokens     ``<beat?>`` (classify the beat before it), ``<af?>`` (is this segment
                atrial fibrillation?), answers ``<af>`` / ``<not_af>``: prompts of the
                Heart Language Model's fine-tuning tasks (:mod:`hlmtune.data_builders.ecg`)
==============  ===============================================================
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping

import numpy as np

from hlmtune.ecg_tokenizer.labels import LABEL_MODES, RHYTHM_OTHER, RHYTHMS, label_classes

SCHEMES = ("annotation", "samples")
QUANTIZATIONS = ("mu-law", "uniform")
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<sep>")
# Appended after the rhythm tokens so every earlier id keeps its value.
TASK_TOKENS = ("<beat?>", "<af?>", "<af>", "<not_af>")
PAD_ID, BOS_ID, EOS_ID, SEP_ID = 0, 1, 2, 3
WINDOW_MIN, WINDOW_MAX = 128, 1024


@dataclass(frozen=True)
class TokenizerParams:
    """Everything that decides the tokens (hashed into the shards' ``params_hash``).

    Attributes:
        scheme (str): ``"annotation"`` (one token per beat) or ``"samples"`` (a window of
            quantized samples per beat).
        window (int): samples per beat window at ``target_rate`` (128..1024).
        target_rate (float): canonical sampling rate (Hz) every record is resampled to.
        label_mode (str): ``"aami"`` (N S V F Q) or ``"raw"`` (WFDB beat symbols).
        quantization (str): ``"mu-law"`` or ``"uniform"``.
        levels (int): quantization levels (2..65536).
        amplitude_mv (float): quantizer range is [-amplitude_mv, +amplitude_mv] mV after
            baseline removal; values outside are clipped to the end levels.
        mu (float): mu-law compression constant.
        rr_bins (int): RR-interval bins (0 = no RR information).
        rr_min_s (float): lower edge of the first RR bin (s); shorter RRs fall in it.
        rr_max_s (float): upper edge of the last RR bin (s); longer RRs fall in it.
    """

    scheme: str = "samples"
    window: int = 128
    target_rate: float = 128.0
    label_mode: str = "aami"
    quantization: str = "mu-law"
    levels: int = 256
    amplitude_mv: float = 3.0
    mu: float = 255.0
    rr_bins: int = 16
    rr_min_s: float = 0.2
    rr_max_s: float = 2.0

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if not WINDOW_MIN <= int(self.window) <= WINDOW_MAX:
            raise ValueError(f"window must be {WINDOW_MIN}..{WINDOW_MAX} samples, got {self.window}")
        if self.label_mode not in LABEL_MODES:
            raise ValueError(f"label_mode must be one of {LABEL_MODES}, got {self.label_mode!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if not 2 <= int(self.levels) <= 65536:
            raise ValueError(f"levels must be 2..65536, got {self.levels}")
        for name in ("target_rate", "amplitude_mv", "mu"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not 0 <= int(self.rr_bins) <= 256:
            raise ValueError(f"rr_bins must be 0..256, got {self.rr_bins}")
        if not 0 <= self.rr_min_s < self.rr_max_s:
            raise ValueError(f"need 0 <= rr_min_s < rr_max_s, got {self.rr_min_s}, {self.rr_max_s}")

    @property
    def pre(self) -> int:
        """Window samples before the R peak (a third of the window: P wave before, T after)."""
        return int(self.window) // 3

    def to_dict(self) -> Dict[str, Any]:
        """Plain dict (JSON-ready)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TokenizerParams":
        """Inverse of :meth:`to_dict`; unknown keys are errors naming the closest key.

        Args:
            d (Mapping[str, Any]): parameters.

        Returns:
            TokenizerParams: the parameters.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        for k in d:
            if k not in names:
                import difflib

                close = difflib.get_close_matches(k, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown tokenizer parameter {k!r}{hint}")
        return cls(**dict(d))

    def digest(self) -> str:
        """Stable sha256 of the parameters."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


class Vocabulary:
    """Token names and id ranges for one :class:`TokenizerParams`.

    Args:
        params (TokenizerParams): the parameters.
    """

    def __init__(self, params: TokenizerParams) -> None:
        self.params = params
        self.classes: List[str] = label_classes(params.label_mode)
        names: List[str] = list(SPECIAL_TOKENS)
        b = int(params.rr_bins)
        rr_names = [f"rr{i:02d}" for i in range(b)] + ["rr?"] if b else []
        self.label_base = len(names)
        if params.scheme == "annotation" and b:
            # One token per (class, RR bin): id = label_base + class * (b + 1) + rr_bin.
            names += [f"{c}|{r}" for c in self.classes for r in rr_names]
        else:
            names += list(self.classes)
        self.rr_base = len(names)
        if params.scheme == "samples":
            names += rr_names
        self.sample_base = len(names)
        if params.scheme == "samples":
            width = len(str(int(params.levels) - 1))
            names += [f"q{i:0{width}d}" for i in range(int(params.levels))]
        self.rhythm_base = len(names)
        self.rhythms: List[str] = [*RHYTHMS, RHYTHM_OTHER]
        names += self.rhythms
        self.task_base = len(names)
        names += list(TASK_TOKENS)
        self.names: List[str] = names
        self.ids: Dict[str, int] = {n: i for i, n in enumerate(names)}
        if len(self.ids) != len(names):  # pragma: no cover - guards the layout above
            raise AssertionError("duplicate token names")
        self.dtype = np.dtype(np.uint16) if len(names) <= 65536 else np.dtype(np.uint32)

    def __len__(self) -> int:
        return len(self.names)

    def layout(self) -> Dict[str, int]:
        """Id ranges (JSON-ready)."""
        return {
            "pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID, "sep": SEP_ID,
            "label_base": self.label_base, "rr_base": self.rr_base,
            "sample_base": self.sample_base, "rhythm_base": self.rhythm_base,
            "task_base": self.task_base, "size": len(self.names),
        }

    def rhythm_id(self, rhythm: str) -> int:
        """Token id of a rhythm label (unknown rhythms -> ``(OTHER``)."""
        return self.rhythm_base + (
            self.rhythms.index(rhythm) if rhythm in self.rhythms else len(self.rhythms) - 1
        )


# ----------------------------------------------------------------------------- quantizers


def quantizer_edges(params: TokenizerParams) -> np.ndarray:
    """Bin edges (mV) of the amplitude quantizer, increasing, ``levels + 1`` values.

    Uniform: equal steps over [-A, A]. Mu-law: equal steps in the compressed domain
    ``y = sign(x) ln(1 + mu|x|/A) / ln(1 + mu)`` mapped back, so steps are fine near 0 mV
    (P and T waves) and coarse near the R peak.

    Args:
        params (TokenizerParams): the parameters.

    Returns:
        np.ndarray: (levels + 1,) float64 edges; edges[0] = -A, edges[-1] = A.
    """
    a, n = float(params.amplitude_mv), int(params.levels)
    y = np.linspace(-1.0, 1.0, n + 1)
    if params.quantization == "uniform":
        e = a * y
    else:
        mu = float(params.mu)
        e = a * np.sign(y) * np.expm1(np.abs(y) * math.log1p(mu)) / mu
    e[0], e[-1] = -a, a
    return e


def quantize(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Level index of each value: i such that edges[i] <= v < edges[i+1], clipped to range.

    A comparison-only search, so any array shape gives bit-identical results (the fast
    and the reference tokenizer agree exactly).

    Args:
        values (np.ndarray): any shape, mV, no NaN.
        edges (np.ndarray): from :func:`quantizer_edges`.

    Returns:
        np.ndarray: int64 level indices, same shape, in [0, levels - 1].
    """
    return np.searchsorted(edges[1:-1], values, side="right").astype(np.int64)


class FastQuantizer:
    """Table-driven equivalent of :func:`quantize` (about 10x faster on large arrays).

    A uniform grid finer than the smallest bin guesses the level (at most one edge per grid
    cell), then one comparison against each neighbouring edge fixes the guess, so the
    result equals :func:`quantize` exactly whatever the rounding of the guess.

    Args:
        edges (np.ndarray): from :func:`quantizer_edges`.
    """

    def __init__(self, edges: np.ndarray) -> None:
        self.edges = np.asarray(edges, dtype=np.float64)
        lo, hi = float(self.edges[0]), float(self.edges[-1])
        n = self.edges.size - 1
        min_step = float(np.min(np.diff(self.edges)))
        cells = int(max(n, math.ceil((hi - lo) / min_step) * 2))
        self.table = None
        if cells > 1 << 20:  # bins too fine for a table: fall back to the exact search
            return
        self.lo, self.scale, self.cells = lo, cells / (hi - lo), cells
        grid = lo + np.arange(cells, dtype=np.float64) / self.scale
        self.table = quantize(grid, self.edges).astype(np.int32)
        # Lower/upper edge of each level, open-ended at the extremes.
        self.lower = np.concatenate([[-np.inf], self.edges[1:-1]])
        self.upper = np.concatenate([self.edges[1:-1], [np.inf]])

    def __call__(self, values: np.ndarray) -> np.ndarray:
        """Level indices (int32, int64 without a table), identical to ``quantize(values, edges)``."""
        if self.table is None:
            return quantize(values, self.edges)
        # float32 is plenty for a guess within one cell (cells < 2**21, relative error 6e-8).
        g = values.astype(np.float32)
        g -= np.float32(self.lo)
        g *= np.float32(self.scale)
        np.clip(g, 0, self.cells - 1, out=g)
        idx = self.table[g.astype(np.int32)]
        idx -= values < self.lower[idx]
        idx += values >= self.upper[idx]
        return idx


def dequantize(levels: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Midpoint (mV) of each level's bin: the round trip error is at most half that bin.

    Args:
        levels (np.ndarray): int level indices.
        edges (np.ndarray): from :func:`quantizer_edges`.

    Returns:
        np.ndarray: float64 values, same shape.
    """
    centers = 0.5 * (edges[:-1] + edges[1:])
    return centers[np.asarray(levels, dtype=np.int64)]


def rr_edges(params: TokenizerParams) -> np.ndarray:
    """RR bin edges (s): ``rr_bins + 1`` equal steps over [rr_min_s, rr_max_s]."""
    return np.linspace(float(params.rr_min_s), float(params.rr_max_s), int(params.rr_bins) + 1)


def rr_bin(rr_s: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """RR bin of each interval (clipped to the end bins); NaN (unknown) -> ``rr_bins``.

    Args:
        rr_s (np.ndarray): RR intervals in seconds, NaN where unknown.
        edges (np.ndarray): from :func:`rr_edges`.

    Returns:
        np.ndarray: int64 bins in [0, rr_bins].
    """
    rr_s = np.asarray(rr_s, dtype=np.float64)
    b = np.searchsorted(edges[1:-1], rr_s, side="right").astype(np.int64)
    b[np.isnan(rr_s)] = len(edges) - 1
    return b
