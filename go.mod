module github.com/runfleet/runfleet

go 1.26

require (
	code.gitea.io/actions-proto-go v0.4.1 // indirect
	code.gitea.io/sdk/gitea v0.25.1 // indirect
	connectrpc.com/connect v1.20.0 // indirect
	github.com/42wim/httpsig v1.2.4 // indirect
	github.com/davidmz/go-pageant v1.0.2 // indirect
	github.com/go-fed/httpsig v1.1.0 // indirect
	github.com/hashicorp/go-version v1.9.0 // indirect
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/spf13/cobra v1.10.2 // indirect
	github.com/spf13/pflag v1.0.9 // indirect
	go.yaml.in/yaml/v2 v2.4.2 // indirect
	golang.org/x/crypto v0.50.0 // indirect
	golang.org/x/sys v0.43.0 // indirect
	google.golang.org/protobuf v1.36.11 // indirect
	sigs.k8s.io/yaml v1.6.0 // indirect
)
