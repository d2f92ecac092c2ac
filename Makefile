# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PYTHON312 ?= $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12.*/bin/python3.12) $(shell command -v python3.12))
VENV := .venv
PY := $(VENV)/bin/python
PROMPT ?= def fibonacci(n):
# `make run` hands the prompt to the command through the environment, as typed: quotes and `$` survive, whether it
# comes from the environment (PROMPT='...' make run) or the command line (make run PROMPT='...'; $(value) stops
# make from expanding a `$` in it).
override PROMPT := $(value PROMPT)
export PROMPT

.PHONY: run test install lint clean proto

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found (pyenv's 3.12 or python3.12 on PATH)"; exit 1; }
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# Generation with the embedded model (hcfjax/assets/stdlib-v3): $PROMPT and a second prompt in one batch, both
# sampled (temperature 0.7, top-p 0.9); --stats times a second, compiled run.
run: install
	$(VENV)/bin/hcfjax generate --prompt "$$PROMPT" --prompt "class LRUCache:" --max-new-tokens 96 \
		--temperature 0.7 --top-p 0.9 --stats

# -rs: every skipped test with its reason.
test: install
	$(PY) -m pytest tests -n 2 --dist loadfile --durations=15 -rs

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build

# The gRPC modules in hcfjax/serving/ (committed) from hcfjax.proto, with the pinned grpcio-tools.
proto: install
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. hcfjax/serving/hcfjax.proto hcfjax/serving/pd.proto
