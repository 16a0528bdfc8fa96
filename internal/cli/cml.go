package cli

import (
	"cmp"
	"crypto/rand"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/runfleet/runfleet/internal/lazyregexp"
)

// The options of `cml runner launch` as CML 0.20.x defines them
// (iterative/cml: bin/cml/runner/launch.js for the command's own options,
// bin/cml.js for the global --log, --driver, --repo and --driver-token and
// for the variables it renames before parsing, src/cml.js for the token's
// variables), and the two that runfleet adds (--docker, --agent).

// optKind is how an option's value is read, as yargs reads CML's.
type optKind int

const (
	optString optKind = iota
	optBool
	optNumber
	// optArray may be given several times, or with several values after
	// one flag (yargs' arrays); from a variable it is one value.
	optArray
)

// cmlOption is one option of `cml runner launch`.
type cmlOption struct {
	name    string
	aliases []string // CML's other spellings of the flag
	kind    optKind
	def     string
	// env are the variables that set it ahead of CML_RUNNER_<NAME>, in
	// CML's order: bin/cml.js copies CML_<GLOBAL> and the legacy
	// RUNNER_<NAME> over CML_RUNNER_<NAME> before yargs reads it.
	env []string
	// fallback are read after everything else, default included (the
	// token's, src/cml.js inferToken).
	fallback  []string
	choices   []string
	conflicts []string
	help      string
	// ignored says why a CML option means nothing to runfleet; it is
	// accepted and noted in one debug line.
	ignored string
	// runfleet marks an option CML does not have.
	runfleet bool
	// secret: its value is never shown, in an error or a log.
	secret bool
}

