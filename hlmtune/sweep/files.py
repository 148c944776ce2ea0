"""The sweep templates and example grids shipped with the pack (``hlmtune ls``/``cp``/``path``)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

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
