"""A training run's record: the step's logged values (:class:`StepMetrics`, one device read per step),
``train_log.jsonl`` and the TensorBoard events (:class:`RunLog`, rank 0) and ``train_loss.png``
(:func:`plot_log`).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from deepspec.checkpoints import RUN_LOG, clear_previous_run
from deepspec.models.acceptance import AcceptanceCounts
from deepspec.train.config import TrainConfig
from deepspec.train.distributed import Dist
from deepspec.utils import atomic_write_json, atomic_write_text, pyplot, save_png


class StepMetrics:
    """A step's logged sums, kept on the device until the step is logged.

    :meth:`add` sums each micro-batch's ``scalars()`` (0-d tensors, float64 on ``device``; plain
    floats are accepted) and its acceptance counts without reading the device. :meth:`read` packs the
    sums, the pooled acceptance counts and ``grad_norm`` into one tensor, all-reduces it once across
    ranks (sums; ``grad_norm`` is already global and is taken as is) and reads it on the host once:
    the step's only device sync besides the losses' own (``nonzero`` in the DSpark loss).

    float64 sums in micro-batch order: the same values as summing the scalars as Python floats.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.totals: dict[str, torch.Tensor] = {}
        self.acceptance: AcceptanceCounts | None = None
        self.num_added = 0

    def add(self, loss_out) -> None:
        """Add one micro-batch's ``loss_out.scalars()`` and ``loss_out.acceptance`` (no host read)."""
        for key, value in loss_out.scalars().items():
            value = torch.as_tensor(value, dtype=torch.float64, device=self.device)
            self.totals[key] = value if key not in self.totals else self.totals[key] + value
        if loss_out.acceptance is not None:
            a = loss_out.acceptance
            self.acceptance = a if self.acceptance is None else self.acceptance + a
        self.num_added += 1

    def read(self, ctx: Dist, *, num_tokens: int, grad_norm: torch.Tensor | float | None = None) -> dict[str, float]:
        """The step's logged values (summed over micro-batches and ranks) as floats: the scalars,
        ``num_tokens``, the pooled tau estimates (``tau_estimate`` (T = 1), ``greedy_tau_estimate``, the
        greedy prefix survival ``accept_rate_prefix_k`` per slot; none when the loss gives no counts,
        which every rank must then do alike) and ``grad_norm`` when given. One all-reduce, one host read."""
        keys = sorted(self.totals)
        parts = [torch.stack([self.totals[k] for k in keys]) if keys else torch.zeros(0, dtype=torch.float64,
                                                                                      device=self.device),
                 torch.full((1,), float(num_tokens), dtype=torch.float64, device=self.device)]
        K = 0
        if self.acceptance is not None:
            packed_RK = self.acceptance.pack().to(self.device, torch.float64)
            K = packed_RK.shape[1]
            parts.append(packed_RK.flatten())
        summed = torch.cat(parts)
        if ctx.sharded:
            dist.all_reduce(summed)
        if grad_norm is not None:
            summed = torch.cat([summed, torch.as_tensor(grad_norm, device=self.device).to(torch.float64).view(1)])
        host = summed.tolist()  # the host read
        out = dict(zip(keys, host[:len(keys)]))
        out["num_tokens"] = host[len(keys)]
        if K:
            R = AcceptanceCounts.NUM_ROWS
            pooled = AcceptanceCounts.unpack(torch.tensor(host[len(keys) + 1:len(keys) + 1 + R * K],
                                                          dtype=torch.float64).view(R, K))
            out["tau_estimate"], out["greedy_tau_estimate"] = pooled.tau(), pooled.greedy_tau()
            for k, (s, n) in enumerate(zip(pooled.greedy_survive_K.tolist(), pooled.count_K.tolist())):
                out[f"accept_rate_prefix_{k + 1}"] = s / n if n > 0 else 0.0
        if grad_norm is not None:
            out["grad_norm"] = host[-1]
        return out


