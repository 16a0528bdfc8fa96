package slurm

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/runfleet/runfleet/provider"
)

// Time limits. A runner's job gets --time for its idle life and for one
// job after it: the pool retires an idle runner once it could no longer
// finish a job of job_timeout within what is left, so that Slurm's kill
// (TIMEOUT) is a last resort, never the end of a job that kept to its
// limit.
const (
	// DefaultJobTimeout is the longest job when neither the pool
	// (job_timeout) nor its forge says: the longest forge default
	// (GitHub's 6 hours).
	DefaultJobTimeout = 6 * time.Hour
	// DefaultLifetime is a runner's idle life when the pool sets no
	// max_lifetime: no job holds a node for ever.
	DefaultLifetime = 24 * time.Hour
)

// margin is the room left after a job of the longest length: for the
// agent to report it and end, and for the pass that retires an idle
// runner to come. A tenth of the job's length, from 1 to 10 minutes.
func margin(job time.Duration) time.Duration {
	return min(max(job/10, time.Minute), 10*time.Minute)
}

// NoticeSignal is the signal Slurm sends a runner's job (--signal=B:) as
// its end nears: noticeLead before its time limit, or at once where a
// preemption sends it (SchedulerParameters=preempt_send_user_signal).
const NoticeSignal = "USR1"

// noticeLead is how long before its time limit a job is signalled: half
// the room after its longest job, so that a job that kept to its limit has
// ended and an idle runner has been retired before; Slurm may signal up to
// a minute earlier (sbatch(1), --signal).
func noticeLead(job time.Duration) time.Duration {
	return margin(job) / 2
}

// minIdle is the least idle life a runner's --time must leave.
const minIdle = time.Minute

// Partition is what the provider reads of a partition's limits.
type Partition struct {
	Name string
	// MaxTime is the longest --time it takes; 0 for none.
	MaxTime time.Duration
	// GraceTime is how long a job it preempts has between the notice
	// (SIGTERM, or --signal's with send_user_signal) and its kill.
	GraceTime time.Duration
	// QOS is the partition's own QOS (QoS=), whose limits stand over
	// the job's QOS's; "" for none.
	QOS string
}

// QOS is what the provider reads of a QOS's limits.
type QOS struct {
	Name string
	// MaxWall is the longest --time a job of it may ask
	// (MaxWallDurationPerJob); 0 for none.
	MaxWall time.Duration
	// OverPartQOS: its limits stand over the partition QOS's.
	OverPartQOS bool
	// PartitionTimeLimit: its jobs may ask for more than the
	// partition's MaxTime.
	PartitionTimeLimit bool
}

// QOSReader is implemented by Clusters that can read a QOS's limits
// (sacctmgr, from slurmdbd), so that the runners' --time is bounded by
// its MaxWall as by the partition's MaxTime: over it, a job pends for
// ever (QOSMaxWallDurationPerJobLimit) or, with the QOS's DenyOnLimit, is
// refused at every submission (resource_limits.html).
type QOSReader interface {
	// QOS reads the named QOS. One that does not exist wraps
	// provider.ErrRejected.
	QOS(ctx context.Context, name string) (QOS, error)
}

// bound is the longest --time a pool's jobs may ask, and what sets it.
type bound struct {
	max  time.Duration // 0: none
	what string        // "partition short's MaxTime"
}

// boundOf is the bound of a job in part with the job's QOS: the
// partition's MaxTime, unless the QOS has PartitionTimeLimit, and the
// MaxWall of the partition's QOS, which stands over the job QOS's unless
// the job QOS is OverPartQOS and sets one (resource_limits.html, "QOS
// specific limits": each limit comes from the first QOS that sets it).
func boundOf(part Partition, partQOS, jobQOS QOS) bound {
	var b bound
	if part.MaxTime > 0 && !jobQOS.PartitionTimeLimit {
		where := "partition " + part.Name
		if part.Name == "" {
			where = "the default partition"
		}
		b = bound{part.MaxTime, where + "'s MaxTime"}
	}
	wall := jobQOS
	if partQOS.MaxWall > 0 && (!jobQOS.OverPartQOS || jobQOS.MaxWall == 0) {
		wall = partQOS
	}
	if wall.MaxWall > 0 && (b.max == 0 || wall.MaxWall < b.max) {
		b = bound{wall.MaxWall, "QOS " + wall.Name + "'s MaxWall"}
	}
	return b
}