var cmlOptions = []cmlOption{
	{name: "labels", def: "cml", env: []string{"RUNNER_LABELS"},
		help: "one or more labels for this runner, comma-separated"},
	{name: "idle-timeout", def: "5 minutes", env: []string{"RUNNER_IDLE_TIMEOUT"},
		help: `time to wait for a job before shutting down: seconds (300) or a time ("5min", "1h30m"); "never", 0 or -1 wait for ever. Unlike CML's, the clock never runs while a job does`},
	{name: "name",
		help: "name of the runner (default cml-<random>). Each job gets a fresh runner, named <name>-<n>; --reuse matches the name and those"},
	{name: "no-retry", kind: optBool, env: []string{"RUNNER_NO_RETRY"},
		help: "do not re-run a job whose runner's machine was taken back (a spot instance) or went away mid-job"},
	{name: "single", kind: optBool, env: []string{"RUNNER_SINGLE"}, conflicts: []string{"reuse", "reuse-idle"},
		help: "exit after running a single job"},
	{name: "reuse", kind: optBool, env: []string{"RUNNER_REUSE"}, conflicts: []string{"single", "reuse-idle"},
		help: "start nothing if an online runner has this name (or <name>-<n>) or every one of the labels; offline runners are ignored, unlike CML's"},
	{name: "reuse-idle", kind: optBool, conflicts: []string{"reuse", "single"},
		help: "start nothing if an idle online runner has every one of the labels"},
	{name: "workdir", aliases: []string{"path"}, env: []string{"RUNNER_PATH"},
		help: "the runners' state and working directory (default ~/.local/state/runfleet/<name>)"},
	{name: "docker-volumes", kind: optArray,
		help: "volumes for each runner's container, src:dst[:ro|rw], read-only unless :rw; with --docker (CML gives them to GitLab's Docker executor)"},
	{name: "cloud", choices: []string{"aws", "azure", "gcp", "kubernetes"},
		help: "cloud to start the runner in: aws, azure, gcp or kubernetes"},
	{name: "cloud-region", def: "us-west",
		help: "region: us-east, us-west, eu-west, eu-north, or the cloud's own region (a zone on GCP)"},
	{name: "cloud-type",
		help: "instance type: s, m, l, xl, with +t4, +k80 or +v100 (m+t4), or the cloud's own type (t2.micro)"},
	{name: "cloud-permission-set",
		help: "instance profile (AWS), service account (GCP: email[,scopes=...]) or identity (Azure)"},
	{name: "cloud-metadata", kind: optArray,
		help: "key=value tag or label for the instance; may be given several times"},
	{name: "cloud-gpu",
		help: "GPU type: k80, v100, t4, or the cloud's own (nvidia-tesla-t4); nogpu for none; tesla is v100"},
	{name: "cloud-hdd-size", kind: optNumber,
		help: "disk size in GB"},
	{name: "cloud-ssh-private", secret: true,
		help: "private SSH key whose public half may log in to the instance (the private key stays here)"},
	{name: "cloud-spot", kind: optBool,
		help: "request a spot instance"},
	{name: "cloud-spot-price", kind: optNumber, def: "-1",
		help: "maximum spot price in USD an hour; -1 for the current price, up to the on-demand one"},
	{name: "cloud-startup-script",
		help: "base64-encoded script run as root when the instance starts, before the runner"},
	{name: "cloud-aws-security-group",
		help: "AWS security group"},
	{name: "cloud-aws-subnet", aliases: []string{"cloud-aws-subnet-id"},
		help: "AWS subnet"},
	{name: "cloud-kubernetes-node-selector", kind: optArray,
		help: `key=value node selector for the runner's pod; may be given several times; a value of "infer" takes the GPU's model (default accelerator=infer)`},
	{name: "cloud-image",
		help: "machine image (an AMI, a GCE image, an Azure image) or the pod's image; without it on AWS, GCP and Azure, a stock image onto which runfleet and the agent are installed at boot"},
	{name: "tpi-version", def: ">= 0.9.10", ignored: "runfleet calls the clouds' APIs itself, without Terraform"},
	{name: "cml-version", ignored: "the instance runs runfleet's agent, not CML"},
	{name: "tf-resource", aliases: []string{"tf_resource"}, ignored: "runfleet keeps no Terraform state"},
	{name: "gcp-access-token", ignored: "CML takes it and uses it for nothing"},
	{name: "runner-path", ignored: "CML takes it and uses it for nothing; --workdir is the runners' directory"},
	{name: "destroy-delay", kind: optNumber, def: "10", ignored: "runfleet reads a runner's log before its machine goes"},
	// bin/cml.js's global options, which the runner takes as its own.
	{name: "log", def: "info", env: []string{"CML_LOG"}, choices: []string{"error", "warn", "info", "debug"},
		help: "log level"},
	{name: "driver", env: []string{"CML_DRIVER", "RUNNER_DRIVER"}, choices: []string{"github", "gitlab", "bitbucket", "gitea", "azure-pipelines"},
		help: "forge of the repository (gitea and azure-pipelines beside CML's three); inferred from --repo or the CI job when absent"},
	{name: "repo", env: []string{"CML_REPO", "RUNNER_REPO"},
		help: "repository (or organisation) URL to register the runner with (default: GITHUB_REPOSITORY, CI_PROJECT_URL, or the git remote)"},
	{name: "driver-token", aliases: []string{"token"}, secret: true, env: []string{"CML_DRIVER_TOKEN", "CML_TOKEN"},
		fallback: []string{"REPO_TOKEN", "repo_token", "GITHUB_TOKEN", "GITLAB_TOKEN", "BITBUCKET_TOKEN"},
		help:     "personal access token (prefer REPO_TOKEN: a flag shows in process listings)"},
	// runfleet's own.
	{name: "docker", runfleet: true,
		help: "run each job's runner in a fresh container of this image instead of on this machine"},
	{name: "agent", runfleet: true,
		help: "the forge's runner agent (run.sh, gitea-runner, gitlab-runner, ...); without it, on this host, the one in PATH, else the forge's release runfleet pins, fetched into runfleet's cache (GitHub's runner)"},
	{name: "agent-url", runfleet: true,
		help: "where to fetch the forge's agent release from instead of the forge's own site: a mirror holding the same files"},
	{name: "agent-sha256", runfleet: true,
		help: "the SHA-256 of the agent release's file at --agent-url, where it is a build of your own rather than the forge's"},
}

// envNames returns the variables that set an option, in precedence:
// CML's renamed ones, then CML_RUNNER_<NAME> for the name and each alias
// (yargs' .env('CML_RUNNER')).
func (o cmlOption) envNames() []string {
	out := slices.Clone(o.env)
	for _, n := range append([]string{o.name}, o.aliases...) {
		out = append(out, "CML_RUNNER_"+strings.ToUpper(strings.NewReplacer("-", "_").Replace(n)))
	}
	return out
}

