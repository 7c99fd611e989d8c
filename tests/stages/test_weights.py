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


@pytest.mark.parametrize("arch, changes, window", [
    ("mistral", dict(sliding_window=16), 16),
    ("mistral", dict(sliding_window=None), None),
    # Qwen2 slides only with use_sliding_window, and then from layer max_window_layers on
    ("qwen2", dict(sliding_window=16, use_sliding_window=False), None),
    ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=4), None),
    ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=2), 16),
])
def test_sliding_window_caps_the_length_where_a_layer_slides(hf_models: dict, tmp_path: Path, arch: str,
                                                             changes: dict, window: int | None) -> None:
    from pp_runtime.engine_args import build_engine_config
    cfg = hf_config(edited(hf_models[arch], tmp_path / "m", **changes))
    assert (cfg.sliding_window, cfg.max_position_embeddings) == (window, 512)
    assert cfg.max_len == (window or 512)
    assert build_engine_config(str(tmp_path / "m"))[0].scheduler.max_model_len == cfg.max_len
    if window:  # longer would attend past the window: refused by the field's name
        with pytest.raises(ValueError, match="max_model_len=64 exceeds the model's sliding window of 16 tokens"):
            build_engine_config(str(tmp_path / "m"), max_model_len=64)


def test_generation_config_adds_its_stop_ids(hf_models: dict, tmp_path: Path) -> None:
    """Instruct models often list their end-of-turn token only in generation_config.json, where
    transformers' generate and vLLM find it."""
    m = edited(hf_models["llama"], tmp_path / "m", eos_token_id=2)
    (m / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 188], "bos_token_id": 1}))
    assert hf_config(m).eos_token_ids == (2, 188)
    (m / "generation_config.json").write_text("{")
    with pytest.raises(ModelError, match="generation_config.json is not valid JSON"):
        hf_config(m)
    (m / "generation_config.json").unlink()
    assert hf_config(m).eos_token_ids == (2,)
