"""The GPU as a device: the CLI pipeline, flex vs dense block attention (and the dtype flex runs in), the
engine's lossless check with a draft whose proposals are accepted, eager vs compiled (CUDA graphs) vs
Hugging Face ``generate()``, and FSDP2 sharding over 2 ranks, on CUDA. Marker ``gpu``; skipped without CUDA.

``DEEPSPEC_GPU_TESTS_ON_CPU=1`` runs the tests that have a CPU meaning (the pipeline, the engine,
FSDP2 with gloo) on the CPU instead, to check the tests themselves on a machine without a GPU; flex
has no CPU backward, so its test stays CUDA-only. ``bench/gpu_check.py`` runs this folder on a GPU
machine and keeps the figures the tests print (``-s``).

Targets are small random Qwen3 models saved with the real Qwen3 tokenizer
(``tests/fixtures/qwen3_tokenizer``); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch._dynamo

from tests.integration.test_train_fsdp import _CONNECTION_ERRORS

ON_CPU = os.environ.get("DEEPSPEC_GPU_TESTS_ON_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (HAS_CUDA or ON_CPU), reason="needs CUDA (or DEEPSPEC_GPU_TESTS_ON_CPU=1)")]
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="flex_attention has no backward on the CPU")


def tiny_qwen3_target(folder: Path, *, layers: int = 4, hidden: int = 64, seed: int = 0,
                      init_std: float = 0.02) -> Path:
    """A random Qwen3 (``layers`` x ``hidden``) with the real Qwen3 tokenizer, saved as a Hugging Face folder.
    ``init_std``: the weights' init std (transformers' ``initializer_range``); at the default 0.02 such a
    model answers every prompt with one repeated token, at 0.1 with varied tokens."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from tests.helpers import qwen3_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    torch.manual_seed(seed)
    # 151,936 rows as the real Qwen3 (the tokenizer has 151,669 ids: spare rows, one of them the mask token)
    cfg = Qwen3Config(vocab_size=151_936, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, initializer_range=init_std)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_cli_pipeline_runs_on_the_device_and_records_it(tmp_path, capsys):
    """prepare (local backend, batched) -> cache -> train -> eval with ``--device cuda``: every stage
    places the target there, records the device, and eval's speculative outputs equal target-only's (fp32)."""
    from deepspec.cli import main

    target = tiny_qwen3_target(tmp_path / "target")
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}, please."},
                                        {"role": "assistant", "content": "(regenerated)"}]} for i in range(12)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepared = tmp_path / "prepared.jsonl"
    assert main(["prepare", "--input", str(source), "--output", str(prepared), "--target", str(target),
                 "--max-new-tokens", "24", "--device", DEVICE, "--dtype", "bfloat16" if HAS_CUDA else "float32"]) == 0
    summary = json.loads(Path(f"{prepared}.summary.json").read_text())["summary"]
    assert summary["model_device"].startswith(DEVICE), summary
    cache = tmp_path / "cache"
    assert main(["cache", "--input", str(prepared), "--output-dir", str(cache), "--target", str(target),
                 "--target-layer-ids", "0", "2", "--device", DEVICE]) == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["capture"]["device"] == DEVICE, manifest["capture"]
    train_out = tmp_path / "train"
    assert main(["train", "--cache-dir", str(cache), "--output-dir", str(train_out), "--max-steps", "4",
                 "--block-size", "4", "--num-anchors", "8", "--batch-size", "2", "--device", DEVICE,
                 "--dtype", "bf16" if HAS_CUDA else "fp32"]) == 0
    state = torch.load(train_out / "checkpoint-000004" / "trainer_state.pt", weights_only=False)
    assert str(state["device"]).startswith(DEVICE)
    losses = [json.loads(line)["loss"] for line in (train_out / "train_log.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    bench = tmp_path / "gsm8k.jsonl"
    bench.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n"
                             for q in ("Count to three.", "Name a letter.", "What is 2 + 2?")))
    out = tmp_path / "eval"
    capsys.readouterr()
    assert main(["eval", "--draft", str(train_out), "--target", str(target), "--benchmarks", "gsm8k",
                 "--benchmark-files", f"gsm8k={bench}", "--num-prompts", "3", "--max-new-tokens", "24",
                 "--dtype", "float32", "--device", DEVICE, "--output-dir", str(out),
                 "--compare-hf-generate", "false"]) == 0
    results = json.loads((out / "eval_results.json").read_text())
    assert str(results["config"]["device"]).startswith(DEVICE)
    assert f"on {DEVICE}" in (out / "eval_report.md").read_text()
    records = results["samples"]["gsm8k"]
    assert all(r["identical_to_baseline"] for rs in records.values() for r in rs)  # fp32: lossless
    assert all(r["num_new_tokens"] > 0 for rs in records.values() for r in rs)