// PartitionReader is implemented by Clusters that can read a partition's
// limits, so that a pool whose jobs cannot fit is refused at start rather
// than pending for ever (EnforcePartLimits=NO: reason PartitionTimeLimit)
// or refused at every submission (ALL).
type PartitionReader interface {
	// Partition reads the named partition, or the cluster's default one
	// for "". One that does not exist wraps provider.ErrRejected.
	Partition(ctx context.Context, name string) (Partition, error)
}

// times is a pool's fit of its runners' jobs in the cluster's limits.
type times struct {
	// limit is the job's --time.
	limit time.Duration
	// idle is how long a runner may stay idle from its job's start: a
	// job it takes after that could outrun limit.
	idle time.Duration
	// job is the longest job it makes room for.
	job time.Duration
}

// fit works out a pool's --time: the time_limit given, or the idle life
// (max_lifetime) and one job (jobTimeout and its margin), within the
// cluster's bound (a partition's MaxTime, a QOS's MaxWall; 0: none), which
// shortens the idle life. It fails, naming both figures, when one job
// cannot fit.
func fit(s Section, maxLifetime, jobTimeout time.Duration, b bound) (times, error) {
	if jobTimeout <= 0 {
		jobTimeout = DefaultJobTimeout
	}
	need := roundUp(jobTimeout + margin(jobTimeout))
	if s.TimeLimit.Given() {
		limit := roundUp(s.TimeLimit.Duration)
		switch {
		case b.max > 0 && limit > b.max:
			return times{}, fmt.Errorf("slurm.time_limit: %s is over %s %s", limit, b.what, b.max)
		case limit < need+minIdle:
			return times{}, fmt.Errorf("slurm.time_limit: %s leaves no room for a runner to wait %s for a job of %s (job_timeout, or the forge's limit) and %s to end in: at least %s",
				limit, minIdle, jobTimeout, need-jobTimeout, need+minIdle)
		}
		return times{limit: limit, idle: limit - need, job: jobTimeout}, nil
	}
	if maxLifetime <= 0 {
		maxLifetime = DefaultLifetime
	}
	limit := roundUp(maxLifetime + need)
	if b.max > 0 && need+minIdle > b.max {
		return times{}, fmt.Errorf("job_timeout: a runner's job needs --time of at least %s (%s to wait, a job of %s and %s to end in), over %s %s: lower job_timeout, or choose a partition and QOS that allow it",
			need+minIdle, minIdle, jobTimeout, need-jobTimeout, b.what, b.max)
	}
	if b.max > 0 && limit > b.max {
		limit = b.max
	}
	return times{limit: limit, idle: limit - need, job: jobTimeout}, nil
}

// roundUp rounds up to Slurm's unit of --time, the minute.
func roundUp(d time.Duration) time.Duration {
	return (d + time.Minute - 1) / time.Minute * time.Minute
}

// minutes is d as --time takes it.
func minutes(d time.Duration) string {
	return strconv.FormatInt(int64(roundUp(d)/time.Minute), 10)
}

// Partition runs `scontrol show partition -o`: one line of key=value
// pairs per partition, the same since long before --json existed.
func (c *CLI) Partition(ctx context.Context, name string) (Partition, error) {
	args := []string{"show", "partition", "-o"}
	if name != "" {
		args = append(args, name)
	}
	out, err := c.run(ctx, nil, "scontrol", args...)
	var ce *CommandError
	if errors.As(err, &ce) {
		// scontrol prints "Partition x not found" on its standard
		// output, and exits 1 (seen with 22.05).
		msg := strings.TrimSpace(ce.Message + " " + string(out))
		if strings.Contains(strings.ToLower(msg), "not found") {
			return Partition{}, fmt.Errorf("partition %s: %s: %w", name, msg, provider.ErrRejected)
		}
	}
	if err != nil {
		return Partition{}, err
	}
	return parsePartition(out, name)
}

