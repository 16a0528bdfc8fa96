package slurm

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// ParseQueue reads `squeue --json`. Its shape changed across Slurm's
// releases (the OpenAPI plugin's versions): a job's state is a string up
// to 23.02 and a list of flags after, times are Unix seconds or
// {"set", "infinite", "number"} objects, and ids numbers; both are read.
func ParseQueue(b []byte) ([]Job, error) {
	var doc struct {
		Jobs   []rawJob `json:"jobs"`
		Errors []struct {
			Error       string `json:"error"`
			Description string `json:"description"`
		} `json:"errors"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		return nil, fmt.Errorf("squeue --json: %w", err)
	}
	// A controller that does not answer in time makes squeue exit 0 with
	// an empty list and an error beside it: that is no empty queue.
	if len(doc.Errors) > 0 {
		e := doc.Errors[0]
		return nil, fmt.Errorf("squeue --json: %s", strings.TrimSpace(e.Error+": "+e.Description))
	}
	if doc.Jobs == nil {
		return nil, fmt.Errorf("squeue --json: no job list in the answer")
	}
	jobs := make([]Job, 0, len(doc.Jobs))
	for _, r := range doc.Jobs {
		j := Job{
			ID: r.ID.String(), Name: r.Name, Comment: r.Comment, User: r.User,
			State: r.State.main(), Reason: r.Reason, Nodes: r.Nodes,
			Submit: r.Submit.time(), Start: r.Start.time(),
		}
		for _, g := range r.GRES {
			for _, idx := range gresIndexes(g) {
				j.GPUs = append(j.GPUs, r.Nodes+":"+idx)
			}
		}
		jobs = append(jobs, j)
	}
	return jobs, nil
}

type rawJob struct {
	ID      number   `json:"job_id"`
	Name    string   `json:"name"`
	Comment string   `json:"comment"`
	User    string   `json:"user_name"`
	State   states   `json:"job_state"`
	Reason  string   `json:"state_reason"`
	Nodes   string   `json:"nodes"`
	Submit  number   `json:"submit_time"`
	Start   number   `json:"start_time"`
	GRES    []string `json:"gres_detail"`
}

// number is a plain number, or Slurm's {"set": bool, "infinite": bool,
// "number": n} (v0.0.39 and later).
type number struct {
	n   int64
	set bool
}

func (n *number) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '{' {
		var o struct {
			Set      *bool `json:"set"`
			Infinite bool  `json:"infinite"`
			Number   int64 `json:"number"`
		}
		if err := json.Unmarshal(b, &o); err != nil {
			return err
		}
		*n = number{n: o.Number, set: (o.Set == nil || *o.Set) && !o.Infinite}
		return nil
	}
	if string(b) == "null" {
		return nil
	}
	var v json.Number
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	i, err := strconv.ParseInt(v.String(), 10, 64)
	if err != nil {
		return err
	}
	*n = number{n: i, set: true}
	return nil
}

func (n number) String() string {
	if !n.set {
		return ""
	}
	return strconv.FormatInt(n.n, 10)
}

func (n number) time() time.Time {
	if !n.set || n.n <= 0 {
		return time.Time{}
	}
	return time.Unix(n.n, 0).UTC()
}

// states is a job's state: "RUNNING", or ["RUNNING"] with flags after
// ["PENDING", "REQUEUED"].
type states []string

func (s *states) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		var one string
		if err := json.Unmarshal(b, &one); err != nil {
			return err
		}
		*s = states{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(b, &many); err != nil {
		return err
	}
	*s = many
	return nil
}

func (s states) main() string {
	if len(s) == 0 {
		return ""
	}
	return strings.ToUpper(s[0])
}

// gresIndexes reads the indexes of one gres_detail entry:
// "gpu:1(IDX:0)", "gpu:a100:2(IDX:0-1)", "gpu:3(IDX:0,2-3)".
func gresIndexes(g string) []string {
	if !strings.HasPrefix(g, "gpu") {
		return nil
	}
	_, rest, ok := strings.Cut(g, "(IDX:")
	if !ok {
		return nil
	}
	list, _, _ := strings.Cut(rest, ")")
	var out []string
	for _, part := range strings.Split(list, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err1 := strconv.Atoi(lo)
		if !isRange {
			if err1 == nil {
				out = append(out, lo)
			}
			continue
		}
		b, err2 := strconv.Atoi(hi)
		if err1 != nil || err2 != nil || b < a || b-a > 64 {
			continue
		}
		for i := a; i <= b; i++ {
			out = append(out, strconv.Itoa(i))
		}
	}
	return out
}

// formatFields are what queueByFormat asks squeue to print of each job
// (squeue(1), -o): id, name, comment, user, state in full, reason, nodes,
// submit and start times, the trackable resources asked of each node.
// Without a width, a field is printed whole.
var formatFields = []string{"%i", "%j", "%k", "%u", "%T", "%r", "%N", "%V", "%S", "%b"}

// fieldSep parts the fields: no name or comment holds it.
const fieldSep = "\x1f"

// parseFormat reads squeue's lines of formatFields.
func parseFormat(b []byte) ([]Job, error) {
	jobs := []Job{}
	for _, line := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		if line == "" {
			continue
		}
		f := strings.Split(line, fieldSep)
		if len(f) != len(formatFields) {
			return nil, fmt.Errorf("squeue: a line of %d fields, want %d: %q", len(f), len(formatFields), line)
		}
		for i, v := range f {
			if v == "(null)" || v == "N/A" {
				f[i] = ""
			}
		}
		if _, err := strconv.ParseUint(strings.SplitN(f[0], "_", 2)[0], 10, 64); err != nil {
			return nil, fmt.Errorf("squeue: %q is not a job id", f[0])
		}
		jobs = append(jobs, Job{ID: f[0], Name: f[1], Comment: f[2], User: f[3], State: strings.ToUpper(f[4]), Reason: f[5],
			Nodes: f[6], Submit: formatTime(f[7]), Start: formatTime(f[8]), GRES: f[9]})
	}
	return jobs, nil
}

// formatTime reads squeue's times, printed in the TZ it is given (UTC:
// cleanEnv); "Unknown" and the like are no time.
func formatTime(v string) time.Time {
	t, err := time.Parse("2006-01-02T15:04:05", v)
	if err != nil {
		return time.Time{}
	}
	return t
}

// showGPUs reads a job's GPUs from `scontrol -d show job`, whose lines
// for each node say "Nodes=gpu07 CPU_IDs=0-3 Mem=100 GRES=gpu:a100:2(IDX:0-1)".
func showGPUs(b []byte) []string {
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		node, gres := "", ""
		for _, f := range strings.Fields(line) {
			switch k, v, _ := strings.Cut(f, "="); k {
			case "Nodes":
				node = v
			case "GRES":
				gres = v
			}
		}
		if node == "" || gres == "" {
			continue
		}
		for _, idx := range gresIndexes(gres) {
			out = append(out, node+":"+idx)
		}
	}
	return out
}
