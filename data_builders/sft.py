"""Supervised fine-tuning builders: alpaca-cleaned, grammar (C4_200M), samsum, slimorca.

Each builder mirrors torchtune 0.6.1's (``torchtune/datasets/_alpaca.py`` etc.): same hub
defaults, same message transforms (:class:`~torchtune.data.AlpacaToMessages`,
:class:`~torchtune.data.InputOutputToMessages`, :class:`~torchtune.data.ShareGPTToMessages`),
same sample format (``{"tokens", "labels", "mask"}`` with prompt labels set to
``CROSS_ENTROPY_IGNORE_IDX`` = -100, collated by ``padded_collate_sft``), and adds:

- the matching prompt template applied by the builder (torchtune leaves it to the tokenizer's
  ``prompt_template``): alpaca's instruct prompt, ``GrammarErrorCorrectionTemplate``,
  ``SummarizeTemplate``;
- row validation before tokenization with an error naming file and row, or skip-and-count
  (``on_bad_row``; the count is ``dataset.skipped_rows``);
- an equal-size, seeded subset (``subset_size``, ``subset_seed``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
from torchtune.data import (
    CROSS_ENTROPY_IGNORE_IDX,
    AlpacaToMessages,
    InputOutputToMessages,
    Message,
    PromptTemplate,
    ShareGPTToMessages,
    validate_messages,
)
from torchtune.datasets import PackedDataset, SFTDataset
from torchtune.modules.transforms import Transform

from hlmtune.data_builders.loading import (
    PreparedRows,
    check_message_list,
    check_text_field,
    prepare_rows,
    reject_typos,
)

# Template dotpaths (``prompt_template`` accepts these, a {role: (prepend, append)} dict, a
# template object, or None).
GRAMMAR_TEMPLATE = "torchtune.data.GrammarErrorCorrectionTemplate"
SUMMARIZE_TEMPLATE = "torchtune.data.SummarizeTemplate"

# Template name reported per builder (token-count report, docs).
TEMPLATE_NAMES = {
    "alpaca_cleaned": "instruct",
    "grammar": "grammar_error_correction",
    "samsum": "summarize",
    "slimorca": "chat",
}

_COMMON_ARGS = (
    "source", "data_files", "split", "column_map", "train_on_input", "packed", "subset_size",
    "subset_seed", "on_bad_row", "filter_fn", "new_system_prompt", "prompt_template",
)

TemplateSpec = Union[None, str, Dict[str, Any], Callable[..., List[Message]]]


def resolve_template(spec: TemplateSpec) -> Optional[Callable[..., List[Message]]]:
    """Turn a ``prompt_template`` argument into a template object.

    Args:
        spec (TemplateSpec): None, a dotpath of a template class/partial
            ("torchtune.data.SummarizeTemplate"), a ``{role: [prepend, append]}`` dict, or an
            object with ``__call__(messages)``.

    Returns:
        Optional[Callable]: the template, or None.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        module_name, _, attr = spec.rpartition(".")
        if not module_name:
            raise ValueError(f"prompt_template {spec!r} is not a dotpath like 'torchtune.data.SummarizeTemplate'")
        target = getattr(importlib.import_module(module_name), attr)
        return target()
    if isinstance(spec, Mapping):
        return PromptTemplate({role: tuple(tags) for role, tags in spec.items()})
    if callable(spec):
        return spec
    raise TypeError(f"prompt_template must be None, a dotpath, a dict or a template, got {type(spec).__name__}")


class TemplatedMessages(Transform):
    """Apply a prompt template to the ``messages`` a message transform produced.

    Args:
        inner (Transform): the message transform (e.g. ``InputOutputToMessages``).
        template (Optional[Callable]): prompt template (``PromptTemplate`` interface), or None.
    """

    def __init__(self, inner: Transform, template: Optional[Callable[..., List[Message]]]):
        self.inner = inner
        self.template = template

    def __call__(self, sample: Mapping[str, Any]) -> Mapping[str, Any]:
        out = dict(self.inner(sample))
        if self.template is not None:
            out["messages"] = [_join_text(m) for m in self.template(out["messages"])]
        return out


def _join_text(message: Message) -> Message:
    """Merge a text-only message's content items into one.

    ``PromptTemplate`` adds its tags as separate content items and ``Llama3Tokenizer`` strips
    every item, which would turn "Correct this to standard English: {input}\n---\nCorrected: "
    into "Correct this to standard English:{input}---\nCorrected:". One item keeps the template
    exactly as documented (only the ends of the whole message are stripped).
    """
    if any(item["type"] != "text" for item in message.content):
        return message
    return Message(
        role=message.role,
        content="".join(item["content"] for item in message.content),
        masked=message.masked,
        ipython=message.ipython,
        eot=message.eot,
    )


