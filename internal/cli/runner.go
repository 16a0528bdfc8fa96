package cli

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/daemon"
	"github.com/runfleet/runfleet/pool"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/secret"
)

// runnerSettings is what `cml runner launch` is told, after flags, the
// CML_RUNNER_* variables, the older RUNNER_* ones and the defaults.
type runnerSettings struct {
	Labels        []string
	IdleTimeout   time.Duration // 0: never
	Name          string
	Single        bool
	Reuse         bool
	ReuseIdle     bool
	NoRetry       bool
	DockerVolumes []string
	Driver        string
	Repo          string
	Token         string
	Log           string
	Docker        string // image: run the agent in a container
	Agent         string
	// Cloud holds the --cloud* options given, by flag name without the
	// dashes, for a provider that takes them.
	Cloud map[string]string
}

// cmlFlag is one option of `cml runner launch`: its flag, the variables
// that set it, and the help.
type cmlFlag struct {
	name string
	env  []string // in order of precedence, after the flag
	help string
	kind string // string, bool, list
	def  string
}

var cmlFlags = []cmlFlag{
	{"labels", []string{"CML_RUNNER_LABELS", "RUNNER_LABELS"}, "one or more labels for this runner, comma-separated", "string", "cml"},
	{"idle-timeout", []string{"CML_RUNNER_IDLE_TIMEOUT", "RUNNER_IDLE_TIMEOUT"}, "time to wait for a job before shutting down: seconds or a duration (90, 5m); 0, -1 or never to wait for ever", "string", "5m"},
	{"name", []string{"CML_RUNNER_NAME"}, "name of the runner; each job's fresh runner is <name>-<n> (default cml-<random>)", "string", ""},
	{"single", []string{"CML_RUNNER_SINGLE", "RUNNER_SINGLE"}, "exit after running a single job", "bool", ""},
	{"reuse", []string{"CML_RUNNER_REUSE", "RUNNER_REUSE"}, "start nothing if an online runner has the same name or overlapping labels (offline runners are ignored)", "bool", ""},
	{"reuse-idle", []string{"CML_RUNNER_REUSE_IDLE"}, "start nothing if an idle online runner has the same name or overlapping labels", "bool", ""},
	{"no-retry", []string{"CML_RUNNER_NO_RETRY", "RUNNER_NO_RETRY"}, "do not re-run a job whose runner's machine went away mid-job", "bool", ""},
	{"docker-volumes", []string{"CML_RUNNER_DOCKER_VOLUMES"}, "volumes for the runner's container, src:dst[:ro|rw] (read-only unless :rw), with --docker", "list", ""},
	{"driver", []string{"CML_RUNNER_DRIVER", "RUNNER_DRIVER"}, "forge of the repository: github, gitea, gitlab, azure-pipelines or bitbucket (inferred from --repo or the CI environment when absent)", "string", ""},
	{"repo", []string{"CML_RUNNER_REPO", "RUNNER_REPO"}, "repository (or organisation) URL to register the runner with (default: GITHUB_REPOSITORY, CI_PROJECT_URL, or the git remote)", "string", ""},
	{"token", []string{"CML_RUNNER_TOKEN", "REPO_TOKEN", "repo_token", "GITHUB_TOKEN", "GITLAB_TOKEN"}, "personal access token (prefer the REPO_TOKEN variable: a flag shows in process listings)", "string", ""},
	{"log", []string{"CML_RUNNER_LOG"}, "log level: error, warn, info or debug (default: --log-level)", "string", ""},
	{"docker", []string{"CML_RUNNER_DOCKER"}, "run each job's runner in a fresh container of this image instead of on this machine", "string", ""},
	{"agent", []string{"CML_RUNNER_AGENT"}, "the forge's runner agent: GitHub's run.sh, gitea-runner, gitlab-runner or the Azure Pipelines agent's run.sh (found in PATH; in the image with --docker)", "string", ""},
	{"cloud", []string{"CML_RUNNER_CLOUD"}, "cloud to start the runner in: aws, azure, gcp or kubernetes", "string", ""},
	{"cloud-region", []string{"CML_RUNNER_CLOUD_REGION"}, "cloud region", "string", ""},
	{"cloud-type", []string{"CML_RUNNER_CLOUD_TYPE"}, "instance type", "string", ""},
	{"cloud-permission-set", []string{"CML_RUNNER_CLOUD_PERMISSION_SET"}, "instance profile (AWS) or service account (GCP)", "string", ""},
	{"cloud-metadata", []string{"CML_RUNNER_CLOUD_METADATA"}, "key=value tags for the instance", "list", ""},
	{"cloud-gpu", []string{"CML_RUNNER_CLOUD_GPU"}, "GPU type", "string", ""},
	{"cloud-hdd-size", []string{"CML_RUNNER_CLOUD_HDD_SIZE"}, "disk size in GB", "string", ""},
	{"cloud-ssh-private", []string{"CML_RUNNER_CLOUD_SSH_PRIVATE"}, "private SSH key for the instance", "string", ""},
	{"cloud-spot", []string{"CML_RUNNER_CLOUD_SPOT"}, "request a spot instance", "bool", ""},
	{"cloud-spot-price", []string{"CML_RUNNER_CLOUD_SPOT_PRICE"}, "maximum spot price in USD", "string", ""},
	{"cloud-startup-script", []string{"CML_RUNNER_CLOUD_STARTUP_SCRIPT"}, "base64-encoded script run when the instance starts", "string", ""},
	{"cloud-aws-security-group", []string{"CML_RUNNER_CLOUD_AWS_SECURITY_GROUP"}, "AWS security group", "string", ""},
	{"cloud-aws-subnet", []string{"CML_RUNNER_CLOUD_AWS_SUBNET"}, "AWS subnet", "string", ""},
	{"cloud-image", []string{"CML_RUNNER_CLOUD_IMAGE"}, "machine image", "string", ""},
	{"cloud-kubernetes-node-selector", []string{"CML_RUNNER_CLOUD_KUBERNETES_NODE_SELECTOR"}, "Kubernetes node selector, key=value", "string", ""},
}