def _record_flex_dtypes(monkeypatch) -> list[tuple[torch.dtype, torch.dtype, torch.dtype]]:
    """The (q, k, v) dtypes of every call into DSpark's compiled flex_attention, recorded at the call
    (outside the compiled region: the graph compiled is the one every run uses)."""
    from deepspec.algorithms.dspark import model as dspark_model

    seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []
    compiled_flex = dspark_model._compiled_flex_attention

    def recording():
        kernel = compiled_flex()

        def call(q, k, v, *args, **kwargs):
            seen.append((q.dtype, k.dtype, v.dtype))
            return kernel(q, k, v, *args, **kwargs)

        return call

    monkeypatch.setattr(dspark_model, "_compiled_flex_attention", recording)
    return seen


_FLEX_LENGTHS_RUN: list[int] = []  # lengths the flex test has compiled and run in this process


@needs_cuda
@pytest.mark.parametrize("seq_len", [129, 137, 300, 4096])
def test_flex_block_attention_matches_the_dense_mask(seq_len, monkeypatch):
    """DSpark's forward_train with the flex BlockMask (compiled) against the dense SDPA mask, bf16
    autocast on CUDA, anchors with padding blocks: logits, loss and every gradient within bf16
    tolerance, nothing NaN; q, k and v reach the compiled flex kernel in bfloat16 (in float32 it runs
    off the tensor cores)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from deepspec.algorithms.dspark.config import draft_config_from_target
    from deepspec.algorithms.dspark.loss import dspark_loss
    from deepspec.algorithms.dspark.model import DSparkDraftModel
    from deepspec.models.anchors import sample_anchors

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=8192,
                      tie_word_embeddings=True)
    target = Qwen3ForCausalLM(cfg).cuda().eval()
    dcfg = draft_config_from_target(target.config, num_draft_layers=2, target_layer_ids=[0, 2], mask_token_id=5,
                                    markov_rank=16, block_size=7)
    draft = DSparkDraftModel.from_target(target, dcfg).cuda().train()
    B, S = 2, seq_len
    g = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(6, 1024, (B, S), generator=g)
    loss_mask = torch.zeros(B, S, dtype=torch.long)
    loss_mask[0, S // 3:] = 1
    loss_mask[1, S - 20:] = 1  # few candidates: most of sample 1's blocks are padding blocks
    anchors, valid = sample_anchors(loss_mask, 32, g)
    assert not bool(valid[1].all())
    feats = torch.randn(B, S, 2 * 256, generator=g).cuda()
    last = torch.randn(B, S, 256, generator=g).cuda()
    ids, loss_mask, anchors, valid = ids.cuda(), loss_mask.cuda(), anchors.cuda(), valid.cuda()
    flex_dtypes = _record_flex_dtypes(monkeypatch)
    results = {}
    for use_flex in (False, True):
        draft.zero_grad(set_to_none=True)
        # after the first length nothing may compile again: one dynamic-shape graph serves every length
        with torch._dynamo.config.patch(error_on_recompile=use_flex and bool(_FLEX_LENGTHS_RUN)):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = draft.forward_train(ids, feats, anchors, valid, use_flex=use_flex)
            loss = dspark_loss(out, ids, loss_mask, anchors, valid, last, draft.target_lm_head_weight, draft.config)
            loss.loss.backward()
        grads = {n: p.grad.float().clone() for n, p in draft.named_parameters() if p.grad is not None}
        results[use_flex] = (out.logits_BAKV.float().detach(), loss.loss.detach().float(), grads)
    (dense_logits, dense_loss, dense_grads), (flex_logits, flex_loss, flex_grads) = results[False], results[True]
    assert len(flex_dtypes) >= draft.config.num_draft_layers, f"flex ran {len(flex_dtypes)} times"
    assert set(flex_dtypes) == {(torch.bfloat16,) * 3}, f"q, k, v reached compiled flex in {set(flex_dtypes)}"
    keep = valid[:, :, None, None].expand_as(dense_logits)  # padding blocks carry nothing
    assert torch.isfinite(flex_logits).all() and torch.isfinite(flex_loss)
    torch.testing.assert_close(flex_logits[keep], dense_logits[keep], rtol=5e-2, atol=1e-1)
    torch.testing.assert_close(flex_loss, dense_loss, rtol=2e-2, atol=2e-2)
    assert flex_grads.keys() == dense_grads.keys()
    for name, grad in dense_grads.items():
        assert torch.isfinite(flex_grads[name]).all(), name
        scale = grad.abs().max().clamp_min(1e-6)
        assert float((flex_grads[name] - grad).abs().max() / scale) < 5e-2, name
    _FLEX_LENGTHS_RUN.append(seq_len)
    agreement = float((flex_logits.argmax(-1) == dense_logits.argmax(-1))[valid].float().mean())
    print(f"flex vs dense S={seq_len}: loss {float(flex_loss):.5f} / {float(dense_loss):.5f}, "
          f"max logit diff {float((flex_logits - dense_logits)[keep].abs().max()):.4f}, argmax agreement {agreement:.4f}")


LAYER_IDS = [0, 2]
BLOCK_SIZE = 4  # drafts proposed per step
MAX_NEW_TOKENS = 32
PROMPTS = [f"Write {n} words about the sea." for n in range(4)]


@pytest.fixture(scope="module")
def memorised(tmp_path_factory) -> tuple[Path, Path]:
    """A target that answers with varied tokens (``init_std`` 0.1) and a DSpark draft (blocks of
    ``BLOCK_SIZE``, a 256-token draft vocabulary) trained on the device to memorise the target's float32
    greedy answers to ``PROMPTS``: its proposals are accepted, so the lossless checks below run through
    accepted drafts and multi-token commits, not only through rejections. Returns (target folder,
    draft folder)."""
    from deepspec.algorithms.protocol import NullProposer
    from deepspec.data.cache import write_target_cache_from_samples
    from deepspec.data.chat import render_prompt
    from deepspec.decoding.engine import SpeculativeEngine
    from deepspec.eval.run import eos_token_ids_of
    from deepspec.target.load import load_target, target_fingerprint, tokenizer_fingerprint
    from deepspec.train.config import TrainConfig
    from deepspec.train.loop import train

    root = tmp_path_factory.mktemp("memorised")
    target = tiny_qwen3_target(root / "target", layers=4, hidden=128, init_std=0.1)
    model, tok = load_target(str(target))
    model = model.float().eval()
    eos = eos_token_ids_of(model, tok)
    samples = []
    for i, text in enumerate(PROMPTS):
        ids = render_prompt(tok, [{"role": "user", "content": text}])
        # past MAX_NEW_TOKENS by a block and more: the last steps' proposals are memorised too
        answer = SpeculativeEngine(model, LAYER_IDS, NullProposer(), eos).generate(
            ids, max_new_tokens=MAX_NEW_TOKENS + 2 * BLOCK_SIZE).output_ids
        samples.append((f"p{i}", ids + answer, [0] * len(ids) + [1] * len(answer)))
    write_target_cache_from_samples(samples, root / "cache", model, target_layer_ids=LAYER_IDS,
                                    target_fingerprint=target_fingerprint(model),
                                    tokenizer_fingerprint=tokenizer_fingerprint(tok), storage_dtype="float32",
                                    progress=False)
    cfg = TrainConfig(cache_dir=str(root / "cache"), output_dir=str(root / "train"), markov_rank=16, seed=1,
                      block_size=BLOCK_SIZE, num_anchors=16, batch_size=4, draft_vocab_size=256, max_steps=200,
                      lr=5e-3, warmup_frac=0.05, device=DEVICE)
    return target, train(cfg, target_model=model, tokenizer=tok) / "draft"


def _mean_accepted(results) -> float:
    """Accepted drafts per step with a proposal, over ``results`` (GenerationResults)."""
    steps = [s for res in results for s in res.steps if s.num_proposed > 0]
    return sum(s.num_accepted for s in steps) / max(len(steps), 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_greedy_on_the_device(memorised, dtype):
    """The engine with the target and the memorised DSpark draft on the device: the draft is accepted
    (mean accepted drafts per step above a floor, some steps accept a whole block); in fp32 speculative
    output equals target-only output token for token; in bf16 the first divergence (if any) and the
    target's top-2 logit gap there are printed (a near-tie decided by the forward's shape: docs/semantics.md)."""
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.algorithms.protocol import NullProposer
    from deepspec.algorithms.registry import get_algorithm
    from deepspec.data.chat import render_prompt
    from deepspec.decoding.engine import SpeculativeEngine
    from deepspec.device import TORCH_DTYPES, cast_for_decoding
    from deepspec.eval.run import eos_token_ids_of
    from deepspec.target.load import load_target

    target_dir, draft_dir = memorised
    model, tok = load_target(str(target_dir))
    torch_dtype = TORCH_DTYPES[dtype]
    model = cast_for_decoding(model, torch_dtype, DEVICE)
    draft = cast_for_decoding(get_algorithm("dspark").load(draft_dir).eval(), torch_dtype, DEVICE)
    eos = eos_token_ids_of(model, tok)
    identical = 0
    spec_results = []
    for text in PROMPTS:
        ids = render_prompt(tok, [{"role": "user", "content": text}])
        base = SpeculativeEngine(model, LAYER_IDS, NullProposer(), eos).generate(ids, max_new_tokens=MAX_NEW_TOKENS)
        spec = SpeculativeEngine(model, LAYER_IDS, DSparkProposer(draft), eos).generate(
            ids, max_new_tokens=MAX_NEW_TOKENS)
        spec_results.append(spec)
        assert len(spec.output_ids) > 0
        if spec.output_ids == base.output_ids:
            identical += 1
            continue
        assert dtype == "bfloat16", f"fp32 outputs differ for {text!r}"
        pos = next(i for i, (a, b) in enumerate(zip(spec.output_ids, base.output_ids)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([ids + base.output_ids[:pos]], device=DEVICE)).logits[0, -1].float()
        top2 = logits.topk(2).values
        print(f"bf16 divergence for {text!r} at output token {pos}: top-2 logit gap {float(top2[0] - top2[1]):.4f}")
    accepted = _mean_accepted(spec_results)
    print(f"engine on {DEVICE} in {dtype}: {identical}/{len(PROMPTS)} outputs identical to target-only, "
          f"{accepted:.2f} accepted drafts per step")
    # a draft that is never accepted would leave the lossless check with rejections only
    assert accepted >= (2.0 if dtype == "float32" else 0.5), accepted
    assert any(s.num_accepted == BLOCK_SIZE for res in spec_results for s in res.steps)
    if dtype == "float32":
        assert identical == len(PROMPTS)


def _cuda_graphs_recorded() -> int:
    """CUDA graphs torch's CUDA-graph trees recorded on the current GPU (0 when none was)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    return 0 if manager is None else sum(len(nodes) for nodes in manager.roots.values())


