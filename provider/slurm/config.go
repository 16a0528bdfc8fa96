package slurm

import (
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/internal/lazyregexp"
)

// Section is a pool's `slurm:` section: what each runner's batch job asks
// the cluster for. The manager runs where `sbatch`, `squeue` and `scancel`
// work (a login node) as an ordinary user; the cluster's own slurm.conf
// (or SLURM_CONF in the manager's environment) says where the controller
// is.
type Section struct {
	Partition string `json:"partition"`
	Account   string `json:"account"`
	QOS       string `json:"qos"`
	// TimeLimit is the job's --time: when not given, the pool's
	// max_lifetime (or DefaultLifetime) and room for one job (fit),
	// within the partition's MaxTime. An idle runner leaves once a job
	// could no longer finish within it.
	TimeLimit config.Duration `json:"time_limit"`
	// CPUs is --cpus-per-task; Memory --mem, in Slurm's units (16G).
	CPUs   int    `json:"cpus"`
	Memory string `json:"memory"`
	// GPUType is the gres type of a GPU pool's GPUs (a100: --gres=gpu:a100:N);
	// GPUOption says how GPUs are asked for: "gres" (--gres=gpu:N, the
	// default, which every Slurm takes) or "gpus" (--gpus=N).
	GPUType   string `json:"gpu_type"`
	GPUOption string `json:"gpu_option"`
	// Constraint is --constraint (node features: "a100&ib").
	Constraint string `json:"constraint"`
	// Options are more sbatch options, each one argument
	// ("--reservation=ml", "--exclusive"). Those runfleet sets itself
	// are refused here.
	Options []string `json:"sbatch_options"`
	// QueueWait leaves a runner pending for as long as the cluster takes
	// to run it: on a busy cluster the wait is the point. Without it, a
	// runner pending past the pool's bootstrap_timeout is cancelled and
	// the pool backs off.
	QueueWait bool `json:"queue_wait"`
	// SpoolDir holds each runner's record, its files until its job
	// starts, and its agent's output: on a filesystem the nodes also see
	// (a home or project directory). <state_dir>/slurm when not given.
	SpoolDir string `json:"spool_dir"`
	// Bin is where sbatch, squeue and scancel are; the manager's PATH when
	// not given.
	Bin string `json:"bin_dir"`
	// RunAs are local accounts, each runner's job running as one that no
	// other live runner of the manager has (submitted through `sudo -n
	// -u`), so that jobs cannot read each other's credentials or the
	// manager's files. It needs spool_dir, which every account can
	// reach, and as many accounts as the pool's max.
	RunAs []string `json:"run_as"`
	// PollInterval is how often the cluster's queue is read (5s): one
	// `squeue --json` for every pool of the manager.
	PollInterval config.Duration `json:"poll_interval"`
}

// DefaultPollInterval is how often the queue is read at most.
const DefaultPollInterval = 5 * time.Second

var (
	nameRE = lazyregexp.New(`^[A-Za-z0-9_.+-]+$`)
	memRE  = lazyregexp.New(`^[0-9]+[KMGT]?$`)
	// accountRE is a portable user name (useradd's NAME_REGEX).
	accountRE = lazyregexp.New(`^[a-z_][a-z0-9_-]*[$]?$`)
	// The options runfleet sets itself, or that would let the job's
	// output or identity escape the manager's view.
	ownOptions = []string{"--job-name", "-J", "--comment", "--output", "-o", "--error", "-e", "--parsable",
		"--export", "--time", "-t", "--gres", "--gpus", "-G", "--partition", "-p", "--account", "-A", "--qos", "-q",
		"--cpus-per-task", "-c", "--mem", "--constraint", "-C", "--chdir", "-D", "--wrap", "--array", "-a",
		"--uid", "--gid", "--get-user-env", "--export-file", "--open-mode", "--input", "-i"}
)

// DecodeSection decodes and checks a pool's section, with defaults.
func DecodeSection(raw json.RawMessage, gpusPerRunner int) (Section, error) {
	var s Section
	decodeErr := config.DecodeSection(raw, &s)
	if !s.PollInterval.Given() {
		s.PollInterval = config.D(DefaultPollInterval)
	}
	if s.GPUOption == "" {
		s.GPUOption = "gres"
	}
	return s, errors.Join(decodeErr, s.check(gpusPerRunner))
}

