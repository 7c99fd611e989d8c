"""pp_runtime/config.py: CacheConfig's checks name the field; which K/V dtypes suit which model."""
from __future__ import annotations

import pytest

from pp_runtime.config import CacheConfig, check_kv_dtype


def test_cache_config_prefault() -> None:
    assert CacheConfig().prefault is False and CacheConfig(prefault=True).prefault is True
    with pytest.raises(ValueError, match="CacheConfig.prefault must be true or false, got 'yes'"):
        CacheConfig(prefault="yes")
    with pytest.raises(ValueError, match="CacheConfig.kv_dtype"):
        CacheConfig(kv_dtype="int8")


def test_cache_config_prefix_caching() -> None:
    assert CacheConfig().enable_prefix_caching is True  # as in vLLM
    assert CacheConfig(enable_prefix_caching=False).enable_prefix_caching is False
    with pytest.raises(ValueError, match="CacheConfig.enable_prefix_caching must be true or false, got 1"):
        CacheConfig(enable_prefix_caching=1)


@pytest.mark.parametrize("kv,device,dtype,error", (
    ("auto", "cuda", "bfloat16", None),
    ("fp8", "cpu", "float32", None),
    ("float16", "cpu", "float32", None),
    ("fp8", "cpu", "bfloat16", "kv_cache_dtype fp8 is for float32 models on CPU"),
    ("fp8", "cuda", "bfloat16", None),  # vLLM's --kv-cache-dtype fp8 on a GPU: half a bf16 model's K/V
    ("fp8", "cuda", "float16", None),
    ("fp8", "cuda", "float32", None),
    ("float16", "cuda", "float32", None),
    ("float16", "cuda", "bfloat16", "kv_cache_dtype float16 is no smaller than a bfloat16 model's K/V on CUDA"),
    ("float16", "cuda", "float16", "kv_cache_dtype float16 is no smaller than a float16 model's K/V on CUDA"),
    ("int8", "cuda", "bfloat16", "kv_cache_dtype must be auto or float16 or fp8, got 'int8'")))
def test_kv_dtype_suits_the_model(kv: str, device: str, dtype: str, error: str | None) -> None:
    if error is None:
        check_kv_dtype(kv, device, dtype)
    else:
        with pytest.raises(ValueError, match=error):
            check_kv_dtype(kv, device, dtype)


@pytest.mark.parametrize("field, value, heads", [("num_heads", 3, dict(num_heads=3, num_kv_heads=1, head_dim=16)),
                                                 ("num_kv_heads", 3, dict(num_heads=6, num_kv_heads=3, head_dim=16)),
                                                 ("intermediate_size", 129, {}), ("vocab_size", 251, {})])
def test_tp_must_divide_every_split_dimension_named(field: str, value: int, heads: dict) -> None:
    """Checked before any worker starts: a vocabulary of 251 used to fail inside the workers'
    weight loading as 'dimension 251 is not divisible by tp=2', naming no field."""
    from pp_runtime.config import ModelConfig, ParallelConfig
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    ParallelConfig(1, 2).check_model(ModelConfig(**shape))
    shape.update({field: value, **heads})
    with pytest.raises(ValueError, match=f"tp=2 does not divide the model's {field}={value}"):
        ParallelConfig(1, 2).check_model(ModelConfig(**shape))