class ValidatedSFTDataset(SFTDataset):
    """An :class:`~torchtune.datasets.SFTDataset` over rows already loaded, validated and subset.

    ``SFTDataset.__init__`` calls ``load_dataset`` itself, so it is not called; samples are made
    exactly like ``SFTDataset``'s (message transform -> ``validate_messages`` -> tokenizer ->
    ``labels = where(mask, -100, tokens)``) with public torchtune pieces only.

    Attributes:
        skipped_rows (int): bad rows skipped with ``on_bad_row="skip"``.
        row_indices (List[int]): index of each sample's row in the loaded split.
        source_label (str): the file(s) or hub dataset the rows came from.
        message_transform (Transform): row -> ``{"messages": [...]}``.
        model_transform (Transform): the tokenizer.
    """

    def __init__(self, *, rows: PreparedRows, message_transform: Transform, model_transform: Transform) -> None:
        # Deliberately no super().__init__(): the rows are loaded already (see class docstring).
        self.message_transform = message_transform
        self.model_transform = model_transform
        self._rows = rows.data
        self.row_indices = rows.row_indices
        self.skipped_rows = rows.skipped_rows
        self.source_label = rows.source_label

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        return self.transform(self._rows[index])

    def messages(self, index: int) -> List[Message]:
        """The templated messages of sample ``index`` (before tokenization)."""
        return self.message_transform(self._rows[index])["messages"]

    def transform(self, row: Mapping[str, Any]) -> Dict[str, Any]:
        """Row -> ``{"messages", "tokens", "mask", "labels"}`` (``SFTTransform``'s contract)."""
        sample = self.message_transform(row)
        validate_messages(sample["messages"])
        tokenized = self.model_transform(sample)
        if "tokens" not in tokenized or "mask" not in tokenized:
            raise ValueError(f"model_transform returned {sorted(tokenized)}; it must return 'tokens' and 'mask'")
        tokenized["labels"] = list(np.where(tokenized["mask"], CROSS_ENTROPY_IGNORE_IDX, tokenized["tokens"]))
        return tokenized


def _check_tokenizer_template(name: str, tokenizer: Any, template: Any) -> None:
    if template is not None and getattr(tokenizer, "prompt_template", None) is not None:
        raise ValueError(
            f"{name}: the tokenizer has a prompt_template and the builder applies one too, the "
            "prompt would be templated twice. Set prompt_template: null in the dataset config, "
            "or remove it from the tokenizer config."
        )


def _finish(name: str, tokenizer: Any, ds: ValidatedSFTDataset, packed: bool) -> Union[ValidatedSFTDataset, PackedDataset]:
    if not packed:
        return ds
    if getattr(tokenizer, "max_seq_len", None) is None:
        raise ValueError(f"{name}: packed=True requires max_seq_len to be set on the tokenizer")
    out = PackedDataset(ds, max_seq_len=tokenizer.max_seq_len)
    # Keep the counters reachable on the packed dataset too.
    out.skipped_rows = ds.skipped_rows
    out.source_label = ds.source_label
    return out


@dataclass(frozen=True)
class RowOptions:
    """Where a builder's rows come from and which are kept (one object, passed down once).

    The public builders take these as explicit keyword arguments (config validation reads
    their signatures) and bundle them here; everything below takes the bundle.

    Attributes:
        source (str): hub dataset, or "json"/"parquet" with ``data_files``.
        data_files (Any): local file(s) when ``source`` is a file type.
        split (str): split to load.
        packed (bool): pack samples to the tokenizer's ``max_seq_len``.
        subset_size (Optional[int]): keep this many rows (seeded).
        subset_seed (int): seed of the subset.
        on_bad_row (str): "error" or "skip".
        filter_fn (Optional[Callable]): keep rows where it is true.
        load_dataset_kwargs (Dict[str, Any]): more ``datasets.load_dataset`` arguments.
    """

    source: str
    data_files: Any
    split: str
    packed: bool
    subset_size: Optional[int]
    subset_seed: int
    on_bad_row: str
    filter_fn: Optional[Callable]
    load_dataset_kwargs: Dict[str, Any]

    def prepare(self, name: str, check: Callable[[Mapping[str, Any]], Optional[str]], builder_args: Tuple[str, ...]) -> PreparedRows:
        """Reject typos among the extra kwargs, then load, validate, filter and subset the rows."""
        reject_typos(name, self.load_dataset_kwargs, builder_args)
        return prepare_rows(
            name=name, source=self.source, data_files=self.data_files, split=self.split, check=check,
            on_bad_row=self.on_bad_row, subset_size=self.subset_size, subset_seed=self.subset_seed,
            filter_fn=self.filter_fn, load_dataset_kwargs=self.load_dataset_kwargs,
        )


