"""The 61 training patients' WFDB folders, as the ECG benchmarks read them from ``$HLM_DATA``.

MIT-BIH DS1 of ``$HLM_DATA/mitdb`` and every record of ``$HLM_DATA/svdb`` when that folder is there
(the training half of the Supraventricular Arrhythmia Database); DS2 is never listed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Tuple


def training_folders() -> List[Tuple[Path, str, List[str]]]:
    """(folder, database name, record names) of each training database under ``$HLM_DATA``.

    Raises:
        SystemExit: ``HLM_DATA`` unset, or no ``$HLM_DATA/mitdb`` folder (the message names it).
    """
    from hlmtune.ecg_tokenizer.labels import MITDB_DS1
    from hlmtune.ecg_tokenizer.records import list_records

    if not os.environ.get("HLM_DATA"):
        raise SystemExit("set HLM_DATA (MIT-BIH in $HLM_DATA/mitdb, svdb in $HLM_DATA/svdb) or pass --records DIR")
    data = Path(os.environ["HLM_DATA"])
    if not (data / "mitdb").is_dir():
        raise SystemExit(f"{data / 'mitdb'}: not a folder (MIT-BIH's records are read from there)")
    out = [(data / "mitdb", "mitdb", list(MITDB_DS1))]
    if (data / "svdb").is_dir():
        out.append((data / "svdb", "svdb", list_records(data / "svdb")))
    return out
