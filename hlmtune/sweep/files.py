"""The sweep templates and example grids shipped with the pack (``hlmtune ls``/``cp``/``path``)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Dict, List, Optional

_ROOT = Path(__file__).parent


def pack_files() -> Dict[str, Path]:
    """File name -> path of every template (``templates/*.j2``) and example grid (``grids/*.yaml``)."""
    out = {p.name: p for p in sorted((_ROOT / "templates").glob("*.j2"))}
    out.update({p.name: p for p in sorted((_ROOT / "grids").glob("*.yaml"))})
    return out


def pack_file(name: str) -> Optional[Path]:
    """A template or example grid by file name, with or without ``.j2`` / ``.yaml``; None if unknown."""
    files = pack_files()
    for candidate in (name, f"{name}.j2", f"{name}.yaml"):
        if candidate in files:
            return files[candidate]
    return None


def pack_grids() -> List[str]:
    """File names of the example grids shipped with the pack (``grids/*.yaml``)."""
    return [n for n, p in pack_files().items() if p.parent.name == "grids"]


def resolve_grid(name: str) -> Path:
    """A grid file: the path if such a file exists, else a shipped grid by name (``.yaml`` optional).

    A local file wins over a shipped grid of the same name (``hlmtune cp`` keeps the name, and
    the copy is the one being edited). The shipped grids write their sweep under the current
    directory (``runs/<name>/``), not next to the grid file.

    Args:
        name (str): what the user typed after ``hlmtune sweep``.

    Returns:
        Path: the grid file to load.

    Raises:
        GridError: neither a file nor a shipped grid (names the closest shipped grid).
    """
    from hlmtune.sweep.grid import GridError

    if Path(name).is_file():
        return Path(name)
    p = pack_file(name)
    if p is not None and p.name in pack_grids():
        return p
    grids = pack_grids()
    stem = Path(name).name
    stem = stem[:-5] if stem.endswith(".yaml") else stem
    stems = [g[:-5] for g in grids]
    match = [s for s in stems if stem and s.startswith(stem)] or difflib.get_close_matches(stem, stems, n=1, cutoff=0.4)
    hint = f" (did you mean '{match[0]}.yaml'?)" if match else ""
    raise GridError(f"{name}: no such grid file, nor a grid shipped with the pack{hint}; "
                    "list the shipped grids with `hlmtune ls`")