def _build(
    name: str,
    tokenizer: Any,
    *,
    check: Callable[[Mapping[str, Any]], Optional[str]],
    message_transform: Transform,
    load: RowOptions,
) -> Union[ValidatedSFTDataset, PackedDataset]:
    rows = load.prepare(name, check, _COMMON_ARGS)
    ds = ValidatedSFTDataset(rows=rows, message_transform=message_transform, model_transform=tokenizer)
    return _finish(name, tokenizer, ds, load.packed)


def alpaca_cleaned_dataset(
    tokenizer: Any,
    *,
    source: str = "yahma/alpaca-cleaned",
    data_files: Any = None,
    split: str = "train",
    column_map: Optional[Dict[str, str]] = None,
    train_on_input: bool = True,
    packed: bool = False,
    subset_size: Optional[int] = None,
    subset_seed: int = 0,
    on_bad_row: str = "error",
    filter_fn: Optional[Callable] = None,
    **load_dataset_kwargs: Any,
) -> Union[ValidatedSFTDataset, PackedDataset]:
    """Alpaca-cleaned (``yahma/alpaca-cleaned``) with the Alpaca instruct prompt.

    The prompt ("Below is an instruction that describes a task ... ### Response:\\n", with an
    "### Input:" block when ``input`` is non-empty) is applied by
    :class:`~torchtune.data.AlpacaToMessages`, as in torchtune.

    Args:
        tokenizer (ModelTokenizer): tokenizer with ``tokenize_messages`` (e.g. Llama3).
        source (str): hub dataset, or "json"/"parquet" with ``data_files``. Default
            "yahma/alpaca-cleaned".
        data_files (Any): local file(s) (path, glob or list) when ``source`` is a file type.
        split (str): split to load. Default "train".
        column_map (Optional[Dict[str, str]]): {"instruction"|"input"|"output": column}.
        train_on_input (bool): keep the prompt in the loss. Default True (torchtune's and
            alpaca-lora's default).
        packed (bool): pack to the tokenizer's ``max_seq_len``. Default False.
        subset_size (Optional[int]): keep this many rows (seeded, deterministic). Default None.
        subset_seed (int): seed of the subset. Default 0.
        on_bad_row (str): "error" (default) or "skip" bad rows (counted in ``skipped_rows``).
        filter_fn (Optional[Callable]): keep rows where ``filter_fn(row)`` is true.
        **load_dataset_kwargs (Any): more ``datasets.load_dataset`` arguments.

    Returns:
        Union[ValidatedSFTDataset, PackedDataset]: samples ``{"tokens", "labels", ...}``.
    """
    cmap = column_map or {}
    k_instruction = cmap.get("instruction", "instruction")
    k_input = cmap.get("input", "input")
    k_output = cmap.get("output", "output")

    def check(row: Mapping[str, Any]) -> Optional[str]:
        return (
            check_text_field(row, k_instruction)
            or check_text_field(row, k_input, allow_empty=True)
            or check_text_field(row, k_output)
        )

    return _build(
        "alpaca_cleaned",
        tokenizer,
        check=check,
        message_transform=AlpacaToMessages(train_on_input=train_on_input, column_map=column_map),
        load=RowOptions(
            source=source, data_files=data_files, split=split, packed=packed, subset_size=subset_size,
            subset_seed=subset_seed, on_bad_row=on_bad_row, filter_fn=filter_fn, load_dataset_kwargs=load_dataset_kwargs,
        ),
    )


