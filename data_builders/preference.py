"""Preference-pair builders for DPO: stack-exchange paired and HH-RLHF.

Samples follow :class:`~torchtune.datasets.PreferenceDataset`: ``chosen_input_ids``,
``chosen_labels``, ``rejected_input_ids``, ``rejected_labels`` (prompt labels -100 unless
``train_on_input``), collated by ``torchtune.data.padded_collate_dpo``. Rows are validated
before tokenization (``on_bad_row``), and can be subset like the SFT builders.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Mapping, Optional

import numpy as np
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, ChosenRejectedToMessages, Message
from torchtune.datasets import PreferenceDataset
from torchtune.modules.transforms import Transform

from hlmtune.data_builders.loading import (
    PreparedRows,
    check_message_list,
    check_text_field,
)
from hlmtune.data_builders.sft import RowOptions

TEMPLATE_NAMES = {"stack_exchange_paired": "chat", "hh_rlhf": "chat"}

_COMMON_ARGS = (
    "source", "data_files", "split", "column_map", "train_on_input", "packed", "subset_size",
    "subset_seed", "on_bad_row", "filter_fn", "new_system_prompt",
)
_OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
# Anthropic/hh-rlhf on the hub stores each side as one transcript:
# "\n\nHuman: ...\n\nAssistant: ...\n\nHuman: ...\n\nAssistant: ...".
_HH_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def parse_hh_transcript(text: str) -> Optional[List[Dict[str, str]]]:
    """Split an HH-RLHF transcript string into ``[{"role", "content"}]`` turns.

    Args:
        text (str): "\\n\\nHuman: ...\\n\\nAssistant: ..." as stored by ``Anthropic/hh-rlhf``.

    Returns:
        Optional[List[Dict[str, str]]]: the turns, or None when the text has no
        "Human:"/"Assistant:" markers or text before the first marker.
    """
    parts = _HH_TURN.split(text)
    # parts = [before, role1, content1, role2, content2, ...]
    if len(parts) < 3 or parts[0].strip():
        return None
    return [
        {"role": _HH_ROLES[parts[i]], "content": parts[i + 1].strip()} for i in range(1, len(parts), 2)
    ]


class ValidatedPreferenceDataset(PreferenceDataset):
    """A :class:`~torchtune.datasets.PreferenceDataset` over rows already loaded, validated and
    subset. ``PreferenceDataset.__init__`` (which calls ``load_dataset``) is not called; samples
    are made as in ``PreferenceDataset._prepare_sample`` with public pieces.

    Attributes:
        skipped_rows (int): bad rows skipped with ``on_bad_row="skip"``.
        row_indices (List[int]): index of each sample's row in the loaded split.
        source_label (str): the file(s) or hub dataset.
        message_transform (Transform): row -> ``{"chosen": [...], "rejected": [...]}``.
        tokenizer (ModelTokenizer): the tokenizer.
    """

    def __init__(self, *, rows: PreparedRows, message_transform: Transform, tokenizer: Any) -> None:
        # Deliberately no super().__init__(): the rows are loaded already.
        self.message_transform = message_transform
        self.tokenizer = tokenizer
        self._rows = rows.data
        self.row_indices = rows.row_indices
        self.skipped_rows = rows.skipped_rows
        self.source_label = rows.source_label

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Dict[str, List[int]]:
        return self.transform(self._rows[index])

    def messages(self, index: int) -> Dict[str, List[Message]]:
        """``{"chosen": [...], "rejected": [...]}`` messages of sample ``index``."""
        return self.message_transform(self._rows[index])

    def transform(self, row: Mapping[str, Any]) -> Dict[str, List[int]]:
        """Row -> the four ``PreferenceDataset`` keys."""
        pair = self.message_transform(row)
        out: Dict[str, List[int]] = {}
        for side in ("chosen", "rejected"):
            tokens, mask = self.tokenizer.tokenize_messages(pair[side])
            out[f"{side}_input_ids"] = tokens
            out[f"{side}_labels"] = list(np.where(mask, CROSS_ENTROPY_IGNORE_IDX, tokens))
        return out


class PromptResponsesToMessages(Transform):
    """``{prompt, chosen, rejected}`` text columns -> chosen/rejected message lists (one user
    turn, one assistant turn), as torchtune's ``StackExchangePairedToMessages``.

    Args:
        train_on_input (bool): keep the prompt in the loss.
        column_map (Dict[str, str]): {"prompt"|"chosen"|"rejected": column}.
    """

    def __init__(self, *, train_on_input: bool, column_map: Dict[str, str]):
        self.train_on_input = train_on_input
        self.column_map = column_map

    def __call__(self, sample: Mapping[str, Any]) -> Dict[str, List[Message]]:
        prompt = sample[self.column_map["prompt"]]
        out = {}
        for side in ("chosen", "rejected"):
            out[side] = [
                Message(role="user", content=prompt, masked=not self.train_on_input),
                Message(role="assistant", content=sample[self.column_map[side]]),
            ]
        return out


class HHToMessages(Transform):
    """HH-RLHF rows -> chosen/rejected messages with
    :class:`~torchtune.data.ChosenRejectedToMessages`; a side stored as a transcript string
    (the hub's format) is split into turns first.

    Args:
        train_on_input (bool): keep non-assistant turns in the loss.
        column_map (Dict[str, str]): {"chosen"|"rejected": column}.
        new_system_prompt (Optional[str]): system message replacing any in the rows.
    """

    def __init__(self, *, train_on_input: bool, column_map: Dict[str, str], new_system_prompt: Optional[str]):
        self.column_map = column_map
        self.inner = ChosenRejectedToMessages(
            train_on_input=train_on_input, column_map=column_map, new_system_prompt=new_system_prompt
        )

    def __call__(self, sample: Mapping[str, Any]) -> Dict[str, List[Message]]:
        sample = dict(sample)
        for side in ("chosen", "rejected"):
            key = self.column_map[side]
            value = sample[key]
            if isinstance(value, str):
                value = parse_hh_transcript(value)
            # ChosenRejectedToMessages writes "masked" into each turn dict: work on copies.
            sample[key] = [dict(turn) for turn in value]
        return self.inner(sample)


def _build(
    name: str,
    tokenizer: Any,
    *,
    check: Callable[[Mapping[str, Any]], Optional[str]],
    message_transform: Transform,
    load: RowOptions,
) -> ValidatedPreferenceDataset:
    if load.packed:
        raise ValueError(f"{name}: packed=True is not supported for preference datasets (as in torchtune)")
    rows = load.prepare(name, check, _COMMON_ARGS)
    return ValidatedPreferenceDataset(rows=rows, message_transform=message_transform, tokenizer=tokenizer)


def stack_exchange_paired_dataset(
    tokenizer: Any,
    *,
    source: str = "lvwerra/stack-exchange-paired",
    data_files: Any = None,
    split: str = "train",
    column_map: Optional[Dict[str, str]] = None,
    train_on_input: bool = False,
    packed: bool = False,
    subset_size: Optional[int] = None,
    subset_seed: int = 0,
    on_bad_row: str = "error",
    filter_fn: Optional[Callable] = None,
    **load_dataset_kwargs: Any,
) -> ValidatedPreferenceDataset:
    """Stack Exchange paired answers (``lvwerra/stack-exchange-paired``): ``question`` is the
    prompt, ``response_j`` (higher score) chosen, ``response_k`` rejected.

    On the hub, ``data_dir="data/rl"`` is used unless given (torchtune's choice: the RL split of
    the repository); local sources get no ``data_dir``.

    Args:
        tokenizer (ModelTokenizer): tokenizer with ``tokenize_messages``.
        source (str): hub dataset or "json"/"parquet". Default "lvwerra/stack-exchange-paired".
        data_files (Any): local file(s) for a file ``source``.
        split (str): split. Default "train".
        column_map (Optional[Dict[str, str]]): {"prompt"|"chosen"|"rejected": column}; default
            {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}.
        train_on_input (bool): keep the prompt in the loss. Default False.
        packed (bool): must be False (as in torchtune).
        subset_size (Optional[int]): keep this many pairs (seeded). Default None.
        subset_seed (int): subset seed. Default 0.
        on_bad_row (str): "error" (default) or "skip".
        filter_fn (Optional[Callable]): row filter.
        **load_dataset_kwargs (Any): more ``load_dataset`` arguments.

    Returns:
        ValidatedPreferenceDataset: pairs in ``PreferenceDataset`` format.
    """
    cmap = {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}
    cmap.update(column_map or {})
    if source == "lvwerra/stack-exchange-paired" and data_files is None:
        load_dataset_kwargs.setdefault("data_dir", "data/rl")

    def check(row: Mapping[str, Any]) -> Optional[str]:
        return check_text_field(row, cmap["prompt"]) or check_text_field(row, cmap["chosen"]) or check_text_field(row, cmap["rejected"])

    return _build(
        "stack_exchange_paired",
        tokenizer,
        check=check,
        message_transform=PromptResponsesToMessages(train_on_input=train_on_input, column_map=cmap),
        load=RowOptions(
            source=source, data_files=data_files, split=split, packed=packed, subset_size=subset_size,
            subset_seed=subset_seed, on_bad_row=on_bad_row, filter_fn=filter_fn, load_dataset_kwargs=load_dataset_kwargs,
        ),
    )


def hh_rlhf_dataset(
    tokenizer: Any,
    *,
    source: str = "Anthropic/hh-rlhf",
    data_files: Any = None,
    split: str = "train",
    column_map: Optional[Dict[str, str]] = None,
    train_on_input: bool = False,
    new_system_prompt: Optional[str] = None,
    packed: bool = False,
    subset_size: Optional[int] = None,
    subset_seed: int = 0,
    on_bad_row: str = "error",
    filter_fn: Optional[Callable] = None,
    **load_dataset_kwargs: Any,
) -> ValidatedPreferenceDataset:
    """Anthropic HH-RLHF (``Anthropic/hh-rlhf``) preference pairs.

    ``chosen``/``rejected`` are either message lists (``[{role, content}]``, OpenAI style, as in
    processed copies) or the hub's transcript strings ("\\n\\nHuman: ...\\n\\nAssistant: ...").
    Both sides must end with a non-empty assistant turn; pick a subset of the hub repository
    with ``data_dir`` (e.g. "harmless-base", "helpful-base").

    Args:
        tokenizer (ModelTokenizer): tokenizer with ``tokenize_messages``.
        source (str): hub dataset or "json"/"parquet". Default "Anthropic/hh-rlhf".
        data_files (Any): local file(s) for a file ``source``.
        split (str): split. Default "train".
        column_map (Optional[Dict[str, str]]): {"chosen"|"rejected": column}.
        train_on_input (bool): keep non-assistant turns in the loss. Default False.
        new_system_prompt (Optional[str]): system message for every pair.
        packed (bool): must be False.
        subset_size (Optional[int]): keep this many pairs (seeded). Default None.
        subset_seed (int): subset seed. Default 0.
        on_bad_row (str): "error" (default) or "skip". Note: the real HH-RLHF data has a few
            pairs whose chosen answer is empty; they are bad rows.
        filter_fn (Optional[Callable]): row filter.
        **load_dataset_kwargs (Any): more ``load_dataset`` arguments (e.g. ``data_dir``).

    Returns:
        ValidatedPreferenceDataset: pairs in ``PreferenceDataset`` format.
    """
    cmap = {"chosen": "chosen", "rejected": "rejected"}
    cmap.update(column_map or {})

    def check(row: Mapping[str, Any]) -> Optional[str]:
        for side in ("chosen", "rejected"):
            key = cmap[side]
            value = row.get(key)
            if isinstance(value, str):
                turns = parse_hh_transcript(value)
                if turns is None:
                    return f"field {key!r} is a string without 'Human:'/'Assistant:' turns"
                value = turns
            problem = check_message_list(
                value if key in row else None, key, role_key="role", content_key="content", role_map=_OPENAI_ROLES
            )
            if problem:
                return problem
        return None

    return _build(
        "hh_rlhf",
        tokenizer,
        check=check,
        message_transform=HHToMessages(train_on_input=train_on_input, column_map=cmap, new_system_prompt=new_system_prompt),
        load=RowOptions(
            source=source, data_files=data_files, split=split, packed=packed, subset_size=subset_size,
            subset_seed=subset_seed, on_bad_row=on_bad_row, filter_fn=filter_fn, load_dataset_kwargs=load_dataset_kwargs,
        ),
    )
