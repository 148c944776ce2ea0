"""Checks before any process starts: environment variables, input paths, the output folder.

A config that names a missing checkpoint, tokenizer file, data file or shard manifest, an
unset ``${oc.env:...}`` variable, or an ``output_dir`` that cannot be written would
otherwise fail inside every rank, seconds to minutes after launch, as a traceback wrapped
in torchrun's failure page. Here each problem is one line naming the key and its value.

Only omegaconf is imported (no torch): ``hlmtune validate`` and ``hlmtune run`` call this
before anything heavy.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Any, Iterator, List, Mapping, Tuple

from omegaconf import DictConfig, OmegaConf

# `${oc.env:NAME}` without a default (`${oc.env:NAME,default}` always resolves).
_ENV_REF = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)\s*\}")

# Keys that name inputs which must exist, wherever they appear in the config.
INPUT_DIR_KEYS = frozenset({"checkpoint_dir", "shards_dir", "model_dir", "data_dir", "pretrain_dir"})
INPUT_FILE_KEYS = frozenset(
    {"path", "special_tokens_path", "merges_file", "vocab_path", "tokenizer_path", "manifest_path", "data_files"}
)
# Keys that name outputs (created by the run) or are not local paths, even if they end in _dir/_path.
_NOT_INPUTS = frozenset({"output_dir", "log_dir", "output_name", "source"})


def env_problems(cfg: DictConfig) -> List[str]:
    """``${oc.env:NAME}`` references to unset variables, one line per key.

    Args:
        cfg (DictConfig): the unresolved config.

    Returns:
        List[str]: ``key 'a.b': ${oc.env:NAME}...: environment variable NAME is not set``.
    """
    out = []
    for key, value in _walk(OmegaConf.to_container(cfg, resolve=False)):
        if not isinstance(value, str):
            continue
        for name in _ENV_REF.findall(value):
            if name not in os.environ:
                out.append(f"key '{key}': {value}: environment variable {name} is not set (export it or override {key.split('.')[-1]}=...)")
    return out


def path_problems(data: Mapping[str, Any]) -> List[str]:
    """Input paths the config names that do not exist or cannot be read.

    Checked keys: directories ``checkpoint_dir``, ``shards_dir``, ``model_dir``,
    ``data_dir``, ``pretrain_dir``; files ``checkpoint_files`` (relative to the sibling
    ``checkpoint_dir``, list or torchtune's ``{filename_format, max_filename}`` form),
    tokenizer ``path`` / ``special_tokens_path`` / ``merges_file``, ``data_files`` (string,
    list or split mapping; globs must match), ``manifest_path``; and any other key ending
    in ``_dir``/``_path``/``_file``/``_files`` except outputs (``output_dir``, ``log_dir``).
    Remote references (``hf://``, ``https://`` ...) are not checked.

    Args:
        data (Mapping[str, Any]): the resolved config.

    Returns:
        List[str]: one line per problem, naming the key and the path.
    """
    out: List[str] = []
    for key, value in _walk(data):
        leaf = key.rsplit(".", 1)[-1].split("[")[0]
        if value is None or leaf in _NOT_INPUTS:
            continue
        if leaf == "checkpoint_files":
            parent = _parent(data, key)
            base = Path(str(parent.get("checkpoint_dir", ""))) if isinstance(parent, Mapping) else Path()
            for f in _checkpoint_files(value):
                _check_file(f"{key}", base / f, out)
            continue
        if leaf in INPUT_DIR_KEYS or (leaf.endswith("_dir") and leaf not in _NOT_INPUTS):
            if isinstance(value, str) and not _remote(value):
                p = Path(value)
                if not p.is_dir():
                    out.append(f"key '{key}': {value}: {'not a directory' if p.exists() else 'does not exist'}")
                elif not os.access(p, os.R_OK | os.X_OK):
                    out.append(f"key '{key}': {value}: not readable")
            continue
        if leaf in INPUT_FILE_KEYS or leaf.endswith(("_path", "_file", "_files")):
            if leaf == "path" and not _tokenizer_like(key):
                continue  # `path` elsewhere may be a hub id
            for v in _strings(value):
                if _remote(v):
                    continue
                if any(c in v for c in "*?["):
                    if not glob.glob(v):
                        out.append(f"key '{key}': {v}: no file matches")
                    continue
                _check_file(key, Path(v), out)
    return out


def output_problems(data: Mapping[str, Any]) -> List[str]:
    """``output_dir`` (top level) cannot be created or written."""
    value = data.get("output_dir")
    if not isinstance(value, str):
        return []
    p = Path(value)
    probe = p
    while not probe.exists():  # the nearest existing ancestor decides whether mkdir -p works
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        return [f"key 'output_dir': {value}: {probe} is a file, not a directory"]
    if not os.access(probe, os.W_OK | os.X_OK):
        return [f"key 'output_dir': {value}: not writable ({probe} is not writable by this user)"]
    return []


def preflight(cfg: DictConfig) -> List[str]:
    """Every pre-launch problem of a config (empty when it can run).

    Unset environment variables are reported first and alone: the config cannot be
    resolved without them, so paths built on them cannot be checked.

    Args:
        cfg (DictConfig): the unresolved config, overrides applied.

    Returns:
        List[str]: one line per problem.
    """
    problems = env_problems(cfg)
    if problems:
        return problems
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:  # omegaconf's InterpolationResolutionError and kin: one line
        return [f"cannot resolve the config: {str(e).splitlines()[0]}"]
    return path_problems(data) + output_problems(data)


# ---------------------------------------------------------------------------- helpers
def _walk(node: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    if isinstance(node, Mapping):
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            yield key, v
            if isinstance(v, (Mapping, list)):
                yield from _walk(v, key)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if isinstance(v, (Mapping, list)):
                yield from _walk(v, f"{prefix}[{i}]")


def _parent(data: Mapping[str, Any], key: str) -> Any:
    node: Any = data
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key)[:-1]:
        node = node[int(part[1:-1])] if part.startswith("[") else node.get(part)
        if node is None:
            return None
    return node


def _tokenizer_like(key: str) -> bool:
    return key.split(".")[0].split("[")[0] in ("tokenizer",) or ".tokenizer" in key


def _remote(v: str) -> bool:
    return "://" in v


def _strings(value: Any) -> List[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, Mapping):  # data_files: {train: [...], test: ...}
        return [s for v in value.values() for s in _strings(v)]
    return []


def _checkpoint_files(value: Any) -> List[str]:
    if isinstance(value, Mapping) and "filename_format" in value:
        n = str(value.get("max_filename", "1"))
        return [str(value["filename_format"]).format(str(i).zfill(len(n)), n) for i in range(1, int(n) + 1)]
    return _strings(value)


def _check_file(key: str, p: Path, out: List[str]) -> None:
    if not p.exists():
        out.append(f"key '{key}': {p}: does not exist")
    elif not os.access(p, os.R_OK):
        out.append(f"key '{key}': {p}: not readable")