// parsePartition picks the named partition (or the default one) out of
// scontrol's lines.
func parsePartition(out []byte, name string) (Partition, error) {
	for _, line := range strings.Split(string(out), "\n") {
		kv := map[string]string{}
		for _, f := range strings.Fields(line) {
			k, v, _ := strings.Cut(f, "=")
			kv[k] = v
		}
		if kv["PartitionName"] == "" || (name != "" && kv["PartitionName"] != name) || (name == "" && kv["Default"] != "YES") {
			continue
		}
		p := Partition{Name: kv["PartitionName"]}
		var err error
		if p.MaxTime, err = slurmDuration(kv["MaxTime"]); err != nil {
			return p, fmt.Errorf("partition %s: MaxTime: %w", p.Name, err)
		}
		if p.GraceTime, err = slurmSeconds(kv["GraceTime"]); err != nil {
			return p, fmt.Errorf("partition %s: GraceTime: %w", p.Name, err)
		}
		if q := kv["QoS"]; q != "N/A" {
			p.QOS = q
		}
		return p, nil
	}
	if name == "" {
		return Partition{}, fmt.Errorf("scontrol show partition: no default partition: set slurm.partition: %w", provider.ErrRejected)
	}
	return Partition{}, fmt.Errorf("scontrol show partition: no partition %s in the answer", name)
}

// QOS runs `sacctmgr show qos`, parsable (-P: fields split by "|"),
// without its header (-n): the QOS's name, MaxWall and flags. sacctmgr
// asks slurmdbd, not slurmctld; a QOS it does not know gives no line.
func (c *CLI) QOS(ctx context.Context, name string) (QOS, error) {
	out, err := c.run(ctx, nil, "sacctmgr", "-n", "-P", "show", "qos", "name="+name, "format=Name,MaxWall,Flags")
	if err != nil {
		return QOS{}, err
	}
	return parseQOS(out, name)
}

// parseQOS reads sacctmgr's line for the named QOS: MaxWall as
// mins2time_str prints it (empty for none), the flags comma-separated
// (DenyOnLimit,OverPartQOS).
func parseQOS(out []byte, name string) (QOS, error) {
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Split(strings.TrimSpace(line), "|")
		if len(f) < 3 || !strings.EqualFold(f[0], name) {
			continue
		}
		q := QOS{Name: f[0]}
		var err error
		if q.MaxWall, err = slurmDuration(f[1]); err != nil {
			return q, fmt.Errorf("QOS %s: MaxWall: %w", name, err)
		}
		for flag := range strings.SplitSeq(f[2], ",") {
			switch strings.ToLower(flag) {
			case "overpartqos":
				q.OverPartQOS = true
			case "partitiontimelimit":
				q.PartitionTimeLimit = true
			}
		}
		return q, nil
	}
	return QOS{}, fmt.Errorf("sacctmgr show qos: no QOS %s: %w", name, provider.ErrRejected)
}

// slurmDuration reads Slurm's printed time limits: UNLIMITED, or
// [days-]hours:minutes:seconds (secs2time_str in src/common/parse_time.c),
// or minutes[:seconds] as written in slurm.conf.
func slurmDuration(v string) (time.Duration, error) {
	switch v {
	case "", "UNLIMITED", "INFINITE", "NONE":
		return 0, nil
	}
	days := 0
	if d, rest, ok := strings.Cut(v, "-"); ok {
		n, err := strconv.Atoi(d)
		if err != nil {
			return 0, fmt.Errorf("%q is not a Slurm time", v)
		}
		days, v = n, rest
	}
	parts := strings.Split(v, ":")
	var nums []int
	for _, p := range parts {
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("%q is not a Slurm time", v)
		}
		nums = append(nums, n)
	}
	var h, m, s int
	switch {
	case len(nums) == 3:
		h, m, s = nums[0], nums[1], nums[2]
	case len(nums) == 2 && days > 0:
		h, m = nums[0], nums[1]
	case len(nums) == 2:
		m, s = nums[0], nums[1]
	case len(nums) == 1 && days > 0:
		h = nums[0]
	case len(nums) == 1:
		m = nums[0]
	default:
		return 0, fmt.Errorf("%q is not a Slurm time", v)
	}
	return time.Duration(days)*24*time.Hour + time.Duration(h)*time.Hour + time.Duration(m)*time.Minute + time.Duration(s)*time.Second, nil
}

// slurmSeconds reads a number of seconds (GraceTime=30).
func slurmSeconds(v string) (time.Duration, error) {
	if v == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%q is not a number of seconds", v)
	}
	return time.Duration(n) * time.Second, nil
}