// addCMLFlags declares the options on a command: each alias as a flag of
// its own, hidden, so that --help lists each option once.
func addCMLFlags(fs *pflag.FlagSet) {
	for _, o := range cmlOptions {
		help := o.help
		if env := o.envNames(); len(env) > 0 {
			help += " [env " + strings.Join(append(env, o.fallback...), ", ") + "]"
		}
		for i, n := range append([]string{o.name}, o.aliases...) {
			switch o.kind {
			case optBool:
				fs.Bool(n, false, help)
			case optArray:
				fs.StringArray(n, nil, help)
			default:
				fs.String(n, o.def, help)
			}
			if i > 0 || o.ignored != "" {
				_ = fs.MarkHidden(n)
			}
		}
	}
	fs.SortFlags = false
}

// cmlRaw is one option as given: its values (several for an array), and
// where they came from.
type cmlRaw struct {
	values []string
	from   string // "--name", a variable, or "" for the default
	secret bool
}

// quoted is the value for an error: quoted, or hidden for a secret.
func (r cmlRaw) quoted() string {
	if r.secret {
		return "(the value given)"
	}
	return strconv.Quote(r.value())
}

func (r cmlRaw) set() bool { return r.from != "" }
func (r cmlRaw) value() string {
	if len(r.values) == 0 {
		return ""
	}
	return r.values[len(r.values)-1]
}

// cmlLookup reads one option: a flag (its name or an alias), else the
// first of its variables that is set, else its default, else its
// fallback variables.
func cmlLookup(fs *pflag.FlagSet, getenv func(string) (string, bool), o cmlOption) cmlRaw {
	r := cmlFind(fs, getenv, o)
	r.secret = o.secret
	return r
}

func cmlFind(fs *pflag.FlagSet, getenv func(string) (string, bool), o cmlOption) cmlRaw {
	for _, n := range append([]string{o.name}, o.aliases...) {
		fl := fs.Lookup(n)
		if fl == nil || !fl.Changed {
			continue
		}
		if o.kind == optArray {
			v, _ := fs.GetStringArray(n)
			return cmlRaw{values: v, from: "--" + n}
		}
		return cmlRaw{values: []string{fl.Value.String()}, from: "--" + n}
	}
	for _, e := range o.envNames() {
		if v, ok := getenv(e); ok && v != "" {
			return cmlRaw{values: []string{v}, from: e}
		}
	}
	if o.def != "" {
		return cmlRaw{values: []string{o.def}}
	}
	for _, e := range o.fallback {
		if v, ok := getenv(e); ok && v != "" {
			return cmlRaw{values: []string{v}, from: e}
		}
	}
	return cmlRaw{}
}

// resolveRunner reads the settings from the parsed flags and the
// environment (getenv) as CML would, and checks each value: every problem
// is returned, each naming its option.
func resolveRunner(fs *pflag.FlagSet, getenv func(string) (string, bool)) (runnerSettings, error) {
	var errs []error
	raw := map[string]cmlRaw{}
	for _, o := range cmlOptions {
		r := cmlLookup(fs, getenv, o)
		raw[o.name] = r
		if r.set() && len(o.choices) > 0 && !slices.Contains(o.choices, r.value()) {
			errs = append(errs, fmt.Errorf("%s: %s is not one of %s", r.from, r.quoted(), strings.Join(o.choices, ", ")))
		}
		if r.set() && o.kind == optNumber {
			if _, err := strconv.ParseFloat(strings.TrimSpace(r.value()), 64); err != nil {
				errs = append(errs, fmt.Errorf("%s: %s is not a number", r.from, r.quoted()))
			}
		}
	}
	boolean := func(name string) bool {
		r := raw[name]
		if !r.set() {
			return false
		}
		b, err := strconv.ParseBool(strings.TrimSpace(r.value()))
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %s is not true or false", r.from, r.quoted()))
		}
		return b
	}
	s := runnerSettings{
		Name: raw["name"].value(), Single: boolean("single"), Reuse: boolean("reuse"), ReuseIdle: boolean("reuse-idle"),
		NoRetry: boolean("no-retry"), Workdir: raw["workdir"].value(), Driver: raw["driver"].value(), Repo: raw["repo"].value(),
		Log: raw["log"].value(), Docker: raw["docker"].value(), Agent: raw["agent"].value(),
		AgentURL: raw["agent-url"].value(), AgentSHA256: strings.TrimSpace(raw["agent-sha256"].value()),
		// A token from a variable may end in the newline of the file or
		// the secret store it came from: trimmed, as token_file's is.
		Token: strings.TrimSpace(raw["driver-token"].value()),
	}
	for l := range strings.SplitSeq(raw["labels"].value(), ",") {
		if l = strings.TrimSpace(l); l != "" && !slices.Contains(s.Labels, l) {
			s.Labels = append(s.Labels, l)
		}
	}
	d, err := parseIdleTimeout(raw["idle-timeout"].value())
	if err != nil {
		errs = append(errs, fmt.Errorf("%s: %w", cmp.Or(raw["idle-timeout"].from, "--idle-timeout"), err))
	}
	s.IdleTimeout = d
	errs = append(errs, cmlConflicts(raw, boolean)...)
	if r := raw["docker-volumes"]; r.set() {
		s.DockerVolumes = splitVolumes(r)
	}
	cloud, err := cloudOptions(raw, boolean, &s)
	errs = append(errs, err)
	s.Cloud = cloud
	for _, o := range cmlOptions {
		if r := raw[o.name]; o.ignored != "" && r.set() {
			s.Ignored = append(s.Ignored, fmt.Sprintf("%s (%s)", r.from, o.ignored))
		}
	}
	if v, ok := getenv("RUNNER_NAME"); ok && v != "" && !raw["name"].set() {
		// As CML: GitHub's hosted runners set RUNNER_NAME to their own.
		s.Warnings = append(s.Warnings, "ignoring the RUNNER_NAME variable: use CML_RUNNER_NAME or --name instead")
	}
	return s, errors.Join(errs...)
}

