"""pp_runtime/config.py: CacheConfig's and ParallelConfig's checks name the field; the LM head's
rows per stage."""
from __future__ import annotations

import pytest

from pp_runtime.config import CacheConfig, ParallelConfig


def test_cache_config_prefault() -> None:
    assert CacheConfig().prefault is False and CacheConfig(prefault=True).prefault is True
    with pytest.raises(ValueError, match="CacheConfig.prefault must be true or false, got 'yes'"):
        CacheConfig(prefault="yes")
    with pytest.raises(ValueError, match="CacheConfig.kv_dtype"):
        CacheConfig(kv_dtype="int8")


@pytest.mark.parametrize("pp, tp, share, vocab, cut", ((2, 1, 0.5, 49152, 24576), (2, 2, 0.5, 256, 128),
                                                       (3, 1, 0.3, 49152, 14752), (2, 1, 0.001, 256, 16),
                                                       (2, 4, 0.999, 256, 192), (2, 1, 0.5, 1000, 496)))
def test_head_rows_cut_whole_panels_on_every_rank(pp: int, tp: int, share: float, vocab: int, cut: int) -> None:
    """The split point is a multiple of 16·tp, at least one such step from either end; stages
    between the ends hold no head."""
    rows = ParallelConfig(pp, tp, head_split=share).head_rows(vocab)
    assert rows == [(0, cut)] + [None] * (pp - 2) + [(cut, vocab)]
    assert ParallelConfig(pp, tp).head_rows(vocab) == [None] * (pp - 1) + [(0, vocab)]


@pytest.mark.parametrize("kw, message", ((dict(pp=1, head_split=0.5), "head_split needs pp > 1"),
                                         (dict(pp=2, head_split=1), "head_split must be a share in"),
                                         (dict(pp=2, head_split=False), "head_split must be a share in"),
                                         (dict(pp=2, head_split="0.5"), "head_split must be a share in")))
def test_parallel_config_head_split_is_checked(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"ParallelConfig.{message}"):
        ParallelConfig(**kw)
