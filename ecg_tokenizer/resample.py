"""Exact rational-rate resampling of integer WFDB samples to the canonical rate.

The filter is resample_poly's design (Kaiser-windowed sinc, beta 5) with half length
5 x max(up, down) taps of the up-sampled rate (resample_poly: 10) with each polyphase branch rounded to
integers summing to exactly ``2**SCALE_BITS`` (unit DC gain). Digital WFDB samples are
integers, so every canonical sample is an exact integer sum (< 2**53 for |x| < 2**30):
the whole-record fast path (``scipy.signal.upfirdn``, any summation order) and the
one-output-at-a-time reference give bit-identical values.

Canonical sample ``m`` (time ``m / target_rate``) is
``c[m] = sum_i h[m * down + D - i * up] * x[i]`` with ``D`` the filter centre.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

SCALE_BITS = 20  # fixed-point bits of the filter taps
SCALE = float(1 << SCALE_BITS)
# Zero crossings of the sinc on each side (resample_poly uses 10; 5 halves the cost). For
# 360 -> 128 Hz the response is flat to 40 Hz (-0.5 dB at 50 Hz), -21 dB or less from 76 Hz:
# ECG energy above 50 Hz is small (EMG, noise), measured by tests/test_ecg_resample.py.
HALF_ZEROS = 5


@dataclass(frozen=True)
class Resampler:
    """Polyphase integer filter for ``fs -> target_rate = fs * up / down``.

    Attributes:
        up (int): up-sampling factor.
        down (int): down-sampling factor.
        center (int): index D of the filter centre (the filter has 2D + 1 taps).
        taps (np.ndarray): (2D + 1,) int64 taps; each branch ``taps[p::up]`` sums to 2**20.
    """

    up: int
    down: int
    center: int
    taps: np.ndarray

    def support(self, m: np.ndarray):
        """First and last input sample that canonical samples ``m`` depend on.

        Args:
            m (np.ndarray): int64 canonical indices.

        Returns:
            Tuple[np.ndarray, np.ndarray]: (i_min, i_max) int64, inclusive.
        """
        m = np.asarray(m, dtype=np.int64)
        # i_min = ceil((m*down - D) / up), i_max = floor((m*down + D) / up)
        return -((-(m * self.down - self.center)) // self.up), (m * self.down + self.center) // self.up

    def whole(self, x: np.ndarray) -> np.ndarray:
        """Every canonical sample of a record (fast path: ``scipy.signal.upfirdn``'s
        polyphase C loop over the whole record, single-threaded).

        Every value is an exact integer, so the loop's summation order does not matter
        (== :meth:`at` bit for bit).

        Args:
            x (np.ndarray): (n,) integer samples.

        Returns:
            np.ndarray: (floor((n - 1) * up / down) + 1,) float64 canonical samples
            holding exact integers (scaled by 2**20); index m is canonical sample m.
            Entries whose support leaves [0, n) use zero padding (callers drop them).
        """
        from scipy.signal import upfirdn

        a, b = divmod(self.center, self.down)
        h = self.taps.astype(np.float64)
        if b:
            # z'[n] = z[n - (down - b)] so that z'[(m + a + 1) * down] = z[m * down + D].
            h = np.concatenate([np.zeros(self.down - b), h])
            a += 1
        y = upfirdn(h, np.asarray(x, dtype=np.float64), self.up, self.down)
        n_out = (np.asarray(x).size - 1) * self.up // self.down + 1
        return y[a : a + n_out]

    def at(self, x: np.ndarray, m: int) -> int:
        """One canonical sample from its definition (reference path).

        Args:
            x (np.ndarray): (n,) integer samples.
            m (int): canonical index whose support lies inside ``x``.

        Returns:
            int: the exact integer ``c[m]``.
        """
        i_min = -((self.center - m * self.down) // self.up)  # ceil((m*down - D) / up)
        i_max = (m * self.down + self.center) // self.up
        i = np.arange(i_min, i_max + 1, dtype=np.int64)
        k = m * self.down + self.center - i * self.up
        return int(np.dot(self.taps[k], np.asarray(x[i_min : i_max + 1], dtype=np.int64)))


@functools.lru_cache(maxsize=32)
def get_resampler(fs: float, target_rate: float) -> Resampler:
    """Build (and cache) the resampler for a rate pair.

    Args:
        fs (float): record sampling rate (Hz).
        target_rate (float): canonical rate (Hz).

    Returns:
        Resampler: the filter.
    """
    ratio = (Fraction(target_rate).limit_denominator(1000) / Fraction(fs).limit_denominator(1000)).limit_denominator(1000)
    up, down = ratio.numerator, ratio.denominator
    if up == down == 1:
        return Resampler(1, 1, 0, np.array([1 << SCALE_BITS], dtype=np.int64))
    from scipy.signal import firwin

    max_rate = max(up, down)
    half_len = HALF_ZEROS * max_rate
    h = firwin(2 * half_len + 1, 1.0 / max_rate, window=("kaiser", 5.0)) * up
    taps = np.zeros(h.size, dtype=np.int64)
    for p in range(up):
        branch = h[p::up]
        hi = np.round(branch * (SCALE / branch.sum())).astype(np.int64)
        hi[int(np.argmax(np.abs(hi)))] += (1 << SCALE_BITS) - int(hi.sum())
        taps[p::up] = hi
    taps.setflags(write=False)
    return Resampler(up, down, half_len, taps)