def test_compiled_engine_on_the_device(memorised):
    """The compiled target path (deepspec.decoding.compiled: static KV cache + torch.compile, CUDA graphs on CUDA)
    in fp32 on the device, with the memorised draft proposing through its own compiled graphs: compiled target-only output equals eager target-only
    output and Hugging Face ``generate(do_sample=False)`` token for token, and speculative output (compiled
    and eager) equals them, through accepted drafts; on CUDA every compiled step ran as a CUDA graph
    (none skipped). The compiled and eager engines' mean step times are printed (figures, not asserted).
    On the CPU (DEEPSPEC_GPU_TESTS_ON_CPU) the graphs are captured with the ``eager`` backend: inductor's
    CPU code generation is tests/unit/test_compiled.py's."""
    from torch._dynamo.utils import counters

    from deepspec.algorithms.dspark.compiled import compile_proposer
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.algorithms.protocol import NullProposer
    from deepspec.algorithms.registry import get_algorithm
    from deepspec.data.chat import render_prompt
    from deepspec.decoding.compiled import CompiledTarget
    from deepspec.decoding.engine import SpeculativeEngine
    from deepspec.device import cast_for_decoding
    from deepspec.eval.run import eos_token_ids_of, hf_generate
    from deepspec.target.decoding import SamplingParams
    from deepspec.target.load import load_target

    target_dir, draft_dir = memorised
    model, tok = load_target(str(target_dir))
    model = cast_for_decoding(model, torch.float32, DEVICE)
    draft = cast_for_decoding(get_algorithm("dspark").load(draft_dir).eval(), torch.float32, DEVICE)
    eos = eos_token_ids_of(model, tok)
    counters.clear()
    compiled = CompiledTarget(model, (1, BLOCK_SIZE + 1), **({} if HAS_CUDA else {"backend": "eager"}))
    if HAS_CUDA:
        assert compiled.mode == "reduce-overhead"
    backend = {} if HAS_CUDA else {"backend": "eager"}
    proposers = {("target-only", "eager"): NullProposer(), ("target-only", "compiled"): NullProposer(),
                 ("speculative", "eager"): DSparkProposer(draft),
                 # the compiled engine's draft proposes through its own graphs (deepspec.algorithms.dspark.compiled)
                 ("speculative", "compiled"): compile_proposer(DSparkProposer(draft), **backend)}
    engines = {key: SpeculativeEngine(model, LAYER_IDS, prop, eos, compiled=compiled if key[1] == "compiled" else None)
               for key, prop in proposers.items()}
    step_ms: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
    spec_results = []
    for text in PROMPTS[:3]:
        ids = render_prompt(tok, [{"role": "user", "content": text}])
        out = {key: engine.generate(ids, max_new_tokens=MAX_NEW_TOKENS) for key, engine in engines.items()}
        hf = hf_generate(model, ids, max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingParams(), eos=eos,
                         pad=tok.pad_token_id).output_ids
        reference = out["target-only", "compiled"].output_ids
        assert len(reference) > 0
        assert reference == out["target-only", "eager"].output_ids, f"compiled vs eager target-only for {text!r}"
        assert reference == hf, f"compiled target-only vs HF generate for {text!r}"
        assert out["speculative", "compiled"].output_ids == reference, f"speculative compiled for {text!r}"
        assert out["speculative", "eager"].output_ids == reference, f"speculative eager for {text!r}"
        spec_results.append(out["speculative", "compiled"])
        for key, res in out.items():
            step_ms[key] += [1000 * s.time_s for s in res.steps[1:]]  # the first step of each prompt left out
    accepted = _mean_accepted(spec_results)
    assert accepted >= 2.0, accepted
    assert any(s.num_accepted == BLOCK_SIZE for res in spec_results for s in res.steps)
    if HAS_CUDA:
        # a skipped graph runs the step without CUDA graphs: silently slower, and another code path
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        assert _cuda_graphs_recorded() > 0
    print(f"engine on {DEVICE}, fp32: {accepted:.2f} accepted drafts per step (compiled); mean step ms: " + ", ".join(
        f"{name} {kind} {sum(v) / max(len(v), 1):.2f}" for (name, kind), v in step_ms.items()))


