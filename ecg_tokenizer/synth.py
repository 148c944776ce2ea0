"""Offline synthetic ECG: labeled WFDB records (normal, ectopic beats, atrial fibrillation).

Each beat is a sum of Gaussian waves (P, Q, R, S, T; the ECGSYN idea of McSharry et al.,
IEEE TBME 50(3), 2003, in the time domain). Normal sinus beats ``N`` at ~60-90 bpm;
premature ventricular contractions ``V`` (early, wide, no P wave, inverted T, compensatory
pause); atrial premature beats ``A`` (early, different P); atrial fibrillation episodes
(irregular RR, no P waves, 4-9 Hz fibrillatory waves) marked by rhythm annotations ``+``
with ``aux_note`` ``(AFIB`` / ``(N`` like MIT-BIH. Baseline wander and noise are added.
Records are written with ``wfdb.wrsamp`` (format 212, 2 leads MLII and V1) and
``wfdb.wrann`` (``.atr``), so the whole pipeline runs with no downloaded data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

# (offset from R s, amplitude mV, width s) of the P, Q, R, S, T waves.
_NORMAL = [(-0.20, 0.15, 0.025), (-0.035, -0.10, 0.010), (0.0, 1.20, 0.012), (0.035, -0.25, 0.012), (0.28, 0.30, 0.050)]
_APB = [(-0.16, -0.10, 0.020), (-0.035, -0.10, 0.010), (0.0, 1.15, 0.012), (0.035, -0.25, 0.012), (0.27, 0.28, 0.050)]
_PVC = [(-0.05, -0.30, 0.030), (0.0, 1.60, 0.035), (0.08, -0.60, 0.040), (0.32, -0.40, 0.070)]
_AF = [w for w in _NORMAL if w[0] != -0.20]  # no P wave


def _add_beat(sig: np.ndarray, fs: float, r: int, waves) -> None:
    lo, hi = max(0, r - int(0.4 * fs)), min(sig.size, r + int(0.7 * fs))
    t = (np.arange(lo, hi) - r) / fs
    for off, amp, width in waves:
        sig[lo:hi] += amp * np.exp(-0.5 * ((t - off) / width) ** 2)


def _beat_train(sig: np.ndarray, fs: int, duration_s: float, rng: np.random.Generator, af: Optional[Tuple[int, int]],
                *, pvc_rate: float, apb_rate: float) -> Tuple[List[int], List[str]]:
    """Add the beats to ``sig`` (mV, (n,)); returns their R-peak samples and symbols."""
    base_rr = rng.uniform(0.65, 1.0)
    samples: List[int] = []
    symbols: List[str] = []
    t = 0.5
    while t < duration_s - 0.8:
        r = int(round(t * fs))
        in_af = af is not None and af[0] <= r < af[1]
        if in_af:
            _add_beat(sig, fs, r, _AF)
            samples.append(r), symbols.append("N")
            t += rng.uniform(0.4, 1.1)  # irregularly irregular
            continue
        u = rng.random()
        if samples and symbols[-1] == "N" and u < pvc_rate:
            # Replace this beat by an early PVC, then a compensatory pause.
            r = int(round((t - 0.35 * base_rr) * fs))
            _add_beat(sig, fs, r, _PVC)
            samples.append(r), symbols.append("V")
            t += 0.65 * base_rr + base_rr
            continue
        if samples and symbols[-1] == "N" and u < pvc_rate + apb_rate:
            r = int(round((t - 0.25 * base_rr) * fs))
            _add_beat(sig, fs, r, _APB)
            samples.append(r), symbols.append("A")
            t += 0.75 * base_rr + base_rr * rng.uniform(0.95, 1.05)
            continue
        _add_beat(sig, fs, r, _NORMAL)
        samples.append(r), symbols.append("N")
        t += base_rr * rng.uniform(0.97, 1.03)
    return samples, symbols


def _add_noise(sig: np.ndarray, fs: int, rng: np.random.Generator, af: Optional[Tuple[int, int]]) -> None:
    """Fibrillatory waves in the AF episode, baseline wander and white noise, in place."""
    n = sig.size
    tt = np.arange(n) / fs
    if af is not None:
        fw = np.zeros(n)
        for f in (4.3, 6.1, 8.7):
            fw += 0.03 * np.sin(2 * np.pi * f * tt + rng.uniform(0, 2 * np.pi))
        sig[af[0] : af[1]] += fw[af[0] : af[1]]
    sig += 0.1 * np.sin(2 * np.pi * 0.3 * tt + rng.uniform(0, 2 * np.pi))  # baseline wander
    sig += rng.normal(0, 0.01, n)


def _write_annotations(name: str, out_dir: Path, samples: List[int], symbols: List[str],
                       af: Optional[Tuple[int, int]]) -> None:
    """``name.atr``: the beats and the rhythm changes."""
    import wfdb

    # Rhythm changes sit one sample before the first beat of the new rhythm (as in MIT-BIH).
    anns = [(0, "+", "(N")] + [(int(s), sym, "") for s, sym in zip(samples, symbols)]
    if af is not None:
        first_af = next(i for i, s in enumerate(samples) if s >= af[0])
        anns.append((samples[first_af] - 1, "+", "(AFIB"))
        after_af = next((i for i, s in enumerate(samples) if s >= af[1]), None)
        if after_af is not None:
            anns.append((samples[after_af] - 1, "+", "(N"))
    anns.sort(key=lambda x: x[0])
    wfdb.wrann(
        name, "atr", np.array([x[0] for x in anns], dtype=np.int64), symbol=[x[1] for x in anns],
        aux_note=[x[2] for x in anns], write_dir=str(out_dir),
    )


def synthesize_record(
    name: str,
    out_dir: Path,
    *,
    fs: int = 360,
    duration_s: float = 120.0,
    seed: int = 0,
    pvc_rate: float = 0.06,
    apb_rate: float = 0.04,
    af_fraction: float = 0.3,
) -> Dict[str, object]:
    """Write one synthetic record (``name.hea``, ``name.dat``, ``name.atr``).

    Args:
        name (str): record name.
        out_dir (Path): directory (created).
        fs (int): sampling rate (Hz).
        duration_s (float): length (s).
        seed (int): RNG seed (same seed, same bytes).
        pvc_rate (float): probability that a sinus beat is followed by a PVC.
        apb_rate (float): probability of an atrial premature beat.
        af_fraction (float): fraction of the record in one AF episode (0 = none), placed in
            the middle.

    Returns:
        Dict[str, object]: ``samples`` (beat R peaks), ``symbols``, ``af`` (start, end)
        samples of the AF episode or None.
    """
    rng = np.random.default_rng(seed)  # one stream, drawn in this order: rhythm, beats, noise
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = int(round(duration_s * fs))
    sig = np.zeros(n)
    af = None
    if af_fraction > 0:
        a0 = int(n * (0.5 - af_fraction / 2))
        af = (a0, a0 + int(n * af_fraction))
    samples, symbols = _beat_train(sig, fs, duration_s, rng, af, pvc_rate=pvc_rate, apb_rate=apb_rate)
    _add_noise(sig, fs, rng, af)
    v1 = -0.6 * sig + 0.05 * np.sin(2 * np.pi * 0.2 * np.arange(n) / fs)
    p = np.clip(np.stack([sig, v1], axis=1), -5.0, 5.0)

    import wfdb

    wfdb.wrsamp(
        name, fs=fs, units=["mV", "mV"], sig_name=["MLII", "V1"], p_signal=p, fmt=["212", "212"],
        adc_gain=[200.0, 200.0], baseline=[1024, 1024], write_dir=str(out_dir),
    )
    _write_annotations(name, out_dir, samples, symbols, af)
    return {"samples": np.array(samples, dtype=np.int64), "symbols": symbols, "af": af}


def write_synthetic_database(
    out_dir: Path, *, n_records: int = 4, fs: int = 360, duration_s: float = 120.0, seed: int = 0
) -> List[str]:
    """Write ``n_records`` synthetic records named ``s000``... and a ``RECORDS`` list.

    Record ``i`` uses seed ``seed + i``; every other record has an AF episode.

    Args:
        out_dir (Path): directory (created).
        n_records (int): records to write.
        fs (int): sampling rate (Hz).
        duration_s (float): length of each record (s).
        seed (int): base seed.

    Returns:
        List[str]: record names.
    """
    out_dir = Path(out_dir)
    names = []
    for i in range(n_records):
        name = f"s{i:03d}"
        synthesize_record(
            name, out_dir, fs=fs, duration_s=duration_s, seed=seed + i, af_fraction=0.3 if i % 2 == 0 else 0.0
        )
        names.append(name)
    (out_dir / "RECORDS").write_text("".join(f"{n}\n" for n in names))
    return names
