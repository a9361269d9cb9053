"""Experiment (2026-12-01): DSpark with each target-feature dim scaled by 1/rms (over a sample of the cache,
position 0 left out) before ``fc``, by patching ``DSparkDraftModel.context_features``; the rest is
bench/recipe.py. Usage (from the checkout):

    python docs/results/knobs-cpu-2026-12-01/feature_scale_experiment.py runs/recipe/cache scale \
        --cache-dir runs/recipe/cache --output-dir runs/study2 --max-steps 800 --heldout-every 200 \
        --heldout-benchmarks gsm8k humaneval --heldout-num-prompts 6 --setting "fscale:$B"
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import recipe as R
from deepspec.data.cache.reader import TargetCache
from deepspec.algorithms.dspark.model import DSparkDraftModel
cache_dir = sys.argv[1]
c = TargetCache(cache_dir)
acc = None; n = 0
for i in range(0, len(c), max(1, len(c)//64)):
    h = c[i]["target_hidden"].float()[1:]   # skip position 0 (the attention sink)
    acc = h.pow(2).sum(0) if acc is None else acc + h.pow(2).sum(0); n += h.shape[0]
rms = (acc / n).sqrt()
scale = (1.0 / rms.clamp_min(1e-6))
mode = sys.argv[2]
if mode == "scale":
    s = scale * rms.mean()
orig = DSparkDraftModel.context_features
def cf(self, x):
    return self.hidden_norm(self.fc(x.to(self.fc.weight.dtype) * s.to(x.device)))
if mode == "scale":
    DSparkDraftModel.context_features = cf
R.main(sys.argv[3:])