// cmlConflicts returns CML's refusals of options given together (yargs'
// conflicts: "Arguments single and reuse are mutually exclusive").
func cmlConflicts(raw map[string]cmlRaw, boolean func(string) bool) []error {
	var errs []error
	seen := map[string]bool{}
	for _, o := range cmlOptions {
		if o.kind != optBool || !boolean(o.name) {
			continue
		}
		for _, c := range o.conflicts {
			pair := min(o.name, c) + " " + max(o.name, c)
			if boolean(c) && !seen[pair] {
				seen[pair] = true
				errs = append(errs, fmt.Errorf("%s and %s: cannot be used together, as in CML (arguments %s and %s are mutually exclusive)", raw[o.name].from, raw[c].from, o.name, c))
			}
		}
	}
	return errs
}

// splitVolumes reads --docker-volumes: each flag one volume; a variable
// may hold several, comma-separated.
func splitVolumes(r cmlRaw) []string {
	if strings.HasPrefix(r.from, "--") {
		return r.values
	}
	var out []string
	for v := range strings.SplitSeq(r.value(), ",") {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
}

// cloudOptions gathers the --cloud* options given, by name without the
// dashes, with CML's coercions: --cloud-gpu nogpu is none and tesla is
// v100; --cloud-metadata and --cloud-kubernetes-node-selector are
// key=value pairs split at the first "=", the last of a key winning.
func cloudOptions(raw map[string]cmlRaw, boolean func(string) bool, s *runnerSettings) (map[string]string, error) {
	var errs []error
	cloud := map[string]string{}
	for _, o := range cmlOptions {
		r := raw[o.name]
		if !strings.HasPrefix(o.name, "cloud") || !r.set() {
			continue
		}
		switch o.kind {
		case optBool:
			if boolean(o.name) {
				cloud[o.name] = "true"
			}
		case optArray:
			pairs, err := keyValues(r)
			errs = append(errs, err)
			switch o.name {
			case "cloud-metadata":
				s.Metadata = pairs
			case "cloud-kubernetes-node-selector":
				s.NodeSelector = pairs
			}
		default:
			cloud[o.name] = strings.TrimSpace(r.value())
		}
	}
	switch cloud["cloud-gpu"] {
	case "nogpu":
		delete(cloud, "cloud-gpu")
	case "tesla":
		cloud["cloud-gpu"] = "v100"
		s.Warnings = append(s.Warnings, `--cloud-gpu: GPU model "tesla" has been deprecated (as in CML); taking "v100"`)
	}
	if len(cloud) == 0 {
		cloud = nil
	}
	return cloud, errors.Join(errs...)
}

// keyValues reads CML's key=value pairs (launch.js: item.split(/=(.+)/)):
// split at the first "=", a key alone has an empty value.
func keyValues(r cmlRaw) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range r.values {
		k, v, _ := strings.Cut(strings.TrimSpace(kv), "=")
		if k == "" {
			return nil, fmt.Errorf("%s: %q is not key=value", r.from, kv)
		}
		out[k] = v
	}
	return out, nil
}

