# The two commands a newcomer needs (see README.md):
#   make demo   builds Gitea and gitea-runner on first use, then shows a pool run jobs
#   make test   vets and runs every test, the end-to-end ones against a real
#               Gitea and the local Docker engine

.PHONY: demo test build deps

demo:
	go run ./cmd/runfleet demo

# The end-to-end tests build Gitea on first use (about 5 minutes on two
# cores, cached in ~/.cache/runfleet afterwards), hence the long timeout:
# cold, internal/e2e took 2251 s of it on two cores (2026-11-24).
# The NVML reader is behind the nvml build tag (cgo); its tests run over
# go-nvml's DGX H200 mock. NVML's header marks some calls deprecated.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations

test: deps
	go vet ./...
	go vet -tags nvml ./gpu
	go test -race -tags nvml ./gpu
	go test -race -timeout 50m ./...

# Test images are built FROM scratch (no registry is needed) out of static
# binaries from Debian's bash-static and busybox-static packages; the status
# page is checked in Debian's headless Chromium; the GPU tests give their
# private Docker engine a bridge with iproute2.
deps:
	@if [ ! -x /bin/bash-static ] || [ ! -x /bin/busybox ] || ! command -v chromium >/dev/null || ! command -v ip >/dev/null; then \
		echo "installing bash-static, busybox-static, chromium and iproute2 for the tests"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq bash-static busybox-static chromium iproute2; \
	fi

build:
	go build -tags nvml -o bin/runfleet ./cmd/runfleet
