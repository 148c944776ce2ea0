"""Profiling for hlmtune runs (imported as ``hlmtune.profiling``; see docs/profiling.md).

- ``hlmtune.profiling.collector.CollectorLogger``: torchtune metric logger recording per-step
  iteration time, tokens/s and peak memory (``run.json``, ``steps.jsonl``, ``summary.json``);
- ``hlmtune.profiling.runs``: reading run directories (partial runs included) and summaries;
- ``hlmtune.profiling.analysis``: ``hlmtune collect`` (scaling table, problems);
- ``hlmtune.profiling.plots``: PNG plots;
- ``hlmtune.profiling.nsys``: ``hlmtune profile nsys|parse`` (Nsight Systems stats CSV / SQLite);
- ``hlmtune.profiling.torchprof``: ``hlmtune profile torch`` (CPU, torch.profiler).

Nothing is imported here so that ``hlmtune --help`` stays fast.
"""
