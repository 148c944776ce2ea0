"""Resumable training state: trainable weights, optimizer, scheduler, data position, RNG.

A checkpoint is a directory ``<output_dir>/checkpoints/step_<global_step>/``. All ranks write
into ``step_<N>.partial/`` first; after a barrier rank 0 writes ``state.json`` last and
renames the directory, so a directory without the ``.partial`` suffix is always complete and a
run killed mid-save leaves only a ``.partial`` that resume ignores.

Weights and optimizer state are gathered as *full* state dicts (torch's distributed
state-dict API handles FSDP2, DDP and plain modules alike), so a run may resume at another
world size. Only trainable parameters are stored (``ignore_frozen_params``): for LoRA that is
the adapters, the frozen (possibly NF4) base comes from the original checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch
import torch.distributed as dist
from hlmtune.files import atomic_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

STATE_FILE = "state.json"


def _rng_state() -> Dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state()[1].tolist(),
        "numpy_pos": int(np.random.get_state()[2]),
        "python": random.getstate()[1],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    """Where the resumable checkpoints of a run live."""
    return Path(output_dir) / "checkpoints"


def latest_checkpoint(output_dir: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint directory, or None.

    Args:
        output_dir (str | os.PathLike): the run's ``output_dir``.

    Returns:
        Optional[Path]: ``.../checkpoints/step_<N>`` with the largest N holding ``state.json``.
    """
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    best, best_step = None, -1
    for d in root.iterdir():
        if not d.is_dir() or not d.name.startswith("step_") or d.name.endswith(".partial"):
            continue
        try:
            step = int(d.name[len("step_"):])
        except ValueError:
            continue
        if (d / STATE_FILE).exists() and step > best_step:
            best, best_step = d, step
    return best


def save_training_state(
    *,
    output_dir: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Optional[Any],
    dataloader: Any,
    recipe_state: Dict[str, Any],
    keep_last: Optional[int] = None,
) -> Path:
    """Write a resumable checkpoint (collective: every rank must call it).

    Args:
        output_dir (str | os.PathLike): the run's ``output_dir``.
        model (torch.nn.Module): the wrapped training model (FSDP2, DDP or plain).
        optimizer (torch.optim.Optimizer): its optimizer.
        lr_scheduler (Optional[Any]): scheduler with ``state_dict()``, or None.
        dataloader (Any): a ``StatefulDataLoader`` (its per-rank position is saved).
        recipe_state (Dict[str, Any]): JSON-able counters; must hold ``global_step``.
        keep_last (Optional[int]): delete older complete checkpoints beyond this many.

    Returns:
        Path: the complete checkpoint directory.
    """
    rank = dist.get_rank()
    step = int(recipe_state["global_step"])
    root = checkpoint_root(output_dir)
    final = root / f"step_{step}"
    partial = root / f"step_{step}.partial"
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    model_sd = get_model_state_dict(model, options=opts)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    dist.barrier()
    atomic_torch_save({"dataloader": dataloader.state_dict(), "rng": _rng_state()}, partial / f"rank{rank}.pt")
    if rank == 0:
        atomic_torch_save(model_sd, partial / "trainable.pt")
        atomic_torch_save(optim_sd, partial / "optimizer.pt")
        if lr_scheduler is not None:
            atomic_torch_save(lr_scheduler.state_dict(), partial / "lr_scheduler.pt")
    dist.barrier()
    if rank == 0:
        state = dict(recipe_state, world_size=dist.get_world_size())
        with open(partial / STATE_FILE, "w") as f:
            json.dump(state, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        if keep_last:
            done = sorted(
                (d for d in root.iterdir() if d.is_dir() and d.name.startswith("step_") and not d.name.endswith(".partial")),
                key=lambda d: int(d.name.split("_")[1]),
            )
            for old in done[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_training_state(
    ckpt_dir: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Optional[Any],
    dataloader: Any,
) -> Dict[str, Any]:
    """Restore a checkpoint written by :func:`save_training_state` (collective).

    Args:
        ckpt_dir (Path): a complete ``step_<N>`` directory.
        model (torch.nn.Module): the wrapped training model, built and loaded with base weights.
        optimizer (torch.optim.Optimizer): its optimizer.
        lr_scheduler (Optional[Any]): scheduler, or None.
        dataloader (Any): the ``StatefulDataLoader``.

    Returns:
        Dict[str, Any]: the saved recipe state (``global_step``, ``epochs_run`` ...).

    Raises:
        FileNotFoundError: a file of the checkpoint is missing (named in the message).
    """
    rank = dist.get_rank()
    state = json.loads((ckpt_dir / STATE_FILE).read_text())
    for name in ("trainable.pt", "optimizer.pt"):
        if not (ckpt_dir / name).exists():
            raise FileNotFoundError(f"checkpoint {ckpt_dir} is missing {name}")
    model_sd = torch.load(ckpt_dir / "trainable.pt", map_location="cpu", weights_only=True)
    optim_sd = torch.load(ckpt_dir / "optimizer.pt", map_location="cpu", weights_only=True)
    set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True, strict=False))
    set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(full_state_dict=True))
    if lr_scheduler is not None and (ckpt_dir / "lr_scheduler.pt").exists():
        lr_scheduler.load_state_dict(torch.load(ckpt_dir / "lr_scheduler.pt", weights_only=True))
    rank_file = ckpt_dir / f"rank{rank}.pt"
    if state.get("world_size") == dist.get_world_size() and rank_file.exists():
        per_rank = torch.load(rank_file, weights_only=True)
        if state.get("step_in_epoch", 0):
            # Mid-epoch: the loader goes on where it stopped. At an epoch's end (step_in_epoch 0)
            # the next epoch is a fresh pass in that epoch's own order, as in the run that was
            # not stopped; the loader's position (partway through the finished epoch when
            # max_steps_per_epoch cut it, or batches were left over) must not carry into it.
            dataloader.load_state_dict(per_rank["dataloader"])
        _set_rng_state(per_rank["rng"])
    elif state.get("step_in_epoch", 0):
        raise RuntimeError(
            f"checkpoint {ckpt_dir} was written mid-epoch by {state.get('world_size')} ranks; "
            f"resume it with the same world size (now {dist.get_world_size()})"
        )
    return state
