# The two commands a newcomer needs (see README.md):
#   make demo   builds Gitea and gitea-runner on first use, then shows a pool run jobs
#   make test   vets and runs every test, the end-to-end ones against a real
#               Gitea and the local Docker engine

.PHONY: demo test build release image image-context deps

demo:
	go run ./internal/testbed/demo

# The end-to-end tests build Gitea, gitea-runner and a Kubernetes control
# plane on first use (about 25 minutes on two cores with Go's build cache
# empty, cached in ~/.cache/runfleet afterwards, one build at a time under
# a lock), hence the long timeout. The end-to-end packages
# (internal/e2e/*) mostly wait on jobs, so up to TEST_PARALLEL test
# packages run side by side: four, on two cores about half busy (18m21s
# of tests warm, against 25m49s at three). A first try at four failed
# where Gitea answered task fetches after the runners had given up on them
# and a drain of pods outlived its minute, both since fixed in the
# manager; at six, two cores ran at a load of 20 and container starts took
# 20 s. testsum
# shows each package's output as it ends, then the wall time of every
# package and the ten slowest tests.
# TEST_JSON keeps go test's own record. -count=1: go test's cache cannot
# see Gitea, Docker or the simulators' builds, so a cached pass would be
# no test at all. The end-to-end packages share one runfleet binary, built
# here, static so that the cloud stand-ins' images take it too (each would
# link its own: a tenth of the run's CPU on two cores). go vet compiles
# what it checks with cgo off too, so that on a cold build cache the
# static binary reuses its work rather than compiling everything once more
# (no file of ours needs cgo but the NVML reader's, which is vetted with
# it on).
# The NVML reader is behind the nvml build tag (cgo); its tests run over
# go-nvml's DGX H200 mock. NVML's header marks some calls deprecated.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations
TEST_PARALLEL ?= 4
# Tests marked t.Parallel run up to TEST_BESIDE at once in their package
# (go test's default is GOMAXPROCS, two here): only the Slurm package's
# that wait on Slurm's clock are, four of them beside each other.
TEST_BESIDE ?= 4
# go test starts packages in the order they are named: the longest first
# (by testsum's summary of a warm run), so that none of them starts last
# and runs on alone. release is short with Go's build cache warm, but
# compiles everything for arm64 and with cgo when it is cold: early, it
# overlaps with the end-to-end packages' waiting.
# github runs 6 minutes since its status page test (a 240-job burst): it
# ended a run alone, last in this list, until it moved up.
SLOWEST_FIRST = ./internal/e2e/chaoscloud ./internal/e2e/kube ./internal/e2e/aws ./internal/e2e/slurm ./internal/e2e/github \
	./internal/e2e/release ./internal/e2e/azurevm ./internal/e2e/chaos ./internal/e2e/gcp ./internal/e2e/docker ./internal/e2e/gitlab \
	./internal/e2e/manager ./internal/e2e/gitea ./internal/e2e/azure ./internal/e2e/bitbucket
TEST_JSON ?= /dev/null
# Go's build cache keys a package built without -trimpath by its directory,
# so each clean clone (CI's) compiled every package of the module again,
# with -race and without: 2.5 s against 0.4 s for one package from a
# second clone. With it a clone reuses what the last one built.
TRIM = -trimpath
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

test: deps
	CGO_ENABLED=0 go vet $(TRIM) ./...
	go vet $(TRIM) -tags nvml ./gpu
	go test $(TRIM) -race -tags nvml ./gpu
	go build $(TRIM) -o bin/testsum ./internal/testbed/testsum
	CGO_ENABLED=0 go build $(TRIM) -o bin/runfleet-e2e ./cmd/runfleet
	RUNFLEET_E2E_BINARY=$(CURDIR)/bin/runfleet-e2e \
		go test $(TRIM) -race -count=1 -timeout 50m -p $(TEST_PARALLEL) -parallel $(TEST_BESIDE) -json $(SLOWEST_FIRST) ./... | tee $(TEST_JSON) | bin/testsum

# Test images are built FROM scratch (no registry is needed) out of static
# binaries from Debian's bash-static and busybox-static packages; the status
# page is checked in Debian's headless Chromium; the GPU tests give their
# private Docker engine a bridge with iproute2; the Slurm tests run Debian's
# slurmctld and slurmd with munge (and sudo, for run_as); a real kubelet runs its pods with
# Debian's containerd and runc; the docker: dind test's daemon image is
# made of the host's Docker engine and iptables.
deps:
	@if [ ! -x /bin/bash-static ] || [ ! -x /bin/busybox ] || ! command -v chromium >/dev/null || ! command -v ip >/dev/null || \
		! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null || ! command -v sudo >/dev/null || \
		! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null || \
		! command -v systemd-analyze >/dev/null || ! command -v containerd >/dev/null || ! command -v ctr >/dev/null || ! command -v runc >/dev/null || \
		[ ! -x /usr/sbin/xtables-legacy-multi ]; then \
		echo "installing bash-static, busybox-static, chromium, iproute2, Slurm with slurmdbd and MariaDB, systemd, containerd and iptables for the tests"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			bash-static busybox-static chromium iproute2 slurmctld slurmd slurmdbd slurm-client munge mariadb-server sudo systemd containerd runc iptables; \
	fi

