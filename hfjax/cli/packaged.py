"""Files shipped inside the package: the example configs (`hfjax/configs`, also the repository's `configs/`), found
through `importlib.resources` so that `hfjax quickstart` and the other commands work from any directory of an
installed wheel."""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path

CONFIG_PREFIX = "configs/"


def packaged_configs() -> list[str]:
    """The shipped configs, as names relative to the config folder (`quickstart.yaml`, `gsm8k/...yaml`)."""
    root = resources.files("hfjax") / "configs"
    names: list[str] = []
    stack = [(root, "")]
    while stack:
        folder, prefix = stack.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                stack.append((entry, f"{prefix}{entry.name}/"))
            elif entry.name.endswith(".yaml"):
                names.append(prefix + entry.name)
    return sorted(names)


def config_path(name: str) -> Path:
    """`name` itself when it is a file; otherwise the shipped config of that name (`quickstart.yaml`, with or without
    a leading `configs/`). Raises FileNotFoundError listing the shipped configs."""
    if Path(name).is_file():
        return Path(name)
    relative = name[len(CONFIG_PREFIX) :] if name.startswith(CONFIG_PREFIX) else name
    shipped = packaged_configs()
    if relative in shipped:
        return Path(str(resources.files("hfjax") / "configs" / relative))
    close = difflib.get_close_matches(relative, shipped, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise FileNotFoundError(
        f"{name}: no such config file, and no shipped config of that name (shipped: {', '.join(shipped)}){hint}"
    )
