"""The device and decoding-dtype rules (deepspec.device): names, aliases, ``auto`` on CPU with and
without native bf16 or CUDA, clear errors for a device that is not there, the cast copy that leaves the
caller's module alone, and every stage's config checking its ``device``."""

from __future__ import annotations

import pytest
import torch

import deepspec.device as device_mod
from deepspec.device import (
    cast_for_decoding,
    check_device_name,
    check_dtype_name,
    dtype_name,
    resolve_device,
    resolve_dtype,
)


def test_names_and_aliases():
    assert check_dtype_name("auto", "eval.dtype") == "auto"
    assert check_dtype_name("bf16", "eval.dtype") == "bfloat16"
    assert check_dtype_name("fp32", "eval.dtype") == "float32"
    for bad in ("float16", "BF16", None, 3):
        with pytest.raises(ValueError, match="eval.dtype: expected one of auto, float32, bfloat16"):
            check_dtype_name(bad, "eval.dtype")
    assert resolve_dtype("float32") is torch.float32 and resolve_dtype("bf16", "cuda") is torch.bfloat16
    assert dtype_name(torch.bfloat16) == "bfloat16"


def test_auto_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(device_mod, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(device_mod, "cpu_bf16_flags", lambda: ())
    assert resolve_dtype("auto", "cpu") is torch.float32
    with pytest.warns(UserWarning, match="no native bf16.*float32"):
        assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16  # an explicit choice is kept, with the cost


def test_cpu_flags_come_from_the_first_cpuinfo_flags_line_and_torchs_capability(monkeypatch):
    """The native bf16 features are the known flag names found as whole words on /proc/cpuinfo's first
    ``flags`` line or in torch's CPU capability; other flags are ignored, and without /proc/cpuinfo torch's
    capability alone counts."""
    class CpuInfo:
        text: str | None = None

        def __init__(self, path):
            assert str(path) == "/proc/cpuinfo"

        def read_text(self, **kwargs):
            if CpuInfo.text is None:
                raise OSError("no /proc/cpuinfo")
            return CpuInfo.text

    def flags(cpuinfo, capability):
        CpuInfo.text = cpuinfo
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        device_mod.cpu_bf16_flags.cache_clear()
        return device_mod.cpu_bf16_flags()

    monkeypatch.setattr(device_mod, "Path", CpuInfo)
    try:
        first_line = "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 avx512f\nflags\t\t: avx512_bf16\n"
        assert flags(first_line, "AVX2") == ("amx_bf16",)
        assert flags("flags\t\t: avx2 avx512_bf16x avx512_fp16\n", "AVX512") == ()
        assert flags("flags\t\t: avx2\n", "AVX512_BF16") == ("avx512_bf16",)
        assert flags(None, "AMX_BF16") == ("amx_bf16",)
        assert flags(None, "DEFAULT") == ()
    finally:
        device_mod.cpu_bf16_flags.cache_clear()  # the real machine's flags again for later tests


def test_cast_for_decoding_copies_only_when_needed():
    layer = torch.nn.Linear(4, 4)
    assert cast_for_decoding(layer, torch.float32) is layer
    assert cast_for_decoding(layer, torch.float32, "cpu") is layer
    cast = cast_for_decoding(layer, torch.bfloat16)
    assert cast is not layer and cast.weight.dtype is torch.bfloat16 and layer.weight.dtype is torch.float32
    assert cast_for_decoding(layer, torch.bfloat16, "cpu", in_place=True) is layer
    assert layer.weight.dtype is torch.bfloat16


def test_device_names_and_auto(monkeypatch):
    for name in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        assert check_device_name(name, "eval.device") == name
    for bad in ("gpu", "cuda:", "cuda:x", "CPU", "mps", "cuda: 0", "cuda:-1", "cuda:\u0661", None, 0):
        with pytest.raises(ValueError, match=r"eval.device: expected auto, cpu, cuda or cuda:N"):
            check_device_name(bad, "eval.device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=rf"train.device={name}: CUDA is not available here .*use --device cpu, or --device auto"):
            resolve_device(name, "train.device")


def test_cuda_devices_follow_local_rank_and_must_exist(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda", 1) == resolve_device("cuda")
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"cache.device=cuda:2: GPU 2 asked for .* but 2 visible"):
        resolve_device("cuda:2", "cache.device")
    monkeypatch.setenv("LOCAL_RANK", "3")  # more processes per node than GPUs
    with pytest.raises(ValueError, match=r"cache.device=auto: GPU 3 asked for \(LOCAL_RANK 3\)"):
        resolve_device("auto", "cache.device")
    monkeypatch.setenv("LOCAL_RANK", "abc")
    with pytest.raises(ValueError, match=r"cache.device=cuda: LOCAL_RANK='abc' is not a GPU index"):
        resolve_device("cuda", "cache.device")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)  # a named GPU does not read LOCAL_RANK


def test_every_stage_config_checks_its_device(tmp_path):
    from deepspec.data.prepare import PrepareConfig
    from deepspec.demo import DemoConfig
    from deepspec.eval.stage import EvalConfig
    from deepspec.serve.openai_server import ServeConfig
    from deepspec.stages import CacheConfig
    from deepspec.train.config import TrainConfig

    makers = {
        "PrepareConfig.device": lambda d: PrepareConfig(input="sharegpt-demo", output=tmp_path / "p.jsonl", device=d),
        "cache.device": lambda d: CacheConfig(input="p.jsonl", output_dir="c", device=d),
        "train.device": lambda d: TrainConfig(cache_dir="c", output_dir="t", device=d),
        "eval.device": lambda d: EvalConfig(draft=["x"], output_dir="o", device=d),
        "serve.device": lambda d: ServeConfig(device=d),
        "demo.device": lambda d: DemoConfig(device=d),
    }
    for field, make in makers.items():
        assert make("auto").device == "auto" and make("cuda:1").device == "cuda:1"
        with pytest.raises(ValueError, match=field):
            make("gpu")


def test_every_stage_refuses_cuda_without_it_before_loading_the_target(tmp_path, monkeypatch):
    import deepspec.serve.openai_server as openai_server
    import deepspec.data.prepare as prepare
    import deepspec.stages as stages
    import deepspec.train.loop as train_loop
    from deepspec.data.prepare import PrepareConfig
    from deepspec.demo import DemoConfig, run_demo
    from deepspec.eval.stage import EvalConfig, run_eval_stage
    from deepspec.serve.openai_server import ServeConfig, run_serve_stage
    from deepspec.stages import CacheConfig, run_cache_stage, run_prepare_stage
    from deepspec.train.config import TrainConfig
    from deepspec.train.loop import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for module in (stages, prepare, train_loop):
        monkeypatch.setattr(module, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    monkeypatch.setattr(openai_server.load, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    # (deepspec.demo and the eval stage, through load.open_target, load through the same module: load.load_target)
    runs = {
        "PrepareConfig.device": lambda: run_prepare_stage(PrepareConfig(input="sharegpt-demo", output=tmp_path / "p.jsonl",
                                                                  device="cuda")),
        "cache.device": lambda: run_cache_stage(CacheConfig(input=str(tmp_path / "p.jsonl"),
                                                            output_dir=str(tmp_path / "c"), device="cuda")),
        "train.device": lambda: train(TrainConfig(cache_dir=str(tmp_path / "c"), output_dir=str(tmp_path / "t"),
                                                  device="cuda:0")),
        "eval.device": lambda: run_eval_stage(EvalConfig(draft=[str(tmp_path / "d")], output_dir=str(tmp_path / "e"),
                                                         device="cuda")),
        "serve.device": lambda: run_serve_stage(ServeConfig(port=0, device="cuda")),
        "demo.device": lambda: run_demo(DemoConfig(output_dir=str(tmp_path / "demo"), device="cuda")),
    }
    for field, run in runs.items():
        with pytest.raises(ValueError, match=rf"{field}=cuda(:0)?: CUDA is not available here"):
            run()
    assert not (tmp_path / "e").exists()  # eval's output folder is removed again
    assert not (tmp_path / "demo").exists()  # the demo writes nothing


def test_configs_validate_dtype(tmp_path):
    from deepspec.data.prepare import PrepareConfig
    from deepspec.demo import DemoConfig
    from deepspec.eval.stage import EvalConfig

    assert EvalConfig(draft=["x"], output_dir="o", dtype="bf16").dtype == "bfloat16"
    assert PrepareConfig(input="sharegpt-demo", output=tmp_path / "p.jsonl", dtype="fp32").dtype == "float32"
    assert DemoConfig(dtype="auto").dtype == "auto"
    with pytest.raises(ValueError, match="eval.dtype"):
        EvalConfig(draft=["x"], output_dir="o", dtype="half")
    with pytest.raises(ValueError, match="PrepareConfig.dtype"):
        PrepareConfig(input="sharegpt-demo", output=tmp_path / "p.jsonl", dtype="half")
    with pytest.raises(ValueError, match="demo.dtype"):
        DemoConfig(dtype="int8")


def test_train_dtype_auto_is_bf16_autocast_where_the_hardware_runs_it_fast(monkeypatch):
    from deepspec import device as device_mod
    from deepspec.train.config import TrainConfig

    cfg = TrainConfig(cache_dir="c", output_dir="o", dtype="auto")
    assert cfg.dtype == "auto"  # recorded as asked; resolved per device
    monkeypatch.setattr(device_mod, "cpu_bf16_flags", lambda: ("amx_bf16",))
    assert cfg.uses_bf16(torch.device("cpu"))
    monkeypatch.setattr(device_mod, "cpu_bf16_flags", lambda: ())
    assert not cfg.uses_bf16(torch.device("cpu"))
    assert TrainConfig(cache_dir="c", output_dir="o", dtype="bfloat16").uses_bf16(torch.device("cpu"))
    assert not TrainConfig(cache_dir="c", output_dir="o", dtype="float32").uses_bf16(torch.device("cpu"))
    with pytest.raises(ValueError, match="train.dtype"):
        TrainConfig(cache_dir="c", output_dir="o", dtype="half")


def test_every_stage_defaults_to_auto_which_is_bf16_on_cuda(tmp_path, monkeypatch):
    """Training, the cache capture, prepare, eval and the demo default to ``auto``; on a CUDA device
    with bf16 units ``auto`` is bfloat16 for each of them (float32 only where the GPU lacks bf16)."""
    from deepspec.data.prepare import PrepareConfig
    from deepspec.demo import DemoConfig
    from deepspec.eval.stage import EvalConfig
    from deepspec.stages import CacheConfig
    from deepspec.train.config import TrainConfig

    train = TrainConfig(cache_dir="c", output_dir="o")
    defaults = {"train": train.dtype, "cache": CacheConfig(input="p.jsonl", output_dir="o").dtype,
                "prepare": PrepareConfig(input="sharegpt-demo", output=tmp_path / "p.jsonl").dtype,
                "eval": EvalConfig(draft=["x"], output_dir="o").dtype, "demo": DemoConfig().dtype}
    assert set(defaults.values()) == {"auto"}, defaults
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert train.uses_bf16(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda") == torch.float32


@pytest.fixture
def tf32_off():
    """TF32 off for the test, the process's settings restored after it."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_allow_tf32_turns_on_tf32_products(tf32_off):
    device_mod.allow_tf32()
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def test_training_on_cuda_allows_tf32_and_decoding_does_not(monkeypatch, tf32_off):
    """The trainer's set-up on a CUDA device allows TF32; resolving a device for decoding does not (a
    float32 eval is the bit-exact reference)."""
    import deepspec.train.distributed as distributed

    calls = []
    monkeypatch.setattr(distributed, "allow_tf32", lambda: calls.append("tf32"))
    monkeypatch.setattr(distributed, "resolve_device", lambda name, field: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    distributed.setup_distributed("cuda")
    assert calls == ["tf32"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    resolve_device("cuda")
    assert not torch.backends.cuda.matmul.allow_tf32
