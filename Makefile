# The two commands a newcomer needs (see README.md):
#   make demo   builds Gitea and gitea-runner on first use, then shows a pool run jobs
#   make test   vets and runs every test, the end-to-end ones against a real
#               Gitea and the local Docker engine

.PHONY: demo test build deps

demo:
	go run ./cmd/runfleet demo

# The end-to-end tests build Gitea on first use (about 5 minutes on two
# cores, cached in ~/.cache/runfleet afterwards), hence the long timeout.
test: deps
	go vet ./...
	go test -race -timeout 40m ./...

# Test images are built FROM scratch (no registry is needed) out of static
# binaries from Debian's bash-static and busybox-static packages.
deps:
	@if [ ! -x /bin/bash-static ] || [ ! -x /bin/busybox ]; then \
		echo "installing bash-static and busybox-static for the test images"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq bash-static busybox-static; \
	fi

build:
	go build -o bin/runfleet ./cmd/runfleet
