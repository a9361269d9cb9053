"""Online mode: target features computed on demand, with the interface of the target cache.

Shape legend: T tokens of one sample, H target hidden size, n number of target layers,
F = n * H target feature size.

DESIGN section 4 offers **online mode** where a cache would be too large (about 38 TB for
Qwen3-4B on the original data): the frozen target computes the same tensors inside the training
loop. "The same" is exact, not approximate: :class:`OnlineTargetFeatures` renders a prepared JSONL
file with the cache writer's rule (:func:`iter_prepared_samples`) and computes features with the
one capture function of the cache writer (:func:`deepspec.target.capture.capture_sample_features`,
each sample alone, no padding), converted as the cache writer stores them and its reader returns
them. So ``online[i]`` equals
``TargetCache(...)[i]`` bit for bit for the same target, data, layer ids, ``max_seq_len`` and
storage dtype, whatever batch the trainer later puts the sample in.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepspec.data.cache.format import check_storage_dtype, storage_features
from deepspec.data.cache.fp8 import dequantize_fp8
from deepspec.data.cache.samples import check_prepared_render, iter_prepared_samples
from deepspec.data.chat import target_stop_token_ids
from deepspec.data.conversations import read_jsonl
from deepspec.target import load
from deepspec.target.capture import capture_sample_features, validate_target_layer_ids

ONLINE_FORMAT = "deepspec-online/1"
FIELDS = ("input_ids", "loss_mask", "target_hidden", "target_last_hidden")


class OnlineTargetFeatures:
    """Training samples of a prepared JSONL file whose target features are computed on demand.

    Same interface as :class:`deepspec.data.cache.reader.TargetCache`: ``len``, ``read(i, fields)``,
    ``[i]``, ``sample_id(i)``, ``sample_length(i)``, ``target_layer_ids`` and a ``manifest`` dict
    (``target_fingerprint``, ``tokenizer_fingerprint``, ``target_layer_ids``, ``hidden_size``,
    ``feature_size``, ``dtypes``, ``max_seq_len``, counts) so that
    :func:`deepspec.data.cache.reader.check_compatible` works on it.

    ``online[i]`` -> ``{"input_ids": int32 [T], "loss_mask": uint8 [T], "target_hidden": [T, F],
    "target_last_hidden": [T, H]}``, all on the CPU, in the dtypes the cache reader returns for
    ``storage_dtype=feature_dtype`` (float32/bfloat16/float16 as named; fp8: ``target_hidden``
    quantised and dequantised to float32, ``target_last_hidden`` bfloat16). The rows are rendered
    once, at construction (token ids and masks only, :func:`iter_prepared_samples`, with the target's
    stop rule and the cache writer's render check :func:`deepspec.data.cache.samples.check_prepared_render`;
    the per-turn counts go into ``manifest``); features are
    computed at each read of a feature field by
    :func:`deepspec.target.capture.capture_sample_features` (the sample alone, under
    ``torch.no_grad``) and converted by the cache writer's own storage conversion: bitwise equal to
    what a cache with ``storage_dtype=feature_dtype`` built from the same file returns. Reading
    only ``input_ids`` / ``loss_mask`` runs no forward.

    Args:
        prepared_jsonl: a file written by ``deepspec prepare``.
        model: the frozen target (``*ForCausalLM``); features come from its device.
        tokenizer: the target's tokenizer (renders through its chat template).
        target_layer_ids: validated against the model's layer count.
        max_seq_len: samples longer than this are truncated (prefix kept); None keeps all.
        feature_dtype: "float32" (default) | "bfloat16" | "float16" | "fp8": the cache storage
            dtype to reproduce.
        target_fingerprint, tokenizer_fingerprint: recorded in the manifest; computed with
            :mod:`deepspec.target.load` when omitted.

    Raises:
        FileNotFoundError: ``prepared_jsonl`` does not exist.
        ValueError: invalid layer ids, ``max_seq_len`` < 1, unknown ``feature_dtype``, a bad row,
            or no sample left to train on. :meth:`read` raises ValueError for a sample whose
            features are not finite (the cache writer refuses such a sample).
    """

    FIELDS = fields = FIELDS  # no target_logsumexp / target_argmax: losses compute the full logits

    def __init__(
        self,
        prepared_jsonl: str | os.PathLike[str],
        model: nn.Module,
        tokenizer: Any,
        *,
        target_layer_ids: Sequence[int],
        max_seq_len: int | None,
        feature_dtype: str = "float32",
        target_fingerprint: str | None = None,
        tokenizer_fingerprint: str | None = None,
    ):
        self.path = Path(prepared_jsonl)
        if not self.path.is_file():
            raise FileNotFoundError(f"prepared data {self.path} not found; run `deepspec prepare` first")
        check_storage_dtype(feature_dtype, "feature_dtype")
        if max_seq_len is not None and max_seq_len < 1:
            raise ValueError(f"max_seq_len: expected >= 1 or None, received {max_seq_len}")
        num_hidden_layers = int(model.config.num_hidden_layers)
        self._layer_ids = validate_target_layer_ids(list(target_layer_ids), num_hidden_layers)
        self.model = model
        self.feature_dtype = feature_dtype
        stop_ids = target_stop_token_ids(model, tokenizer)
        render = check_prepared_render(self.path, tokenizer, stop_ids)  # the cache writer's check
        counts: dict[str, Any] = {}
        self._samples = list(iter_prepared_samples(read_jsonl(self.path), tokenizer, max_seq_len=max_seq_len,
                                                   counts=counts, stop_ids=stop_ids))
        if not self._samples:
            raise ValueError(
                f"{self.path}: no training sample left (rows {counts['num_rows']}, held out "
                f"{counts['num_heldout']}, without loss tokens {counts['num_refused_empty_mask']}); "
                f"prepare more data or raise max_seq_len"
            )
        if target_fingerprint is None or tokenizer_fingerprint is None:
            target_fingerprint = target_fingerprint or load.target_fingerprint(model)
            tokenizer_fingerprint = tokenizer_fingerprint or load.tokenizer_fingerprint(tokenizer)
        hidden_size = int(model.config.hidden_size)
        self.manifest: dict[str, Any] = {
            "format": ONLINE_FORMAT,
            "source": str(self.path),
            "target_fingerprint": target_fingerprint,
            "tokenizer_fingerprint": tokenizer_fingerprint,
            "target_layer_ids": list(self._layer_ids),
            "hidden_size": hidden_size,
            "feature_size": hidden_size * len(self._layer_ids),
            "num_hidden_layers": num_hidden_layers,
            "storage_dtype": feature_dtype,
            "max_seq_len": max_seq_len,
            "num_samples": len(self._samples),
            "num_tokens": sum(len(ids) for _, ids, _ in self._samples),
            "num_loss_tokens": sum(sum(mask) for _, _, mask in self._samples),
            "stop_token_ids": stop_ids,
            "render": render,
            **counts,
        }

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self._layer_ids)

    @property
    def storage_dtype(self) -> str:
        return self.feature_dtype

    def _locate(self, i: int) -> int:
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range for {n} online samples")
        return i

    def sample_id(self, i: int) -> str:
        """``row_id + suffix`` of sample ``i`` (the id the cache would record)."""
        return self._samples[self._locate(i)][0]

    def sample_length(self, i: int) -> int:
        """Tokens T of sample ``i`` (after truncation)."""
        return len(self._samples[self._locate(i)][1])

    def read(self, i: int, fields: Sequence[str] = FIELDS, *, dequantize: bool = True) -> dict[str, torch.Tensor]:
        """The named fields of sample ``i``; a forward of the target runs only if a feature field is asked.

        ``dequantize=False`` (``feature_dtype="fp8"`` only, as :meth:`TargetCache.read
        <deepspec.data.cache.reader.TargetCache.read>`): ``target_hidden`` stays the float8_e4m3fn
        payload and the dict gains ``target_hidden_scale`` float32 ``[T, n]``.

        Raises:
            ValueError: an unknown field name.
            IndexError: ``i`` out of range.
        """
        unknown = [f for f in fields if f not in FIELDS]
        if unknown:
            raise ValueError(f"fields: unknown {unknown}; expected a subset of {list(FIELDS)}")
        sample_id, ids, mask = self._samples[self._locate(i)]
        out: dict[str, torch.Tensor] = {}
        if "input_ids" in fields:
            out["input_ids"] = torch.tensor(ids, dtype=torch.int32)
        if "loss_mask" in fields:
            out["loss_mask"] = torch.tensor(mask, dtype=torch.uint8)
        if "target_hidden" in fields or "target_last_hidden" in fields:
            out.update(self._features(sample_id, ids, dequantize=dequantize))
        scale = ["target_hidden_scale"] if "target_hidden" in fields and "target_hidden_scale" in out else []
        return {name: out[name] for name in [*fields, *scale]}

    def _features(self, sample_id: str, ids: list[int], *, dequantize: bool = True) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            hidden_TF, last_TH = capture_sample_features(self.model, ids, self._layer_ids)
        stored = storage_features(hidden_TF, last_TH, self.feature_dtype, len(self._layer_ids))
        if stored is None:
            raise ValueError(
                f"online sample {sample_id!r} ({self.path}): the target's features hold NaN/inf; the cache writer "
                f"refuses such samples: remove the row, or build a cache (`deepspec cache`) and train on it"
            )
        if "target_hidden_scale" in stored and dequantize:  # fp8: what the cache reader returns (float32)
            stored["target_hidden"] = dequantize_fp8(stored.pop("target_hidden"), stored.pop("target_hidden_scale"))
        return stored

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.read(i)