// parseIdleTimeout reads --idle-timeout as CML does (launch.js: whole
// seconds, or a time for the timestring package: "5min", "5 minutes",
// "1h30m", "2d"); 0, any negative number and "never" disable it. Go's
// durations ("2m30s", "500ms") read the same.
func parseIdleTimeout(v string) (time.Duration, error) {
	v = strings.TrimSpace(v)
	switch v {
	case "never", "":
		return 0, nil
	}
	if n, err := strconv.ParseFloat(v, 64); err == nil {
		if n <= 0 || math.IsNaN(n) {
			return 0, nil
		}
		return time.Duration(n * float64(time.Second)), nil
	}
	secs, err := timestring(v)
	if err != nil {
		return 0, err
	}
	if secs <= 0 {
		return 0, nil
	}
	return time.Duration(secs * float64(time.Second)), nil
}

// timestringUnits are the units of the timestring package CML reads
// --idle-timeout with (mike182uk/timestring, index.js), in seconds.
var timestringUnits = map[string]float64{}

func init() {
	for secs, names := range map[float64][]string{
		0.001:               {"ms", "milli", "millisecond", "milliseconds"},
		1:                   {"s", "sec", "secs", "second", "seconds"},
		60:                  {"m", "min", "mins", "minute", "minutes"},
		3600:                {"h", "hr", "hrs", "hour", "hours"},
		86400:               {"d", "day", "days"},
		7 * 86400:           {"w", "week", "weeks"},
		365.25 / 12 * 86400: {"mon", "mth", "mths", "month", "months"},
		365.25 * 86400:      {"y", "yr", "yrs", "year", "years"},
	} {
		for _, n := range names {
			timestringUnits[n] = secs
		}
	}
}

var (
	timestringStrip = lazyregexp.New(`[^.\w+-]+`)
	timestringGroup = lazyregexp.New(`([-+]?)([0-9.]+)([a-z]+)`)
)

// timestring reads a time as the timestring package does: spaces and
// punctuation dropped, then number-unit groups summed.
func timestring(v string) (float64, error) {
	s := timestringStrip.ReplaceAllString(strings.ToLower(v), "")
	groups := timestringGroup.FindAllStringSubmatchIndex(s, -1)
	if len(groups) == 0 {
		return 0, fmt.Errorf("%q is not seconds, a time (5min, 1h30m) or never", v)
	}
	total, end := 0.0, 0
	for _, g := range groups {
		if g[0] != end {
			break
		}
		end = g[1]
		n, err := strconv.ParseFloat(s[g[4]:g[5]], 64)
		unit, ok := timestringUnits[s[g[6]:g[7]]]
		if err != nil || !ok {
			return 0, fmt.Errorf("%q is not seconds, a time (5min, 1h30m) or never: %q is not a unit of time", v, s[g[6]:g[7]])
		}
		total += n * unit
	}
	if end != len(s) {
		return 0, fmt.Errorf("%q is not seconds, a time (5min, 1h30m) or never", v)
	}
	return total, nil
}

// randomName is CML's default runner name, cml-<random>.
func randomName() string {
	const digits = "0123456789abcdefghijklmnopqrstuvwxyz"
	b := make([]byte, 10)
	_, _ = rand.Read(b)
	for i := range b {
		b[i] = digits[int(b[i])%len(digits)]
	}
	return "cml-" + string(b)
}

// cmlArrays lets an array option take several values after one flag, as
// yargs does (`--cloud-metadata a=1 b=2`): the words after an array flag's
// value, up to the next flag, become more of its values. `runfleet runner`
// takes no arguments of its own, so no word is taken from anything else.
func cmlArrays(args []string) []string {
	at := slices.IndexFunc(args, func(a string) bool { return a == "runner" })
	if at < 0 {
		return args
	}
	arrays := map[string]bool{}
	for _, o := range cmlOptions {
		if o.kind == optArray {
			arrays["--"+o.name] = true
		}
	}
	out := slices.Clone(args[:at+1])
	for i := at + 1; i < len(args); i++ {
		a := args[i]
		out = append(out, a)
		name, _, hasValue := strings.Cut(a, "=")
		if !arrays[name] {
			continue
		}
		if !hasValue && i+1 < len(args) {
			i++
			out = append(out, args[i])
		}
		for i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") && args[i+1] != "launch" {
			i++
			out = append(out, name+"="+args[i])
		}
	}
	return out
}
