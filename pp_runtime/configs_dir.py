"""Where the YAML files under ``configs/`` are read from.

From the checkout when the package runs from one (``pip install -e .``, as scripts/setup.sh
installs it); from the copy a wheel installs under ``<data>/share/pp-runtime/configs``
(setup.cfg's ``data_files``; ``<data>`` is the install scheme's data path: the venv, /usr/local
for a system pip, the user base for ``--user``) otherwise, so that a plain ``pip install .``
still finds the model presets (the default model among them) and the simulator's presets.

    configs_dir() / "models" / "smollm2-135m.yaml"
    find_config("pp2_zipf", "runs")   # ./pp2_zipf if that file exists, else configs/runs/pp2_zipf.yaml
"""
from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKOUT = ROOT / "configs"
SHARE = Path("share") / "pp-runtime" / "configs"
# files of configs/sim/ that are presets the configs refer to, not simulation configs themselves
NOT_CONFIGS = {"sim": ("hardware", "models")}


def _data_paths() -> list[Path]:
    """The data paths a wheel's data_files may have gone to: this interpreter's default scheme,
    the user scheme, and sys.prefix (a venv's)."""
    paths = [sysconfig.get_path("data")]
    try:
        paths.append(sysconfig.get_path("data", f"{os.name}_user"))
    except KeyError:  # no user scheme on this platform
        pass
    paths.append(sys.prefix)
    return [Path(p) for p in dict.fromkeys(paths) if p]


def candidates() -> list[Path]:
    """In order: the checkout's configs/ (only when this package runs from a checkout, so that
    some other distribution's top-level configs/ in site-packages is never taken for it), then
    the installed copies."""
    checkout = [CHECKOUT] if (ROOT / "setup.cfg").is_file() else []
    return checkout + [p / SHARE for p in _data_paths()]


def configs_dir() -> Path:
    """The first of ``candidates()`` that exists; the checkout's path when none does (the error
    that follows then names where the files were expected)."""
    return next((p for p in candidates() if p.is_dir()), CHECKOUT)


def find_config(spec: str | Path, kind: str) -> Path:
    """A ``--config`` value: the file it names when there is one; else, for a bare name such as
    ``pp2_zipf`` (no folder, ``.yaml`` / ``.yml`` optional), ``configs_dir() / kind / name.yaml``
    when that exists, so an installed copy's configs can be used from any folder; else the path
    as given, for the reader's error to name."""
    raw, path = str(spec), Path(spec)
    if path.is_file() or "/" in raw or os.sep in raw:
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
    if Path(name).stem in NOT_CONFIGS.get(kind, ()):
        return path
    shipped = configs_dir() / kind / name
    return shipped if shipped.is_file() else path
