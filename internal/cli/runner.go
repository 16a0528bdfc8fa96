package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/fetch"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/daemon"
	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/pool"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/secret"
)

// runnerSettings is what `cml runner launch` is told, after flags,
// variables and defaults (cml.go).
type runnerSettings struct {
	Labels        []string
	IdleTimeout   time.Duration // 0: never
	Name          string
	Single        bool
	Reuse         bool
	ReuseIdle     bool
	NoRetry       bool
	Workdir       string
	DockerVolumes []string
	Driver        string
	Repo          string
	Token         string
	Log           string
	Docker        string // image: run the agent in a container
	Agent         string
	// AgentURL and AgentSHA256 say where the forge's agent release is
	// fetched from, and its checksum, instead of the forge's own.
	AgentURL, AgentSHA256 string
	// Cloud holds the scalar --cloud* options given, by flag name
	// without the dashes; Metadata and NodeSelector CML's key=value
	// lists.
	Cloud                  map[string]string
	Metadata, NodeSelector map[string]string
	// Ignored are the CML options given that mean nothing to runfleet,
	// each with why; Warnings what CML would warn of.
	Ignored, Warnings []string
}

// inferRepo finds the repository as CML does: GITHUB_REPOSITORY (on
// GITHUB_SERVER_URL), CI_PROJECT_URL, BITBUCKET_GIT_HTTP_ORIGIN (where
// CML reads the git remote, which a Bitbucket step's clone has too), or
// the git remote of the current directory.
func inferRepo(getenv func(string) (string, bool)) string {
	if r, ok := getenv("GITHUB_REPOSITORY"); ok && r != "" {
		server, _ := getenv("GITHUB_SERVER_URL")
		if server == "" {
			server = "https://github.com"
		}
		return strings.TrimRight(server, "/") + "/" + r
	}
	if u, ok := getenv("CI_PROJECT_URL"); ok && u != "" {
		return u
	}
	// Bitbucket Pipelines' "URL for the origin" (its default variables).
	if u, ok := getenv("BITBUCKET_GIT_HTTP_ORIGIN"); ok && u != "" {
		return u
	}
	out, err := exec.Command("git", "remote", "get-url", "origin").Output()
	if err != nil {
		return ""
	}
	remote := strings.TrimSpace(string(out))
	// git@github.com:owner/repo.git -> https://github.com/owner/repo
	if rest, ok := strings.CutPrefix(remote, "git@"); ok {
		host, path, _ := strings.Cut(rest, ":")
		remote = "https://" + host + "/" + path
	}
	return strings.TrimSuffix(remote, ".git")
}

// repoDriver is a forge driver that `runfleet runner` can configure from
// a repository URL.
type repoDriver struct {
	typ string
	forge.RepoDriver
}

// repoDrivers returns the forge drivers that can configure themselves from
// a repository URL, by type name.
func repoDrivers() []repoDriver {
	var out []repoDriver
	for _, typ := range forge.Types() {
		d, _ := forge.Lookup(typ)
		if rd, ok := d.(forge.RepoDriver); ok {
			out = append(out, repoDriver{typ, rd})
		}
	}
	return out
}

// inferDriver tells the forge from the repository's host, or else from
// the CI job it runs in, by asking each forge driver that can configure
// itself from a repository URL.
func inferDriver(repo string, getenv func(string) (string, bool)) string {
	drivers := repoDrivers()
	if u, err := url.Parse(repo); err == nil && u.Host != "" {
		for _, d := range drivers {
			if d.Recognize(u) {
				return d.typ
			}
		}
	}
	for _, d := range drivers {
		if d.InCI(getenv) {
			return d.typ
		}
	}
	return ""
}

var runnerNameRE = lazyregexp.New(`^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$`)

func runnerCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "runner",
		Short: "Start a runner on this machine or in a cloud, as `cml runner launch` does",
		Long: `runner (or runner launch) is a drop-in for ` + "`cml runner launch`" + `: the same
options, defaults and variables (CML_RUNNER_*, CML_*, the older RUNNER_*, and
the token in REPO_TOKEN and the others CML reads). It checks the token and
the repository first and exits 1 at once with the forge's answer if they do
not work.

What differs, on purpose: each job runs in a fresh runner registered just
for it (a GitHub JIT runner, a GitLab runner deleted after its job), so
--name is the prefix of their names (<name>-<n>); the next runner is ready
as soon as a job starts; the idle clock never runs while a job does;
--reuse ignores offline runners. It runs them on this machine, in a fresh
container with --docker IMAGE, or in a cloud with --cloud. It exits after
--idle-timeout without a job, or after one job with --single, and leaves no
registration behind: 0 if a runner came online, 1 if none ever did.`,
		Args: cobra.NoArgs,
		RunE: runRunnerCmd,
	}
	addCMLFlags(cmd.Flags())
	launch := &cobra.Command{
		Use:   "launch",
		Short: "Launch a runner: the same as runner, as CML spells it",
		Long:  cmd.Long,
		Args:  cobra.NoArgs,
		RunE:  runRunnerCmd,
	}
	addCMLFlags(launch.Flags())
	cmd.AddCommand(launch)
	return cmd
}

