"""Where the YAML files under ``configs/`` are read from.

From the checkout when the package runs from one (``pip install -e .``, as scripts/setup.sh
installs it); from the copy a wheel installs under ``<prefix>/share/pp-runtime/configs``
(setup.cfg's ``data_files``) otherwise, so that a plain ``pip install .`` still finds the model
presets (the default model among them) and the simulator's hardware and model presets.

    configs_dir() / "models" / "smollm2-135m.yaml"
"""
from __future__ import annotations

import site
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent / "configs"
SHARE = Path("share") / "pp-runtime" / "configs"


def candidates() -> list[Path]:
    """In order: the checkout's configs/, then the installed copy for this interpreter's prefix
    (a venv or the system) and for a ``pip install --user``."""
    return [CHECKOUT, Path(sys.prefix) / SHARE, Path(site.getuserbase()) / SHARE]


def configs_dir() -> Path:
    """The first of ``candidates()`` that exists; the checkout's path when none does (the error
    that follows then names where the files were expected)."""
    return next((p for p in candidates() if p.is_dir()), CHECKOUT)


def find_config(spec: str | Path, kind: str) -> Path:
    """A ``--config`` value: the file it names when there is one; else, for a bare name such as
    ``pp2_zipf`` (no folder, ``.yaml`` optional), ``configs_dir() / kind / name.yaml`` when that
    exists, so an installed copy's configs can be used from any folder; else the path as given,
    for the reader's error to name."""
    path = Path(spec)
    if path.exists() or len(path.parts) != 1:
        return path
    shipped = configs_dir() / kind / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    return shipped if shipped.is_file() else path
