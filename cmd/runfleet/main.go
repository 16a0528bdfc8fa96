// Command runfleet keeps pools of fresh, single-job CI runners for Gitea,
// GitHub and other forges, on this host's processes and containers or in the
// cloud. See the README for the configuration.
package main

import (
	"os"

	"github.com/runfleet/runfleet/internal/cli"
)

func main() {
	os.Exit(cli.Main(os.Args[1:], os.Stdout, os.Stderr))
}