// resolveRunner reads the settings from the parsed flags and the
// environment (getenv), flags first.
func resolveRunner(fs *pflag.FlagSet, getenv func(string) (string, bool)) (runnerSettings, error) {
	var errs []error
	value := func(f cmlFlag) (string, bool) { return cmlValue(fs, getenv, f) }
	boolean := func(f cmlFlag) bool {
		v, set := value(f)
		if !set {
			return false
		}
		b, err := strconv.ParseBool(v)
		if err != nil {
			errs = append(errs, fmt.Errorf("--%s: %q is not true or false", f.name, v))
		}
		return b
	}
	var s runnerSettings
	for _, f := range cmlFlags {
		v, set := value(f)
		switch f.name {
		case "labels":
			for l := range strings.SplitSeq(v, ",") {
				if l = strings.TrimSpace(l); l != "" && !slices.Contains(s.Labels, l) {
					s.Labels = append(s.Labels, l)
				}
			}
		case "idle-timeout":
			d, err := parseIdleTimeout(v)
			if err != nil {
				errs = append(errs, err)
			}
			s.IdleTimeout = d
		case "name":
			s.Name = v
		case "single":
			s.Single = boolean(f)
		case "reuse":
			s.Reuse = boolean(f)
		case "reuse-idle":
			s.ReuseIdle = boolean(f)
		case "no-retry":
			s.NoRetry = boolean(f)
		case "docker-volumes":
			if v != "" {
				s.DockerVolumes = strings.Split(v, ",")
			}
		case "driver":
			s.Driver = v
		case "repo":
			s.Repo = v
		case "token":
			s.Token = v
		case "log":
			s.Log = v
		case "docker":
			s.Docker = v
		case "agent":
			s.Agent = v
		default: // --cloud*
			if set && (f.kind != "bool" || boolean(f)) {
				if s.Cloud == nil {
					s.Cloud = map[string]string{}
				}
				s.Cloud[f.name] = v
			}
		}
	}
	return s, errors.Join(errs...)
}

