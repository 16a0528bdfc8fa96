package cli

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"

	"github.com/spf13/cobra"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/version"
)

// initOptions are `runfleet init`'s flags.
type initOptions struct {
	forge, provider    string
	url, runnerURL     string
	scope, image, pool string
	id                 string
	labels             []string
}

func initCmd() *cobra.Command {
	var o initOptions
	cmd := &cobra.Command{
		Use:   "init --forge TYPE --provider NAME",
		Short: "Print a commented starter config for a forge and a provider",
		Long: `init prints a starter config for one forge and one provider, every key
commented. serve takes it as printed once the token's variable is set;
--url, --scope and --image fill in what would otherwise be placeholders.

  runfleet init --forge gitea --provider docker > fleet.yaml
  GITEA_TOKEN=... runfleet serve -c fleet.yaml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := writeStarter(cmd.OutOrStdout(), o); err != nil {
				return &ExitError{ExitUsage, err}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.forge, "forge", "", "the forge's type: "+strings.Join(forge.Types(), ", "))
	f.StringVar(&o.provider, "provider", "", "where runners run: "+strings.Join(provider.Names(), ", "))
	f.StringVar(&o.url, "url", "", "the forge's address")
	f.StringVar(&o.runnerURL, "runner-url", "", "the forge's address as runners reach it, when it differs (from a container: http://host.docker.internal:3000)")
	f.StringVar(&o.scope, "scope", "", "what runners serve: owner/repo (a GitLab project, an Azure Pipelines agent pool, a Bitbucket workspace/repository)")
	f.StringVar(&o.image, "image", "", "the runner image (a container image, an AMI, a cloud image)")
	f.StringVar(&o.pool, "pool", "ci", "the pool's name")
	f.StringVar(&o.id, "id", "runfleet", "the manager's id, which all it creates carries")
	f.StringSliceVar(&o.labels, "labels", nil, "the pool's labels, what jobs ask for (default: the pool's name)")
	return cmd
}

// isLoopback says whether a host is this host's loopback.
func isLoopback(host string) bool {
	ip := net.ParseIP(host)
	return host == "localhost" || ip != nil && ip.IsLoopback()
}

var poolName = lazyregexp.New(`^[a-z0-9]([a-z0-9-]*[a-z0-9])?$`)

// writeStarter writes the config: the forge's entry and the provider's
// keys come from their drivers (forge.Starter, provider.Starter), the rest
// is every pool's.
func writeStarter(w io.Writer, o initOptions) error {
	fd, ok := forge.Lookup(o.forge)
	if how, out := forge.LeftOut(o.forge); !ok && out {
		return fmt.Errorf("--forge: %s is not in this build of runfleet: %s", o.forge, how)
	}
	if !ok {
		return fmt.Errorf("--forge: %q is not one of %s", o.forge, strings.Join(forge.Types(), ", "))
	}
	pd, ok := provider.Lookup(o.provider)
	if how, out := provider.LeftOut(o.provider); !ok && out {
		return fmt.Errorf("--provider: %s is not in this build of runfleet: %s", o.provider, how)
	}
	if !ok {
		return fmt.Errorf("--provider: %q is not one of %s", o.provider, strings.Join(provider.Names(), ", "))
	}
	fs, ok1 := fd.(forge.Starter)
	ps, ok2 := pd.(provider.Starter)
	if !ok1 || !ok2 {
		return errors.New("this forge or provider has no starter config; see docs/")
	}
	if !poolName.MatchString(o.pool) {
		return fmt.Errorf("--pool: %q is not lower-case letters, digits and -", o.pool)
	}
	if !poolName.MatchString(o.id) {
		return fmt.Errorf("--id: %q is not lower-case letters, digits and -", o.id)
	}
	if len(o.labels) == 0 {
		o.labels = []string{o.pool}
	}
	entry := fs.Starter(forge.StarterOptions{URL: o.url, RunnerURL: o.runnerURL, Scope: o.scope})
	var b strings.Builder
	fmt.Fprintf(&b, `# runfleet: a %s forge, runners on %s.
# Written by runfleet init (%s). Set %s, then:
#   runfleet serve -c fleet.yaml
# Every key: the README's configuration reference, docs/forges/%s.md and
# docs/providers/%s.md.
id: %s                  # this manager; all it creates carries it
# state_dir: ~/.local/state/runfleet/%s   # records, logs, the history of jobs
# listen: :8080               # webhooks at /webhook/<forge>
# status_listen: 127.0.0.1:9180   # the status page, /metrics and /healthz
forges:
  - name: %s
    type: %s
%s`, o.forge, o.provider, version.Get().Version, entry.TokenEnv, o.forge, o.provider, o.id, o.id, o.forge, o.forge, entry.Keys)
	if o.runnerURL != "" {
		fmt.Fprintf(&b, "    runner_url: %s   # the forge as runners reach it\n", o.runnerURL)
	} else if rs, ok := pd.(provider.RunnerURLStarter); ok && o.url != "" {
		if u, err := url.Parse(o.url); err == nil && isLoopback(u.Hostname()) {
			// A container does not reach this host's loopback.
			u.Host = rs.StarterRunnerHost() + strings.TrimPrefix(u.Host, u.Hostname())
			fmt.Fprintf(&b, "    # runner_url: %s   # the forge as runners reach it, since they do not reach %s\n", u, o.url)
		}
	}
	fmt.Fprintf(&b, `pools:
  - name: %s
    forge: %s
    labels: [%s]   # what jobs ask for (runs-on, tags, demands)
    size: 1                   # idle runners kept ready
    max: 4                    # all runners, busy ones included
    idle_timeout: 10m         # runners started for queued jobs go when idle this long
%s`, o.pool, o.forge, strings.Join(o.labels, ", "),
		ps.Starter(provider.StarterOptions{Forge: o.forge, Image: o.image, AgentImage: entry.Image, Agent: entry.Agent}))
	_, err := io.WriteString(w, b.String())
	return err
}