class RunLog:
    """The run's log rows: appended to ``<output_dir>/train_log.jsonl`` and written as TensorBoard scalars
    (``<output_dir>/tensorboard``; ``heldout/<key>`` for the held-out curve, ``train/<key>`` for the rest)
    by rank 0. On the other ranks it holds no rows and writes nothing (:meth:`add` is rank 0's)."""

    def __init__(self, path: Path, rows: list[dict], writer=None) -> None:
        self.path, self.rows, self.writer = path, rows, writer

    @classmethod
    def start(cls, cfg: TrainConfig, start_step: int, *, is_main: bool) -> RunLog:
        """Rank 0: open the run folder at ``start_step``: with ``--resume never`` remove the earlier run
        (:func:`deepspec.checkpoints.clear_previous_run`), write ``train_config.json``, keep the earlier
        log's rows up to ``start_step`` (:func:`read_log`) and open the TensorBoard writer, dropping the
        events logged after ``start_step``. Other ranks: an empty log."""
        out = Path(cfg.output_dir)
        if not is_main:
            return cls(out / RUN_LOG, [])
        from torch.utils.tensorboard import SummaryWriter

        if cfg.resume == "never" and clear_previous_run(out):
            print(f"train: --resume never: removed the earlier run in {out}; starting from step 0")
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "train_config.json", asdict(cfg))
        rows = read_log(out / RUN_LOG, upto_step=start_step)
        # purge_step drops events an earlier run logged after the resume point (they are replayed)
        return cls(out / RUN_LOG, rows, SummaryWriter(str(out / "tensorboard"),
                                                      purge_step=start_step + 1 if start_step else None))

    @property
    def elapsed_s(self) -> float:
        """The training seconds of the last row that records them (0.0 for a new run)."""
        return next((r["elapsed_s"] for r in reversed(self.rows) if "elapsed_s" in r), 0.0)

    def add(self, row: dict) -> None:
        """Append ``row`` (its ``step`` and logged values) to the rows, the JSONL file and TensorBoard."""
        self.rows.append(row)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in row.items():
            if key != "step":
                self.writer.add_scalar(f"{'heldout' if key.startswith('heldout') else 'train'}/{key}", value,
                                       row["step"])

    def close(self) -> None:
        """Close the TensorBoard writer (rank 0)."""
        if self.writer is not None:
            self.writer.close()


def read_log(path: Path, *, upto_step: int) -> list[dict]:
    """Rows of an earlier run's log up to ``upto_step``; the file is rewritten without later rows."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["step"] <= upto_step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _ema(values: list[float], alpha: float = 0.9) -> list[float]:
    """Exponential moving average (bias-corrected, so the first points are not pulled to 0)."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = alpha * acc + (1 - alpha) * v
        weight = alpha * weight + (1 - alpha)
        out.append(acc / weight)
    return out


def plot_log(rows: list[dict], path: Path) -> None:
    """``train_loss.png``: loss terms (log scale), the training tau estimates and, when logged, the
    held-out greedy tau (the learning curve). Noisy per-step series are drawn faint with their
    exponential moving average on top."""
    if not rows:
        return
    plt = pyplot()

    heldout = [r for r in rows if "heldout_tau" in r]
    fig, axes = plt.subplots(1, 3 if heldout else 2, figsize=(15 if heldout else 10, 4))
    ax_loss, ax_tau = axes[0], axes[1]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def series(ax, key: str, color: str, label: str) -> None:
        pts = [(r["step"], r[key]) for r in rows if key in r and r[key] == r[key] and r[key] > 0]
        if not pts:
            return
        steps, values = zip(*pts)
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, _ema(list(values)), color=color, label=f"{label} (EMA 0.9)")

    for i, key in enumerate(("loss", "ce", "l1", "confidence")):
        series(ax_loss, key, colors[i], key)
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (global-batch weighted mean, log scale)")
    ax_loss.set_title("training loss")
    ax_loss.legend(fontsize=8)
    for i, (key, label) in enumerate((("greedy_tau_estimate", "greedy (T=0)"), ("tau_estimate", "T=1"))):
        series(ax_tau, key, colors[i], label)
    ax_tau.set_xlabel("step")
    ax_tau.set_ylabel("tau estimate (tokens committed, teacher-forced)")
    ax_tau.set_title("training-time tau estimates")
    ax_tau.legend(fontsize=8)
    if heldout:
        ax = axes[2]
        steps = [r["step"] for r in heldout]
        ax.plot(steps, [r["heldout_tau"] for r in heldout], "o-", color="black", label="all prompts")
        for i, key in enumerate(sorted({k for r in heldout for k in r if k.startswith("heldout_tau_")})):
            ax.plot(steps, [r.get(key, float("nan")) for r in heldout], ".--", color=colors[i % len(colors)],
                    label=key[len("heldout_tau_"):])
        minutes = heldout[-1].get("elapsed_s", 0.0) / 60
        ax.set_xlabel(f"step ({minutes:.1f} training minutes at step {steps[-1]})")
        ax.set_ylabel("held-out greedy tau (tokens committed per step)")
        ax.set_title("learning curve (held-out prompts)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