def _input_output_dataset(
    name: str,
    tokenizer: Any,
    *,
    default_columns: Dict[str, str],
    column_map: Optional[Dict[str, str]],
    train_on_input: bool,
    new_system_prompt: Optional[str],
    prompt_template: TemplateSpec,
    load: RowOptions,
) -> Union[ValidatedSFTDataset, PackedDataset]:
    cmap = dict(default_columns)
    cmap.update(column_map or {})
    template = resolve_template(prompt_template)
    _check_tokenizer_template(name, tokenizer, template)

    def check(row: Mapping[str, Any]) -> Optional[str]:
        return check_text_field(row, cmap["input"]) or check_text_field(row, cmap["output"])

    transform = TemplatedMessages(
        InputOutputToMessages(train_on_input=train_on_input, column_map=cmap, new_system_prompt=new_system_prompt),
        template,
    )
    return _build(
        name,
        tokenizer,
        check=check,
        message_transform=transform,
        load=load,
    )


def grammar_dataset(
    tokenizer: Any,
    *,
    source: str = "liweili/c4_200m",
    data_files: Any = None,
    split: str = "train",
    column_map: Optional[Dict[str, str]] = None,
    train_on_input: bool = False,
    new_system_prompt: Optional[str] = None,
    prompt_template: TemplateSpec = GRAMMAR_TEMPLATE,
    packed: bool = False,
    subset_size: Optional[int] = None,
    subset_seed: int = 0,
    on_bad_row: str = "error",
    filter_fn: Optional[Callable] = None,
    **load_dataset_kwargs: Any,
) -> Union[ValidatedSFTDataset, PackedDataset]:
    """Grammar error correction on C4_200M (``liweili/c4_200m``: ``input`` -> ``output``).

    The user turn is wrapped by ``GrammarErrorCorrectionTemplate``:
    "Correct this to standard English: {input}\\n---\\nCorrected: ".

    Args:
        tokenizer (ModelTokenizer): tokenizer with ``tokenize_messages``. It must not have a
            ``prompt_template`` of its own while this builder applies one.
        source (str): hub dataset or "json"/"parquet". Default "liweili/c4_200m".
        data_files (Any): local file(s) for a file ``source``.
        split (str): split. Default "train".
        column_map (Optional[Dict[str, str]]): {"input"|"output": column}.
        train_on_input (bool): keep the prompt in the loss. Default False.
        new_system_prompt (Optional[str]): system message prepended to every sample.
        prompt_template (TemplateSpec): template; None to disable. Default
            "torchtune.data.GrammarErrorCorrectionTemplate".
        packed (bool): pack to ``max_seq_len``. Default False.
        subset_size (Optional[int]): keep this many rows (seeded). Default None.
        subset_seed (int): subset seed. Default 0.
        on_bad_row (str): "error" (default) or "skip".
        filter_fn (Optional[Callable]): row filter.
        **load_dataset_kwargs (Any): more ``load_dataset`` arguments.

    Returns:
        Union[ValidatedSFTDataset, PackedDataset]: the dataset.
    """
    return _input_output_dataset(
        "grammar",
        tokenizer,
        default_columns={"input": "input", "output": "output"},
        column_map=column_map,
        train_on_input=train_on_input,
        new_system_prompt=new_system_prompt,
        prompt_template=prompt_template,
        load=RowOptions(
            source=source, data_files=data_files, split=split, packed=packed, subset_size=subset_size,
            subset_seed=subset_seed, on_bad_row=on_bad_row, filter_fn=filter_fn, load_dataset_kwargs=load_dataset_kwargs,
        ),
    )