func (s Section) check(gpusPerRunner int) error {
	var errs []error
	bad := func(field, format string, a ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, a...)))
	}
	for field, v := range map[string]string{"partition": s.Partition, "account": s.Account, "qos": s.QOS, "gpu_type": s.GPUType} {
		if v != "" && !nameRE.MatchString(v) {
			bad(field, "%q is not a Slurm name (letters, digits, _ . + -)", v)
		}
	}
	if err := s.TimeLimit.Check(); err != nil {
		bad("time_limit", "%v", err)
	} else if s.TimeLimit.Given() && s.TimeLimit.Duration < time.Minute {
		bad("time_limit", "%s is under Slurm's unit of a minute", s.TimeLimit.Duration)
	}
	if err := s.PollInterval.Check(); err != nil {
		bad("poll_interval", "%v", err)
	} else if s.PollInterval.Duration < time.Second {
		bad("poll_interval", "%s is under a second", s.PollInterval.Duration)
	}
	if s.CPUs < 0 {
		bad("cpus", "%d is not a number of CPUs", s.CPUs)
	}
	if s.Memory != "" && !memRE.MatchString(s.Memory) {
		bad("memory", "%q is not a Slurm size (a number with K, M, G or T)", s.Memory)
	}
	if s.GPUOption != "gres" && s.GPUOption != "gpus" {
		bad("gpu_option", "%q is neither gres nor gpus", s.GPUOption)
	}
	switch {
	case gpusPerRunner < 0:
		errs = append(errs, errors.New(`gpus_per_runner: "all" counts this host's GPUs; a Slurm pool asks for a number of GPUs per runner`))
	case gpusPerRunner == 0 && s.GPUType != "":
		bad("gpu_type", "%q is set, and gpus_per_runner is not: a runner would get no GPU", s.GPUType)
	}
	if strings.ContainsAny(s.Constraint, "\n\x00") {
		bad("constraint", "holds a line break")
	}
	for i, o := range s.Options {
		flag, _, _ := strings.Cut(o, "=")
		switch {
		case !strings.HasPrefix(o, "-"):
			bad(fmt.Sprintf("sbatch_options[%d]", i), "%q is not an option: write each as --name=value", o)
		case isOwn(flag):
			bad(fmt.Sprintf("sbatch_options[%d]", i), "%s is set by runfleet (or by this section's own fields)", flag)
		case strings.ContainsAny(o, "\n\x00"):
			bad(fmt.Sprintf("sbatch_options[%d]", i), "holds a line break")
		}
	}
	for i, a := range s.RunAs {
		switch {
		case !accountRE.MatchString(a):
			bad(fmt.Sprintf("run_as[%d]", i), "%q is not a local account name", a)
		case slices.Contains(s.RunAs[:i], a):
			bad(fmt.Sprintf("run_as[%d]", i), "%q is named twice", a)
		}
	}
	if len(s.RunAs) > 0 && s.SpoolDir == "" {
		bad("run_as", "needs spool_dir: a directory every account can reach (the manager's state_dir is for it alone)")
	}
	if s.SpoolDir != "" && !filepath.IsAbs(s.SpoolDir) {
		bad("spool_dir", "%q is not an absolute path", s.SpoolDir)
	}
	if s.Bin != "" && !filepath.IsAbs(s.Bin) {
		bad("bin_dir", "%q is not an absolute path", s.Bin)
	}
	return errors.Join(errs...)
}

func isOwn(flag string) bool {
	for _, o := range ownOptions {
		if flag == o {
			return true
		}
	}
	// A short option written with its value attached (-pgpu).
	return len(flag) > 2 && !strings.HasPrefix(flag, "--") && isOwn(flag[:2])
}

// submitArgs are sbatch's arguments for a runner: none of them secret.
func (s Section) submitArgs(gpus int, limit time.Duration) []string {
	args := []string{"--time=" + minutes(limit)}
	add := func(flag, v string) {
		if v != "" {
			args = append(args, flag+"="+v)
		}
	}
	add("--partition", s.Partition)
	add("--account", s.Account)
	add("--qos", s.QOS)
	if s.CPUs > 0 {
		add("--cpus-per-task", fmt.Sprint(s.CPUs))
	}
	add("--mem", s.Memory)
	add("--constraint", s.Constraint)
	if gpus > 0 {
		typ := ""
		if s.GPUType != "" {
			typ = s.GPUType + ":"
		}
		if s.GPUOption == "gpus" {
			add("--gpus", fmt.Sprintf("%s%d", typ, gpus))
		} else {
			add("--gres", fmt.Sprintf("gpu:%s%d", typ, gpus))
		}
	}
	return append(args, s.Options...)
}