// cmlValue reads one option: the flag, else the first of its variables
// that is set, else its default; set says whether it was given.
func cmlValue(fs *pflag.FlagSet, getenv func(string) (string, bool), f cmlFlag) (v string, set bool) {
	if fl := fs.Lookup(f.name); fl != nil && fl.Changed {
		if f.kind == "list" {
			v, _ := fs.GetStringArray(f.name)
			return strings.Join(v, ","), true
		}
		return fl.Value.String(), true
	}
	for _, e := range f.env {
		if v, ok := getenv(e); ok && v != "" {
			return v, true
		}
	}
	return f.def, false
}

// parseIdleTimeout reads CML's seconds, or a Go duration; 0, -1 and
// "never" disable the timeout.
func parseIdleTimeout(v string) (time.Duration, error) {
	v = strings.TrimSpace(v)
	switch v {
	case "never", "0", "-1", "":
		return 0, nil
	}
	if n, err := strconv.ParseFloat(v, 64); err == nil {
		if n < 0 {
			return 0, nil
		}
		return time.Duration(n * float64(time.Second)), nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("--idle-timeout: %q is not seconds, a duration (5m) or never", v)
	}
	if d < 0 {
		return 0, nil
	}
	return d, nil
}

// inferRepo finds the repository as CML does: GITHUB_REPOSITORY (on
// GITHUB_SERVER_URL), CI_PROJECT_URL, or the git remote of the current
// directory.
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

var runnerNameRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$`)

func runnerCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "runner",
		Short: "Start a runner on this machine, as `cml runner launch` does",
		Long: `runner is a drop-in for ` + "`cml runner launch`" + `: the same options and
environment variables (CML_RUNNER_*, and the older RUNNER_*). Each job runs
in a fresh runner registered just for it (a GitHub JIT runner, a GitLab
runner deleted after its job), on this
machine or, with --docker, in a fresh container; the next one is ready as
soon as a job starts. The runner exits after --idle-timeout without a job
(never while a job runs), or after one job with --single, and leaves no
registration behind.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := resolveRunner(cmd.Flags(), os.LookupEnv)
			if err != nil {
				return &ExitError{ExitUsage, err}
			}
			return runRunner(cmd.Context(), s, os.LookupEnv)
		},
	}
	for _, f := range cmlFlags {
		help := f.help
		if len(f.env) > 0 {
			help += " [env " + strings.Join(f.env, ", ") + "]"
		}
		switch f.kind {
		case "bool":
			cmd.Flags().Bool(f.name, false, help)
		case "list":
			cmd.Flags().StringArray(f.name, nil, help)
		default:
			cmd.Flags().String(f.name, f.def, help)
		}
	}
	cmd.Flags().SortFlags = false
	return cmd
}

