"""Process-group setup and teardown by device, and the few collectives the loop needs.

CPU runs use gloo, CUDA runs NCCL. A run started as a plain process (no ``torchrun``) still
gets a one-rank process group, so every code path (barriers, state-dict gathering, metric
reduction) is the same at world size 1 and N.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Sequence

import torch
import torch.distributed as dist

from hlmtune.proc import die_with_parent, launcher_pid


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job.

    Attributes:
        rank (int): global rank.
        world_size (int): number of ranks.
        local_rank (int): rank on this node.
        local_world_size (int): ranks on this node.
        device (torch.device): the device this rank computes on.
        backend (str): ``gloo`` or ``nccl``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_rank_zero(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def nodes(self) -> int:
        """Number of nodes (``world_size / local_world_size``)."""
        return max(1, self.world_size // max(1, self.local_world_size))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(name: str | None) -> torch.device:
    """Turn the config's ``device`` into this rank's device.

    Args:
        name (str | None): ``cpu``, ``cuda`` or ``cuda:N``; None picks CUDA when available.

    Returns:
        torch.device: ``cuda:<LOCAL_RANK>`` for ``cuda`` (one GPU per rank), else CPU.

    Raises:
        RuntimeError: ``cuda`` asked for on a machine without CUDA.
    """
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "config asks for device=cuda but CUDA is not available here; "
                "override with device=cpu (e.g. `hlmtune run ... device=cpu`)"
            )
        if dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        raise RuntimeError(f"device={name!r} is not supported (use cpu or cuda)")
    return dev


def init_distributed(device_name: str | None, timeout_s: float = 1800.0) -> DistInfo:
    """Initialise the default process group for this device.

    Under ``torchrun`` the usual env vars (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...)
    are used; a plain process becomes rank 0 of 1 on a free loopback port.

    Args:
        device_name (str | None): the config's ``device``.
        timeout_s (float): collective timeout.

    Returns:
        DistInfo: this rank's placement.
    """
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        _die_with_launcher()
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        )
    device = resolve_device(device_name)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            kwargs["device_id"] = device  # eager NCCL init, binds the communicator to this GPU
        dist.init_process_group(**kwargs)
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
        device=device,
        backend=backend,
    )


def _die_with_launcher() -> None:
    """Under torchrun: this rank dies when the launcher does (see ``hlmtune/proc.py``).

    torchrun puts each rank in a new session, so killing the launcher's process group leaves
    the ranks running; the parent-death signal closes that gap. The launcher may have died
    before this point (imports take seconds): ``hlmtune run`` exports the pid of the process
    that runs torchrun's agent, and a rank whose parent is no longer that pid, while that pid
    is gone, was orphaned.
    """
    expected = launcher_pid()
    if expected is not None and expected != os.getppid():
        try:
            os.kill(expected, 0)
            expected = None  # alive but not our parent: an unrelated value inherited from outside
        except ProcessLookupError:
            pass  # the launcher is gone and we were re-parented
        except PermissionError:
            expected = None
    die_with_parent(expected_parent=expected)


# Process groups unregistered by teardown_distributed but kept alive until the process ends.
RETIRED_GROUPS: List[object] = []


def teardown_distributed() -> None:
    """Unregister the default process group if one exists, and keep its object alive.

    Why not let it go: gloo's C++ destructor joins its worker threads while the calling
    thread holds the GIL, and a worker still releasing a finished collective's Python-owned
    tensors needs the GIL: a deadlock. Seen at the end of a 2-rank DPO run: the main thread
    in ``~ProcessGroupGloo`` -> ``thread::join`` as the DDP reducer was freed, the gloo thread
    in ``~AsyncAllgatherWork`` -> GIL. Kept here, no destructor runs while recipe objects are
    freed; ``hlmtune run`` ranks then leave with ``os._exit`` (``hlmtune/_rank.py``), so it
    never runs.
    """
    if dist.is_available() and dist.is_initialized():
        RETIRED_GROUPS.append(dist.distributed_c10d._get_default_group())
        dist.destroy_process_group()


def all_gather_floats(values: Sequence[float], device: torch.device) -> List[List[float]]:
    """Gather a short vector of floats from every rank (one collective).

    Args:
        values (Sequence[float]): this rank's values (same length on every rank).
        device (torch.device): where the collective runs (CUDA for NCCL, CPU for gloo).

    Returns:
        List[List[float]]: ``out[r]`` is rank r's vector.
    """
    mine = torch.tensor(list(values), dtype=torch.float64, device=device)  # (K,)
    world = dist.get_world_size()
    if world == 1:
        return [mine.tolist()]
    out = torch.empty(world * mine.numel(), dtype=torch.float64, device=device)  # (W*K,)
    dist.all_gather_into_tensor(out, mine)
    return out.view(world, -1).cpu().tolist()  # (W, K)


def rank_zero_value(value: Any) -> Any:
    """Rank 0's ``value`` on every rank: one decision made once for the whole run.

    Args:
        value (Any): a picklable value (what rank 0 decided; other ranks pass anything, e.g. None).

    Returns:
        Any: rank 0's value; ``value`` itself without a process group or with one rank.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_module_params(module: torch.nn.Module, *, only_trainable: bool = True) -> None:
    """Copy rank 0's parameters to every rank (used instead of DDP's initial sync).

    DDP's own initial sync broadcasts every parameter, frozen (possibly NF4) base weights
    included; those are loaded identically from the checkpoint on every rank, so only the
    trainable ones need it.

    Args:
        module (torch.nn.Module): the (unwrapped) model.
        only_trainable (bool): skip parameters with ``requires_grad=False``.
    """
    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for p in module.parameters():
            if only_trainable and not p.requires_grad:
                continue
            dist.broadcast(p.data, src=0)
