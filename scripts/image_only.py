"""Hide from Python every module that the GPU image lacks and .whl/ does not carry, so that a CPU run imports as the
device call would (scripts/gpu_rehearse.sh).

    python scripts/image_only.py KINDS.md .whl > hidden.txt     # the modules to hide, one a line
    QGATE_HIDDEN=hidden.txt PYTHONPATH=DIR python ...          # with this file as DIR/sitecustomize.py: hidden

The first form reads the image's package list (the "Packages:" line of the device tool's KINDS.md) and the wheels in
.whl/, and prints the top-level modules of this interpreter's installed distributions that neither holds. Imported
as sitecustomize, it wraps every finder on sys.meta_path so that each answers None for those modules: imports of
them fail, and importlib.util.find_spec, with which libraries probe what is installed, says None, as on the image.
Each hidden module asked for is appended to the file QGATE_HIDDEN_LOG names, where it is set.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def hidden(kinds: Path, wheels: Path) -> list[str]:
    from importlib.metadata import packages_distributions

    if not kinds.is_file():
        raise SystemExit(f"{kinds}: not found: the GPU image's package list (the device tool's KINDS.md); set KINDS")
    line = next((s for s in kinds.read_text().splitlines() if "Packages: " in s), None)
    if line is None:
        raise SystemExit(f"{kinds}: no line with 'Packages: ' (the GPU image's package list)")
    there = {_norm(p.strip()) for p in line.split("Packages: ", 1)[1].rstrip(".").split(",")}
    there |= {_norm(w.name.split("-")[0]) for w in wheels.glob("*.whl")}
    mods = packages_distributions()
    return sorted(m for m, dists in mods.items() if m != "qgate" and not any(_norm(d) in there for d in dists))


class _Hiding:
    """A finder that answers None for the hidden modules and asks the finder it wraps about the rest."""

    def __init__(self, finder, names: frozenset[str], log: str | None):
        self.finder, self.names, self.log = finder, names, log

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in self.names:
            if self.log:
                with open(self.log, "a") as f:
                    f.write(top + "\n")
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python scripts/image_only.py KINDS.md WHEEL_DIR")
    print("\n".join(hidden(Path(sys.argv[1]), Path(sys.argv[2]))))
elif os.environ.get("QGATE_HIDDEN"):
    _names = frozenset(Path(os.environ["QGATE_HIDDEN"]).read_text().split())
    sys.meta_path[:] = [_Hiding(f, _names, os.environ.get("QGATE_HIDDEN_LOG")) for f in sys.meta_path]
