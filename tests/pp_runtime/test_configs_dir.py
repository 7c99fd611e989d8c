"""configs/ outside the checkout: a wheel installs it under <prefix>/share/pp-runtime/configs
(setup.cfg data_files), and the model and simulator presets are found there."""
from __future__ import annotations

import configparser
import glob
import shutil
import sys
from pathlib import Path

import pytest

from pp_runtime import configs_dir as cd
from pp_runtime.sim import presets
from stages import model_source

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def installed_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The package as a non-editable install sees it: no checkout configs/, the copy under the
    interpreter's prefix (only the default model's preset and the simulator's presets in it)."""
    share = tmp_path / "prefix" / cd.SHARE
    (share / "models").mkdir(parents=True)
    shutil.copy(ROOT / "configs" / "models" / "smollm2-135m.yaml", share / "models")
    shutil.copytree(ROOT / "configs" / "sim", share / "sim")
    shutil.copytree(ROOT / "configs" / "runs", share / "runs")
    monkeypatch.setattr(cd, "ROOT", tmp_path / "site-packages")  # no setup.cfg beside the package
    monkeypatch.setattr(cd, "CHECKOUT", tmp_path / "site-packages" / "configs")
    monkeypatch.setattr(cd, "_data_paths", lambda: [tmp_path / "empty-user", tmp_path / "prefix"])
    monkeypatch.chdir(tmp_path)
    return share


def test_checkout_comes_first() -> None:
    assert cd.configs_dir() == ROOT / "configs"


def test_installed_copy_is_found_without_a_checkout(installed_copy: Path) -> None:
    assert cd.configs_dir() == installed_copy
    assert model_source.preset_names() == ["smollm2-135m"]
    assert model_source.resolve_model(None).kind == "gguf"  # the default model, from the installed preset
    assert "cpu-2core" in presets.hardware_names()


def test_another_packages_configs_folder_is_not_taken_for_ours(installed_copy: Path, tmp_path: Path) -> None:
    """Outside a checkout, a top-level configs/ in site-packages (some other distribution's) is not ours."""
    (tmp_path / "site-packages" / "configs" / "models").mkdir(parents=True)
    assert cd.configs_dir() == installed_copy


def test_data_paths_cover_the_install_schemes() -> None:
    """Where pip puts a wheel's data_files: the default scheme's data path (a venv, or /usr/local
    for a Debian system pip, whose sys.prefix is /usr), the user scheme's, and sys.prefix."""
    import sysconfig
    paths = cd._data_paths()
    assert Path(sysconfig.get_path("data")) in paths and Path(sys.prefix) in paths
    assert len(paths) == len(set(paths))


def test_missing_everywhere_names_the_checkout_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cd, "CHECKOUT", tmp_path / "gone" / "configs")
    monkeypatch.setattr(cd, "_data_paths", lambda: [tmp_path / "empty-prefix"])
    assert cd.configs_dir() == tmp_path / "gone" / "configs"
    with pytest.raises(model_source.ModelError, match="not found"):
        model_source.resolve_model(None)
    with pytest.raises(ValueError, match="cannot read hardware presets"):
        presets.hardware_names()


def test_setup_cfg_installs_every_config_file() -> None:
    """Every YAML under configs/ is in a data_files entry that installs it where configs_dir looks."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    installed = {}
    for target, pattern in cfg["options.data_files"].items():
        for f in glob.glob(str(ROOT / pattern.strip())):
            installed[Path(f).relative_to(ROOT / "configs")] = Path(target) / Path(f).name
    shipped = {p.relative_to(ROOT / "configs") for p in (ROOT / "configs").rglob("*.yaml")}
    assert shipped and set(installed) == shipped
    for rel, dest in installed.items():
        assert dest == cd.SHARE / rel


@pytest.mark.parametrize("spec", ["pp2_zipf", "pp2_zipf.yaml"])
def test_bare_config_name_is_looked_up_in_configs(spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pp-runtime bench --config pp2_zipf` from any folder: a name that is not a file here."""
    from pp_runtime.run_config import load_run_config
    from pp_runtime.sim.config import load_sim_config
    monkeypatch.chdir(tmp_path)
    assert cd.find_config(spec, "runs") == ROOT / "configs" / "runs" / "pp2_zipf.yaml"
    assert load_run_config(spec).workload == load_run_config(ROOT / "configs" / "runs" / "pp2_zipf.yaml").workload
    assert load_sim_config("smoke").path == str(ROOT / "configs" / "sim" / "smoke.yaml")


def test_bare_names_find_the_installed_copy(installed_copy: Path) -> None:
    from pp_runtime.run_config import load_run_config
    assert cd.find_config("pp2_zipf", "runs") == installed_copy / "runs" / "pp2_zipf.yaml"
    assert cd.find_config("smoke.yml", "sim") == Path("smoke.yml")  # no smoke.yml.yaml: .yml is a suffix too
    assert cd.find_config("fig12", "sim") == installed_copy / "sim" / "fig12.yaml"
    assert load_run_config("pp2_zipf").workload.num_requests > 0


def test_edge_cases_of_a_bare_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fig12").mkdir()  # e.g. left by `simulate --config fig12 --out fig12`
    assert cd.find_config("fig12", "sim") == ROOT / "configs" / "sim" / "fig12.yaml"
    assert cd.find_config("./smoke", "sim") == Path("smoke")  # written as a path: not looked up
    assert cd.find_config("hardware", "sim") == Path("hardware")  # a preset file, not a config
    assert cd.find_config("models", "sim") == Path("models")


def test_config_path_wins_and_unknown_names_stay_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pp_runtime.run_config import load_run_config
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pp2_zipf.yaml").write_text("workload: {num_requests: 3, prompt_len: 8, output_len: 2}\n")
    assert cd.find_config("pp2_zipf.yaml", "runs") == Path("pp2_zipf.yaml")  # the local file, not the shipped one
    assert cd.find_config("nope", "runs") == Path("nope")
    assert cd.find_config("sub/pp2_zipf", "runs") == Path("sub/pp2_zipf")  # a path with a folder is never looked up
    with pytest.raises(ValueError, match="cannot read run config 'nope'"):
        load_run_config("nope")
