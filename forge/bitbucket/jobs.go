package bitbucket

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/runfleet/runfleet/forge"
)

// pipeline and step are the parts of the documented answers the driver
// reads.
type pipeline struct {
	UUID        string `json:"uuid"`
	BuildNumber int64  `json:"build_number"`
	State       struct {
		Name   string `json:"name"`
		Result *struct {
			Name string `json:"name"`
		} `json:"result"`
	} `json:"state"`
	Target struct {
		RefName string `json:"ref_name"`
		Commit  struct {
			Hash string `json:"hash"`
		} `json:"commit"`
	} `json:"target"`
	// Creator is who set it going; absent for a schedule's.
	Creator *struct {
		Nickname    string `json:"nickname"`
		DisplayName string `json:"display_name"`
	} `json:"creator"`
}

type step struct {
	UUID  string `json:"uuid"`
	Name  string `json:"name"`
	State struct {
		Name   string `json:"name"`
		Result *struct {
			Name string `json:"name"`
		} `json:"result"`
	} `json:"state"`
	StartedOn   *time.Time `json:"started_on"`
	CompletedOn *time.Time `json:"completed_on"`
}

// maxPipelinePages bounds the pipelines read per repository: the ones
// pending or in progress are the latest.
const maxPipelinePages = 2

// maxKeptFiles bounds the commits whose bitbucket-pipelines.yml is kept.
const maxKeptFiles = 256

// Jobs lists the steps that wait for a self-hosted runner (queued) or run
// on one (in progress), in the pipelines pending or in progress of the
// scope's repository (or the repositories configured for a workspace).
// A step's labels are its runs-on in the pipeline's bitbucket-pipelines.yml
// at its commit (the step's answer does not give them), read once per
// commit; a step without runs-on runs on Bitbucket's own machines and is
// left out. Steps of a pipeline wait in turn, so a pending step may not
// wait for a runner yet: a pool may start its runner early, never late.
func (d *Forge) Jobs(ctx context.Context, st forge.JobStatus) ([]forge.Job, error) {
	if st != forge.JobQueued && st != forge.JobInProgress {
		return nil, fmt.Errorf("bitbucket jobs %s: %w", st, errors.ErrUnsupported)
	}
	repos := d.demandRepos()
	if len(repos) == 0 {
		return nil, fmt.Errorf("bitbucket jobs of workspace %s without repositories to read: %w", d.cfg.Workspace, errors.ErrUnsupported)
	}
	var out []forge.Job
	for _, repo := range repos {
		jobs, err := d.repoJobs(ctx, repo, st)
		if err != nil {
			return nil, err
		}
		out = append(out, jobs...)
	}
	return out, nil
}

// demandRepos are the repositories whose pipelines are read: the scope's
// own, or those configured for a workspace.
func (d *Forge) demandRepos() []string {
	if len(d.cfg.Repositories) == 0 && d.cfg.Repository != "" {
		return []string{d.cfg.Repository}
	}
	return d.cfg.Repositories
}

func (d *Forge) repoJobs(ctx context.Context, repo string, st forge.JobStatus) ([]forge.Job, error) {
	if st == forge.JobQueued && d.skipRead(repo) {
		return nil, nil // idle when last read (idle.go)
	}
	key := fmt.Sprint(repo, " ", st)
	if jobs, ok := d.lastRead(key); ok {
		return jobs, nil // the hour's calls are nearly spent (limits.go)
	}
	base := repoPath(d.cfg.Workspace, repo) + "/pipelines"
	busy := false
	q := url.Values{"status": {"PENDING", "IN_PROGRESS"}, "sort": {"-created_on"}, "pagelen": {"100"}}
	path := base + "?" + q.Encode()
	var out []forge.Job
	for range maxPipelinePages {
		var p page[pipeline]
		if err := d.call(ctx, "list pipelines of "+repo, http.MethodGet, path, nil, &p); err != nil {
			return nil, rejectDefinitive(err)
		}
		for _, pl := range p.Values {
			if pl.State.Name != "PENDING" && pl.State.Name != "IN_PROGRESS" {
				continue // a server that ignores the filter
			}
			busy = true
			jobs, err := d.pipelineJobs(ctx, repo, base, pl, st)
			if err != nil {
				return nil, err
			}
			out = append(out, jobs...)
		}
		if p.Next == "" {
			break
		}
		path = p.Next
	}
	d.paced(repo, busy)
	d.mu.Lock()
	d.reads[key] = jobsRead{at: d.cfg.Clock(), jobs: out}
	d.mu.Unlock()
	return out, nil
}

// jobsRead is a repository's jobs as last read.
type jobsRead struct {
	at   time.Time
	jobs []forge.Job
}