func runRunner(ctx context.Context, s runnerSettings, getenv func(string) (string, bool)) error {
	usage := func(err error) error { return &ExitError{ExitUsage, err} }
	log := slog.Default()
	if s.Log != "" {
		var lvl slog.Level
		if err := lvl.UnmarshalText([]byte(s.Log)); err != nil {
			return usage(fmt.Errorf("--log: %q is not error, warn, info or debug", s.Log))
		}
		log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
	}
	cfg, err := runnerConfig(&s, getenv)
	if err != nil {
		return usage(err)
	}
	fleet, err := daemon.New(cfg, log)
	if err != nil {
		return usage(err)
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	if s.Reuse || s.ReuseIdle {
		reused, err := reuse(ctx, fleet.Forges[s.Name], s)
		if err != nil {
			fleet.Close()
			return err
		}
		if reused != "" {
			log.Info("an existing runner matches; starting none", "runner", reused)
			fleet.Close()
			return nil
		}
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan struct{})
	go func() { fleet.Run(runCtx); close(done) }()
	watchRunner(runCtx, cancel, fleet.Pools[0], s, log)
	<-done
	return nil
}

// runnerConfig builds the config of a one-pool fleet from CML's options:
// the forge from the repository (through its driver), the provider that
// CML's options ask for (--docker, --cloud), or runners on this machine.
func runnerConfig(s *runnerSettings, getenv func(string) (string, bool)) (*config.Config, error) {
	provName, section, err := runnerProvider(*s, getenv)
	if err != nil {
		return nil, err
	}
	if s.Repo == "" {
		s.Repo = inferRepo(getenv)
	}
	if s.Repo == "" {
		return nil, errors.New("--repo: no repository given, and none found in GITHUB_REPOSITORY, CI_PROJECT_URL or the git remote")
	}
	if s.Driver == "" {
		s.Driver = inferDriver(s.Repo, getenv)
	}
	fc, err := runnerForge(*s)
	if err != nil {
		return nil, err
	}
	if s.Token == "" {
		return nil, errors.New("--token: no token; set REPO_TOKEN (or pass --token)")
	}
	fc.Token = secret.String(s.Token)
	if s.Name == "" {
		b := make([]byte, 4)
		_, _ = rand.Read(b)
		s.Name = "cml-" + hex.EncodeToString(b)
	}
	if !runnerNameRE.MatchString(s.Name) {
		return nil, fmt.Errorf("--name: %q is not a valid name (lower-case letters, digits and '-', at most 32)", s.Name)
	}
	retry := !s.NoRetry
	pc := config.Pool{
		Name: s.Name, Forge: fc.Name, Labels: s.Labels, Size: 1, Max: 1,
		IdleTimeout: config.D(time.Minute), RetryLost: &retry, Single: s.Single,
		Agent: config.Agent{Path: s.Agent}, Provider: provName, Section: section,
	}
	cfg := &config.Config{ID: s.Name, Resync: config.D(2 * time.Second), DrainTimeout: config.D(24 * time.Hour), Forges: []config.Forge{fc}, Pools: []config.Pool{pc}}
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
		return config.Forge{}, fmt.Errorf("--driver: cannot tell the forge of %s; pass --driver (%s or %s)", s.Repo, strings.Join(known[:len(known)-1], ", "), known[len(known)-1])
	}
	i := slices.Index(known, s.Driver)
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
func runnerProvider(s runnerSettings, getenv func(string) (string, bool)) (string, json.RawMessage, error) {
	if len(s.DockerVolumes) > 0 && s.Docker == "" {
		return "", nil, errors.New("--docker-volumes: needs --docker <image>")
	}
	opts := provider.CMLOptions{Docker: s.Docker, DockerVolumes: s.DockerVolumes, Cloud: s.Cloud, Getenv: getenv}
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
	case len(s.Cloud) > 0:
		return "", nil, fmt.Errorf("--%s: needs --cloud", strings.Join(slices.Sorted(maps.Keys(s.Cloud)), ", --"))
	}
	return config.DefaultProvider, nil, nil
}

// reuse returns the name of an online runner with the same name or an
// overlapping label (idle, with --reuse-idle), "" if there is none.
// Offline runners never count: they take no job.
func reuse(ctx context.Context, f forge.Forge, s runnerSettings) (string, error) {
	rs, err := f.Runners(ctx)
	if err != nil {
		return "", fmt.Errorf("--reuse: %w", err)
	}
	for _, r := range rs {
		if r.Status == forge.StatusOffline || (s.ReuseIdle && r.Status == forge.StatusBusy) {
			continue
		}
		if r.Name == s.Name || strings.HasPrefix(r.Name, s.Name+"-") || slices.ContainsFunc(r.Labels, func(l string) bool { return slices.Contains(s.Labels, l) }) {
			return r.Name, nil
		}
	}
	return "", nil
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
			if !now[m] {
				idleSince = time.Now() // a runner ended: it ran a job, or failed to
			}
		}
		machines = now
		if busy(rs) {
			idleSince = time.Now()
			continue
		}
		// With --single the pool fills its slot once: when that runner
		// is gone, its job is done.
		if s.Single && sawRunner && len(rs) == 0 {
			log.Info("the job is done; exiting (--single)")
			stop()
			return
		}
		if s.IdleTimeout > 0 && time.Since(idleSince) > s.IdleTimeout {
			fresh, err := p.Observe(ctx)
			if err == nil && busy(fresh) {
				idleSince = time.Now()
				continue
			}
			log.Info("no job within the idle timeout; shutting down", "idle_timeout", s.IdleTimeout)
			stop()
			return
		}
	}
}