# Records, on each rank, the local shard of every trainable parameter FSDP2 holds (then runs the CLI).
_SHARD_RECORDER = """
import json, os, sys
from deepspec.train import loop

real_shard_model = loop.shard_model

def recording(model, cfg, ctx):
    model = real_shard_model(model, cfg, ctx)
    shards = {name: {"full": list(p.shape), "local": list(p.to_local().shape), "placements": str(p.placements)}
              for name, p in model.named_parameters() if p.requires_grad}
    with open(os.path.join(os.environ["DEEPSPEC_TEST_SHARDS_DIR"], f"rank{ctx.rank}.json"), "w") as f:
        json.dump({"world_size": ctx.world_size, "device": str(ctx.device), "shards": shards}, f)
    return model

loop.shard_model = recording
from deepspec.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_fsdp2_shards_over_two_ranks_and_trains_like_one_process(tmp_path):
    """``torchrun --nproc-per-node 2 deepspec train``: FSDP2 over 2 ranks, NCCL on 2 GPUs where there are
    two, else gloo on the CPU (two NCCL ranks cannot share one GPU). Each rank holds half of every
    trainable parameter (dim 0), the checkpoint records world size 2, and the losses and the gathered
    draft (loadable) equal a one-process run on the device over the same global batch (2 micro-batches
    of 2 samples), in fp32."""
    from safetensors.torch import load_file

    from deepspec.algorithms.registry import get_algorithm
    from deepspec.data.cache import write_target_cache_from_samples
    from deepspec.target.load import load_target, target_fingerprint, tokenizer_fingerprint
    from deepspec.train.config import TrainConfig
    from deepspec.train.loop import train
    from tests.integration.test_cache_crash import subprocess_env
    from tests.integration.test_cache_torchrun import _torchrun

    sharded_device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    target = tiny_qwen3_target(tmp_path / "target")
    model, tok = load_target(str(target))
    g = torch.Generator().manual_seed(0)
    samples = [(f"s{i}", torch.randint(10, 5000, (40 + 8 * i,), generator=g).tolist(), [0] * 10 + [1] * (30 + 8 * i))
               for i in range(8)]
    cache = tmp_path / "cache"
    write_target_cache_from_samples(samples, cache, model, target_layer_ids=[0, 2],
                                    target_fingerprint=target_fingerprint(model),
                                    tokenizer_fingerprint=tokenizer_fingerprint(tok), storage_dtype="float32",
                                    progress=False)
    common = {"max_steps": 3, "batch_size": 2, "num_anchors": 8, "block_size": 4, "markov_rank": 8, "lr": 1e-2,
              "warmup_frac": 0.2}
    driver = tmp_path / "driver.py"
    driver.write_text(_SHARD_RECORDER, encoding="utf-8")
    shards_dir = tmp_path / "shards"
    shards_dir.mkdir()
    out = tmp_path / "multi"
    cmd = [*_torchrun(), "--standalone", "--nproc-per-node", "2", str(driver), "train", "--cache-dir", str(cache),
           "--target", str(target), "--output-dir", str(out), "--device", sharded_device, "--dtype", "fp32",
           *[f"--{k.replace('_', '-')}={v}" for k, v in common.items()]]
    for _ in range(2):  # a loaded machine can lose torchrun's local rendezvous race: retry that once
        shutil.rmtree(out, ignore_errors=True)
        run = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2],
                             env=subprocess_env(DEEPSPEC_TEST_SHARDS_DIR=str(shards_dir)), capture_output=True,
                             text=True, timeout=900, check=False)
        if run.returncode == 0 or not any(m in run.stderr for m in _CONNECTION_ERRORS):
            break
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    # sharded: each rank holds its own part of every trainable parameter, the parts make up the whole
    ranks = [json.loads((shards_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2] and all(r["device"].startswith(sharded_device) for r in ranks)
    assert ranks[0]["shards"].keys() == ranks[1]["shards"].keys() and ranks[0]["shards"]
    for name, shard0 in ranks[0]["shards"].items():
        shard1 = ranks[1]["shards"][name]
        assert "Shard(dim=0)" in shard0["placements"], (name, shard0)
        assert shard0["local"][0] + shard1["local"][0] == shard0["full"][0], (name, shard0, shard1)
        assert shard0["local"][1:] == shard0["full"][1:], (name, shard0)
    assert any(0 < s["local"][0] < s["full"][0] for s in ranks[0]["shards"].values())
    state = torch.load(out / "checkpoint-000003" / "trainer_state.pt", weights_only=False)
    assert state["world_size"] == 2 and state["step"] == 3

    # one process on the device over the same global batch
    single = train(TrainConfig(cache_dir=str(cache), output_dir=str(tmp_path / "single"), grad_accum_steps=2,
                               device=DEVICE, dtype="fp32", **common), target_model=model, tokenizer=tok)
    rows = {name: [json.loads(line) for line in (path / "train_log.jsonl").read_text().splitlines()]
            for name, path in (("multi", out), ("single", tmp_path / "single"))}
    assert [r["step"] for r in rows["multi"]] == [r["step"] for r in rows["single"]] == [1, 2, 3]
    for key in ("loss", "grad_norm", "num_tokens"):
        assert [r[key] for r in rows["multi"]] == pytest.approx([r[key] for r in rows["single"]], rel=1e-4), key
    gathered = get_algorithm("dspark").load(out / "checkpoint-000003" / "draft").state_dict()
    reference = load_file(str(single / "draft" / "model.safetensors"))
    assert gathered.keys() >= reference.keys()
    worst = max(float((gathered[n].float() - w.float()).abs().max()) for n, w in reference.items())
    print(f"FSDP2 over 2 ranks on {sharded_device} vs one process on {DEVICE}: losses "
          + ", ".join(f"{a['loss']:.6f}/{b['loss']:.6f}" for a, b in zip(rows["multi"], rows["single"]))
          + f", max weight difference {worst:.2e}")
    for name, weight in reference.items():
        # AdamW moves a weight by about lr per step whatever its gradient's size: a gradient of rounding size
        # (the zero-initialised markov_w2 rows of tokens absent from the batch) can move it either way on
        # another split, so a few elements may differ by up to lr x steps; every other one is equal
        off = (gathered[name].float() - weight.float()).abs() > 1e-5 + 1e-4 * weight.float().abs()
        assert float(off.float().mean()) <= 1e-4, (name, int(off.sum()))
        torch.testing.assert_close(gathered[name].float(), weight.float(), rtol=0,
                                   atol=common["lr"] * common["max_steps"], msg=name)
