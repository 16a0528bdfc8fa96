package gitlab

import (
	"context"
	"regexp"
	"strings"
	"sync"
	"time"

	gl "gitlab.com/gitlab-org/api/client-go"
)

// The runners' access levels (POST /user/runners, access_level).
const (
	AccessRefProtected = "ref_protected"
	AccessNotProtected = "not_protected"
)

// NotProtected is the label of a queued job of an unprotected ref when the
// runners are ref_protected: GitLab gives them none of those
// (app/models/ci/runner.rb, can_pick?), so no pool has this label, and such
// a job starts no runner that could not take it.
const NotProtected = "(unprotected ref; the runners are ref_protected)"

// protectedTTL is how long a project's protected branches are reused: a
// newly protected branch's jobs may wait that long for a runner.
const protectedTTL = time.Minute

// protectedRefs keeps a project's protected branches between reads.
type protectedRefs struct {
	mu    sync.Mutex
	names []*regexp.Regexp
	read  time.Time
}

// mayTake says whether the runners may take a job of a ref: any, unless
// they are ref_protected; then only one of a protected branch. Tags and
// merge request refs (refs/merge-requests/…) count as unprotected: GitLab
// protects tags on their own list, which the driver does not read, and a
// merge request's pipeline is protected only in cases it cannot tell
// (the docs' "protected branches and merge request pipelines"). When the
// branches cannot be read, the job is taken as demand: a runner that does
// not get it goes at its idle timeout.
func (d *Forge) mayTake(ctx context.Context, project int64, ref string, tag bool) bool {
	if d.cfg.AccessLevel != AccessRefProtected {
		return true
	}
	if tag || strings.HasPrefix(ref, "refs/") {
		return false
	}
	names, err := d.protectedBranches(ctx, project)
	if err != nil {
		d.log.Warn("gitlab: could not read the project's protected branches; its queued jobs count as demand", "err", err)
		return true
	}
	for _, re := range names {
		if re.MatchString(ref) {
			return true
		}
	}
	return false
}

// protectedBranches reads a project's protected branches, as patterns:
// GitLab's wildcard * matches any characters, slashes included.
func (d *Forge) protectedBranches(ctx context.Context, project int64) ([]*regexp.Regexp, error) {
	d.prot.mu.Lock()
	defer d.prot.mu.Unlock()
	if !d.prot.read.IsZero() && time.Since(d.prot.read) < protectedTTL {
		return d.prot.names, nil
	}
	var names []*regexp.Regexp
	err := d.call(ctx, "list protected branches", func(o gl.RequestOptionFunc) (*gl.Response, error) {
		list, resp, err := d.api.ProtectedBranches.ListProtectedBranches(project, &gl.ListProtectedBranchesOptions{ListOptions: gl.ListOptions{PerPage: 100}}, o)
		for _, b := range list {
			re, rerr := regexp.Compile("^" + strings.ReplaceAll(regexp.QuoteMeta(b.Name), `\*`, ".*") + "$")
			if rerr == nil {
				names = append(names, re)
			}
		}
		return resp, err
	})
	if err != nil {
		return nil, err
	}
	d.prot.names, d.prot.read = names, time.Now()
	return names, nil
}
