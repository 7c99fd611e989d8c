"""Model configs the stage code cannot run exactly are refused by name, not loaded wrong."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stages.model_source import ModelError, hf_config


def edited(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act 'gelu_pytorch_tanh' .* is not supported"),
    (dict(mlp_bias=True), "mlp_bias .* is not supported"),
    (dict(attention_bias=True), "attention_bias .* is not supported for llama"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope scaling 'yarn' is not supported"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "rope scaling 'linear' is not supported"),
])
def test_unsupported_options_are_refused(hf_models: dict, tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ModelError, match=message):
        hf_config(edited(hf_models["llama"], tmp_path / "m", **changes))


def test_supported_options_load(hf_models: dict, tmp_path: Path) -> None:
    # silu spelled out, biases off, and qwen2's q/k/v biases (its o_proj has none)
    cfg = hf_config(edited(hf_models["llama"], tmp_path / "m", hidden_act="silu", mlp_bias=False,
                           attention_bias=False))
    assert not cfg.qkv_bias
    assert hf_config(hf_models["qwen2"]).qkv_bias


def test_a_corrupt_safetensors_file_is_named(hf_models: dict, tmp_path: Path) -> None:
    from stages.weight_sources import SafetensorsSource
    bad = edited(hf_models["llama"], tmp_path / "m")
    (st,) = bad.glob("*.safetensors")
    st.write_bytes(b"\xff" * 1024)
    with pytest.raises(ModelError, match=f"{st} is not a readable safetensors file"):
        SafetensorsSource(str(bad))
