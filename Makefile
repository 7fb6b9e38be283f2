# Two commands on a fresh machine: `make serve` and `make test`. Both run `make install` first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.specpd-installed
PORT   ?= 8000
MODEL  ?= default

export OPENBLAS_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install serve test bench clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml specpd/disagg/transfer/install_ibverbs.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -r requirements.txt
	sh specpd/disagg/transfer/install_ibverbs.sh $(VENV)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m specpd.model.default
	touch $@

# a 1P1D cluster (router, prefill, decode as child processes on $(PORT), $(PORT)+1, $(PORT)+2, restarted if
# they die) with the shipped EAGLE-3 draft (n-grams merged into its tree: hybrid, the default) in
# draft-on-both mode, KV over Mooncake (the launcher falls back to tcp, saying why, where Mooncake cannot
# load); SERVE_ARGS adds flags (e.g. --draft-mode decode-only, --no-spec-ngram)
SPEC_ARGS ?= --speculative-algorithm eagle3 --draft-model default --draft-mode both
serve: install
	$(BIN)/specpd serve --disagg 1p1d --model $(MODEL) --host 127.0.0.1 --port $(PORT) $(SPEC_ARGS) $(SERVE_ARGS)

# In-process suites run on two workers with one thread each (on 2 cores: 7 min -> 3.5 min); the suites that
# start real servers (each P and D wants a core, and they check timings) run alone after them.
SERVER_TESTS := tests/disagg tests/server tests/grammar

test: install
	@OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 tests $(SERVER_TESTS:%=--ignore=%); a=$$?; \
	$(BIN)/python -m pytest -q --durations=15 $(SERVER_TESTS); b=$$?; \
	test $$a -eq 0 -a $$b -eq 0

bench: install
	$(BIN)/python evals/bench_offline.py

clean:
	rm -rf $(VENV) build *.egg-info
