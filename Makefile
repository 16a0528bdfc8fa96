# The two commands a newcomer needs (see README.md):
#   make demo   builds Gitea and gitea-runner on first use, then shows a pool run jobs
#   make test   vets and runs every test, the end-to-end ones against a real Gitea

.PHONY: demo test build

demo:
	go run ./cmd/runfleet demo

# The end-to-end tests build Gitea on first use (about 5 minutes on two
# cores, cached in ~/.cache/runfleet afterwards), hence the long timeout.
test:
	go vet ./...
	go test -race -timeout 40m ./...

build:
	go build -o bin/runfleet ./cmd/runfleet
