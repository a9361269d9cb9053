"""The target cache: token ids, loss masks and target features on disk (docs/design/cache.md).

One module per job:

- :mod:`deepspec.data.cache.format`: the on-disk format ``deepspec-target-cache/3`` (file names,
  storage dtypes, the tensors of a shard and their byte layout, the stored form of one sample's
  features, reading the manifest) and :class:`CacheSummary`;
- :mod:`deepspec.data.cache.fp8`: the ``fp8`` storage mode's quantisation;
- :mod:`deepspec.data.cache.samples`: prepared row -> training samples, the one rule of the cache
  writer, online mode and ``deepspec estimate``;
- :mod:`deepspec.data.cache.writer`: building a cache (deterministic shards, resume, ranks, manifest);
- :mod:`deepspec.data.cache.reader`: :class:`TargetCache` (memory-mapped, one sample at a time)
  and :func:`check_compatible`;
- :mod:`deepspec.data.cache.verify`: ``deepspec cache --verify``.

The names below are re-exported so that ``from deepspec.data.cache import X`` keeps working; the
package's own modules import from the submodule that defines a name. A test that replaces a name
a function looks up (``capture_sample_features``, ``render_training_samples``) patches the
submodule that looks it up, not this package.
"""

from deepspec.data.cache.format import (
    FORMAT_VERSION,
    STORAGE_DTYPES,
    CacheSummary,
    cache_bytes_per_token,
    check_storage_dtype,
    sha256_file,
    storage_features,
)
from deepspec.data.cache.fp8 import dequantize_fp8, quantize_fp8
from deepspec.data.cache.reader import TargetCache, check_compatible
from deepspec.data.cache.samples import check_prepared_render, iter_prepared_samples, keep_sample, render_prepared_row
from deepspec.data.cache.verify import ShardCheck, verify_target_cache
from deepspec.data.cache.writer import write_target_cache, write_target_cache_from_samples

__all__ = [
    "FORMAT_VERSION",
    "STORAGE_DTYPES",
    "CacheSummary",
    "ShardCheck",
    "TargetCache",
    "cache_bytes_per_token",
    "check_compatible",
    "check_prepared_render",
    "check_storage_dtype",
    "dequantize_fp8",
    "iter_prepared_samples",
    "keep_sample",
    "quantize_fp8",
    "render_prepared_row",
    "sha256_file",
    "storage_features",
    "verify_target_cache",
    "write_target_cache",
    "write_target_cache_from_samples",
]
