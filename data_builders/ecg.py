"""Heart Language Model datasets: pretraining windows, beat classes, atrial fibrillation, DPO pairs.

Every builder reads the memory-mapped shards of ``hlmtune tokenize`` (format version 2: a
``samples`` beat is ``<sep> rrNN q...q``, signal only; labels and rhythms live in the beat
tables) and follows torchtune's conventions: ``builder(tokenizer, *, ...)`` returning a
map-style dataset of ``{"tokens", "labels"}`` (``padded_collate_sft``) or of
``{"chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"}``
(``padded_collate_dpo``). Labels are -100 except where the model must predict.

Splits (:mod:`hlmtune.ecg_tokenizer.splits`): every builder defaults to ``split: DS1`` (MIT-BIH
inter-patient training records) and refuses DS2 records, which only ``hlmtune eval`` reads.

Inputs never hold the answer:

* pretraining (``ecg_pretrain_dataset``): windows of ``max_seq_len`` tokens of the record
  streams; for ``samples`` shards these are waveform levels and RR bins only (the papers'
  second HLM, "built on ECG samples surrounding a heartbeat");
* beat classification (``ecg_beat_classification_dataset``), one example per target beat::

      <bos> rr(i-C) ... rr(i-1)  <sep> rr(i) q...q  rr(i+1)  <beat?>  LABEL  <eos>
            context: RR bins       the target beat   following RR      answer
            of earlier beats       (signal only)     (as in de Chazal 2004)

  Earlier beats appear as their RR bins only (no waveform, no label): the rhythm context of
  the inter-patient feature sets (local RR average, prematurity) at one token per beat. Only
  ``LABEL`` is trained on. With the default 128-sample beats and 16 context beats an example
  is 149 tokens. ``template_beats`` puts the patient's typical beat (``t...t``, the median of
  earlier beats, :func:`beat_templates`) right after ``<bos>``; ``template_delta`` shows the
  target beat's samples minus it; ``premature_synth`` (training only) shows some N beats early
  and labels them S;
* atrial fibrillation (``ecg_af_dataset``): a segment of ``segment_beats`` consecutive beats
  (annotation shards: one symbol token per beat, the papers' first HLM; samples shards: the
  beats' RR tokens) then ``<af?>`` and the answer ``<af>``/``<not_af>`` from the rhythm
  annotations (majority of the segment's beats in ``(AFIB``), which are never in the input;
* DPO pairs (``ecg_beat_dpo_dataset``): the classification prompt with the correct class
  chosen and a wrong class rejected.

Class imbalance (DS1: N 45,866 vs S 944): ``balance`` draws the epoch's ``num_examples`` with
class shares proportional to ``count ** balance`` (0 = equal classes, 1 = as recorded; default
0.5 for classification), without replacement while a class has enough examples and cycling
through a seeded permutation when it must repeat them. The draw is made once, when the dataset
is built: every epoch shows the same examples (in the sampler's order; the configs train one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from torch.utils.data import Dataset

from hlmtune.ecg_tokenizer.dataset import ECGTokensDataset, ecg_tokens_dataset, open_token_shard  # noqa: F401
from hlmtune.ecg_tokenizer.shards import RECORDS_SUBDIR, read_manifest, stem
from hlmtune.ecg_tokenizer.vocab import (
    BOS_ID, EOS_ID, TokenizerParams, Vocabulary, dequantize, quantize, quantizer_edges, rr_bin, rr_edges,
)
from hlmtune.data_builders.beat_prompt import (
    BeatBlock, BeatDraw, BeatPrompt, BeatPromptOptions, BeatSource, assemble_prompt, builder_signature, parse_options,
)
from hlmtune.data_builders.rr_features import (  # noqa: F401  (normalized_rr_tokens: public here too)
    GATE_EARLY, NORMAL_RR_S, interval_tokens, local_average_rr, long_reference, long_rr_tokens, normalized_rr_tokens,
    rhythm_irregularity, running_reference, window_average_rr,
)
from hlmtune.data_builders.p_wave import p_wave_regularity, p_wave_tokens
from hlmtune.ecg_tokenizer.splits import RANDOM, TRAIN, SplitError, random_beat_mask, resolve_records

IGNORE = -100  # torchtune's CROSS_ENTROPY_IGNORE_IDX
# ``p_wave_beats`` for an ``irregular_no_p_wave`` example (a synthetic fibrillating context): drawn
# uniformly in this range, where the training patients' fibrillating contexts lie (median
# p_wave_regularity over 8 beats before their early N beats: mitdb/203 0.42, svdb/804 0.35; sinus
# contexts before S beats 0.8-0.9; docs/hlm-experiments.md, 2026-12-06).
FIBRILLATING_P_REGULARITY = (-0.2, 0.5)
AF_RHYTHM = "(AFIB"
AF_SEGMENTS = (41, 128, 256, 512)  # the papers' AF segment lengths in beats
# ``early_n_weight``: an N beat is early when its own RR token is under this ratio to the running
# reference: the reference's own gate (rr_features.GATE_EARLY) and the reports' "premature" bucket
# (hlm.metrics.PREMATURE_RATIO, the same 0.8).
EARLY_N_RATIO = GATE_EARLY
# The confusion that matters most for each true class in inter-patient work: the rejected
# answer of a DPO pair (N beats alternate between S and V, the classes the task is about).
_REJECT = {"N": ("S", "V"), "S": ("N",), "V": ("N",), "F": ("V",), "Q": ("N",)}


def read_shards(tokenizer: Any, shards_dir: Optional[str]) -> Tuple[Dict[str, Any], TokenizerParams]:
    """(manifest, tokenizer parameters) of the shards a builder reads, checked against the tokenizer.

    Args:
        tokenizer (Any): an ``ECGTokenizer`` (or None when ``shards_dir`` is given).
        shards_dir (Optional[str]): the shards (default: the tokenizer's manifest folder).

    Raises:
        ValueError: no shards named, or the tokenizer's parameters differ from the shards'.
    """
    shards = shards_dir or getattr(tokenizer, "manifest_dir", None)
    if shards is None:
        raise ValueError("ECG datasets need shards_dir (or a tokenizer built from manifest_path)")
    manifest = read_manifest(Path(shards))
    params = TokenizerParams.from_dict(manifest["params"])
    tp = getattr(tokenizer, "params", None)
    if tp is not None and tp != params:
        diff = {k: (v, getattr(params, k)) for k, v in tp.to_dict().items() if getattr(params, k) != v}
        raise ValueError(f"tokenizer parameters disagree with the shards in {manifest['_dir']}: (tokenizer, shards) {diff}")
    return manifest, params


def _spread(total: int, share: np.ndarray) -> np.ndarray:
    """Integer split of ``total`` proportional to ``share`` (largest shares get the remainder)."""
    want = np.floor(share / share.sum() * total).astype(np.int64)
    want[np.argsort(-share, kind="stable")[: total - int(want.sum())]] += 1
    return want


def _cycle(rng: np.random.Generator, members: np.ndarray, k: int) -> np.ndarray:
    """``k`` draws from ``members``: fresh permutations, every member once before any twice."""
    reps = -(-int(k) // members.size)
    return np.concatenate([rng.permutation(members) for _ in range(max(reps, 1))])[: int(k)]


def balanced_indices(
    labels: np.ndarray, *, balance: Optional[float], num_examples: Optional[int], seed: int,
    groups: Optional[np.ndarray] = None, group_balance: float = 1.0, weights: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Example indices of one epoch with class shares proportional to ``count ** balance``.

    Args:
        labels (np.ndarray): (n,) class id per candidate example.
        balance (Optional[float]): exponent; None keeps every example once, in order.
        num_examples (Optional[int]): epoch size (default: number of candidates).
        seed (int): seed of the draw.
        groups (Optional[np.ndarray]): (n,) group id per candidate (the record: the patient).
        group_balance (float): within a class, each group's share is proportional to its
            count ``** group_balance``: 1 = as recorded (one patient with most of a class's
            beats dominates it), 0 = every patient of the class equally, 0.5 between.
        weights (Optional[np.ndarray]): (n,) draw weight per candidate, > 0 (default 1 each):
            within a class, the candidates of one weight share its draws in proportion to their
            count times that weight (``early_n_weight``); the class shares are unchanged.

    Returns:
        np.ndarray: (num_examples,) indices into ``labels``, shuffled by class draw.
    """
    n = labels.size
    if balance is None:
        return np.arange(n, dtype=np.int64)
    if not 0.0 <= float(balance) <= 1.0:
        raise ValueError(f"balance must be in [0, 1] or null, got {balance}")
    if not 0.0 <= float(group_balance) <= 1.0:
        raise ValueError(f"record_balance must be in [0, 1], got {group_balance}")
    total = int(num_examples or n)
    classes, counts = np.unique(labels, return_counts=True)
    want = _spread(total, counts.astype(np.float64) ** float(balance))
    rng = np.random.default_rng(seed)
    out = []
    w_all = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    if w_all.shape != (n,) or not np.all(w_all > 0):
        raise ValueError(f"weights must be ({n},) and > 0, got shape {w_all.shape}")
    for c, k in zip(classes, want):
        in_class = np.flatnonzero(labels == c)
        # strata of equal weight (one stratum, the whole class, unless weights differ): (count * weight) shares
        w_ids, w_counts = np.unique(w_all[in_class], return_counts=True)
        for w, kw in zip(w_ids, _spread(int(k), w_counts * w_ids)):
            members = in_class[w_all[in_class] == w]
            if groups is None or float(group_balance) == 1.0:
                out.append(_cycle(rng, members, int(kw)))
                continue
            g_ids, g_counts = np.unique(groups[members], return_counts=True)
            for g, kg in zip(g_ids, _spread(int(kw), g_counts.astype(np.float64) ** float(group_balance))):
                if kg:
                    out.append(_cycle(rng, members[groups[members] == g], int(kg)))
    return np.sort(np.concatenate(out)) if out else np.zeros(0, np.int64)


def _samples_params(manifest: Dict[str, Any]) -> TokenizerParams:
    """Parameters of ``samples`` shards with RR bins (what beat classification reads)."""
    params = TokenizerParams.from_dict(manifest["params"])
    if params.scheme != "samples":
        raise ValueError(
            f"beat classification reads 'samples' shards; {manifest['_dir']} holds '{params.scheme}' shards, "
            "whose tokens are the annotators' labels (an input may not contain the answer). Tokenize with "
            "`hlmtune tokenize --scheme samples`"
        )
    if not params.rr_bins:
        raise ValueError(f"beat classification needs RR tokens: {manifest['_dir']} was tokenized with --rr-bins 0")
    return params


def _target_classes(vocab: Vocabulary, classes: Optional[Sequence[str]]) -> Tuple[List[str], np.ndarray]:
    """(class names, their label ids); default every labelled class (the last is <unlabeled>)."""
    all_classes = vocab.classes[:-1]
    chosen: List[str] = list(classes) if classes is not None else list(all_classes)
    unknown = [c for c in chosen if c not in all_classes]
    if unknown:
        raise ValueError(f"classes {unknown} are not label classes of these shards ({all_classes})")
    return chosen, np.array([vocab.classes.index(c) for c in chosen])


def amplitude_lut(table: np.ndarray, tokens: np.ndarray, vocab: Vocabulary, target_mv: float = 1.0) -> np.ndarray:
    """Token map that rescales a record's waveform so its median R amplitude is ``target_mv``.

    Lead placement and gain change every amplitude of a patient by one factor; a classifier
    trained on a few patients then keys on their amplitudes. The record's median ``|mV|`` at
    the R peak (sample ``window // 3`` of every beat, the tokenizer's R position; mostly
    normal beats, no label read) gives the factor, clipped to 0.25..4. Levels are mapped
    through their bin midpoints (mV), scaled, and quantized again.

    Args:
        table (np.ndarray): a record's beat table.
        tokens (np.ndarray): the record's token stream.
        vocab (Vocabulary): the shards' vocabulary (``samples`` scheme).
        target_mv (float): median R amplitude after scaling.

    Returns:
        np.ndarray: (vocab size,) int64 map, identity except on waveform levels.
    """
    edges = quantizer_edges(vocab.params)
    at_r = table["token_start"].astype(np.int64) + 2 + vocab.params.pre  # <sep> rr, then the window
    r_mv = np.abs(dequantize(tokens[at_r].astype(np.int64) - vocab.sample_base, edges))
    med = float(np.median(r_mv)) if r_mv.size else 0.0
    return gain_lut(vocab, edges, float(np.clip(target_mv / med, 0.25, 4.0)) if med > 0 else 1.0)


def gain_lut(vocab: Vocabulary, edges: np.ndarray, gain: float) -> np.ndarray:
    """Token map scaling every waveform level by ``gain`` (bin midpoints in mV, quantized again).

    Args:
        vocab (Vocabulary): the shards' vocabulary (``samples`` scheme).
        edges (np.ndarray): the quantizer's edges (``quantizer_edges(vocab.params)``).
        gain (float): amplitude factor.

    Returns:
        np.ndarray: (vocab size,) int64 map, identity except on waveform levels.
    """
    lut = np.arange(len(vocab), dtype=np.int64)
    levels = np.arange(int(vocab.params.levels))
    lut[vocab.sample_base + levels] = vocab.sample_base + quantize(dequantize(levels, edges) * gain, edges)
    return lut


TEMPLATE_BLOCK = 64  # beats sharing one template: a wearable refreshes it every ~50 s, not every beat


def beat_templates(waves_mv: np.ndarray, beats: int, block: int = TEMPLATE_BLOCK) -> np.ndarray:
    """The patient's typical beat before each block of beats: sample-wise median of earlier beats.

    A ventricular beat is "wide and unlike this patient's usual beat"; a bundle-branch-block
    patient's normal beats are wide too. A model that sees the patient's template beside the
    beat can compare, instead of remembering what the training patients' beats looked like.
    Label-free: every beat of the window counts, whatever its class (normal beats dominate
    almost every record, so the median is their shape).

    Block ``b`` (beats ``b * block ..``) gets the median over beats ``[s - beats, s)``, with
    ``s = b * block``: causal. Blocks starting before ``beats`` beats share the median of the
    record's first ``beats`` beats (a wearable's warm-up; they include the block's own beats).

    Args:
        waves_mv (np.ndarray): (n_beats, W) float waveform of every beat in mV.
        beats (int): beats in the median (>= 1).
        block (int): beats per block (>= 1).

    Returns:
        np.ndarray: (n_blocks, W) float64 templates; beat ``j`` uses row ``j // block``.
    """
    n = int(waves_mv.shape[0])
    out = np.empty((max(1, -(-n // block)), waves_mv.shape[1]))
    for b in range(out.shape[0]):
        s = b * block
        lo, hi = (s - beats, s) if s >= beats else (0, min(n, beats))
        out[b] = np.median(waves_mv[lo:hi], axis=0) if hi > lo else 0.0
    return out


def _crop(params: TokenizerParams, beat_samples: Optional[int]) -> Tuple[int, int]:
    """(samples kept per beat, offset of the first in the tokenizer's window).

    The crop keeps the R peak at a third of the kept samples, where the tokenizer puts it in
    its window (P wave before, T wave after).
    """
    w = int(params.window)
    n = w if beat_samples is None else int(beat_samples)
    if not 16 <= n <= w:
        raise ValueError(f"beat_samples must be 16..{w} (the shards' samples per beat), got {beat_samples}")
    return n, min(max(0, params.pre - n // 3), w - n)


def _crop_second(params: TokenizerParams, samples: int) -> Tuple[int, int]:
    """(second-lead samples shown, offset of the first in the tokenizer's window): R at 0.4 of them."""
    w, n = int(params.window), int(samples)
    if not 8 <= n <= w:
        raise ValueError(f"second_lead must be 8..{w} (the shards' samples per beat), got {samples}")
    return n, int(np.clip(int(params.pre) - round(0.4 * n), 0, w - n))


def lead_amplitude_lut(windows: np.ndarray, vocab: Vocabulary, target_mv: float = 1.0) -> np.ndarray:
    """Token map that rescales a record's second lead so its median QRS amplitude is ``target_mv``.

    :func:`amplitude_lut`'s rule for a lead whose beats are not aligned on their own R peak (the
    positions are the first lead's): per beat the largest ``|mV|`` within 50 ms of the R position
    (V1's deep S wave, a V5 R wave), the median over the record's beats, the factor clipped to 0.25..4.

    Args:
        windows (np.ndarray): (n_beats, W) the lead's sample tokens (the shards' ``lead2``).
        vocab (Vocabulary): the shards' vocabulary (``samples`` scheme).
        target_mv (float): median QRS amplitude after scaling.

    Returns:
        np.ndarray: (vocab size,) int64 map, identity except on waveform levels.
    """
    edges, pre = quantizer_edges(vocab.params), int(vocab.params.pre)
    half = max(1, round(0.05 * float(vocab.params.target_rate)))  # 50 ms: 6 samples at 128 Hz
    qrs = np.asarray(windows[:, max(0, pre - half) : pre + half + 1], np.int64)  # (n_beats, 2 * half + 1)
    peak = np.abs(dequantize(qrs - vocab.sample_base, edges)).max(axis=1) if qrs.size else np.zeros(0)
    med = float(np.median(peak)) if peak.size else 0.0
    return gain_lut(vocab, edges, float(np.clip(target_mv / med, 0.25, 4.0)) if med > 0 else 1.0)


class _BeatTables:
    """Beat tables of the chosen records, concatenated, and lazily opened token maps."""

    def __init__(self, manifest: Dict[str, Any], records: List[str]) -> None:
        self.dir = Path(manifest["_dir"])
        by_name = {r["record"]: r for r in manifest["records"]}
        self.meta = [by_name[r] for r in records]
        self.names = list(records)
        tables = [np.asarray(np.load(self.dir / m["outputs"]["beats"]["file"], mmap_mode="r")) for m in self.meta]
        self.tables = tables
        self._maps: Dict[int, np.ndarray] = {}
        self._lead2: Dict[int, np.ndarray] = {}

    def tokens(self, i: int) -> np.ndarray:
        m = self._maps.get(i)
        if m is None:
            m = self._maps[i] = open_token_shard(self.dir, self.meta[i])
        return m

    def lacking_lead2(self) -> List[str]:
        """Records whose shards hold no second lead (tokenized without ``--second-lead``)."""
        return [n for n, m in zip(self.names, self.meta) if "lead2" not in m["outputs"]]

    def lead2(self, i: int) -> np.ndarray:
        """(n_beats, W) record ``i``'s second-lead sample tokens, row ``j`` the window of beat ``j``."""
        m = self._lead2.get(i)
        if m is None:
            m = self._lead2[i] = np.load(self.dir / self.meta[i]["outputs"]["lead2"]["file"], mmap_mode="r")
        return m

    def __getstate__(self) -> Dict[str, Any]:  # DataLoader workers re-open the maps
        state = dict(self.__dict__)
        state["_maps"], state["_lead2"] = {}, {}
        return state


class ECGBeatClassificationDataset(Dataset):
    """One example per target beat: signal-only context and beat, then the AAMI class token.

    The prompt's inputs are :class:`~hlmtune.data_builders.beat_prompt.BeatPromptOptions` (each
    field documented there), the draw of an epoch's beats is a
    :class:`~hlmtune.data_builders.beat_prompt.BeatDraw`; :meth:`example` assembles one prompt
    with :func:`~hlmtune.data_builders.beat_prompt.assemble_prompt`.

    Args:
        manifest (Dict): the shards' manifest (``read_manifest``).
        records (List[str]): records to read (already split-checked).
        prompt (BeatPromptOptions): what the prompt shows and how training varies it.
        draw (BeatDraw): the classes and the draw of an epoch's examples.
        beat_mask (Optional[Dict[str, np.ndarray]]): per record, which beats are targets.
        labels (Optional[Dict[str, np.ndarray]]): per record, each beat's class id in place of
            the beat table's (the reference class of a detected beat, ``hlmtune eval --beats
            detector``); never part of a prompt.

    Raises:
        ValueError: annotation shards (their tokens are labels), no RR bins, no examples, an
            option that needs a class the draw does not target.
    """

    def __init__(
        self,
        manifest: Dict[str, Any],
        records: List[str],
        *,
        prompt: BeatPromptOptions,
        draw: BeatDraw,
        beat_mask: Optional[Dict[str, np.ndarray]] = None,
        labels: Optional[Dict[str, np.ndarray]] = None,
    ) -> None:
        params = _samples_params(manifest)
        o = self.options = prompt
        self.draw = draw
        self.vocab = Vocabulary(params)
        self.params = params
        self.context_beats = int(o.context_beats)
        self.beats = _BeatTables(manifest, records)
        self.classes, class_ids = _target_classes(self.vocab, draw.classes)
        self.normalized_rr = bool(o.normalized_rr)
        # per record: (n_beats,) RR token of every beat, absolute or relative to the patient's rhythm
        self.rr_tokens = [normalized_rr_tokens(t, self.vocab, int(o.normalized_rr), o.rr_reference) if o.normalized_rr
                          else self.vocab.rr_base + t["rr_bin"].astype(np.int64) for t in self.beats.tables]
        # per record: (n_beats, F) the rhythm feature tokens after the beat (local, window average)
        self.features = [self._feature_tokens(i, o) for i in range(len(self.beats.tables))]
        # per record: (n_beats,) the beat's own interval against the long reference (long_rr) as an RR
        # token, and the factor that turns a shown own interval (s, as its RR token writes it) into
        # that ratio at 0.8 s, for examples whose interval is drawn (synthetic premature, fibrillating;
        # None where none is, evaluation among them)
        self.long_tokens, self.long_scale = self._long_rr(o) if o.long_rr else (None, None)
        self.amp = ([amplitude_lut(t, self.beats.tokens(i), self.vocab) for i, t in enumerate(self.beats.tables)]
                    if o.normalize_amplitude else None)
        self.beat_samples, self.offset = _crop(params, o.beat_samples)
        self.per_beat = 1 + 1 + int(params.window)  # <sep> rr q*W in the shard
        self.block = BeatBlock(self.beat_samples + int(o.second_lead), next_rr=bool(o.next_rr),  # the target's layout
                               features=o.rhythm_features)
        self.augment, self.seed, self._edges = bool(o.augment), int(draw.seed), quantizer_edges(params)
        self._rr_edges = rr_edges(params)  # (rr_bins + 1,) s: the RR grid of every RR token
        # (rr_bins,) each RR bin's midpoint over the standard cycle: the ratio a normalized token stands for
        self._rr_mids = 0.5 * (self._rr_edges[:-1] + self._rr_edges[1:]) / NORMAL_RR_S
        # per record: (n_blocks, W) token ids of the patient's typical beat (amplitude-normalized if asked)
        self.templates = [self._templates(i, int(o.template_beats)) for i in range(len(self.beats.tables))] \
            if o.template_beats else None
        self._second_lead_setup(o)
        # per record: (n_beats,) p_wave_beats' token: how alike the earlier beats' P waves are (None: off)
        self.p_wave = ([self._p_wave_tokens(i, int(o.p_wave_beats)) for i in range(len(self.beats.tables))]
                       if o.p_wave_beats else None)
        self.template_swap = float(o.template_swap)
        self.previous_swap = float(o.previous_swap)
        self.next_rr = bool(o.next_rr)
        self.template_delta = bool(o.template_delta)
        self.show_template = bool(o.show_template)
        self.query_id = self.vocab.ids["<beat?>"]
        self.unknown_rr = self.vocab.rr_base + int(params.rr_bins)
        self.rec, self.beat, self.label = self._targets(class_ids, beat_mask, labels)
        if self.label.size == 0:
            raise ValueError(f"no beats of classes {self.classes} in records {records}")
        self.index = balanced_indices(self.label, balance=draw.balance, num_examples=draw.num_examples,
                                      seed=draw.seed, groups=self.rec, group_balance=draw.record_balance,
                                      weights=self._draw_weights(draw))
        if o.premature_synth and not ("N" in self.classes and "S" in self.classes):
            raise ValueError(f"premature_synth turns N examples into S examples: classes {self.classes} need both")
        if o.irregular_synth and "N" not in self.classes:
            raise ValueError(f"irregular_synth shows N examples in an irregular rhythm: classes {self.classes} lack N")
        self.synthetic, self.irregular = self._synthetic_draws(o)
        self.irregular_no_p_wave = bool(o.irregular_no_p_wave)
        self.rr_target = bool(o.rr_target)
        self.augment_stretch = float(o.augment_stretch)

    def _second_lead_setup(self, o: BeatPromptOptions) -> None:
        """``second_lead``'s crop, and per record its amplitude map and templates (None where off)."""
        self.second_lead = int(o.second_lead)
        self.amp2: Optional[List[np.ndarray]] = None
        self.templates2: Optional[List[np.ndarray]] = None
        if not self.second_lead:
            return
        lacking = self.beats.lacking_lead2()
        if lacking:
            raise ValueError(
                f"second_lead shows the second lead's samples, but the shards in {self.beats.dir} hold none for "
                f"{len(lacking)} record(s) ({', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}): tokenize "
                "them with `hlmtune tokenize --second-lead`")
        self.n2, self.off2 = _crop_second(self.params, self.second_lead)
        n = len(self.beats.tables)
        if o.normalize_amplitude:
            self.amp2 = [lead_amplitude_lut(self.beats.lead2(i), self.vocab) for i in range(n)]
        if o.template_beats:  # (n_blocks, W) per record: the second lead's typical beat, as the first's
            self.templates2 = []
            for i in range(n):
                v = np.asarray(self.beats.lead2(i), np.int64)  # (n_beats, W)
                v = v if self.amp2 is None else self.amp2[i][v]
                self.templates2.append(self._template_tokens(dequantize(v - self.vocab.sample_base, self._edges),
                                                             int(o.template_beats)))

    def _second_lead_samples(self, i: int, j: int, j_target: int, shift: int, gain: Optional[np.ndarray],
                             stretch: float, template_shown: bool) -> np.ndarray:
        """(second_lead,) the second lead's sample tokens of beat ``j`` of record ``i`` as shown.

        ``j_target`` is the target beat (its template block), ``j`` the beat whose samples are shown
        (the previous one under ``previous_swap``); ``shift``, ``gain`` and ``stretch`` are the first
        lead's training variations of this example (0, None, 0: none), ``template_shown`` whether the
        template stands in for the beat (``template_swap``).
        """
        w, n2, pre = int(self.params.window), self.n2, int(self.params.pre)
        o2 = int(np.clip(self.off2 + shift, 0, w - n2))
        v = np.asarray(self.beats.lead2(i)[j, o2 : o2 + n2], np.int64)  # (n2,)
        if self.amp2 is not None:
            v = self.amp2[i][v]
        t = (self.templates2[i][j_target // TEMPLATE_BLOCK, self.off2 : self.off2 + n2]
             if self.templates2 is not None else None)  # (n2,) unshifted: the reference
        if gain is not None:
            v, t = gain[v], (None if t is None else gain[t])
        if stretch:
            v = self._stretched(v, pre - o2, stretch)
            t = None if t is None else self._stretched(t, pre - self.off2, stretch)
        if template_shown and t is not None:
            v = t
        if self.template_delta and t is not None:  # unlike this patient's usual beat in this lead, in mV
            v = self._delta(v, t)
        return np.asarray(v, np.int64)

    def _draw_weights(self, draw: BeatDraw) -> Optional[np.ndarray]:
        """(n_candidates,) draw weight of each candidate beat: ``early_n_weight`` for N beats whose
        own RR token is early (ratio under :data:`EARLY_N_RATIO` to the running reference), 1 for
        every other; None (the plain draw) at weight 1. Reads the label (what the example answers)
        and the RR token (what it shows), never adds to the prompt."""
        if float(draw.early_n_weight) == 1.0:
            return None
        if not self.normalized_rr:
            raise ValueError("early_n_weight needs normalized_rr (early is judged against the running reference)")
        if "N" not in self.classes:
            raise ValueError(f"early_n_weight weights N examples: classes {self.classes} lack N")
        ratio = self.rr_ratios(self._own_rr(np.arange(self.rec.size)))  # NaN where unknown: not early
        early_n = (self.label == self.vocab.classes.index("N")) & (ratio < EARLY_N_RATIO)
        return np.where(early_n, float(draw.early_n_weight), 1.0)

    def _feature_tokens(self, i: int, o: BeatPromptOptions) -> np.ndarray:
        """(n_beats, F) record ``i``'s rhythm feature tokens (``local_rr``, ``average_rr_s``), each
        written as the prompt's other RR tokens are (absolute, or relative to the running reference)."""
        t, fs = self.beats.tables[i], float(self.beats.meta[i]["fs"])
        if not (o.local_rr or o.average_rr_s):  # the shipped prompts: no second pass of the running reference
            return np.zeros((t.size, 0), np.int64)
        ref = running_reference(t, int(o.normalized_rr), o.rr_reference) if o.normalized_rr else None
        cols = []
        for on, values in ((o.local_rr, lambda: local_average_rr(t, int(o.local_rr))),
                           (o.average_rr_s, lambda: window_average_rr(t, float(o.average_rr_s), fs))):
            if on:
                v = values()  # input samples
                cols.append(interval_tokens(v if ref is not None else v / fs, self.vocab, ref))
        return np.stack(cols, axis=1) if cols else np.zeros((t.size, 0), np.int64)

    def _long_rr(self, o: BeatPromptOptions) -> Tuple[List[np.ndarray], Optional[List[np.ndarray]]]:
        """Per record: ``long_rr``'s token of each beat, and the scale from a shown own interval to it.

        The token is ``rr / long * 0.8 s`` (:func:`long_rr_tokens`). The own RR token shows
        ``rr / ref * 0.8`` with ``normalized_rr`` (``ref`` its running reference) and ``rr / fs``
        without, so the scale is ``ref / long`` or ``0.8 * fs / long``; computed only where
        examples are drawn (``premature_synth``, ``irregular_synth``), else None.
        """
        drawn = bool(o.premature_synth or o.irregular_synth)
        tokens, scales = [], []
        for i, t in enumerate(self.beats.tables):
            long = long_reference(t, int(o.long_rr))  # (n_beats,) input samples
            tokens.append(long_rr_tokens(t, self.vocab, int(o.long_rr), reference=long))
            if drawn:
                shown = (running_reference(t, int(o.normalized_rr), o.rr_reference) if o.normalized_rr
                         else np.full(t.size, NORMAL_RR_S * float(self.beats.meta[i]["fs"])))
                with np.errstate(invalid="ignore", divide="ignore"):
                    scales.append(shown / long)
        return tokens, scales if drawn else None

    def _waves_mv(self, i: int, lut: Optional[np.ndarray] = None) -> np.ndarray:
        """(n_beats, W) record ``i``'s beat windows in mV, as the shard holds them (through ``lut``,
        a token-to-token map such as :func:`amplitude_lut`'s, when given)."""
        t, w = self.beats.tables[i], int(self.params.window)
        idx = t["token_start"].astype(np.int64)[:, None] + 2 + np.arange(w)  # (n_beats, W): skip <sep> rr
        waves = self.beats.tokens(i)[idx].astype(np.int64)
        if lut is not None:
            waves = lut[waves]
        return dequantize(waves - self.vocab.sample_base, self._edges)

    def _p_wave_tokens(self, i: int, beats: int) -> np.ndarray:
        """(n_beats,) record ``i``'s ``p_wave_beats`` token of each beat (:func:`p_wave_regularity`)."""
        values = p_wave_regularity(self._waves_mv(i), pre=int(self.params.pre), fs=float(self.params.target_rate),
                                   beats=beats)
        return p_wave_tokens(values, rr_base=self.vocab.rr_base, rr_bins=int(self.params.rr_bins))

    def _p_wave_token(self, k: int) -> int:
        """Example ``k``'s ``p_wave_beats`` token: the record's, or a fibrillating context's for an
        ``irregular_no_p_wave`` example (its beat and template lost their P wave too)."""
        e = int(self.index[k])
        if self.irregular_no_p_wave and self.irregular[k]:
            lo, hi = FIBRILLATING_P_REGULARITY
            v = np.random.default_rng((self.seed, k, 5)).uniform(lo, hi)
            return int(p_wave_tokens(np.array([v]), rr_base=self.vocab.rr_base, rr_bins=int(self.params.rr_bins))[0])
        return int(self.p_wave[int(self.rec[e])][int(self.beat[e])])

    def _long_token(self, k: int, own: int) -> int:
        """Example ``k``'s ``long_rr`` token: the record's, or from its shown own interval when drawn."""
        e = int(self.index[k])
        i, j = int(self.rec[e]), int(self.beat[e])
        if not (self.synthetic[k] or self.irregular[k]):
            return int(self.long_tokens[i][j])
        shown, scale = self._intervals_s([own]), float(self.long_scale[i][j])  # (0 or 1,) s: the bin middle
        if shown.size == 0 or not np.isfinite(scale):
            return self.unknown_rr
        return int(self.vocab.rr_base + rr_bin(shown * scale, self._rr_edges)[0])

    def _targets(self, class_ids: np.ndarray, beat_mask: Optional[Dict[str, np.ndarray]],
                 override: Optional[Dict[str, np.ndarray]] = None) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(record index, beat index, label id) of every candidate target beat, record by record."""
        rec_idx, beat_idx, labels = [], [], []
        for i, (name, t) in enumerate(zip(self.beats.names, self.beats.tables)):
            lab = override[name] if override is not None else t["label"]
            ok = np.isin(lab, class_ids)
            if beat_mask is not None:
                ok &= beat_mask[name]
            j = np.flatnonzero(ok)
            rec_idx.append(np.full(j.size, i, np.int64))
            beat_idx.append(j)
            labels.append(np.asarray(lab)[j].astype(np.int64))
        if not rec_idx:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(rec_idx), np.concatenate(beat_idx), np.concatenate(labels)

    def _own_rr(self, cand: np.ndarray) -> np.ndarray:
        """(n,) the own RR token (as :attr:`rr_tokens` holds it) of candidates ``cand`` (n,), indices
        into :attr:`rec` / :attr:`beat`: one gather over the records' tokens laid end to end."""
        starts = np.cumsum([0] + [len(x) for x in self.rr_tokens])[:-1]  # (n_records,) offsets in the flat array
        return np.concatenate(self.rr_tokens)[starts[self.rec[cand]] + self.beat[cand]]

    def _synthetic_draws(self, o: BeatPromptOptions) -> Tuple[np.ndarray, np.ndarray]:
        """(len,) which examples are shown as a synthetic premature beat (label S) and which inside
        a synthetic fibrillating rhythm (label N); drawn once, so every epoch shows the same."""
        e = self.index
        # drawn N examples whose own interval is known (a record's first beat has none to redraw)
        n_known = np.zeros(e.size, bool)
        if o.premature_synth or o.irregular_synth:
            n_known = (self.label[e] == self.vocab.classes.index("N")) & (self._own_rr(e) < self.unknown_rr)
        synthetic = n_known & (np.random.default_rng((self.seed, 3)).random(e.size) < float(o.premature_synth))
        if o.premature_max_irregularity is not None:
            for k in np.flatnonzero(synthetic):  # the drawn beats only: a few thousand
                r, b = int(self.rec[e[k]]), int(self.beat[e[k]])
                # s, the context's known intervals (relative with normalized_rr: a ratio is what counts)
                mids = self._intervals_s(self.rr_tokens[r][max(0, b - self.context_beats) : b])
                synthetic[k] = rhythm_irregularity(mids) <= float(o.premature_max_irregularity)
        irregular = (n_known & ~synthetic
                     & (np.random.default_rng((self.seed, 6)).random(e.size) < float(o.irregular_synth)))
        return synthetic, irregular

    def _templates(self, i: int, beats: int) -> np.ndarray:
        """(n_blocks, W) template token ids of record ``i`` (:func:`beat_templates`)."""
        return self._template_tokens(self._waves_mv(i, None if self.amp is None else self.amp[i]), beats)

    def _template_tokens(self, waves_mv: np.ndarray, beats: int) -> np.ndarray:
        """(n_blocks, W) token ids of :func:`beat_templates` over one lead's (n_beats, W) windows in mV."""
        return self.vocab.sample_base + quantize(beat_templates(waves_mv, beats), self._edges)

    def _delta(self, samples: np.ndarray, template: np.ndarray) -> np.ndarray:
        """``samples - template`` (sample tokens, same shape) in mV, quantized again: ``template_delta``."""
        base, edges = self.vocab.sample_base, self._edges
        return base + quantize(dequantize(samples - base, edges) - dequantize(template - base, edges), edges)

    def __len__(self) -> int:
        return int(self.index.size)

    def label_of(self, k: int) -> str:
        """Class name of example ``k`` (S for a synthetic premature beat)."""
        return "S" if self.synthetic[k] else self.vocab.classes[int(self.label[self.index[k]])]

    def record_of(self, k: int) -> str:
        """Record (patient) of example ``k``'s target beat."""
        return self.beats.names[int(self.rec[self.index[k]])]

    # Intervals of a synthetic premature beat relative to the patient's cycle (the median RR of
    # the prompt's context, see _premature): an isolated atrial premature beat comes at 55-85% of
    # the cycle and is followed by a pause longer than the cycle (1.05-1.5x) that is not fully
    # compensatory (both together < 1.95 cycles).
    PREMATURE_RATIO = (0.55, 0.85)
    PAUSE_RATIO = (1.05, 1.5)

    # Spread of a synthetic fibrillating rhythm: each interval is the cycle times exp(N(0, sigma)),
    # sigma drawn per example. A successive difference is then about cycle * N(0, 2 sigma^2), and
    # the median of |N(0, s^2)| is 0.674 s, so rhythm_irregularity (median |d| / median interval)
    # is about 0.674 * sqrt(2) * sigma = 0.95 sigma (0.96 in simulation). The range matches the
    # N beats of DS1's atrial fibrillation and flutter (records 201 and 203, 3,389 beats, 16
    # intervals before each): irregularity 0.15 (10th percentile) to 0.45 (90th), median 0.27;
    # sinus rhythm: a few percent. (Until 2026-11-26 this was 0.08-0.2, from a derivation that
    # counted sqrt(2) twice: an irregularity of 0.08-0.19, milder than most of DS1's fibrillation.)
    IRREGULAR_SIGMA = (0.15, 0.45)

    def _intervals_s(self, rr_tokens: Sequence[int]) -> np.ndarray:
        """The known intervals among ``rr_tokens`` in s (bin middles); unknown ones are dropped."""
        bins = np.asarray(rr_tokens, np.int64) - self.vocab.rr_base
        bins = bins[(bins >= 0) & (bins < int(self.params.rr_bins))]
        return 0.5 * (self._rr_edges[bins] + self._rr_edges[bins + 1])

    def _cycle_s(self, rr_tokens: Sequence[int]) -> float:
        """The patient's cycle in s: median of the known intervals among ``rr_tokens`` (the beat's own at least)."""
        return float(np.median(self._intervals_s(rr_tokens)))

    def _irregular(self, k: int, rr_tokens: Sequence[int]) -> List[int]:
        """``rr_tokens`` (context, the beat's own, the following) redrawn as a fibrillating rhythm.

        Every known interval becomes ``cycle * exp(N(0, sigma))`` around the cycle of
        :meth:`_cycle_s`, ``sigma`` drawn from :attr:`IRREGULAR_SIGMA` per example; unknown
        intervals (a record's first or last beat) stay unknown. The beat itself may come early
        or late by chance: in fibrillation that is what a normally conducted beat does.

        Args:
            k (int): example index (seeds the draw).
            rr_tokens (Sequence[int]): RR tokens of the context beats, the beat and the next one.

        Returns:
            List[int]: the same number of RR tokens.
        """
        rng = np.random.default_rng((self.seed, k, 5))
        sigma = rng.uniform(*self.IRREGULAR_SIGMA)
        toks = np.asarray(rr_tokens, np.int64)
        known = (toks >= self.vocab.rr_base) & (toks < self.unknown_rr)
        secs = self._cycle_s(toks[known]) * np.exp(rng.normal(0.0, sigma, int(known.sum())))
        toks[known] = self.vocab.rr_base + rr_bin(secs, self._rr_edges)
        return toks.tolist()

    # A synthetic fibrillating beat without its P wave (irregular_no_p_wave). In atrial
    # fibrillation the atria never contract together, so no P wave comes before the QRS; low
    # fibrillatory (f) waves at 4-9 Hz (ecg_tokenizer.synth sums three in that band) run through the
    # whole cycle instead, a few hundredths to a tenth of a mV in lead MLII (below the 1 mV R
    # that normalize_amplitude sets). The P wave and PR segment lie in the 0.25 s shown before R
    # up to the QRS onset, ~0.05 s before R (half a QRS of 0.08-0.10 s).
    P_WAVE_END_S = 0.05
    FIB_WAVE_HZ = (4.0, 9.0)
    FIB_WAVE_MV = (0.02, 0.08)  # peak amplitude: 0.04-0.16 mV peak to peak

    def _flat_p(self, samples_mv: np.ndarray, r: int) -> np.ndarray:
        """``samples_mv`` (n,) with the P wave gone: a straight line from the first sample to the QRS onset.

        Args:
            samples_mv (np.ndarray): (n,) one beat (or template) in mV.
            r (int): index of the R peak in ``samples_mv``.

        Returns:
            np.ndarray: (n,) a copy; unchanged when the QRS onset is not after the first sample.
        """
        out = np.array(samples_mv, np.float64)
        end = r - int(round(self.P_WAVE_END_S * float(self.params.target_rate)))  # QRS onset
        if 0 < end < out.size:
            out[: end + 1] = np.linspace(out[0], out[end], end + 1)  # baseline, drift kept, no P wave
        return out

    def _fibrillating_waveform(self, k: int, beat: np.ndarray, r_beat: int, tmpl: np.ndarray,
                               r_tmpl: int) -> Tuple[np.ndarray, np.ndarray]:
        """Sample tokens of example ``k``'s beat and template as in atrial fibrillation.

        Both lose their P wave (:meth:`_flat_p`): a patient in fibrillation has none in the
        median beat either. The beat gets f waves over all its samples (amplitude, rate and
        phase drawn per example); the template none (a median over beats averages them out).

        Args:
            k (int): example index (seeds the draw).
            beat (np.ndarray): (n,) the beat's sample tokens.
            r_beat (int): index of R in ``beat``.
            tmpl (np.ndarray): (n,) the template's sample tokens (may be empty).
            r_tmpl (int): index of R in ``tmpl``.

        Returns:
            Tuple[np.ndarray, np.ndarray]: the beat's and the template's new sample tokens.
        """
        base, edges = self.vocab.sample_base, self._edges
        rng = np.random.default_rng((self.seed, k, 7))
        amp, hz, phase = rng.uniform(*self.FIB_WAVE_MV), rng.uniform(*self.FIB_WAVE_HZ), rng.uniform(0, 2 * np.pi)
        t = np.arange(beat.size) / float(self.params.target_rate)  # s
        mv = self._flat_p(dequantize(beat - base, edges), r_beat) + amp * np.sin(2 * np.pi * hz * t + phase)
        new_beat = base + quantize(mv, edges)
        new_tmpl = base + quantize(self._flat_p(dequantize(tmpl - base, edges), r_tmpl), edges) if tmpl.size else tmpl
        return new_beat.astype(np.int64), np.asarray(new_tmpl, np.int64)

    def _premature(self, k: int, rr_tokens: Sequence[int]) -> Tuple[int, int]:
        """RR tokens (before, after) of example ``k`` shown as a supraventricular premature beat.

        The waveform stays the N beat's own (normal conduction: what an S beat looks like);
        only its timing changes, so every training patient contributes S examples that are
        S by prematurity, not by the few patients with recorded S beats. The cycle is the
        median of the known intervals of the context and the beat (a beat right after an
        ectopic one has a long interval of its own); the draw in ``__init__`` takes only beats
        whose own interval is known.

        Args:
            k (int): example index (seeds the draw).
            rr_tokens (Sequence[int]): RR tokens of the context beats and of the beat itself.

        Returns:
            Tuple[int, int]: RR tokens before and after the beat.
        """
        edges = self._rr_edges
        cycle = self._cycle_s(rr_tokens)  # s, bin middles
        rng = np.random.default_rng((self.seed, k, 4))
        pre = rng.uniform(*self.PREMATURE_RATIO)
        post = min(rng.uniform(*self.PAUSE_RATIO), 1.95 - pre)
        before, after = rr_bin(np.array([pre * cycle, post * cycle]), edges)
        return int(self.vocab.rr_base + before), int(self.vocab.rr_base + after)

    def stretch_factor(self, k: int) -> float:
        """Time-scale factor of example ``k`` (1.0 without ``augment_stretch``).

        Log-uniform in ``[1 / (1 + a), 1 + a]``: a stretch and its inverse are equally likely,
        so the patients' mean beat duration is kept.
        """
        if not self.augment_stretch:
            return 1.0
        a = np.log1p(self.augment_stretch)
        return float(np.exp(np.random.default_rng((self.seed, k, 8)).uniform(-a, a)))

    def _stretched(self, samples: np.ndarray, r: int, factor: float) -> np.ndarray:
        """Sample tokens stretched in time by ``factor`` around index ``r`` (the R peak).

        The output sample at ``x`` takes the waveform at ``r + (x - r) / factor`` (linear
        interpolation in mV, the ends held beyond the window): a factor above 1 widens the QRS
        and moves the P and T waves away from R, as a slower conduction would. The R sample is
        kept. Applied with one factor to the beat and the template, so their difference
        (``template_delta``) still says whether the beat is unlike the patient's usual one,
        while the template's exact shape, which the model could otherwise memorize per
        training patient, changes from example to example.

        Args:
            samples (np.ndarray): (n,) sample tokens (may be empty).
            r (int): index of the R peak in ``samples``.
            factor (float): time-scale factor.

        Returns:
            np.ndarray: (n,) sample tokens.
        """
        if samples.size == 0:
            return samples
        base, edges = self.vocab.sample_base, self._edges
        x = np.arange(samples.size, dtype=np.float64)
        mv = np.interp(r + (x - r) / factor, x, dequantize(samples - base, edges))  # (n,) mV
        return (base + quantize(mv, edges)).astype(np.int64)

    def _waveform(self, k: int) -> Tuple[np.ndarray, np.ndarray]:
        """Example ``k``'s target beat ``<sep> rr(i) q...q`` (shard RR token) and template samples,
        with every waveform option and training-time variation applied."""
        e = int(self.index[k])
        i, j = int(self.rec[e]), int(self.beat[e])
        t = self.beats.tables[i]
        s = int(t["token_start"][j])
        beat = self.beats.tokens(i)[s : s + self.per_beat].astype(np.int64)  # <sep> rr(i) q*W
        shown = j  # the beat whose samples are shown
        if self.previous_swap and j > 0 and self.vocab.classes[int(self.label[e])] in ("N", "S") \
                and np.random.default_rng((self.seed, k, 2)).random() < self.previous_swap:
            p = int(t["token_start"][j - 1])  # the previous beat's samples (real, not a median): only RR differs
            beat = np.concatenate([beat[:2], self.beats.tokens(i)[p + 2 : p + self.per_beat].astype(np.int64)])
            shown = j - 1
        off = self.offset
        rng = np.random.default_rng((self.seed, k)) if self.augment else None
        if rng is not None:  # shift the crop by up to 2 samples (16 ms) either way, within the window
            off = int(np.clip(off + rng.integers(-2, 3), 0, self.per_beat - 2 - self.beat_samples))
        if self.beat_samples < self.per_beat - 2 or off != self.offset:  # <sep> rr(i) and the kept samples
            beat = np.concatenate([beat[:2], beat[2 + off : 2 + off + self.beat_samples]])
        if self.amp is not None:
            beat = self.amp[i][beat]  # the record's waveform at a common R amplitude
        tmpl = (self.templates[i][j // TEMPLATE_BLOCK, self.offset : self.offset + self.beat_samples]
                if self.templates is not None else beat[:0])  # (beat_samples,) unshifted: the reference
        lut, f, swapped = None, 0.0, False
        if rng is not None:  # gain 0.7..1.4 (log-uniform): no patient is recognised by amplitude alone
            lut = gain_lut(self.vocab, self._edges, float(np.exp(rng.uniform(np.log(0.7), np.log(1.4)))))
            beat, tmpl = lut[beat], lut[tmpl]  # one gain for the patient's beat and template
        if self.augment_stretch:  # one time scale for the beat and its template (R kept in place)
            f = self.stretch_factor(k)
            beat = np.concatenate([beat[:2], self._stretched(beat[2:], int(self.params.pre) - off, f)])
            tmpl = self._stretched(tmpl, int(self.params.pre) - self.offset, f)
        if self.template_swap and self.vocab.classes[int(self.label[e])] in ("N", "S") \
                and np.random.default_rng((self.seed, k, 1)).random() < self.template_swap:
            beat = np.concatenate([beat[:2], tmpl])  # a normal-looking beat: only the RR tells N from S
            swapped = True
        if self.irregular_no_p_wave and self.irregular[k]:  # fibrillation: no P wave, f waves (label N)
            q, tmpl = self._fibrillating_waveform(k, beat[2:], int(self.params.pre) - off, tmpl,
                                                  int(self.params.pre) - self.offset)
            beat = np.concatenate([beat[:2], q])
        if self.template_delta:  # what differs from the patient's usual beat, in mV, quantized again
            beat = np.concatenate([beat[:2], self._delta(beat[2:], tmpl)])  # (2 + beat_samples,)
        if self.second_lead:  # <sep> rr(i) q*beat_samples v*second_lead
            beat = np.concatenate([beat, self._second_lead_samples(i, shown, j, off - self.offset, lut, f, swapped)])
        return beat, tmpl

    def _timing(self, k: int, shard_rr: int) -> Tuple[List[int], int, int]:
        """Example ``k``'s RR tokens as shown: (context, the beat's own, the following).

        With ``normalized_rr``, relative to the running reference (``rr_reference`` over that many
        intervals; the shard holds the absolute RR); redrawn for a synthetic premature beat
        (:meth:`_premature`) or fibrillating rhythm (:meth:`_irregular`).
        """
        e = int(self.index[k])
        i, j = int(self.rec[e]), int(self.beat[e])
        rr = self.rr_tokens[i]
        own = int(rr[j]) if self.normalized_rr else int(shard_rr)
        ctx = rr[max(0, j - self.context_beats) : j].tolist()  # earlier beats: RR only
        after = int(rr[j + 1]) if j + 1 < self.beats.tables[i].size else self.unknown_rr
        if self.synthetic[k]:  # a normal beat made premature (label S): see _premature
            own, after = self._premature(k, ctx + [own])
        elif self.irregular[k]:  # a normal beat inside a synthetic fibrillating rhythm (label N): see _irregular
            *ctx, own, after = self._irregular(k, ctx + [own, after])
        return ctx, own, after

    def rr_ratio(self, rr_token: int) -> float:
        """A normalized RR token as a ratio to the running reference RR (NaN: unknown interval).

        The token is the interval at a standard 0.8 s cycle (:func:`normalized_rr_tokens`): its
        bin's midpoint over ``NORMAL_RR_S`` gives the ratio back, to the bin's width.
        """
        b = int(rr_token) - self.vocab.rr_base
        return float(self._rr_mids[b]) if 0 <= b < self._rr_mids.size else float("nan")

    def rr_ratios(self, rr_tokens: np.ndarray) -> np.ndarray:
        """(n,) :meth:`rr_ratio` of each of ``rr_tokens`` (n,), NaN where a token is no RR bin."""
        b = np.asarray(rr_tokens, np.int64) - self.vocab.rr_base
        known = (b >= 0) & (b < self._rr_mids.size)
        return np.where(known, self._rr_mids[np.clip(b, 0, self._rr_mids.size - 1)], np.nan).astype(float)

    def example(self, k: int) -> BeatPrompt:
        """Example ``k``'s prompt, up to and including ``<beat?>``, and where its target beat is."""
        beat, tmpl = self._waveform(k)
        ctx, own, after = self._timing(k, int(beat[1]))
        beat[1] = own
        e = int(self.index[k])
        features = self.features[int(self.rec[e])][int(self.beat[e])].tolist()
        if self.long_tokens is not None:
            features.append(self._long_token(k, own))
        if self.p_wave is not None:
            features.append(self._p_wave_token(k))
        return assemble_prompt(
            template=tmpl.tolist() if self.show_template else [], context_rr=ctx, beat=beat.tolist(),
            next_rr=after if self.next_rr else None, query_id=self.query_id,
            rr_ratio=self.rr_ratio(own) if self.normalized_rr else None, features=features,
        )

    def prompt(self, k: int) -> List[int]:
        """Token ids of example ``k`` up to and including ``<beat?>`` (what the model reads)."""
        return self.example(k).tokens

    def __getitem__(self, k: int) -> Dict[str, List[int]]:
        ex = self.example(k)
        prompt = ex.tokens
        answer = self.vocab.label_base + self.vocab.classes.index(self.label_of(k))
        tokens = prompt + [answer, EOS_ID]
        labels = [IGNORE] * len(prompt) + [answer, IGNORE]
        if self.rr_target and ex.rr_token != self.unknown_rr:
            # torchtune shifts labels by one: the logits at <sep> learn when this beat should
            # come from the context's rhythm (a broad guess in fibrillation, a sharp one in
            # sinus rhythm); the class read at <beat?> can weigh the real interval against it
            labels[ex.target_at + BeatBlock.RR] = ex.rr_token
        return {"tokens": tokens, "labels": labels}


class ECGBeatStreamDataset(Dataset):
    """Windows of consecutive beats of one record; every beat is classified after its own signal.

    One window of ``K`` beats (``K = (max_seq_len - 2) // (beat_samples + 4)``)::

        <bos> [<sep> rr(b) q...q rr(b+1) <beat?>] x K <eos>

    Each bracket is a :class:`~hlmtune.data_builders.beat_prompt.BeatBlock`, the layout of the
    per-beat prompt's target beat. The window differs from that prompt on purpose: its context
    is the earlier beats' own waveforms (no template, no RR-only context), its RR tokens are
    absolute (it takes none of the per-beat prompt's options), and it classifies every beat.

    The class of beat ``b`` is the label of the position after its ``<beat?>``, whose *input*
    token is the next beat's ``<sep>`` (or ``<eos>``): torchtune's recipes shift labels by one
    position, so the logits at ``<beat?>`` are trained towards the class while no class token
    ever enters the input. Earlier beats of the window are the patient's own waveforms: the
    reference morphology that the per-beat prompt lacks (a ventricular beat is "wide and
    different from this patient's normal beats", not different from other patients').

    Training windows are anchored at a class-balanced draw of beats (``balance``); the anchor
    sits at a random position with at least ``context_beats`` beats before it and is always
    labelled; every other beat of the window is labelled with a probability proportional to
    ``count ** (balance - 1)`` of its class (the rarest class always), so labels keep the
    anchors' class shares. Evaluation windows tile each record: every target beat is labelled
    exactly once, with ``context_beats`` earlier beats before it (except at a record's start).

    Args:
        manifest (Dict): the shards' manifest (``read_manifest``).
        records (List[str]): records to read (already split-checked).
        max_seq_len (int): tokens per window (the model's context).
        beat_samples (Optional[int]): samples per beat, cropped from the tokenizer's window with
            the R peak kept at a third (None = the whole window).
        context_beats (int): beats before the first labelled one in evaluation windows and before
            the anchor in training windows.
        classes (Optional[Sequence[str]]): target classes (default: every labelled class).
        balance (Optional[float]): class-share exponent (None = every beat once, as recorded).
        num_examples (Optional[int]): training windows per epoch (default: number of targets).
        seed (int): seed of the draw.
        beat_mask (Optional[Dict[str, np.ndarray]]): per record, which beats are targets.
        evaluation (bool): tile the records instead of drawing anchors.

    Raises:
        ValueError: annotation shards, no RR bins, a window too short for its context, no targets.
    """

    def __init__(
        self, manifest: Dict[str, Any], records: List[str], *, max_seq_len: int, beat_samples: Optional[int],
        context_beats: int, classes: Optional[Sequence[str]], balance: Optional[float],
        num_examples: Optional[int], seed: int, beat_mask: Optional[Dict[str, np.ndarray]] = None,
        evaluation: bool = False,
    ) -> None:
        params = _samples_params(manifest)
        self.vocab, self.params = Vocabulary(params), params
        n, self.offset = _crop(params, beat_samples)
        self.beat_samples = n
        self.block = BeatBlock(n, next_rr=True, query=True)  # the per-beat prompt's target block, K times
        self.per_beat = len(self.block)  # <sep> rr q*n rr_next <beat?>
        self.k = (int(max_seq_len) - 2) // self.per_beat
        self.context_beats = int(context_beats)
        if self.k < self.context_beats + 1:
            raise ValueError(
                f"max_seq_len {max_seq_len} holds {self.k} beats of {self.per_beat} tokens; context_beats "
                f"{context_beats} needs at least {self.context_beats + 1} (raise max_seq_len or lower beat_samples)"
            )
        self.beats = _BeatTables(manifest, records)
        self.classes, class_ids = _target_classes(self.vocab, classes)
        self.query_id = self.vocab.ids["<beat?>"]
        self.unknown_rr = self.vocab.rr_base + int(params.rr_bins)
        self.target = []  # per record: (n_beats,) class index into self.classes, -1 = not a target
        for name, t in zip(self.beats.names, self.beats.tables):
            cls = np.full(t.size, -1, np.int64)
            for c, cid in enumerate(class_ids):
                cls[t["label"] == cid] = c
            if beat_mask is not None:
                cls[~beat_mask[name]] = -1
            self.target.append(cls)
        counts = np.bincount(np.concatenate(self.target + [np.zeros(0, np.int64)]).clip(-1) + 1,
                             minlength=len(self.classes) + 1)[1:]
        if counts.sum() == 0:
            raise ValueError(f"no beats of classes {self.classes} in records {records}")
        self.class_counts = counts
        rng = np.random.default_rng(seed)
        # windows: (record, first beat, number of beats, first labelled beat, anchor beat or -1)
        rows: List[Tuple[int, int, int, int, int]] = []
        if evaluation:
            for i, cls in enumerate(self.target):
                m, s, lab = cls.size, 0, 0
                while lab < m:
                    kk = min(self.k, m - s)
                    if (cls[lab : s + kk] >= 0).any():
                        rows.append((i, s, kk, lab, -1))
                    lab = s + kk
                    s = max(0, lab - self.context_beats)
        else:
            rec = np.concatenate([np.full(c.size, i, np.int64) for i, c in enumerate(self.target)])
            beat = np.concatenate([np.arange(c.size) for c in self.target])
            lab = np.concatenate(self.target)
            ok = lab >= 0
            rec, beat, lab = rec[ok], beat[ok], lab[ok]
            for e in balanced_indices(lab, balance=balance, num_examples=num_examples, seed=seed):
                i, b = int(rec[e]), int(beat[e])
                m = self.target[i].size
                kk = min(self.k, m)
                pos = int(rng.integers(min(self.context_beats, kk - 1), kk))  # anchor's place in the window
                s = min(max(0, b - pos), m - kk)
                rows.append((i, s, kk, s, b))
            rows = [rows[j] for j in rng.permutation(len(rows))]  # anchors come sorted by class
        if not rows:
            raise ValueError(f"no window of records {records} holds a target beat")
        self.windows = np.array(rows, np.int64).reshape(-1, 5)
        # Labels of non-anchor beats kept with probability ~ count**(balance - 1), rarest class 1.
        if balance is None or evaluation:
            self.keep = np.ones(len(self.classes))
        else:
            share = np.where(counts > 0, np.maximum(counts, 1).astype(np.float64) ** (float(balance) - 1.0), 0.0)
            self.keep = share / share.max()
        self.seed = int(seed)

    def __len__(self) -> int:
        return int(self.windows.shape[0])

    def window(self, k: int) -> Tuple[List[int], List[int], List[int]]:
        """Tokens of window ``k`` (what the model reads), and its labelled beats.

        Returns:
            Tuple[List[int], List[int], List[int]]: tokens; for each labelled beat the index of
            its ``<beat?>`` token (whose next-token prediction is the class) and its class index.
        """
        i, s, kk, lab, anchor = (int(x) for x in self.windows[k])
        t, tok, n, pb, lay = self.beats.tables[i], self.beats.tokens(i), self.beat_samples, self.per_beat, self.block
        b = np.arange(s, s + kk)
        ts = t["token_start"][b].astype(np.int64)  # each beat's <sep> in the shard (<sep> rr q*W)
        block = np.empty((kk, pb), np.int64)  # (K, beat_samples + 4): one BeatBlock per beat
        block[:, lay.SEP] = tok[ts]  # <sep>
        block[:, lay.RR] = tok[ts + 1]  # rr(b)
        block[:, lay.WAVE : lay.WAVE + n] = tok[ts[:, None] + 2 + self.offset + np.arange(n)]  # (K, n) cropped waveform
        nxt = np.full(kk, self.unknown_rr, np.int64)
        has_next = b + 1 < t.size
        nxt[has_next] = self.vocab.rr_base + t["rr_bin"][b[has_next] + 1].astype(np.int64)
        block[:, lay.next_rr_at] = nxt  # rr(b+1): the following interval
        block[:, lay.query_at] = self.query_id
        tokens = [BOS_ID] + block.ravel().tolist() + [EOS_ID]
        cls = self.target[i][b]
        labelled = (cls >= 0) & (b >= lab)
        if anchor >= 0:
            u = np.random.default_rng((self.seed, k)).random(kk)
            labelled &= (u < self.keep[cls.clip(0)]) | (b == anchor)
        j = np.flatnonzero(labelled)
        return tokens, (1 + j * pb + lay.query_at).tolist(), cls[j].tolist()

    def record_of(self, k: int) -> str:
        """Record (patient) of window ``k``: every beat it classifies is that record's."""
        return self.beats.names[int(self.windows[k, 0])]

    def __getitem__(self, k: int) -> Dict[str, List[int]]:
        tokens, query_at, cls = self.window(k)
        labels = [IGNORE] * len(tokens)
        for q, c in zip(query_at, cls):
            labels[q + 1] = self.vocab.label_base + self.vocab.classes.index(self.classes[c])
        return {"tokens": tokens, "labels": labels}


class ECGBeatPreferenceDataset(Dataset):
    """DPO pairs over beat-classification prompts: correct class chosen, a confusable one rejected."""

    def __init__(self, base: ECGBeatClassificationDataset) -> None:
        self.base = base
        self.classes = base.vocab.classes

    def __len__(self) -> int:
        return len(self.base)

    def rejected_label(self, k: int) -> str:
        """The wrong answer of pair ``k`` (see ``_REJECT``), always a class the dataset targets."""
        truth = self.base.label_of(k)
        options = [c for c in _REJECT.get(truth, ()) if c in self.base.classes] or [
            c for c in self.base.classes if c != truth
        ]
        return options[k % len(options)]

    def __getitem__(self, k: int) -> Dict[str, List[int]]:
        prompt = self.base.prompt(k)
        v = self.base.vocab
        good = v.label_base + self.classes.index(self.base.label_of(k))
        bad = v.label_base + self.classes.index(self.rejected_label(k))
        mask = [IGNORE] * len(prompt)
        return {
            "chosen_input_ids": prompt + [good, EOS_ID], "chosen_labels": mask + [good, IGNORE],
            "rejected_input_ids": prompt + [bad, EOS_ID], "rejected_labels": mask + [bad, IGNORE],
        }


class ECGAFDataset(Dataset):
    """Segments of consecutive beats -> ``<af>`` / ``<not_af>`` (rhythm annotations, never in the input)."""

    def __init__(
        self, manifest: Dict[str, Any], records: List[str], *, segment_beats: int, stride_beats: Optional[int],
        balance: Optional[float], num_examples: Optional[int], seed: int,
    ) -> None:
        params = TokenizerParams.from_dict(manifest["params"])
        if params.scheme == "samples" and not params.rr_bins:
            raise ValueError(f"AF from samples shards uses the RR tokens: {manifest['_dir']} has --rr-bins 0")
        self.params, self.vocab = params, Vocabulary(params)
        self.segment_beats = int(segment_beats)
        if self.segment_beats < 2:
            raise ValueError(f"segment_beats must be >= 2, got {segment_beats}")
        stride = int(stride_beats or segment_beats)
        self.beats = _BeatTables(manifest, records)
        self.query_id, self.yes_id, self.no_id = (self.vocab.ids[t] for t in ("<af?>", "<af>", "<not_af>"))
        rec_idx, starts, target = [], [], []
        for i, (meta, t) in enumerate(zip(self.beats.meta, self.beats.tables)):
            n = t.size
            if n < self.segment_beats:
                continue
            is_af = np.array([r == AF_RHYTHM for r in self._record_rhythms(meta["record"])] + [False])
            af = is_af[t["rhythm"]]  # rhythm -1 (unknown) indexes the trailing False
            s = np.arange(0, n - self.segment_beats + 1, stride, dtype=np.int64)
            csum = np.concatenate([[0], np.cumsum(af.astype(np.int64))])
            frac = (csum[s + self.segment_beats] - csum[s]) / self.segment_beats
            rec_idx.append(np.full(s.size, i, np.int64))
            starts.append(s)
            target.append((frac > 0.5).astype(np.int64))  # AF when most beats are: a tie is not AF
        if not starts:
            raise ValueError(f"no record of {records} has {self.segment_beats} beats")
        self.rec, self.start = np.concatenate(rec_idx), np.concatenate(starts)
        self.target = np.concatenate(target)
        self.index = balanced_indices(self.target, balance=balance, num_examples=num_examples, seed=seed)

    def _record_rhythms(self, record: str) -> List[str]:
        # The record's rhythm names (indexed by beats.npy "rhythm") are in its per-record JSON.
        import json

        return list(json.loads((self.beats.dir / RECORDS_SUBDIR / f"{stem(record)}.json").read_text())["rhythms"])

    def __len__(self) -> int:
        return int(self.index.size)

    def is_af(self, k: int) -> bool:
        """Target of example ``k``."""
        return bool(self.target[self.index[k]])

    def record_of(self, k: int) -> str:
        """Record (patient) of example ``k``'s segment."""
        return self.beats.names[int(self.rec[self.index[k]])]

    def prompt(self, k: int) -> List[int]:
        """``<bos>`` + one token per beat of the segment + ``<af?>``."""
        e = int(self.index[k])
        i, s = int(self.rec[e]), int(self.start[e])
        t = self.beats.tables[i]
        if self.params.scheme == "annotation":
            first = int(t["token_start"][s])
            body = self.beats.tokens(i)[first : first + self.segment_beats].tolist()
        else:
            body = (self.vocab.rr_base + t["rr_bin"][s : s + self.segment_beats].astype(np.int64)).tolist()
        return [BOS_ID] + body + [self.query_id]

    def __getitem__(self, k: int) -> Dict[str, List[int]]:
        prompt = self.prompt(k)
        answer = self.yes_id if self.is_af(k) else self.no_id
        return {"tokens": prompt + [answer, EOS_ID], "labels": [IGNORE] * len(prompt) + [answer, IGNORE]}


# ----------------------------------------------------------------------------- builders
# Explicit keyword arguments only: config validation checks every key against these signatures.


def ecg_pretrain_dataset(
    tokenizer: Any,
    *,
    shards_dir: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    stride: Optional[int] = None,
    split: str = TRAIN,
    records: Optional[Sequence[str]] = None,
    split_file: Optional[str] = None,
    extra_records: Any = None,
) -> ECGTokensDataset:
    """Pretraining windows: ``max_seq_len`` tokens of the record streams (the context window).

    Args:
        tokenizer (ECGTokenizer): its parameters must match the shards.
        shards_dir (Optional[str]): ``hlmtune tokenize`` output (default: the tokenizer's manifest dir).
        max_seq_len (Optional[int]): context window in tokens, the papers' sweep 128..1024
            (default ``tokenizer.max_seq_len``).
        stride (Optional[int]): tokens between window starts (default ``max_seq_len``: packed,
            every token once).
        split (str): ``DS1`` (default) or ``random`` (pretraining on the pooled records).
        records (Optional[Sequence[str]]): explicit records (DS2 records are refused).
        split_file (Optional[str]): split lists of another database.
        extra_records (Any): more training patients: a database of the shards (``svdb``), a list
            of record ids, or null (the split's only).

    Returns:
        ECGTokensDataset: memory-mapped windows (only the window is copied; no per-rank copy).
    """
    manifest, params = read_shards(tokenizer, shards_dir)
    seq = max_seq_len or getattr(tokenizer, "max_seq_len", None)
    if not seq:
        raise ValueError("ecg_pretrain_dataset needs max_seq_len (the context window, 128..1024)")
    chosen = resolve_records(split=split, records=records, split_file=split_file,
                             available=[r["record"] for r in manifest["records"]], extra_records=extra_records)
    return ECGTokensDataset(Path(manifest["_dir"]), max_seq_len=int(seq), stride=stride, records=chosen, expected_params=params)


def _beat_records(tokenizer: Any, source: BeatSource, *, seed: int, evaluation: bool
                  ) -> Tuple[Dict[str, Any], List[str], Optional[Dict[str, np.ndarray]]]:
    """(manifest, split-checked records, per-record target-beat mask of ``split: random`` or None)."""
    manifest, _ = read_shards(tokenizer, source.shards_dir)
    chosen = resolve_records(split=source.split, records=source.records, split_file=source.split_file,
                             available=[r["record"] for r in manifest["records"]], evaluation=evaluation,
                             extra_records=None if evaluation else source.extra_records)
    mask = None
    if source.split == RANDOM:
        by_name = {r["record"]: r for r in manifest["records"]}
        # train beats = not test; evaluation reads the test beats
        mask = {}
        for r in chosen:
            test = random_beat_mask(r, int(by_name[r]["n_beats"]), seed=seed, test_fraction=source.random_test_fraction)
            mask[r] = test if evaluation else ~test
    return manifest, chosen, mask


def beat_classification_dataset(
    tokenizer: Any, source: BeatSource, draw: BeatDraw, prompt: BeatPromptOptions, *, evaluation: bool = False,
    labels: Optional[Dict[str, np.ndarray]] = None,
) -> ECGBeatClassificationDataset:
    """A beat-classification dataset from its option objects.

    Args:
        tokenizer (ECGTokenizer): its parameters must match the shards.
        source (BeatSource): shards and records.
        draw (BeatDraw): classes and the epoch's draw.
        prompt (BeatPromptOptions): the prompt's inputs.
        evaluation (bool): every target beat once, in record order, without any training-time
            variation (what ``hlmtune eval`` scores); ``split: random`` then reads the held-out beats.
        labels (Optional[Dict[str, np.ndarray]]): per record, class ids in place of the beat
            tables' (see :class:`ECGBeatClassificationDataset`).

    Returns:
        ECGBeatClassificationDataset: ``{"tokens", "labels"}`` examples.
    """
    manifest, chosen, mask = _beat_records(tokenizer, source, seed=draw.seed, evaluation=evaluation)
    if evaluation:
        draw, prompt = draw.for_evaluation(), prompt.for_evaluation()
    return ECGBeatClassificationDataset(manifest, chosen, prompt=prompt, draw=draw, beat_mask=mask, labels=labels)


def _classification_options(options: Mapping[str, Any]) -> Tuple[BeatSource, BeatDraw, BeatPromptOptions]:
    """:func:`ecg_beat_classification_dataset`'s keys as its option objects (no file read)."""
    return parse_options("ecg_beat_classification_dataset", options)


def ecg_beat_classification_dataset(tokenizer: Any, **options: Any) -> ECGBeatClassificationDataset:
    """Beat classification (AAMI N/S/V/F/Q): signal-only prompt, the class token after it.

    Keyword arguments are the fields of :class:`~hlmtune.data_builders.beat_prompt.BeatSource`
    (shards, split, records), :class:`~hlmtune.data_builders.beat_prompt.BeatDraw` (classes and
    the epoch's draw) and :class:`~hlmtune.data_builders.beat_prompt.BeatPromptOptions` (what the
    prompt shows, and the training-time variations ``hlmtune eval`` never applies), each
    documented there; ``inspect.signature`` lists them all.

    Args:
        tokenizer (ECGTokenizer): its parameters must match the shards.
        **options (Any): the dataset section's keys (see above).

    Returns:
        ECGBeatClassificationDataset: ``{"tokens", "labels"}`` examples.

    Raises:
        TypeError: a key that is not an option, naming the closest one.
    """
    return beat_classification_dataset(tokenizer, *_classification_options(options))


ecg_beat_classification_dataset.__signature__ = builder_signature(ecg_beat_classification_dataset)  # type: ignore[attr-defined]
ecg_beat_classification_dataset.check_arguments = _classification_options  # type: ignore[attr-defined]  (config validation)

# DPO pairs: a larger share of S and V pairs by default; the rr target is a second loss term of
# the classification recipe, which a preference pair has no place for (nor the stretch tried with it).
DPO_DEFAULTS = {"balance": 0.25}
DPO_EXCLUDED = ("rr_target", "augment_stretch")


def _dpo_options(options: Mapping[str, Any]) -> Tuple[BeatSource, BeatDraw, BeatPromptOptions]:
    """:func:`ecg_beat_dpo_dataset`'s keys as its option objects (no file read)."""
    return parse_options("ecg_beat_dpo_dataset", options, defaults=DPO_DEFAULTS, exclude=DPO_EXCLUDED)


def ecg_beat_dpo_dataset(tokenizer: Any, **options: Any) -> ECGBeatPreferenceDataset:
    """DPO pairs on beat classification: chosen = the true class, rejected = its usual confusion.

    S and V carry the task: every N pair rejects S or V (alternating), S and V pairs reject N,
    and the default ``balance`` of 0.25 gives S and V beats a larger share of pairs than the
    classification default. Keyword arguments as :func:`ecg_beat_classification_dataset`,
    without ``rr_target`` and ``augment_stretch``.

    Args:
        tokenizer (ECGTokenizer): its parameters must match the shards.
        **options (Any): the dataset section's keys.

    Returns:
        ECGBeatPreferenceDataset: torchtune preference samples (``padded_collate_dpo``).
    """
    return ECGBeatPreferenceDataset(beat_classification_dataset(tokenizer, *_dpo_options(options)))


ecg_beat_dpo_dataset.__signature__ = builder_signature(ecg_beat_dpo_dataset, defaults=DPO_DEFAULTS, exclude=DPO_EXCLUDED)  # type: ignore[attr-defined]
ecg_beat_dpo_dataset.check_arguments = _dpo_options  # type: ignore[attr-defined]  (config validation)


def ecg_beat_stream_dataset(
    tokenizer: Any,
    *,
    shards_dir: Optional[str] = None,
    split: str = TRAIN,
    records: Optional[Sequence[str]] = None,
    split_file: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    beat_samples: Optional[int] = 80,
    context_beats: int = 2,
    classes: Optional[Sequence[str]] = None,
    balance: Optional[float] = 0.5,
    num_examples: Optional[int] = None,
    seed: int = 0,
    random_test_fraction: float = 0.2,
    extra_records: Any = None,
) -> ECGBeatStreamDataset:
    """Beat classification over windows of consecutive beats (see :class:`ECGBeatStreamDataset`).

    Args:
        tokenizer (ECGTokenizer): its parameters must match the shards.
        shards_dir (Optional[str]): ``samples``-scheme shards (RR bins > 0).
        split (str): ``DS1`` (default) or ``random`` (labelled as such in every report).
        records (Optional[Sequence[str]]): explicit training records (no DS2 record).
        split_file (Optional[str]): split lists of another database (JSON ``{"DS1", "DS2"}``).
        max_seq_len (Optional[int]): tokens per window (default ``tokenizer.max_seq_len``); 1024
            tokens hold 12 beats of 80 samples.
        beat_samples (Optional[int]): samples per beat cropped around the R peak (default 80:
            -0.22 s .. +0.41 s at 128 Hz, P wave to T wave; None = the whole window). Fewer
            samples = more beats of context per window and cheaper evaluation.
        context_beats (int): beats of the patient's own signal before the first classified beat.
        classes (Optional[Sequence[str]]): target classes (default: every labelled class).
        balance (Optional[float]): label class shares ~ ``count ** balance`` (default 0.5).
        num_examples (Optional[int]): windows per epoch (default: number of target beats).
        seed (int): seed of the draw and of the random split.
        random_test_fraction (float): share of beats held out by ``split: random``.
        extra_records (Any): more training patients: a database of the shards (``svdb``), a list
            of record ids, or null (the split's only).

    Returns:
        ECGBeatStreamDataset: ``{"tokens", "labels"}`` windows (``padded_collate_sft``).
    """
    return beat_stream_dataset(tokenizer, shards_dir=shards_dir, split=split, records=records, split_file=split_file,
                               max_seq_len=max_seq_len, beat_samples=beat_samples, context_beats=context_beats,
                               classes=classes, balance=balance, num_examples=num_examples, seed=seed,
                               random_test_fraction=random_test_fraction, extra_records=extra_records)


def beat_stream_dataset(
    tokenizer: Any, *, shards_dir: Optional[str], split: str, records: Optional[Sequence[str]],
    split_file: Optional[str], max_seq_len: Optional[int], beat_samples: Optional[int], context_beats: int,
    classes: Optional[Sequence[str]], balance: Optional[float], num_examples: Optional[int], seed: int,
    random_test_fraction: float, evaluation: bool = False, extra_records: Any = None,
) -> ECGBeatStreamDataset:
    """:func:`ecg_beat_stream_dataset`; ``evaluation`` tiles the records (what ``hlmtune eval`` reads)."""
    seq = max_seq_len or getattr(tokenizer, "max_seq_len", None)
    if not seq:
        raise ValueError("ecg_beat_stream_dataset needs max_seq_len (tokens per window)")
    source = BeatSource(shards_dir=shards_dir, split=split, records=records, split_file=split_file,
                        random_test_fraction=random_test_fraction, extra_records=extra_records)
    manifest, chosen, mask = _beat_records(tokenizer, source, seed=seed, evaluation=evaluation)
    return ECGBeatStreamDataset(
        manifest, chosen, max_seq_len=int(seq), beat_samples=beat_samples, context_beats=context_beats,
        classes=classes, balance=None if evaluation else balance, num_examples=None if evaluation else num_examples,
        seed=seed, beat_mask=mask, evaluation=evaluation,
    )


def ecg_af_dataset(
    tokenizer: Any,
    *,
    shards_dir: Optional[str] = None,
    split: str = TRAIN,
    records: Optional[Sequence[str]] = None,
    split_file: Optional[str] = None,
    segment_beats: int = 41,
    stride_beats: Optional[int] = None,
    balance: Optional[float] = 0.5,
    num_examples: Optional[int] = None,
    seed: int = 0,
) -> ECGAFDataset:
    """Atrial fibrillation: a segment of beats -> ``<af>`` / ``<not_af>``.

    Args:
        tokenizer (ECGTokenizer): its parameters must match the shards.
        shards_dir (Optional[str]): ``annotation`` shards (one symbol token per beat, the
            papers' first HLM) or ``samples`` shards (the beats' RR tokens are the input).
        split (str): ``DS1`` (default); ``random`` is refused (it holds out beats, not segments).
        records (Optional[Sequence[str]]): explicit training records (no DS2 record).
        split_file (Optional[str]): split lists of another database.
        segment_beats (int): beats per segment (the papers: 41, 128, 256, 512).
        stride_beats (Optional[int]): beats between segment starts (default: segment_beats).
        balance (Optional[float]): class-share exponent (AF vs not), null = every segment once.
        num_examples (Optional[int]): examples per epoch when balancing.
        seed (int): seed of the balanced draw.

    Returns:
        ECGAFDataset: ``{"tokens", "labels"}`` examples; the target comes from the rhythm
        annotations, which are never tokens of the input.
    """
    if split == RANDOM:
        # The random split holds out beats, not segments: an AF run would train and test on the
        # very same segments. AF is evaluated between patients only.
        raise SplitError("ecg_af_dataset: split 'random' holds out beats, not AF segments; "
                         "use DS1 (the default), records or split_file")
    manifest, _ = read_shards(tokenizer, shards_dir)
    chosen = resolve_records(split=split, records=records, split_file=split_file,
                             available=[r["record"] for r in manifest["records"]])
    return ECGAFDataset(manifest, chosen, segment_beats=segment_beats, stride_beats=stride_beats,
                        balance=balance, num_examples=num_examples, seed=seed)


def training_records(manifest: Dict[str, Any], section: Mapping[str, Any]) -> List[str]:
    """The records a run of an ECG builder trained on, from its dataset section: the split's
    (or ``records``) plus ``extra_records``, as record ids of the shards.

    Args:
        manifest (Dict[str, Any]): the shards' manifest.
        section (Mapping[str, Any]): the run's dataset keys.

    Returns:
        List[str]: record ids, in manifest order.
    """
    return resolve_records(split=section.get("split", TRAIN), records=section.get("records"),
                           split_file=section.get("split_file"), available=[r["record"] for r in manifest["records"]],
                           extra_records=section.get("extra_records"))


def signal_digests(manifest: Dict[str, Any]) -> Dict[str, str]:
    """Record id -> sha256 of its signal file(s) (the ``.dat`` inputs), for overlap checks that
    see one recording under two ids."""
    out = {}
    for r in manifest["records"]:
        dats = sorted(v for k, v in (r.get("inputs") or {}).items() if not k.endswith((".hea", ".atr")))
        if dats:
            out[r["record"]] = ",".join(dats)
    return out


# ----------------------------------------------------------------------------- test sets
# The beat builders whose test prompts `hlmtune eval` rebuilds, by builder name -> kind of test
# set: "beat" (one prompt per target beat) or "stream" (windows classifying several beats).
BEAT_BUILDERS: Dict[str, str] = {"ecg_beat_classification_dataset": "beat", "ecg_beat_dpo_dataset": "beat",
                                 "ecg_beat_stream_dataset": "stream"}


def beat_test_dataset(
    tokenizer: Any, builder: str, section: Mapping[str, Any], *, split: str, records: Optional[Sequence[str]] = None,
    labels: Optional[Dict[str, np.ndarray]] = None,
) -> Any:
    """The test set ``hlmtune eval`` scores for a run of ``builder`` whose dataset section is ``section``.

    The test prompts are built exactly as the run's training prompts (every key of the section,
    the builder's defaults for the rest); only the records, the draw (every target beat once)
    and the training-time variations (none) differ.

    Args:
        tokenizer (ECGTokenizer): the run's tokenizer.
        builder (str): a name of :data:`BEAT_BUILDERS`.
        section (Mapping[str, Any]): the run's ``dataset`` keys, without ``_component_``.
        split (str): the test split (``DS2``; ``random``: the held-out beats of ``records``).
        records (Optional[Sequence[str]]): the records of a ``random`` split (None: the split's).
        labels (Optional[Dict[str, np.ndarray]]): per record, class ids in place of the beat
            tables' (detected beats: their reference beats' classes); per-beat prompts only.

    Returns:
        ECGBeatClassificationDataset | ECGBeatStreamDataset: the test set.

    Raises:
        ValueError: ``builder`` is not a beat builder.
    """
    if builder not in BEAT_BUILDERS:
        raise ValueError(f"{builder} is not a beat builder ({', '.join(BEAT_BUILDERS)})")
    keys = {**dict(section), "split": split, "records": records}
    if BEAT_BUILDERS[builder] == "stream":
        if labels is not None:
            raise ValueError(f"{builder}: windows classify the shards' own beats; detected-beat labels apply to "
                             "per-beat prompts only")
        import inspect

        defaults = {k: p.default for k, p in inspect.signature(ecg_beat_stream_dataset).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        return beat_stream_dataset(tokenizer, **{**defaults, **keys}, evaluation=True)
    parsed = (_dpo_options if builder == "ecg_beat_dpo_dataset" else _classification_options)(keys)
    return beat_classification_dataset(tokenizer, *parsed, evaluation=True, labels=labels)
