"""Where the disk tier of each rank of an engine lives under `state_disk_dir`, and what engines of
other sizes left there.

An engine at tensor_parallel=1 keeps its conversations in state_disk_dir itself (one manifest,
`<id>.json`, per conversation). Rank r of an engine at tensor_parallel=N > 1 keeps its shard of each
conversation (its KV heads) under the same id in state_disk_dir/tp{N}-rank{r}. A stored conversation
is therefore continued only by an engine of the size that stored it: another size does not find it,
and says so (`stored_elsewhere`, `elsewhere_hint`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_RANK0 = re.compile(r"tp(\d+)-rank0")


def rank_dir(state_disk_dir: str, size: int, rank: int) -> str:
    """The folder of rank `rank` of an engine of `size` ranks (size > 1)."""
    return os.path.join(os.path.expanduser(state_disk_dir), f"tp{size}-rank{rank}")


def root_of(disk_dir: Path, size: int) -> Path:
    """The state_disk_dir that holds `disk_dir`, the disk tier's folder of a rank of an engine of
    `size` ranks (size 1: the folder itself)."""
    return disk_dir.parent if size > 1 else disk_dir


def stored_elsewhere(root: Path, size: int) -> dict[int, list[str]]:
    """{another size M: ids of the conversations an engine at tensor_parallel=M stored under `root`}
    (its rank 0's, for M > 1), sizes with none left out."""
    found = {1: _ids(root)}
    if root.is_dir():
        for folder in root.iterdir():
            match = _RANK0.fullmatch(folder.name)
            if match and folder.is_dir():
                found[int(match.group(1))] = _ids(folder)
    return {m: ids for m, ids in sorted(found.items()) if m != size and ids}


def elsewhere_hint(root: Path, size: int, conversation_id: str) -> str:
    """Why an engine at tensor_parallel=`size` does not find `conversation_id` under `root`, when an
    engine of another size stored it there; "" otherwise."""
    for m, ids in stored_elsewhere(root, size).items():
        if conversation_id in ids:
            return (f"; an engine at tensor_parallel={m} stored it in {root}, and only an engine of that size "
                    f"continues it (this one is at tensor_parallel={size})")
    return ""


def _ids(folder: Path) -> list[str]:
    return sorted(p.name[: -len(".json")] for p in folder.glob("*.json")) if folder.is_dir() else []
