"""Replay a trained DSpark draft on a training run's held-out reference (deepspec.train.heldout) and fit
its confidence calibration there, as the trainer does after its last held-out evaluation: for a draft
trained before the calibration existed (or to refit). Prints the held-out figures raw and calibrated and,
with --write, saves confidence_calibration.json into the draft folder.

    python fit_heldout.py RUN_DIR DRAFT_DIR [--write]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deepspec.algorithms.dspark.model import DSparkDraftModel
from deepspec.algorithms.dspark.proposer import DSparkProposer
from deepspec.models.calibration import save_calibration
from deepspec.train.heldout import REFERENCE_NAME, HeldoutReference, heldout_calibration, heldout_tau


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("draft_dir")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    cfg = json.loads((Path(args.run_dir) / "train_config.json").read_text())
    refs = [HeldoutReference(**r) for r in torch.load(Path(args.run_dir) / REFERENCE_NAME,
                                                      weights_only=False)["references"]]
    model = DSparkDraftModel.from_pretrained(args.draft_dir).eval()
    proposer = DSparkProposer(model, calibrate=False, max_positions=8192)
    steps = []
    tau = heldout_tau(proposer, refs, max_new_tokens=cfg["heldout_max_new_tokens"], eos_token_ids=[2],
                      steps_out=steps)
    figures, cal = heldout_calibration(steps, source=f"{len(refs)} held-out prompts of {args.run_dir}")
    print(json.dumps({**tau, **figures}, indent=1))
    print(json.dumps(cal.to_dict(), indent=1))
    if args.write:
        print("wrote", save_calibration(args.draft_dir, cal))


if __name__ == "__main__":
    main()