func runRunnerCmd(cmd *cobra.Command, _ []string) error {
	s, err := resolveRunner(cmd.Flags(), os.LookupEnv)
	if err != nil {
		return &ExitError{ExitUsage, err}
	}
	return runRunner(cmd.Context(), s, os.LookupEnv)
}

func runRunner(ctx context.Context, s runnerSettings, getenv func(string) (string, bool)) error {
	usage := func(err error) error { return &ExitError{ExitUsage, err} }
	log := slog.Default()
	if s.Log != "" && s.Log != "info" {
		var lvl slog.Level
		if err := lvl.UnmarshalText([]byte(s.Log)); err != nil {
			return usage(fmt.Errorf("--log: %q is not error, warn, info or debug", s.Log))
		}
		log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
	}
	for _, w := range s.Warnings {
		log.Warn(w)
	}
	if len(s.Ignored) > 0 {
		log.Debug("CML options that mean nothing to runfleet, ignored", "options", strings.Join(s.Ignored, "; "))
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	cfg, err := runnerConfig(ctx, &s, getenv, log)
	if err != nil {
		return usage(err)
	}
	// The token, the repository and the cloud are checked first, by a
	// fleet that is only read: before an agent is looked for or fetched,
	// and before anything is written.
	probe, err := daemon.Inspect(ctx, cfg, log)
	if err != nil {
		return usage(err)
	}
	reused, err := checkRunner(ctx, probe, s)
	probe.Close()
	if err != nil {
		return err
	}
	if reused != "" {
		log.Info("an existing runner matches; starting none", "runner", reused)
		return nil
	}
	if err := fetchAgent(ctx, &cfg.Pools[0], s, log); err != nil {
		return err
	}
	fleet, err := daemon.New(ctx, cfg, log)
	if err != nil {
		return usage(err)
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan struct{})
	go func() { fleet.Run(runCtx); close(done) }()
	watchRunner(runCtx, cancel, fleet.Pools[0], s, log)
	<-done
	// Read after the drain: a job that ended just before the stop is
	// known only to the passes made while draining.
	if !fleet.Pools[0].Served() {
		return &ExitError{ExitFailure, noRunner(fleet.Pools[0], ctx.Err() != nil)}
	}
	return nil
}

// fetchAgent gives runners on this host the forge's agent when the host
// has none and --agent names none, as CML installs the agent itself: the
// forge's release runfleet pins (forge.AgentReleaser), fetched into
// runfleet's cache and checked against its SHA-256.
func fetchAgent(ctx context.Context, pc *config.Pool, s runnerSettings, log *slog.Logger) error {
	if pc.Agent.Path != "" || pc.Provider != config.DefaultProvider {
		return nil
	}
	d, _ := forge.Lookup(s.Driver)
	rel, ok := d.(forge.AgentReleaser)
	if !ok {
		st, ok := d.(forge.Starter)
		if agent := st.Starter(forge.StarterOptions{}).Agent; ok && agent != "" {
			if _, err := exec.LookPath(agent); err != nil {
				also := ""
				if da, ok := d.(forge.DockerAgent); ok {
					// Not chosen by itself: it gives each job this
					// host's engine, as mount_docker_socket does.
					also = fmt.Sprintf(", or run it as its image through this host's Docker with --agent %s (each job then reaches this host's engine)", da.DockerAgentPath())
				}
				return &ExitError{ExitUsage, fmt.Errorf("--agent: %s is not on this host, and runfleet fetches no release of %s's agent: install it (docs/forges/%s.md), or name it with --agent%s", agent, s.Driver, s.Driver, also)}
			}
		}
		return nil
	}
	r := rel.AgentRelease()
	if _, err := exec.LookPath(cmp.Or(r.Program, r.Name)); err == nil {
		return nil
	}
	log.Info("the forge's runner agent is not on this host; fetching it", "agent", r.Name, "version", r.Version)
	path, err := r.Get(ctx, fetch.Options{Cache: fetch.DefaultCache(), Mirror: s.AgentURL, SHA256: s.AgentSHA256})
	if err != nil {
		return &ExitError{ExitFailure, fmt.Errorf("--agent: %s is not in PATH, and fetching %s %s failed: %w (install it, or name it with --agent)", cmp.Or(r.Program, r.Name), r.Name, r.Version, err)}
	}
	log.Info("fetched the forge's runner agent", "agent", r.Name, "version", r.Version, "path", path)
	pc.Agent.Path = path
	return nil
}

// noRunner says why the run ends without a runner having come online.
func noRunner(p *pool.Pool, stopped bool) error {
	why := "no runner came online"
	if stopped {
		why += " before the runner was stopped"
	}
	if b := p.Backoff(); b.Reason != "" {
		return fmt.Errorf("%s: %s", why, b.Reason)
	}
	if err := p.LastError(); err != nil {
		return fmt.Errorf("%s: %w", why, err)
	}
	return errors.New(why)
}

// checkTimeout bounds the calls that check the token, the repository and
// the cloud before anything starts: a token or URL that does not work is
// said within seconds, as CML does, not at the idle timeout.
const checkTimeout = 8 * time.Second

// checkRunner makes the calls CML makes before it starts a runner (its
// repoTokenCheck, then the repository's runners): one authenticated call
// to the forge, whose runners it reads, and one to the provider, whose
// machines it lists. It refuses a name that an online runner has, as CML
// does, unless --reuse; and with --reuse or --reuse-idle it returns the
// runner that makes a new one needless.
func checkRunner(ctx context.Context, fleet *daemon.Fleet, s runnerSettings) (reused string, err error) {
	ctx, cancel := context.WithTimeout(ctx, checkTimeout)
	defer cancel()
	f := fleet.Forges[s.Name]
	rs, err := f.Runners(ctx)
	if err != nil {
		return "", &ExitError{ExitFailure, fmt.Errorf("%s (%s %s): %w", checkFailed(err, "the forge", "refused the token or the repository"), fleet.Config.Forges[0].Type, s.Repo, err)}
	}
	if _, err := fleet.Providers[s.Name].List(ctx, fleet.Config.ID); err != nil {
		return "", &ExitError{ExitFailure, fmt.Errorf("%s (%s): %w", checkFailed(err, "the cloud", "refused to list the runners' machines"), fleet.Config.Pools[0].Provider, err)}
	}
	if r := reuse(rs, s); r != "" {
		return r, nil
	}
	if !s.Reuse {
		for _, r := range rs {
			if r.Status != forge.StatusOffline && ownName(r.Name, s.Name) {
				return "", &ExitError{ExitFailure, fmt.Errorf("--name: runner name %s is already in use by an online runner (%s); change the name, pass --reuse, or stop that runner", s.Name, r.Name)}
			}
		}
	}
	return "", nil
}

// checkFailed says in a user's words why a check failed: who could not
// be reached, did not answer in time, or refused.
func checkFailed(err error, who, refused string) string {
	var netErr *net.OpError
	var dnsErr *net.DNSError
	switch {
	case errors.As(err, &netErr), errors.As(err, &dnsErr):
		return who + " could not be reached"
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Sprintf("%s did not answer within %s", who, checkTimeout)
	}
	return who + " " + refused
}

// ownName says whether a registration is named for this runner: the
// name, or <name>-<n> as its fresh runners are.
func ownName(reg, name string) bool {
	rest, ok := strings.CutPrefix(reg, name+"-")
	if reg == name {
		return true
	}
	_, err := strconv.Atoi(rest)
	return ok && err == nil
}

// runnerConfig builds the config of a one-pool fleet from CML's options:
// the forge from the repository (through its driver), the provider that
// CML's options ask for (--docker, --cloud), or runners on this machine.
func runnerConfig(ctx context.Context, s *runnerSettings, getenv func(string) (string, bool), log *slog.Logger) (*config.Config, error) {
	if s.Repo == "" {
		s.Repo = inferRepo(getenv)
	}
	if s.Repo == "" {
		return nil, errors.New("--repo: no repository given, and none found in GITHUB_REPOSITORY, CI_PROJECT_URL, BITBUCKET_GIT_HTTP_ORIGIN or the git remote")
	}
	if s.Driver == "" {
		s.Driver = inferDriver(s.Repo, getenv)
	}
	fc, err := runnerForge(*s)
	if err != nil {
		return nil, err
	}
	if how, out := provider.LeftOut(s.Cloud["cloud"]); out {
		// Before a stock image's agent is looked for.
		return nil, fmt.Errorf("--cloud: %s is not in this build of runfleet: %s", s.Cloud["cloud"], how)
	}
	stock, stockAgent, err := stockInstall(ctx, *s, getenv)
	if err != nil {
		return nil, err
	}
	provName, section, err := runnerProvider(*s, stock, getenv, log)
	if err != nil {
		return nil, err
	}
	agentPath := s.Agent
	if agentPath == "" {
		agentPath = stockAgent // where the boot script unpacks the agent; "" without one
	}
	if s.Token == "" {
		return nil, errors.New("--driver-token: no token; set REPO_TOKEN (or pass --token)")
	}
	fc.Token = secret.String(s.Token)
	if s.Name == "" {
		s.Name = randomName()
	}
	if !runnerNameRE.MatchString(s.Name) {
		return nil, fmt.Errorf("--name: %q is not a valid name (lower-case letters, digits and '-', at most 32)", s.Name)
	}
	retry := !s.NoRetry
	pc := config.Pool{
		Name: s.Name, Forge: fc.Name, Labels: s.Labels, Size: 1, Max: 1,
		IdleTimeout: config.D(time.Minute), RetryLost: &retry, Single: s.Single,
		Agent: config.Agent{Path: agentPath}, Provider: provName, Section: section,
	}
	cfg := &config.Config{ID: s.Name, StateDir: s.Workdir, Resync: config.D(2 * time.Second), DrainTimeout: config.D(24 * time.Hour), Forges: []config.Forge{fc}, Pools: []config.Pool{pc}}
	if err := cfg.Complete(); err != nil {
		return nil, err
	}
	return cfg, nil
}

// runnerForge configures the forge through its driver, from the
// repository URL alone.
func runnerForge(s runnerSettings) (config.Forge, error) {
	drivers := repoDrivers()
	known := make([]string, len(drivers))
	for i, d := range drivers {
		known[i] = d.typ
	}
	if s.Driver == "" {
		list := strings.Join(known, ", ")
		if n := len(known); n > 1 {
			list = strings.Join(known[:n-1], ", ") + " or " + known[n-1]
		}
		return config.Forge{}, fmt.Errorf("--driver: cannot tell the forge of %s; pass --driver (%s)", s.Repo, list)
	}
	i := slices.Index(known, s.Driver)
	if how, out := forge.LeftOut(s.Driver); i < 0 && out {
		return config.Forge{}, fmt.Errorf("--driver: %s is not in this build of runfleet: %s", s.Driver, how)
	}
	if i < 0 {
		return config.Forge{}, fmt.Errorf("--driver: %s is not supported by this build yet (%s)", s.Driver, strings.Join(known, ", "))
	}
	u, section, err := drivers[i].RepoConfig(s.Repo)
	if err != nil {
		return config.Forge{}, fmt.Errorf("--repo: %w", err)
	}
	return config.Forge{Name: "repo", Type: s.Driver, URL: u, Section: section}, nil
}

// runnerProvider finds the provider that CML's options ask for: the one
// driver that takes them, or runners on this machine when none is asked
// for.
func runnerProvider(s runnerSettings, stock *provider.Stock, getenv func(string) (string, bool), log *slog.Logger) (string, json.RawMessage, error) {
	if len(s.DockerVolumes) > 0 && s.Docker == "" {
		// CML gives them to GitLab's Docker executor, and warns of them
		// elsewhere.
		log.Warn("--docker-volumes: ignored without --docker IMAGE: the runners run on this machine")
	}
	opts := provider.CMLOptions{Docker: s.Docker, DockerVolumes: s.DockerVolumes, Cloud: s.Cloud, Metadata: s.Metadata, NodeSelector: s.NodeSelector, Getenv: getenv, Stock: stock, AgentImage: agentImage(s)}
	var chosen []string
	var section json.RawMessage
	for _, name := range provider.Names() {
		d, _ := provider.Lookup(name)
		c, ok := d.(provider.CMLDriver)
		if !ok {
			continue
		}
		sec, ok, err := c.CMLSection(opts)
		if err != nil {
			return "", nil, err
		}
		if ok {
			chosen, section = append(chosen, name), sec
		}
	}
	switch {
	case len(chosen) > 1:
		return "", nil, fmt.Errorf("the options ask for more than one place to run: %s", strings.Join(chosen, ", "))
	case len(chosen) == 1:
		return chosen[0], section, nil
	case s.Cloud["cloud"] != "":
		return "", nil, fmt.Errorf("--cloud: %q is not a cloud of this build (aws, azure, gcp and kubernetes are); run without --cloud* to start the runner on this machine (or in a container with --docker)", s.Cloud["cloud"])
	case len(s.Cloud) > 0 || len(s.Metadata) > 0 || len(s.NodeSelector) > 0:
		// CML reads them only with --cloud, and ignores them without.
		given := slices.Sorted(maps.Keys(s.Cloud))
		for name, m := range map[string]map[string]string{"cloud-metadata": s.Metadata, "cloud-kubernetes-node-selector": s.NodeSelector} {
			if len(m) > 0 {
				given = append(given, name)
			}
		}
		log.Warn("cloud options without --cloud are ignored, as CML does: the runners run on this machine", "options", "--"+strings.Join(given, ", --"))
	}
	return config.DefaultProvider, nil, nil
}

// reuse returns, with --reuse, an online runner of the same name or
// with every one of the labels, and with --reuse-idle an idle online one
// with every label (CML's runnersByLabels); "" if there is none. Offline
// runners never count: they take no job.
func reuse(rs []forge.Runner, s runnerSettings) string {
	if !s.Reuse && !s.ReuseIdle {
		return ""
	}
	for _, r := range rs {
		if r.Status == forge.StatusOffline || (s.ReuseIdle && r.Status == forge.StatusBusy) {
			continue
		}
		if s.Reuse && ownName(r.Name, s.Name) {
			return r.Name
		}
		if len(s.Labels) > 0 && !slices.ContainsFunc(s.Labels, func(l string) bool { return !slices.Contains(r.Labels, l) }) {
			return r.Name
		}
	}
	return ""
}

// watchRunner ends the run: after one job with --single, or after the
// idle timeout. The idle clock restarts whenever a runner is busy, and a
// fresh read of the forge and the agents confirms that none is before it
// fires, so it never fires during a job.
func watchRunner(ctx context.Context, stop context.CancelFunc, p *pool.Pool, s runnerSettings, log *slog.Logger) {
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	idleSince := time.Now()
	sawRunner := false
	machines := map[string]bool{}
	busy := func(rs []pool.Runner) bool {
		return slices.ContainsFunc(rs, func(r pool.Runner) bool { return r.State == pool.StateBusy })
	}
	// The wait for a job begins when a runner is up, as CML's does on
	// the runner's machine: a cloud machine that boots for minutes is not
	// idle. A runner that never comes up is retired at the pool's
	// bootstrap timeout, and the clock runs while the pool backs off.
	starting := func(rs []pool.Runner) bool {
		return slices.ContainsFunc(rs, func(r pool.Runner) bool { return r.State == pool.StateStarting })
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rs := p.Runners()
		// A runner whose job took less than a tick is never seen: the
		// pool's count of runners started tells.
		sawRunner = sawRunner || len(rs) > 0 || p.Created() > 0
		now := map[string]bool{}
		for _, r := range rs {
			if r.Machine != "" {
				now[r.Machine] = true
			}
		}
		for m := range machines {
			if !now[m] && p.Served() {
				// A runner ended: it ran a job, or failed to. Runners
				// that fail before any came online do not hold the
				// clock back: the run ends at the timeout, and says so.
				idleSince = time.Now()
			}
		}
		machines = now
		if busy(rs) || starting(rs) {
			idleSince = time.Now()
			continue
		}
		// With --single the pool fills its slot once: when that runner
		// is gone, its job is done.
		if s.Single && sawRunner && len(rs) == 0 {
			if p.Served() {
				log.Info("the job is done; exiting (--single)")
			}
			stop()
			return
		}
		if s.IdleTimeout > 0 && time.Since(idleSince) > s.IdleTimeout {
			fresh, err := p.Observe(ctx)
			if err == nil && busy(fresh) {
				idleSince = time.Now()
				continue
			}
			if p.Served() {
				log.Info("no job within the idle timeout; shutting down", "idle_timeout", s.IdleTimeout)
			} else {
				log.Error("no runner came online within the idle timeout; shutting down", "idle_timeout", s.IdleTimeout)
			}
			stop()
			return
		}
	}
}