# The version, commit and date the binary reports (runfleet version), from
# git: the tag (v1.2.0, or v1.2.0-3-gabcdef for commits after it), else a
# pseudo-version as Go's own (v0.0.0-<commit time>-<commit>), +dirty for
# uncommitted changes; a build outside a checkout falls back to Go's stamp.
VERSION ?= $(shell git describe --tags --match 'v[0-9]*' --dirty 2>/dev/null || \
	(TZ=UTC git log -1 --format='v0.0.0-%cd-%h' --date=format-local:%Y%m%d%H%M%S --abbrev=12 2>/dev/null | tr -d '\n'; \
	 git diff --quiet HEAD 2>/dev/null || echo '+dirty'))
COMMIT  ?= $(shell git rev-parse HEAD 2>/dev/null)
DATE    ?= $(shell git log -1 --format=%cI 2>/dev/null)
LDFLAGS := -X github.com/runfleet/runfleet/version.version=$(VERSION) -X github.com/runfleet/runfleet/version.commit=$(COMMIT) -X github.com/runfleet/runfleet/version.date=$(DATE)

# The drivers a build links (docs/builds.md): every one by default, or
# those DRIVERS names (make build DRIVERS="github docker process"), each
# by its build tag. The lists are internal/cli/drivers.go's (a test holds
# them to it).
FORGES = azurepipelines bitbucket gitea github gitlab
PROVIDERS = aws azure docker gcp kubernetes process slurm
DRIVERS ?=
driver_tags = $(foreach d,$(subst -,,$(1)),$(if $(filter $(d),$(FORGES)),forge_$(d),$(if $(filter $(d),$(PROVIDERS)),provider_$(d),$(error DRIVERS: no driver is called "$(d)"; forges: $(FORGES); providers: $(PROVIDERS)))))
TAGS = $(call driver_tags,$(DRIVERS))
# A build with drivers named needs a forge and a provider among them.
check_drivers = $(if $(strip $(1)),$(if $(filter forge_%,$(call driver_tags,$(1))),,$(error DRIVERS: "$(1)" names no forge; forges: $(FORGES)))$(if $(filter provider_%,$(call driver_tags,$(1))),,$(error DRIVERS: "$(1)" names no provider; providers: $(PROVIDERS))))

build:
	$(call check_drivers,$(DRIVERS))
	go build -tags "nvml $(TAGS)" -ldflags "$(LDFLAGS)" -o bin/runfleet ./cmd/runfleet

# Release binaries in $(DIST), stripped: every driver, static linux/amd64
# and linux/arm64, and the amd64 build with the NVML reader (cgo, linked
# against glibc), named as such; and, static for both, a build for each
# common set of drivers, every forge in each, named for where its runners
# run (RELEASE_SETS): hosts (processes, Docker, Kubernetes and Slurm: the
# site's own machines), aws, gcp and azure. With their SHA-256 sums.
# Reproducible: no paths (-trimpath), no build ids, the date of the commit
# rather than of the build, so that two builds of one commit give the same
# sums (internal/e2e/release checks).
DIST ?= dist
RELEASE_FLAGS = -trimpath -buildvcs=false -ldflags "-s -w -buildid= $(LDFLAGS)"
RELEASE_NAME = runfleet-$(VERSION)-linux
RELEASE_SETS = hosts aws gcp azure
SET_hosts = $(FORGES) process docker kubernetes slurm
SET_aws = $(FORGES) aws
SET_gcp = $(FORGES) gcp
SET_azure = $(FORGES) azure

release:
	rm -rf $(DIST) && mkdir -p $(DIST)
	CGO_ENABLED=0 GOOS=linux GOARCH=amd64 go build $(RELEASE_FLAGS) -o $(DIST)/$(RELEASE_NAME)-amd64 ./cmd/runfleet
	CGO_ENABLED=0 GOOS=linux GOARCH=arm64 go build $(RELEASE_FLAGS) -o $(DIST)/$(RELEASE_NAME)-arm64 ./cmd/runfleet
	CGO_ENABLED=1 GOOS=linux GOARCH=amd64 go build -tags nvml $(RELEASE_FLAGS) -o $(DIST)/$(RELEASE_NAME)-amd64-nvml ./cmd/runfleet
	$(foreach set,$(RELEASE_SETS),$(foreach arch,amd64 arm64,CGO_ENABLED=0 GOOS=linux GOARCH=$(arch) go build -tags "$(call driver_tags,$(SET_$(set)))" $(RELEASE_FLAGS) -o $(DIST)/$(RELEASE_NAME)-$(arch)-$(set) ./cmd/runfleet && )) true
	cd $(DIST) && sha256sum $(RELEASE_NAME)-* > SHA256SUMS
	cat $(DIST)/SHA256SUMS

# The runfleet image (images/runfleet/Dockerfile), FROM scratch: its context
# is staged in $(IMAGE_CONTEXT) from a static build like release's and the
# host's CA bundle (Debian's ca-certificates). No registry is needed.
IMAGE ?= runfleet/runfleet:$(VERSION)
IMAGE_CONTEXT ?= bin/image
CA_BUNDLE ?= /etc/ssl/certs/ca-certificates.crt

image-context:
	rm -rf $(IMAGE_CONTEXT) && mkdir -p $(IMAGE_CONTEXT)/state
	CGO_ENABLED=0 GOOS=linux go build $(RELEASE_FLAGS) -o $(IMAGE_CONTEXT)/runfleet ./cmd/runfleet
	cp $(CA_BUNDLE) $(IMAGE_CONTEXT)/ca-certificates.crt
	cp images/runfleet/Dockerfile images/runfleet/passwd images/runfleet/group $(IMAGE_CONTEXT)/
	touch $(IMAGE_CONTEXT)/state/.keep

image: image-context
	docker build -t $(IMAGE) $(IMAGE_CONTEXT)
