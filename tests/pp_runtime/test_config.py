"""pp_runtime/config.py: CacheConfig's checks name the field."""
from __future__ import annotations

import pytest

from pp_runtime.config import CacheConfig


def test_cache_config_prefault() -> None:
    assert CacheConfig().prefault is False and CacheConfig(prefault=True).prefault is True
    with pytest.raises(ValueError, match="CacheConfig.prefault must be true or false, got 'yes'"):
        CacheConfig(prefault="yes")
    with pytest.raises(ValueError, match="CacheConfig.kv_dtype"):
        CacheConfig(kv_dtype="int8")


def test_cache_config_prefix_caching() -> None:
    assert CacheConfig().enable_prefix_caching is False
    assert CacheConfig(enable_prefix_caching=True).enable_prefix_caching is True
    with pytest.raises(ValueError, match="CacheConfig.enable_prefix_caching must be true or false, got 1"):
        CacheConfig(enable_prefix_caching=1)
