"""Peak memory of each training step and since process start, on CUDA and CPU alike.

Two numbers answer two questions, so both are reported, under names that say which:

- ``peak_*_gib``: the peak *during one step* (the counters are reset when the step starts).
  Its maximum over the steps of a run is the "peak over steps" (setup and export excluded).
- ``peak_*_since_start_gib``: the peak *since the process started* (setup, model load,
  checkpointing included), as a running maximum of every reading taken before a reset.

CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` / the
``active_bytes.all.peak`` memory stat, reset with ``torch.cuda.reset_peak_memory_stats``.
CPU: the resident-set high-water mark ``VmHWM`` of ``/proc/self/status``, reset by writing
``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0, proc(5)). Where that file cannot be written
(other systems, restricted containers) ``getrusage``'s ``ru_maxrss`` is read instead and the
per-step value equals the since-start one (``per_step`` is then False).

Note: resetting ``VmHWM`` also lowers what ``getrusage`` reports afterwards (Linux derives
``ru_maxrss`` from the same high-water mark), which is why the since-start peak is kept here.
"""

from __future__ import annotations

import resource
import sys
from typing import Any, Dict, List, Optional

_GIB = 1024**3
CUDA_NAMES = ("peak_memory_alloc_gib", "peak_memory_reserved_gib", "peak_memory_active_gib")
CPU_NAMES = ("peak_rss_gib",)


def since_start_name(name: str) -> str:
    """``peak_rss_gib`` -> ``peak_rss_since_start_gib`` (the same quantity since process start)."""
    assert name.endswith("_gib"), name
    return name[: -len("_gib")] + "_since_start_gib"


def _vm_hwm_bytes() -> Optional[int]:
    """Resident-set high-water mark of this process (``VmHWM``, kB in /proc/self/status)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_vm_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # 5: reset the peak resident set size (proc(5))
        return True
    except OSError:
        return False


def _ru_maxrss_bytes() -> int:
    # ru_maxrss is KiB on Linux (getrusage(2)), bytes on macOS.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class PeakMemory:
    """Per-step and since-start peaks of one process.

    Call :meth:`begin_step` when a step starts and :meth:`end_step` when it ends.

    Args:
        device (Any): a ``torch.device`` or device string: CUDA (the allocator peaks of that
            device) or anything else (the process resident set size).
    """

    def __init__(self, device: Any) -> None:
        self._device = device
        self.cuda = str(getattr(device, "type", device)).startswith("cuda")
        self.names = CUDA_NAMES if self.cuda else CPU_NAMES
        self._since_start: List[float] = [0.0] * len(self.names)
        self.per_step = True if self.cuda else (_vm_hwm_bytes() is not None and _reset_probe())

    def _read(self) -> List[float]:
        if self.cuda:
            import torch

            d = self._device
            return [
                torch.cuda.max_memory_allocated(d) / _GIB,
                torch.cuda.max_memory_reserved(d) / _GIB,
                torch.cuda.memory_stats(d).get("active_bytes.all.peak", 0) / _GIB,
            ]
        hwm = _vm_hwm_bytes() if self.per_step else None
        return [(hwm if hwm is not None else _ru_maxrss_bytes()) / _GIB]

    def _fold(self, values: List[float]) -> None:
        self._since_start = [max(a, b) for a, b in zip(self._since_start, values)]

    def begin_step(self) -> None:
        """Fold the peak so far (setup, the previous step's tail, checkpointing) into the
        since-start peak, then reset the counters so the next reading is this step's own."""
        self._fold(self._read())
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self._device)
        elif self.per_step:
            self.per_step = _reset_vm_hwm()

    def end_step(self) -> Dict[str, float]:
        """This step's peaks and the since-start peaks, in GiB.

        Returns:
            Dict[str, float]: ``{name: step peak}`` for :attr:`names` and
            ``{since_start_name(name): since-start peak}``.
        """
        step = self._read()
        self._fold(step)
        out = dict(zip(self.names, step))
        out.update({since_start_name(n): v for n, v in zip(self.names, self._since_start)})
        return out


def _reset_probe() -> bool:
    """Whether this process may reset its own RSS high-water mark (checked once, harmless)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii"):
            return True
    except OSError:
        return False
