"""Checksums of a checkpoint step's files: `write_manifest` records every file's SHA-256 in the step's directory
once its files are final, `verify` reads them again and names the files that changed.

The manifest (`MANIFEST`) has `sha256sum`'s format (`cd <step> && sha256sum -c checksums.sha256` checks it by hand)
and is written to a temporary file and renamed into place, so it is either absent or complete. Files are read in
large blocks and hashed on a few threads (hashlib releases the GIL); SHA-256 is the fastest of hashlib's digests
where the CPU has SHA instructions (x86 SHA-NI, ARMv8).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "checksums.sha256"  # a line "<hex digest>  <path relative to the step>" per file
_DIGEST = re.compile("[0-9a-f]{64}")
_BLOCK = 8 << 20
_THREADS = min(8, os.cpu_count() or 1)


class ChecksumMismatch(ValueError):
    """A step's files differ from the checksums saved with it (or its manifest is unreadable); the message names
    the files."""


def write_manifest(step_dir: Path) -> None:
    """Records the digest of every file under `step_dir` (call once they are final)."""
    files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    names = [file.relative_to(step_dir).as_posix() for file in files]
    lines = [f"{digest}  {name}\n" for name, digest in zip(names, _digests(files), strict=True)]
    partial = step_dir / f".{MANIFEST}.{os.getpid()}.tmp"
    try:
        with open(partial, "w") as handle:
            handle.writelines(lines)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, step_dir / MANIFEST)
    finally:
        partial.unlink(missing_ok=True)


def verify(step_dir: Path) -> bool:
    """True when every file recorded in `step_dir`'s manifest has its recorded digest; False when the step has no
    manifest (saved before hfjax recorded checksums, or stopped before they were written). Raises
    `ChecksumMismatch` naming the files that are missing or changed, or when the manifest is unreadable."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return False
    recorded: dict[str, str] = {}
    try:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            digest, _, name = line.partition("  ")
            if not _DIGEST.fullmatch(digest) or not name:
                raise ValueError(f"line {number} is not '<sha256>  <path>'")
            recorded[name] = digest
        if not recorded:
            raise ValueError("it lists no files")
    except (OSError, ValueError) as e:
        raise ChecksumMismatch(f"its {MANIFEST} is unreadable ({e})") from e
    present = [name for name in recorded if (step_dir / name).is_file()]
    changed = [f"{name} is missing" for name in recorded.keys() - set(present)]
    for name, digest in zip(present, _digests(step_dir / name for name in present), strict=True):
        if digest != recorded[name]:
            changed.append(f"{name} does not match its saved sha256")
    if changed:
        more = f" (and {len(changed) - 3} more files)" if len(changed) > 3 else ""
        raise ChecksumMismatch("; ".join(sorted(changed)[:3]) + more)
    return True


def _digests(files: Iterable[Path]) -> list[str]:
    with ThreadPoolExecutor(_THREADS, thread_name_prefix="hfjax-checksum") as pool:
        return list(pool.map(_digest, files))


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    block = bytearray(_BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(block):
            digest.update(view[:read])
    return digest.hexdigest()