// lastRead returns a repository's jobs as last read, while Bitbucket says
// the hour's calls are nearly spent and the read is younger than
// IdleCacheTTL.
func (d *Forge) lastRead(key string) ([]forge.Job, bool) {
	if !d.rl.nearLimit() {
		return nil, false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	r, ok := d.reads[key]
	if !ok || d.cfg.Clock().Sub(r.at) >= d.cfg.IdleCacheTTL {
		return nil, false
	}
	return slices.Clone(r.jobs), true
}

func (d *Forge) pipelineJobs(ctx context.Context, repo, base string, pl pipeline, st forge.JobStatus) ([]forge.Job, error) {
	steps, err := d.stepsOf(ctx, base, pl.UUID)
	if status(err) == http.StatusNotFound {
		return nil, nil // the pipeline went meanwhile
	}
	if err != nil {
		return nil, err
	}
	var runsOn map[string][]string
	var out []forge.Job
	for _, s := range steps {
		want := st == forge.JobQueued && (s.State.Name == "PENDING" || s.State.Name == "READY") ||
			st == forge.JobInProgress && s.State.Name == "IN_PROGRESS"
		if !want {
			continue
		}
		if runsOn == nil {
			if runsOn, err = d.runsOn(ctx, repo, pl.Target.Commit.Hash); err != nil {
				return nil, err
			}
		}
		labels, ok := runsOn[s.Name]
		if !ok || !slices.Contains(labels, LabelSelfHosted) {
			continue
		}
		j := forge.Job{ID: idOf(s.UUID), RunID: pl.BuildNumber, Name: s.Name, Labels: labels, Status: st,
			Source: forge.Source{Repository: d.cfg.Workspace + "/" + repo, Commit: pl.Target.Commit.Hash, Ref: pl.Target.RefName}}
		if c := pl.Creator; c != nil {
			j.Source.Actor = cmp.Or(c.Nickname, c.DisplayName)
		}
		if s.StartedOn != nil {
			j.StartedAt = *s.StartedOn
		}
		out = append(out, j)
	}
	return out, nil
}

// runsOn reads a commit's bitbucket-pipelines.yml and returns the runs-on
// of each step, by the step's name; kept per commit.
func (d *Forge) runsOn(ctx context.Context, repo, commit string) (map[string][]string, error) {
	key := repo + "@" + commit
	d.mu.Lock()
	m, ok := d.pipelinesYML[key]
	d.mu.Unlock()
	if ok {
		return m, nil
	}
	var raw []byte
	path := repoPath(d.cfg.Workspace, repo) + "/src/" + url.PathEscape(commit) + "/bitbucket-pipelines.yml"
	err := d.call(ctx, "read bitbucket-pipelines.yml of "+repo+" at "+commit, http.MethodGet, path, nil, &raw)
	if err != nil && status(err) != http.StatusNotFound {
		return nil, err
	}
	m = map[string][]string{}
	if err == nil {
		if m, err = StepLabels(raw); err != nil {
			d.log.Warn("bitbucket: a pipeline's bitbucket-pipelines.yml does not parse; its steps are not counted", "repository", repo, "commit", commit, "err", err)
			m = map[string][]string{}
		}
	}
	d.mu.Lock()
	if len(d.pipelinesYML) >= maxKeptFiles {
		clear(d.pipelinesYML)
	}
	d.pipelinesYML[key] = m
	d.mu.Unlock()
	return m, nil
}

// StepLabels reads the runs-on of every step of a bitbucket-pipelines.yml,
// wherever it is (default, branches, tags, pull-requests, custom; in
// parallel groups and stages; in definitions, for steps used by anchor),
// by the step's name. runs-on is a label or a list of labels.
func StepLabels(file []byte) (map[string][]string, error) {
	var doc any
	if err := yaml.Unmarshal(file, &doc); err != nil {
		return nil, err
	}
	out := map[string][]string{}
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			if s, ok := v["step"].(map[string]any); ok {
				name, _ := s["name"].(string)
				if labels := runsOnOf(s["runs-on"]); labels != nil {
					out[name] = labels
				}
			}
			for _, c := range v {
				walk(c)
			}
		case []any:
			for _, c := range v {
				walk(c)
			}
		}
	}
	walk(doc)
	return out, nil
}

func runsOnOf(v any) []string {
	switch v := v.(type) {
	case string:
		return []string{strings.ToLower(v)}
	case []any:
		var out []string
		for _, l := range v {
			if s, ok := l.(string); ok {
				out = append(out, strings.ToLower(s))
			}
		}
		return out
	}
	return nil
}
