"""The GPU as a device (issue 13): the CLI pipeline, flex vs dense block attention, the engine's
lossless check and FSDP2, on CUDA. Marker ``gpu``; skipped without CUDA.

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
import subprocess
from pathlib import Path

import pytest
import torch
import torch._dynamo

ON_CPU = os.environ.get("DEEPSPEC_GPU_TESTS_ON_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (HAS_CUDA or ON_CPU), reason="needs CUDA (or DEEPSPEC_GPU_TESTS_ON_CPU=1)")]
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="flex_attention has no backward on the CPU")


def tiny_qwen3_target(folder: Path, *, layers: int = 4, hidden: int = 64, seed: int = 0) -> Path:
    """A random Qwen3 (``layers`` x ``hidden``) with the real Qwen3 tokenizer, saved as a Hugging Face folder."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from tests.helpers import qwen3_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    torch.manual_seed(seed)
    # 151,936 rows as the real Qwen3 (the tokenizer has 151,669 ids: spare rows, one of them the mask token)
    cfg = Qwen3Config(vocab_size=151_936, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
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


_FLEX_LENGTHS_RUN: list[int] = []  # lengths the flex test has compiled and run in this process


@needs_cuda
@pytest.mark.parametrize("seq_len", [129, 137, 300, 4096])
def test_flex_block_attention_matches_the_dense_mask(seq_len):
    """DSpark's forward_train with the flex BlockMask (compiled) against the dense SDPA mask, bf16
    autocast on CUDA, anchors with padding blocks: logits, loss and every gradient within bf16
    tolerance, nothing NaN."""
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_greedy_on_the_device(tmp_path, dtype):
    """The engine with the target and a DSpark draft on the device: in fp32 speculative output equals
    target-only output token for token; in bf16 the first divergence (if any) and the target's top-2
    logit gap there are printed (a near-tie decided by the forward's shape: docs/semantics.md)."""
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.algorithms.protocol import NullProposer
    from deepspec.data.chat import render_prompt
    from deepspec.device import TORCH_DTYPES, cast_for_decoding
    from deepspec.eval.engine import SpeculativeEngine
    from deepspec.eval.run import eos_token_ids_of
    from deepspec.target.load import load_target
    from deepspec.train.loop import TrainConfig, build_draft

    model, tok = load_target(str(tiny_qwen3_target(tmp_path / "target", layers=4, hidden=128)))
    torch_dtype = TORCH_DTYPES[dtype]
    model = cast_for_decoding(model, torch_dtype, DEVICE)
    layer_ids = [0, 2]
    cfg = TrainConfig(cache_dir="unused", output_dir="unused", markov_rank=16, seed=1, block_size=4)
    draft = cast_for_decoding(build_draft(model, tok, cfg, layer_ids).eval(), torch_dtype, DEVICE)
    eos = eos_token_ids_of(model, tok)
    identical = 0
    prompts = [f"Write {n} words about the sea." for n in range(4)]
    for text in prompts:
        ids = render_prompt(tok, [{"role": "user", "content": text}])
        base = SpeculativeEngine(model, layer_ids, NullProposer(), eos).generate(ids, max_new_tokens=32)
        spec = SpeculativeEngine(model, layer_ids, DSparkProposer(draft), eos).generate(ids, max_new_tokens=32)
        assert len(spec.output_ids) > 0 and any(s.num_proposed > 0 for s in spec.steps)
        if spec.output_ids == base.output_ids:
            identical += 1
            continue
        assert dtype == "bfloat16", f"fp32 outputs differ for {text!r}"
        pos = next(i for i, (a, b) in enumerate(zip(spec.output_ids, base.output_ids)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([ids + base.output_ids[:pos]], device=DEVICE)).logits[0, -1].float()
        top2 = logits.topk(2).values
        print(f"bf16 divergence for {text!r} at output token {pos}: top-2 logit gap {float(top2[0] - top2[1]):.4f}")
    print(f"engine on {DEVICE} in {dtype}: {identical}/{len(prompts)} outputs identical to target-only")
    if dtype == "float32":
        assert identical == len(prompts)


def test_compiled_engine_on_the_device(tmp_path):
    """The compiled target path (deepspec.eval.compiled: static KV cache + torch.compile, CUDA graphs on CUDA)
    in fp32 on the device: speculative output equals compiled target-only output token for token; the
    compiled and eager engines' mean step times are printed (figures, not asserted)."""
    from deepspec.algorithms.dspark.proposer import DSparkProposer
    from deepspec.algorithms.protocol import NullProposer
    from deepspec.data.chat import render_prompt
    from deepspec.device import cast_for_decoding
    from deepspec.eval.compiled import CompiledTarget
    from deepspec.eval.engine import SpeculativeEngine
    from deepspec.eval.run import eos_token_ids_of
    from deepspec.target.load import load_target
    from deepspec.train.loop import TrainConfig, build_draft

    model, tok = load_target(str(tiny_qwen3_target(tmp_path / "target", layers=4, hidden=128)))
    model = cast_for_decoding(model, torch.float32, DEVICE)
    layer_ids = [0, 2]
    cfg = TrainConfig(cache_dir="unused", output_dir="unused", markov_rank=16, seed=1, block_size=4)
    draft = cast_for_decoding(build_draft(model, tok, cfg, layer_ids).eval(), torch.float32, DEVICE)
    eos = eos_token_ids_of(model, tok)
    compiled = CompiledTarget(model, (1, 5))
    engines = {(name, kind): SpeculativeEngine(model, layer_ids, prop, eos, compiled=compiled if kind == "compiled" else None)
               for name, prop in (("target-only", NullProposer()), ("speculative", DSparkProposer(draft)))
               for kind in ("eager", "compiled")}
    step_ms: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
    for n in range(3):
        ids = render_prompt(tok, [{"role": "user", "content": f"Write {n} words about the sea."}])
        out = {key: engine.generate(ids, max_new_tokens=32) for key, engine in engines.items()}
        assert out["speculative", "compiled"].output_ids == out["target-only", "compiled"].output_ids
        assert any(s.num_proposed == 4 for s in out["speculative", "compiled"].steps)
        for key, res in out.items():
            step_ms[key] += [1000 * s.time_s for s in res.steps[1:]]  # the first step of each prompt left out
    print("engine on " + DEVICE + ", fp32, mean step ms: " + ", ".join(
        f"{name} {kind} {sum(v) / max(len(v), 1):.2f}" for (name, kind), v in step_ms.items()))


def test_fsdp2_trains_on_one_device(tmp_path):
    """``torchrun --nproc-per-node 1 deepspec train --device cuda``: FSDP2 on one GPU (gloo with
    DEEPSPEC_GPU_TESTS_ON_CPU) writes a checkpoint with finite losses."""
    from deepspec.data.cache import write_target_cache_from_samples
    from deepspec.target.load import load_target, target_fingerprint, tokenizer_fingerprint
    from tests.integration.test_cache_crash import subprocess_env
    from tests.integration.test_cache_torchrun import _torchrun

    target = tiny_qwen3_target(tmp_path / "target")
    model, tok = load_target(str(target))
    g = torch.Generator().manual_seed(0)
    samples = [(f"s{i}", torch.randint(10, 5000, (40 + 8 * i,), generator=g).tolist(), [0] * 10 + [1] * (30 + 8 * i))
               for i in range(4)]
    cache = tmp_path / "cache"
    write_target_cache_from_samples(samples, cache, model, target_layer_ids=[0, 2],
                                    target_fingerprint=target_fingerprint(model),
                                    tokenizer_fingerprint=tokenizer_fingerprint(tok), storage_dtype="float32",
                                    progress=False)
    out = tmp_path / "train"
    cmd = [*_torchrun(), "--standalone", "--nproc-per-node", "1", "-m", "deepspec.cli", "train", "--cache-dir",
           str(cache), "--target", str(target), "--output-dir", str(out), "--max-steps", "3", "--batch-size", "2",
           "--num-anchors", "8", "--block-size", "4", "--device", DEVICE, "--dtype", "bf16" if HAS_CUDA else "fp32"]
    run = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], env=subprocess_env(), capture_output=True,
                         text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)
    assert (out / "checkpoint-000003" / "draft" / "model.safetensors").is_file()