def samsum_dataset(
    tokenizer: Any,
    *,
    source: str = "Samsung/samsum",
    data_files: Any = None,
    split: str = "train",
    column_map: Optional[Dict[str, str]] = None,
    train_on_input: bool = False,
    new_system_prompt: Optional[str] = None,
    prompt_template: TemplateSpec = SUMMARIZE_TEMPLATE,
    packed: bool = False,
    subset_size: Optional[int] = None,
    subset_seed: int = 0,
    on_bad_row: str = "error",
    filter_fn: Optional[Callable] = None,
    **load_dataset_kwargs: Any,
) -> Union[ValidatedSFTDataset, PackedDataset]:
    """Dialogue summarization on SAMSum (``Samsung/samsum``: ``dialogue`` -> ``summary``).

    The user turn is wrapped by ``SummarizeTemplate``:
    "Summarize this dialogue:\\n{dialogue}\\n---\\nSummary:\\n". Dialogue turns keep their CRLF
    separators as in the source.

    Args:
        tokenizer (ModelTokenizer): tokenizer with ``tokenize_messages`` (no ``prompt_template``
            of its own while this builder applies one).
        source (str): hub dataset or "json"/"parquet". Default "Samsung/samsum".
        data_files (Any): local file(s) for a file ``source``.
        split (str): split. Default "train".
        column_map (Optional[Dict[str, str]]): {"input"|"output": column}; default
            {"input": "dialogue", "output": "summary"}.
        train_on_input (bool): keep the prompt in the loss. Default False.
        new_system_prompt (Optional[str]): system message prepended to every sample.
        prompt_template (TemplateSpec): template; None to disable. Default
            "torchtune.data.SummarizeTemplate".
        packed (bool): pack to ``max_seq_len``. Default False.
        subset_size (Optional[int]): keep this many rows (seeded). Default None.
        subset_seed (int): subset seed. Default 0.
        on_bad_row (str): "error" (default) or "skip".
        filter_fn (Optional[Callable]): row filter.
        **load_dataset_kwargs (Any): more ``load_dataset`` arguments.

    Returns:
        Union[ValidatedSFTDataset, PackedDataset]: the dataset.
    """
    return _input_output_dataset(
        "samsum",
        tokenizer,
        default_columns={"input": "dialogue", "output": "summary"},
        column_map=column_map,
        train_on_input=train_on_input,
        new_system_prompt=new_system_prompt,
        prompt_template=prompt_template,
        load=RowOptions(
            source=source, data_files=data_files, split=split, packed=packed, subset_size=subset_size,
            subset_seed=subset_seed, on_bad_row=on_bad_row, filter_fn=filter_fn, load_dataset_kwargs=load_dataset_kwargs,
        ),
    )


_SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


def slimorca_dataset(
    tokenizer: Any,
    *,
    source: str = "Open-Orca/SlimOrca-Dedup",
    data_files: Any = None,
    split: str = "train",
    column_map: Optional[Dict[str, str]] = None,
    train_on_input: bool = False,
    new_system_prompt: Optional[str] = None,
    prompt_template: TemplateSpec = None,
    packed: bool = False,
    subset_size: Optional[int] = None,
    subset_seed: int = 0,
    on_bad_row: str = "error",
    filter_fn: Optional[Callable] = None,
    **load_dataset_kwargs: Any,
) -> Union[ValidatedSFTDataset, PackedDataset]:
    """SlimOrca (``Open-Orca/SlimOrca-Dedup``), ShareGPT conversations
    (``conversations: [{from: system|human|gpt, value}]``) via
    :class:`~torchtune.data.ShareGPTToMessages`. A chat dataset: no prompt template by default
    (the tokenizer's chat format frames the turns).

    Args:
        tokenizer (ModelTokenizer): tokenizer with ``tokenize_messages``.
        source (str): hub dataset or "json"/"parquet". Default "Open-Orca/SlimOrca-Dedup".
        data_files (Any): local file(s) for a file ``source``.
        split (str): split. Default "train".
        column_map (Optional[Dict[str, str]]): {"conversations": column}.
        train_on_input (bool): keep system/user turns in the loss. Default False.
        new_system_prompt (Optional[str]): replaces the rows' system messages.
        prompt_template (TemplateSpec): optional template. Default None.
        packed (bool): pack to ``max_seq_len``. Default False.
        subset_size (Optional[int]): keep this many rows (seeded). Default None.
        subset_seed (int): subset seed. Default 0.
        on_bad_row (str): "error" (default) or "skip".
        filter_fn (Optional[Callable]): row filter.
        **load_dataset_kwargs (Any): more ``load_dataset`` arguments.

    Returns:
        Union[ValidatedSFTDataset, PackedDataset]: the dataset.
    """
    key = (column_map or {}).get("conversations", "conversations")
    template = resolve_template(prompt_template)
    _check_tokenizer_template("slimorca", tokenizer, template)

    def check(row: Mapping[str, Any]) -> Optional[str]:
        return check_message_list(
            row.get(key) if key in row else None,
            key,
            role_key="from",
            content_key="value",
            role_map=_SHAREGPT_ROLES,
        )

    transform = TemplatedMessages(
        ShareGPTToMessages(train_on_input=train_on_input, column_map={"conversations": key}, new_system_prompt=new_system_prompt),
        template,
    )
    return _build(
        "slimorca",
        tokenizer,
        check=check,
        message_transform=transform,
        load=RowOptions(
            source=source, data_files=data_files, split=split, packed=packed, subset_size=subset_size,
            subset_seed=subset_seed, on_bad_row=on_bad_row, filter_fn=filter_fn, load_dataset_kwargs=load_dataset_kwargs,
        ),
    )
