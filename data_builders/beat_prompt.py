"""The beat-classification prompt: its options, its layout, and the one function that assembles it.

Every ECG beat builder (``ecg_beat_classification_dataset``, ``ecg_beat_dpo_dataset``), the
test set of ``hlmtune eval`` and its reports read the prompt through this module:

* :class:`BeatSource`, :class:`BeatDraw` and :class:`BeatPromptOptions` declare the keys of a
  beat builder's ``dataset`` section once (names, defaults, checks, meaning); the builders'
  signatures are made from them (:func:`builder_signature`), so config validation and
  ``hlmtune validate`` see every key;
* :class:`BeatBlock` is the layout of one beat, ``<sep> rr(i) q...q [rr(i+1)] <beat?>``, shared
  by the per-beat prompt and by the stream dataset's windows;
* :func:`assemble_prompt` builds a prompt from its parts and returns, beside the tokens, what
  evaluation and the reports need (:class:`BeatPrompt`: where the target beat starts, its RR
  token, the following one), so nothing parses a finished prompt back.

The prompt of one target beat ``i``::

    <bos> [t...t] rr(i-C) ... rr(i-1)  <sep> rr(i) q...q [v...v]  [rr(i+1)]  <beat?>  LABEL  <eos>
          template context: RR bins    the target beat           following RR answer (trained on)

(``v...v``: the second lead's samples of the target beat, with ``second_lead``.)

No label enters it: the template is a label-free median of earlier beats, the context holds
RR bins only, and the class token comes after ``<beat?>``.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hlmtune.data_builders.rr_features import RR_REFERENCES
from hlmtune.ecg_tokenizer.splits import TRAIN
from hlmtune.ecg_tokenizer.vocab import BOS_ID


@dataclass(frozen=True)
class BeatSource:
    """Which shards and records a beat dataset reads.

    Attributes:
        shards_dir (Optional[str]): ``samples``-scheme shards with RR bins (default: the
            tokenizer's manifest folder).
        split (str): ``DS1`` (default, inter-patient training) or ``random`` (beats of the
            records split by a seeded hash; reports then say so on their first line).
        records (Optional[Sequence[str]]): explicit training records (no test record).
        split_file (Optional[str]): split lists of another database (JSON ``{"DS1", "DS2"}``).
        random_test_fraction (float): share of beats held out by ``split: random``.
        extra_records (Any): more training patients beside the split's: a database of the
            shards (``svdb``: all its records), a list of record ids, or null (the split's only);
            never a test record (``ecg_tokenizer.splits.extra_records_of``).
    """

    shards_dir: Optional[str] = None
    split: str = TRAIN
    records: Optional[Sequence[str]] = None
    split_file: Optional[str] = None
    random_test_fraction: float = 0.2
    extra_records: Any = None


@dataclass(frozen=True)
class BeatDraw:
    """Which beats are examples of one epoch (training draw; evaluation reads every beat once).

    Attributes:
        classes (Optional[Sequence[str]]): target classes (default: every labelled class).
        balance (Optional[float]): class shares proportional to ``count ** balance``; 0 equal,
            1 as recorded, null = every beat once.
        num_examples (Optional[int]): examples per epoch (default: number of beats).
        seed (int): seed of the draw, of the random split and of every training-time variation.
        record_balance (float): within each class, each record's share of the draw is
            proportional to its beats of that class ``** record_balance`` (1 = as recorded, 0 =
            every patient with the class equally).
        early_n_weight (float): within class N, beats whose own interval comes early (RR token
            under 0.8 x the running reference; needs ``normalized_rr``) are drawn with this weight
            against 1 for the other N beats: above 1 the model sees more of the real N beats that
            come early (irregular rhythms, sinus arrhythmia) beside ``premature_synth``'s early S
            examples; the class shares are unchanged. 1 = as recorded.
    """

    classes: Optional[Sequence[str]] = None
    balance: Optional[float] = 0.5
    num_examples: Optional[int] = None
    seed: int = 0
    record_balance: float = 1.0
    early_n_weight: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.record_balance) <= 1.0:
            raise ValueError(f"record_balance must be in [0, 1], got {self.record_balance}")
        if not float(self.early_n_weight) > 0.0:
            raise ValueError(f"early_n_weight must be > 0, got {self.early_n_weight}")

    def for_evaluation(self) -> "BeatDraw":
        """Every beat once, in record order."""
        return dataclasses.replace(self, balance=None, num_examples=None)


# Fields of BeatPromptOptions that vary training examples only; evaluation shows every beat as it is.
TRAINING_ONLY = ("augment", "template_swap", "previous_swap", "premature_synth", "premature_max_irregularity",
                 "irregular_synth", "irregular_no_p_wave", "rr_target", "augment_stretch")


def _unit(name: str, v: float) -> None:
    if not 0.0 <= float(v) <= 1.0:
        raise ValueError(f"{name} must be 0..1, got {v}")


@dataclass(frozen=True)
class BeatPromptOptions:
    """What a beat prompt shows (the model's inputs), and how training varies it.

    Attributes:
        context_beats (int): earlier beats given as RR tokens (0..1000; more = longer prompts).
        normalized_rr (int): 0 = absolute RR tokens; else every RR token of the prompt (context,
            the beat's own, the following) is the interval relative to the running median RR of
            this many beats (``normalized_rr_tokens``): prematurity without the heart rate.
        normalize_amplitude (bool): rescale each record's waveform to a median R amplitude of
            1 mV (``amplitude_lut``): morphology without the patient's lead gain.
        beat_samples (Optional[int]): samples of the target beat kept around its R peak, R at a
            third of them (None = the shards' whole window; 80 = -0.22 s .. +0.41 s at 128 Hz).
        next_rr (bool): the prompt ends with the following RR interval (the compensatory pause
            of the classic inter-patient feature sets).
        rr_reference (str): the running reference of ``normalized_rr``: ``median`` or ``mean`` of
            the last ``normalized_rr`` intervals, or ``gated``: the median of the last
            ``normalized_rr`` intervals that were neither early nor pauses (``gated_reference``:
            an abrupt ectopic run stays early against it, a gradual speed-up does not), or
            ``gated_regular``: the same, with every interval entering while the rhythm is
            irregular (fibrillation: no interval is early there).
        local_rr (int): 0 = off; else an RR token of the local average interval, the mean of the
            ``local_rr`` beats around the target (de Chazal 2004: 10), after the following RR.
        average_rr_s (float): 0 = off; else an RR token of the average interval of the beats
            within ``average_rr_s / 2`` seconds of the target (de Chazal 2004: 300), after the
            local average. Both are written as the other RR tokens (relative with ``normalized_rr``).
        long_rr (int): 0 = off; else an RR token of the beat's own interval relative to the upper
            quartile of the last ``long_rr`` intervals (``long_reference``: the patient's slower
            usual rhythm, which a running median loses inside a long ectopic run), written at the
            standard 0.8 s cycle, last before ``<beat?>``; a synthetic premature or fibrillating
            example shows its own drawn interval there too.
        p_wave_beats (int): 0 = off; else a token of how alike the P-wave segments (0.25-0.06 s
            before R) of the ``p_wave_beats`` beats before the target are (``p_wave_regularity``:
            the median correlation of each with their median, written as an RR token over [-1, 1]),
            last before ``<beat?>``: the same P wave before every beat (a rhythm a premature S beat
            interrupts) or none (fibrillation, where N beats come early); never the target's own
            samples. An ``irregular_no_p_wave`` example shows a fibrillating context's value there.
        template_beats (int): 0 = off; else the patient's typical beat, the sample-wise median of
            this many earlier beats whatever their class (``beat_templates``), cropped like the
            target beat: opens the prompt and/or serves ``template_delta``.
        template_delta (bool): the target beat is shown as its difference from the template
            (``beat - template`` in mV, quantized again; needs ``template_beats``).
        show_template (bool): the template opens the prompt (False: it only serves
            ``template_delta``; needs ``template_beats``).
        second_lead (int): 0 = off; else this many samples of the second lead around the target's
            R peak (R at 0.4 of them: 32 = -0.10 s .. +0.15 s at 128 Hz, the QRS complex) follow the
            first lead's samples in the beat block: with ``template_delta`` as the beat minus the
            second lead's own template (median of the same earlier beats), with
            ``normalize_amplitude`` at that lead's own scale, and every training variation of the
            beat (gain, shift, stretch, the previous or the template beat in its place) applied
            alike. Needs shards with the second lead (``hlmtune tokenize --second-lead``).
        augment (bool): training only: per example a random gain (0.7..1.4, log-uniform) of the
            beat and template and a crop shift of +-2 samples.
        template_swap (float): training only: probability that an N or S example shows the
            template in place of its own samples, so the RR tokens must carry the class.
        previous_swap (float): training only: probability that an N or S example shows the
            previous beat's real samples instead of its own (its RR tokens kept).
        premature_synth (float): training only: probability that a drawn N example is shown
            after an interval of 55-85% of its context's median cycle, then a pause, and
            labelled S (an S beat is a normally conducted beat that comes early).
        premature_max_irregularity (Optional[float]): with ``premature_synth``, only N beats
            whose context rhythm is regular (``rhythm_irregularity`` at most this) are made
            premature (None: any context).
        irregular_synth (float): training only: probability that a drawn N example (not made
            premature) is shown inside a synthetic fibrillating rhythm, still labelled N.
        irregular_no_p_wave (bool): with ``irregular_synth``, those examples also lose the P wave
            (beat and template) and get 4-9 Hz fibrillatory waves over the beat.
        rr_target (bool): training only: the target beat's own RR token is a second target of
            the loss (predicted at its ``<sep>`` from the context), beside the class token.
        augment_stretch (float): training only: 0 = off; else the beat and the template are
            stretched in time around R by one factor per example, log-uniform in
            ``[1 / (1 + a), 1 + a]`` (0..0.5).

    Raises:
        ValueError: a value out of range, or an option that needs another one switched on.
    """

    context_beats: int = 16
    normalized_rr: int = 0
    normalize_amplitude: bool = False
    beat_samples: Optional[int] = None
    next_rr: bool = True
    rr_reference: str = "median"
    local_rr: int = 0
    average_rr_s: float = 0.0
    long_rr: int = 0
    p_wave_beats: int = 0
    template_beats: int = 0
    template_delta: bool = False
    show_template: bool = True
    second_lead: int = 0
    augment: bool = False
    template_swap: float = 0.0
    previous_swap: float = 0.0
    premature_synth: float = 0.0
    premature_max_irregularity: Optional[float] = None
    irregular_synth: float = 0.0
    irregular_no_p_wave: bool = False
    rr_target: bool = False
    augment_stretch: float = 0.0

    def __post_init__(self) -> None:
        if self.premature_max_irregularity is not None and not self.premature_synth:
            raise ValueError("premature_max_irregularity limits premature_synth: it needs premature_synth > 0")
        if not 0 <= int(self.context_beats) <= 1000:
            raise ValueError(f"context_beats must be 0..1000, got {self.context_beats}")
        if not 0 <= int(self.normalized_rr) <= 100_000:
            raise ValueError(f"normalized_rr must be 0 (off) or the beats of its running median, got {self.normalized_rr}")
        if self.rr_reference not in RR_REFERENCES:
            raise ValueError(f"rr_reference must be one of {RR_REFERENCES}, got {self.rr_reference!r}")
        if not 0 <= int(self.local_rr) <= 1000:
            raise ValueError(f"local_rr must be 0 (off) or the beats of the local average (<= 1000), got {self.local_rr}")
        if not 0.0 <= float(self.average_rr_s) <= 3600.0:
            raise ValueError(f"average_rr_s must be 0 (off) or a window of up to 3600 s, got {self.average_rr_s}")
        if not 0 <= int(self.long_rr) <= 100_000:
            raise ValueError(f"long_rr must be 0 (off) or the beats of its long reference (<= 100000), got {self.long_rr}")
        if not (int(self.p_wave_beats) == 0 or 3 <= int(self.p_wave_beats) <= 1000):
            raise ValueError(f"p_wave_beats must be 0 (off) or the earlier beats compared (3..1000), got {self.p_wave_beats}")
        if not 0 <= int(self.template_beats) <= 100_000:
            raise ValueError(f"template_beats must be 0 (off) or the beats of the median template, got {self.template_beats}")
        if not 0.0 <= float(self.template_swap) <= 1.0 or (self.template_swap and not self.template_beats):
            raise ValueError(f"template_swap must be 0..1 and needs template_beats > 0, got {self.template_swap} "
                             f"with template_beats {self.template_beats}")
        _unit("previous_swap", self.previous_swap)
        if self.template_delta and not self.template_beats:
            raise ValueError("template_delta shows the beat minus the patient's template: it needs template_beats > 0")
        if not (int(self.second_lead) == 0 or 8 <= int(self.second_lead) <= 1024):
            raise ValueError(f"second_lead must be 0 (off) or the second lead's samples shown (8..the shards' window), "
                             f"got {self.second_lead}")
        if not self.show_template and not self.template_beats:
            raise ValueError("show_template: False hides the template of template_beats; with template_beats 0 there is none")
        _unit("premature_synth", self.premature_synth)
        _unit("irregular_synth", self.irregular_synth)
        if self.irregular_no_p_wave and not self.irregular_synth:
            raise ValueError("irregular_no_p_wave removes the P wave of irregular_synth's examples: it needs irregular_synth > 0")
        if self.premature_max_irregularity is not None and not 0.0 < float(self.premature_max_irregularity) <= 10.0:
            raise ValueError(f"premature_max_irregularity must be in (0, 10] or null, got {self.premature_max_irregularity}")
        if not 0.0 <= float(self.augment_stretch) <= 0.5:
            raise ValueError(f"augment_stretch must be 0 (off) .. 0.5 (a factor 1/1.5 .. 1.5), got {self.augment_stretch}")

    @property
    def rhythm_features(self) -> int:
        """Feature tokens after the following RR (``local_rr``, ``average_rr_s``, ``long_rr``, ``p_wave_beats``)."""
        return (int(bool(self.local_rr)) + int(bool(self.average_rr_s)) + int(bool(self.long_rr))
                + int(bool(self.p_wave_beats)))

    def for_evaluation(self) -> "BeatPromptOptions":
        """The same inputs with every training-time variation (:data:`TRAINING_ONLY`) off."""
        defaults = BeatPromptOptions()
        return dataclasses.replace(self, **{k: getattr(defaults, k) for k in TRAINING_ONLY})


@dataclass(frozen=True)
class BeatBlock:
    """Token layout of one beat: ``<sep> rr(i) q...q [rr(i+1)] [f...f] [<beat?>]``.

    The per-beat prompt ends with one such block (the target beat); the stream dataset's windows
    are ``K`` of them with the following RR and the query, one ``<beat?>`` per classified beat.

    Attributes:
        samples (int): waveform tokens of the beat.
        next_rr (bool): whether the following RR interval comes after the waveform.
        query (bool): whether the block ends with ``<beat?>``.
        features (int): feature tokens after the following RR (local, window average, long, P wave).
    """

    samples: int
    next_rr: bool = True
    query: bool = True
    features: int = 0

    SEP = 0  # offset of <sep>
    RR = 1  # offset of the beat's own RR token
    WAVE = 2  # offset of the first waveform token

    @property
    def next_rr_at(self) -> Optional[int]:
        """Offset of the following RR token, or None."""
        return self.WAVE + self.samples if self.next_rr else None

    @property
    def features_at(self) -> int:
        """Offset of the first rhythm feature token (where ``<beat?>`` comes without any)."""
        return self.WAVE + self.samples + int(self.next_rr)

    @property
    def query_at(self) -> Optional[int]:
        """Offset of ``<beat?>``, or None."""
        return self.features_at + self.features if self.query else None

    def __len__(self) -> int:
        return self.features_at + self.features + int(self.query)


@dataclass(frozen=True)
class BeatPrompt:
    """A beat prompt and what evaluation and the reports read about it.

    Attributes:
        tokens (List[int]): ``<bos>`` .. ``<beat?>``: what the model reads.
        target_at (int): index in ``tokens`` of the target beat's ``<sep>``.
        rr_token (int): the target beat's RR token as shown (relative with ``normalized_rr``).
        next_rr_token (Optional[int]): the following RR token as shown, None when not shown.
        rr_ratio (Optional[float]): the target beat's interval over the patient's running
            reference RR as the model read it (NaN: unknown); None for absolute RR tokens.
        feature_tokens (List[int]): the feature tokens as shown (local, window average, long, P wave).
    """

    tokens: List[int]
    target_at: int
    rr_token: int
    next_rr_token: Optional[int]
    rr_ratio: Optional[float] = None
    feature_tokens: List[int] = dataclasses.field(default_factory=list)


def assemble_prompt(
    *, template: Sequence[int], context_rr: Sequence[int], beat: Sequence[int], next_rr: Optional[int],
    query_id: int, rr_ratio: Optional[float] = None, features: Sequence[int] = (),
) -> BeatPrompt:
    """The one place a beat prompt is put together.

    Args:
        template (Sequence[int]): the template's sample tokens shown first (empty: none).
        context_rr (Sequence[int]): RR tokens of the earlier beats, oldest first.
        beat (Sequence[int]): the target beat: ``<sep> rr(i) q...q``.
        next_rr (Optional[int]): the following RR token, None to leave it out.
        query_id (int): the ``<beat?>`` token.
        rr_ratio (Optional[float]): the target's RR ratio to record (see :class:`BeatPrompt`).
        features (Sequence[int]): rhythm feature tokens, after the following RR.

    Returns:
        BeatPrompt: tokens and the target's position and RR tokens.
    """
    head = [BOS_ID, *template, *context_rr]
    tail = ([] if next_rr is None else [int(next_rr)]) + [int(f) for f in features]
    tokens = head + [int(t) for t in beat] + tail + [int(query_id)]
    at = len(head)
    return BeatPrompt(tokens=tokens, target_at=at, rr_token=tokens[at + BeatBlock.RR],
                      next_rr_token=None if next_rr is None else int(next_rr), rr_ratio=rr_ratio,
                      feature_tokens=[int(f) for f in features])


# ----------------------------------------------------------------------------- builder keys

OPTION_GROUPS = (BeatSource, BeatDraw, BeatPromptOptions)


def _fields(cls: type) -> List[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def builder_signature(builder: Any, *, defaults: Mapping[str, Any] = (), exclude: Sequence[str] = ()
                      ) -> inspect.Signature:
    """``builder(tokenizer, *, <every option field>) -> <its return annotation>`` as an ``inspect.Signature``.

    Args:
        builder (Any): the builder function (its return annotation is kept: config validation
            reads it to pair datasets with recipes).
        defaults (Mapping[str, Any]): a builder's own defaults where they differ from the fields'.
        exclude (Sequence[str]): fields the builder does not take.

    Returns:
        inspect.Signature: what ``inspect.signature`` (config validation) reports for the builder.
    """
    defaults = dict(defaults)
    params = [inspect.Parameter("tokenizer", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Any)]
    for cls in OPTION_GROUPS:
        for f in _fields(cls):
            if f.name in exclude:
                continue
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                            default=defaults.get(f.name, f.default), annotation=f.type))
    return inspect.Signature(params, return_annotation=inspect.signature(builder).return_annotation)


def parse_options(
    builder: str, kwargs: Mapping[str, Any], *, defaults: Mapping[str, Any] = (), exclude: Sequence[str] = (),
) -> Tuple[BeatSource, BeatDraw, BeatPromptOptions]:
    """A beat builder's keyword arguments as its three option objects.

    Args:
        builder (str): the builder's name (for errors).
        kwargs (Mapping[str, Any]): the keyword arguments (a config's ``dataset`` section).
        defaults (Mapping[str, Any]): the builder's own defaults (see :func:`builder_signature`).
        exclude (Sequence[str]): fields the builder does not take.

    Returns:
        Tuple[BeatSource, BeatDraw, BeatPromptOptions]: the options.

    Raises:
        TypeError: a key the builder does not take, naming the closest one.
        ValueError: a value out of range (the option classes' checks).
    """
    known = [f.name for cls in OPTION_GROUPS for f in _fields(cls) if f.name not in exclude]
    for k in kwargs:
        if k not in known:
            close = difflib.get_close_matches(k, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise TypeError(f"{builder}() got an unexpected keyword argument '{k}'{hint}")
    merged = {**dict(defaults), **dict(kwargs)}
    out = [cls(**{f.name: merged[f.name] for f in _fields(cls) if f.name in merged}) for cls in OPTION_GROUPS]
    return out[0], out[1], out[2]


def option_docs() -> Dict[str, str]:
    """Each option's one-paragraph meaning, from the option classes' docstrings (for docs/tests)."""
    out: Dict[str, str] = {}
    for cls in OPTION_GROUPS:
        doc = inspect.getdoc(cls) or ""
        name = None
        for line in doc.splitlines():
            stripped = line.strip()
            head = stripped.split(" (", 1)[0]
            if line.startswith("    ") and not line.startswith("        ") and head in {f.name for f in _fields(cls)}:
                name = head
                out[name] = stripped.split("): ", 1)[-1]
            elif name and line.startswith("        "):
                out[name] += " " + stripped
            elif not line.startswith("    "):
                name = None
    return out


__all__ = ["BeatSource", "BeatDraw", "BeatPromptOptions", "BeatBlock", "BeatPrompt", "TRAINING_ONLY",
           "assemble_prompt", "builder_signature", "parse_options", "option_docs"]
