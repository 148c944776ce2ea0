"""torchtune-facing ECG tokenizer: ids <-> token names <-> beats and waveforms.

``ECGTokenizer`` follows torchtune's ``ModelTokenizer`` protocol (``special_tokens``,
``max_seq_len``, ``tokenize_messages``, ``__call__`` on a sample with ``messages``) and
``BaseTokenizer`` (``encode``/``decode``). Its text form is the whitespace-separated token
names (``<bos> <sep> rr05 q128 q131 ... <eos>``), which is what message contents of the
ECG prompt datasets hold (e.g. user: a beat sequence, assistant: a rhythm token such as
``(AFIB``). ``decode`` returns the beats: labels (scheme ``annotation``), RR bins and, for
the ``samples`` scheme, the dequantized waveforms (mV at ``target_rate``). A ``samples`` beat
holds no label: labels there are only answers (a label token after ``<beat?>``).

YAML::

    tokenizer:
      _component_: hlmtune.ecg_tokenizer.tokenizer.ecg_tokenizer
      manifest_path: /path/to/tokens/manifest.json   # parameters are read back from it
      max_seq_len: 2048
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from hlmtune.ecg_tokenizer.vocab import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SEP_ID,
    TokenizerParams,
    Vocabulary,
    dequantize,
    quantize,
    quantizer_edges,
    rr_edges,
)


@dataclass
class DecodedECG:
    """Beats recovered from token ids.

    Attributes:
        labels (List[str]): scheme ``annotation``: label class per beat; scheme
            ``samples``: the label tokens met (answers of classification prompts).
        rr_bins (List[int]): RR bin per beat (-1 unknown or no RR information).
        rr_s (List[float]): centre of each RR bin in seconds (NaN when unknown).
        waveforms (Optional[np.ndarray]): (n_beats, window) dequantized mV, scheme
            ``samples`` only.
        rhythms (List[str]): rhythm tokens met (prompt answers).
    """

    labels: List[str] = field(default_factory=list)
    rr_bins: List[int] = field(default_factory=list)
    rr_s: List[float] = field(default_factory=list)
    waveforms: Optional[np.ndarray] = None
    rhythms: List[str] = field(default_factory=list)


def _message_text(m: Any) -> Tuple[str, bool]:
    """(text, masked) of a torchtune ``Message`` or a ``{"role", "content"}`` dict."""
    if isinstance(m, Mapping):
        content = m.get("content", "")
        if isinstance(content, list):
            content = " ".join(c.get("content", "") for c in content if c.get("type", "text") == "text")
        return str(content), bool(m.get("masked", m.get("role") in ("system", "user", "ipython")))
    return m.text_content, bool(m.masked)


class ECGTokenizer:
    """Heartbeat token vocabulary for the Heart Language Model.

    Args:
        manifest_path (Optional[str]): a shard manifest (or its directory); its parameters
            define the tokenizer. Other parameters may repeat them but must agree.
        max_seq_len (Optional[int]): truncate ``tokenize_messages`` output to this length.
        **params: :class:`TokenizerParams` fields (``scheme``, ``window``, ``levels`` ...)
            when there is no manifest; unknown names are errors naming the closest field.

    Raises:
        ValueError: unknown or conflicting parameters.
    """

    def __init__(self, *, manifest_path: Optional[str] = None, max_seq_len: Optional[int] = None, **params: Any) -> None:
        self.manifest_dir: Optional[Path] = None
        if manifest_path is not None:
            from hlmtune.ecg_tokenizer.shards import read_manifest

            manifest = read_manifest(Path(manifest_path))
            self.manifest_dir = Path(manifest["_dir"])
            p = TokenizerParams.from_dict(manifest["params"])
            TokenizerParams.from_dict(params)  # typos are errors here too
            for k, v in params.items():
                if getattr(p, k) != v:
                    raise ValueError(f"{k}={v!r} disagrees with the manifest {manifest_path} ({k}={getattr(p, k)!r})")
        else:
            p = TokenizerParams.from_dict(params)
        self.params = p
        self.vocab = Vocabulary(p)
        self.max_seq_len = max_seq_len
        self.special_tokens: Dict[str, int] = {"<pad>": PAD_ID, "<bos>": BOS_ID, "<eos>": EOS_ID, "<sep>": SEP_ID}
        self.pad_id, self.bos_id, self.eos_id, self.sep_id = PAD_ID, BOS_ID, EOS_ID, SEP_ID
        self._edges = quantizer_edges(p)
        self._rr_edges = rr_edges(p)
        self._class_index = {c: i for i, c in enumerate(self.vocab.classes)}

    # ------------------------------------------------------------------ basics
    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return len(self.vocab)

    @property
    def tokens_per_beat(self) -> int:
        """Tokens one beat takes in a record stream."""
        if self.params.scheme == "annotation":
            return 1
        return 1 + (1 if self.params.rr_bins else 0) + int(self.params.window)

    def id_to_token(self, i: int) -> str:
        """Name of a token id."""
        return self.vocab.names[i]

    def token_to_id(self, name: str) -> int:
        """Id of a token name (KeyError names the token)."""
        try:
            return self.vocab.ids[name]
        except KeyError:
            raise KeyError(f"unknown ECG token {name!r} (vocabulary of {self.vocab_size} tokens)") from None

    def ids_to_text(self, ids: Sequence[int]) -> str:
        """Whitespace-separated token names."""
        return " ".join(self.vocab.names[int(i)] for i in ids)

    # ------------------------------------------------------------------ encode
    def encode(
        self, text: Union[str, Mapping[str, Any]], add_bos: bool = True, add_eos: bool = True, **kwargs: Any
    ) -> List[int]:
        """Token names (a string) or beats (a mapping, see :meth:`encode_beats`) to ids.

        Args:
            text (Union[str, Mapping]): ``"<sep> rr05 q128 ..."`` or
                ``{"labels": [...], "waveforms": ..., "rr_s": ...}``.
            add_bos (bool): prepend ``<bos>``.
            add_eos (bool): append ``<eos>``.
            **kwargs: ignored (torchtune passes extra flags).

        Returns:
            List[int]: token ids.
        """
        if isinstance(text, Mapping):
            return self.encode_beats(
                text.get("labels"), waveforms=text.get("waveforms"), rr_s=text.get("rr_s"), add_bos=add_bos,
                add_eos=add_eos,
            )
        ids = [self.token_to_id(t) for t in text.split()]
        return ([BOS_ID] if add_bos else []) + ids + ([EOS_ID] if add_eos else [])

    def _rr_bins(self, rr_s: Optional[Sequence[float]], n: int) -> np.ndarray:
        b = int(self.params.rr_bins)
        if rr_s is None:
            return np.full(n, b, dtype=np.int64)
        rr = np.asarray(rr_s, dtype=np.float64)
        out = np.searchsorted(self._rr_edges[1:-1], rr, side="right").astype(np.int64)
        out[np.isnan(rr)] = b
        return out

    def encode_beats(
        self,
        labels: Optional[Sequence[str]] = None,
        *,
        waveforms: Optional[np.ndarray] = None,
        rr_s: Optional[Sequence[float]] = None,
        add_bos: bool = True,
        add_eos: bool = True,
    ) -> List[int]:
        """Beats to ids, in the layout the shards use.

        Args:
            labels (Optional[Sequence[str]]): label class per beat (``"N"``, ``"V"``,
                ``"<unlabeled>"``); scheme ``annotation`` only (a ``samples`` beat holds
                no label).
            waveforms (Optional[np.ndarray]): (n_beats, window) mV at ``target_rate``,
                baseline already removed (scheme ``samples``).
            rr_s (Optional[Sequence[float]]): RR interval per beat in seconds (NaN unknown);
                None = unknown for every beat.
            add_bos (bool): prepend ``<bos>``.
            add_eos (bool): append ``<eos>``.

        Returns:
            List[int]: token ids.

        Raises:
            ValueError: unknown label, missing labels (annotation) or waveforms (samples),
                mis-shaped waveforms.
        """
        nb = int(self.params.rr_bins)
        v = self.vocab
        if self.params.scheme == "annotation":
            if labels is None:
                raise ValueError("scheme 'annotation' needs labels (one token per beat)")
            n = len(labels)
            try:
                cls = np.array([self._class_index[c] for c in labels], dtype=np.int64)
            except KeyError as e:
                raise ValueError(f"unknown label {e.args[0]!r}; classes: {self.vocab.classes}") from None
            rrb = self._rr_bins(rr_s, n)
            body = v.label_base + (cls * (nb + 1) + rrb if nb else cls)
            ids = body.tolist()
        else:
            if waveforms is None:
                raise ValueError("scheme 'samples' needs waveforms of shape (n_beats, window)")
            w = np.asarray(waveforms, dtype=np.float64)
            n = w.shape[0] if w.ndim == 2 else -1
            if w.ndim != 2 or w.shape[1] != int(self.params.window) or (labels is not None and len(labels) != n):
                raise ValueError(f"waveforms must have shape (n_beats, {self.params.window}), got {w.shape}")
            rrb = self._rr_bins(rr_s, n)
            lev = quantize(w, self._edges)
            head = [np.full(n, SEP_ID)] + ([v.rr_base + rrb] if nb else [])
            ids = np.concatenate([np.stack(head, axis=1), v.sample_base + lev], axis=1).reshape(-1).tolist()
        return ([BOS_ID] if add_bos else []) + ids + ([EOS_ID] if add_eos else [])

    # ------------------------------------------------------------------ decode
    def decode(self, token_ids: Sequence[int], **kwargs: Any) -> DecodedECG:
        """Ids to beats; for scheme ``samples`` the waveforms are the bin midpoints.

        Specials other than ``<sep>`` are skipped. A ``samples`` beat shorter than a window
        (a truncated sequence) is dropped.

        Args:
            token_ids (Sequence[int]): ids.
            **kwargs: ignored (torchtune passes ``skip_special_tokens``).

        Returns:
            DecodedECG: the beats.
        """
        v, p = self.vocab, self.params
        nb, w = int(p.rr_bins), int(p.window)
        out = DecodedECG()
        centers = None
        if nb:
            e = self._rr_edges
            centers = np.concatenate([0.5 * (e[:-1] + e[1:]), [math.nan]])
        beats_levels: List[np.ndarray] = []
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(v)):
            raise ValueError(f"token ids must be in [0, {len(v)}), got {ids.min()}..{ids.max()}")

        def add(label: int, rb: int) -> None:
            out.labels.append(v.classes[label])
            known = nb and rb < nb
            out.rr_bins.append(int(rb) if known else -1)
            out.rr_s.append(float(centers[rb]) if known else math.nan)

        if p.scheme == "annotation":
            for t in ids.tolist():
                if v.label_base <= t < v.rr_base:
                    k = t - v.label_base
                    add(k // (nb + 1), k % (nb + 1)) if nb else add(k, -1)
                elif v.rhythm_base <= t < v.task_base:
                    out.rhythms.append(v.names[t])
            return out
        i, n = 0, ids.size
        while i < n:
            t = int(ids[i])
            if v.rhythm_base <= t < v.task_base:
                out.rhythms.append(v.names[t])
            elif v.label_base <= t < v.rr_base:
                out.labels.append(v.classes[t - v.label_base])  # an answer, not part of a beat
            if t != SEP_ID:
                i += 1
                continue
            h = 2 if nb else 1
            seg = ids[i : i + h + w]
            ok = (
                seg.size == h + w
                and (not nb or v.rr_base <= seg[1] < v.sample_base)
                and np.all((seg[h:] >= v.sample_base) & (seg[h:] < v.rhythm_base))
            )
            if ok:
                rb = int(seg[1]) - v.rr_base if nb else -1
                known = nb and rb < nb
                out.rr_bins.append(rb if known else -1)
                out.rr_s.append(float(centers[rb]) if known else math.nan)
                beats_levels.append(seg[h:] - v.sample_base)
                i += h + w
            else:
                i += 1
        out.waveforms = dequantize(np.array(beats_levels, dtype=np.int64).reshape(-1, w), self._edges)
        return out

    # ------------------------------------------------------------------ torchtune
    def tokenize_messages(self, messages: Sequence[Any], add_end_tokens: bool = True, **kwargs: Any) -> Tuple[List[int], List[bool]]:
        """Tokenize a prompt: ``<bos>`` + each message's token names + ``<eos>``.

        Message contents are token-name text (``ids_to_text`` output); ``mask`` is True
        where a token must not be trained on (masked messages, torchtune's convention;
        ``<bos>`` follows the first message, ``<eos>`` the last).

        Args:
            messages (Sequence): torchtune ``Message`` objects or ``{"role", "content",
                "masked"}`` dicts (system/user masked by default).
            add_end_tokens (bool): append ``<eos>``.
            **kwargs: ignored.

        Returns:
            Tuple[List[int], List[bool]]: tokens and mask, truncated to ``max_seq_len``.
        """
        tokens: List[int] = [BOS_ID]
        mask: List[bool] = []
        for k, m in enumerate(messages):
            text, masked = _message_text(m)
            ids = self.encode(text, add_bos=False, add_eos=False)
            if k == 0:
                mask.append(masked)
            tokens += ids
            mask += [masked] * len(ids)
        if not messages:
            mask.append(True)
        if add_end_tokens:
            tokens.append(EOS_ID)
            mask.append(mask[-1])
        if self.max_seq_len is not None and len(tokens) > self.max_seq_len:
            tokens, mask = tokens[: self.max_seq_len], mask[: self.max_seq_len]
            if add_end_tokens:
                tokens[-1] = EOS_ID
        return tokens, mask

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Dict[str, Any]:
        """torchtune ``Transform``: ``sample["messages"]`` -> ``tokens`` and ``mask``.

        Args:
            sample (Mapping): with a ``messages`` list.
            inference (bool): no ``<eos>`` (the model continues).

        Returns:
            Dict[str, Any]: the sample without ``messages``, with ``tokens`` and ``mask``.
        """
        sample = dict(sample)
        messages = sample.pop("messages")
        tokens, mask = self.tokenize_messages(messages, add_end_tokens=not inference)
        sample["tokens"], sample["mask"] = tokens, mask
        return sample


def ecg_tokenizer(*, manifest_path: Optional[str] = None, max_seq_len: Optional[int] = None, **params: Any) -> ECGTokenizer:
    """Builder for YAML ``_component_``: see :class:`ECGTokenizer`.

    Args:
        manifest_path (Optional[str]): shard manifest whose parameters define the tokenizer.
        max_seq_len (Optional[int]): truncation length.
        **params: :class:`TokenizerParams` fields (no manifest) or repeats of them.

    Returns:
        ECGTokenizer: the tokenizer.
    """
    return ECGTokenizer(manifest_path=manifest_path, max_seq_len=max_seq_len, **params)
