"""Experiment grids as SLURM job arrays: ``hlmtune sweep GRID.yaml``.

A grid file (base config + axes + zip lists + per-value overrides) expands to a manifest of
tasks and plain sbatch scripts rendered from the Jinja2 templates in ``templates/``; each
array task runs one ``hlmtune run`` into ``runs/<sweep>/<task>-<name>/``. See docs/sweep.md.

Modules: ``grid`` (schema and expansion, no torch), ``prepare`` (config per task, validation,
manifest), ``render`` (templates), ``slurm`` (sbatch / squeue / sacct), ``local`` (run without
SLURM), ``status``, ``files`` (pack templates and example grids for ``hlmtune cp``; grids by name for
``hlmtune sweep NAME``), ``cli``.
"""
