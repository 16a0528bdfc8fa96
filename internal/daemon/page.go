package daemon

import (
	"cmp"
	"context"
	"fmt"
	"html/template"
	"maps"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/runfleet/runfleet/chart"
	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/demand"
	"github.com/runfleet/runfleet/diagnosis"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/gpu"
	"github.com/runfleet/runfleet/pool"
	"github.com/runfleet/runfleet/server"
	"github.com/runfleet/runfleet/tally"
)

// Page gathers the status page from what the manager already knows (the
// pools' last passes, the jobs reported, the history's last week in
// memory): it makes no forge call and reads no file.
func (f *Fleet) Page(ctx context.Context) server.Page {
	now := time.Now()
	f.mu.Lock()
	cfg := f.Config
	f.mu.Unlock()
	page := server.Page{Manager: cfg.ID, Version: Version, Now: now}
	entries := f.window.Since(now.Add(-windowSpan))
	jobs := f.Demand.Recent(30)
	byRunner := map[string]demand.JobView{}
	for _, j := range jobs {
		if j.Status == demand.InProgress && j.Runner != "" {
			byRunner[j.Runner] = j
		}
	}
	page.Forges = f.forgeViews(cfg, now)
	queued := f.Demand.Queued()
	day, week := tally.CostSince(entries, midnight(now), now), tally.CostSince(entries, now.Add(-windowSpan), now)
	for _, p := range f.pools() {
		pv := f.poolView(p, cfg, queued[p.Name()], byRunner, now)
		poolCharts(&pv, entries, now)
		pv.CostDay, pv.CostWeek, pv.GPUHours = costWords(day[p.Name()], week[p.Name()])
		page.Pools = append(page.Pools, pv)
	}
	if inventory, alloc := f.Host.Read(); inventory != nil {
		page.GPUs = gpuView(*inventory, alloc, f.Host.Usage(), byRunner)
	}
	page.GPUs = elsewhere(page.GPUs, entries, byRunner)
	waiting := 0
	for _, n := range queued {
		waiting += n
	}
	page.Timeline = timeline(entries, jobs, waiting, now)
	for _, j := range jobs {
		page.Jobs = append(page.Jobs, f.jobRow(j, now))
	}
	return page
}

// forgeViews says, for each forge, what is wrong with reading its queue.
func (f *Fleet) forgeViews(cfg *config.Config, now time.Time) []server.ForgeView {
	var out []server.ForgeView
	for _, fc := range cfg.Forges {
		fv := server.ForgeView{Name: fc.Name, Type: fc.Type}
		if v, ok := f.polls.Load(fc.Name); ok {
			st := v.(pollState)
			fv.Words = append(fv.Words, diagnosis.Failing(fmt.Sprintf("%s (forge %s), reading its queue", forgeTitle(fc.Type), fc.Name), st.err, st.since, st.next, now, false))
		}
		out = append(out, fv)
	}
	return out
}

// forgeTitle is a forge type as its users write it.
func forgeTitle(typ string) string {
	switch typ {
	case "github":
		return "GitHub"
	case "gitlab":
		return "GitLab"
	case "azurepipelines":
		return "Azure Pipelines"
	case "gitea":
		return "Gitea"
	case "bitbucket":
		return "Bitbucket"
	}
	return typ
}

// poolView is a pool's state, in words and runners.
func (f *Fleet) poolView(p *pool.Pool, cfg *config.Config, queued int, byRunner map[string]demand.JobView, now time.Time) server.PoolView {
	pc, _ := cfg.Pool(p.Name())
	plan, _ := f.Plan(p.Name())
	pv := server.PoolView{Name: p.Name(), Forge: pc.Forge, Provider: pc.Provider, Size: plan.Size, Max: plan.Max, Queued: queued}
	if err := p.LastError(); err != nil {
		pv.Words = append(pv.Words, diagnosis.Failing("Its passes (forge "+pc.Forge+", provider "+pc.Provider+")", err, p.FailingSince(), p.NextPass(), now, false))
	}
	if v, ok := f.polls.Load(pc.Forge); ok {
		// A pass may ride out an outage on what it read before; the
		// polls say at once.
		st := v.(pollState)
		pv.Words = append(pv.Words, diagnosis.Failing("Its forge "+pc.Forge+"'s queue", st.err, st.since, st.next, now, false))
	}
	pv.Words = append(pv.Words, backoffWords(p.Backoff(), now)...)
	var refused []string
	for shape, why := range p.Refusals() {
		refused = append(refused, "Jobs asking "+shape+" get no runner: "+why)
	}
	slices.Sort(refused)
	pv.Words = append(pv.Words, refused...)
	if why, ok := f.stopped.Load(p.Name()); ok {
		pv.Words = append(pv.Words, "The forge's session stopped, and the pool gets no jobs until runfleet restarts: "+why.(string))
	}
	if d, ok := f.handoff(p.Name()).(refusalLister); ok {
		pv.Words = append(pv.Words, d.Refusals(now.Add(-time.Hour))...)
	}
	runners := p.Runners()
	var reasons []string
	for _, r := range runners {
		row := server.RunnerRow{Name: r.Name, State: string(r.State), Age: "-", GPUs: strings.Join(r.GPUs, ", "), Reason: r.Reason}
		if !r.Created.IsZero() {
			row.Age = now.Sub(r.Created).Round(time.Second).String()
		}
		if j, ok := byRunner[r.Name]; ok {
			row.Job = j.Name
		}
		reasons = append(reasons, r.Reason)
		pv.GPUs = pv.GPUs || len(r.GPUs) > 0
		pv.Runners = append(pv.Runners, row)
	}
	pv.Words = append(pv.Words, diagnosis.Reasons(reasons)...)
	if queued > 0 && len(runners) >= plan.Max {
		pv.Words = append(pv.Words, fmt.Sprintf("%d jobs queued, and the pool has its most runners (max %d): they wait for a runner to end.", queued, plan.Max))
	}
	return pv
}

// backoffWords says why a pool holds off starting runners, and until when.
func backoffWords(b pool.Backoff, now time.Time) []string {
	var out []string
	switch {
	case b.Halted:
		out = append(out, "Not starting runners: "+b.Reason+". No retry can fix this: runfleet waits for the config to change.")
	case b.Failures > 0:
		out = append(out, fmt.Sprintf("%d runner starts failed in a row; next try at %s: %s", b.Failures, diagnosis.Clock(b.Until, now), b.Reason))
	}
	for _, shape := range slices.Sorted(maps.Keys(b.Shapes)) {
		out = append(out, "Runners of "+shape+" back off: "+b.Shapes[shape])
	}
	return out
}

// poolCharts draws the pool's runners by state over the last hour and
// day, and its jobs' waits and durations over the day.
func poolCharts(pv *server.PoolView, entries []tally.Entry, now time.Time) {
	// On average over each minute back from now (each quarter hour for
	// the day): the last interval ends now.
	now = now.Truncate(time.Second)
	pv.Hour = stateChart("runners, last hour", tally.StateSeries(entries, pv.Name, now.Add(-time.Hour), time.Minute, 60, now))
	pv.Day = stateChart("runners, last day", tally.StateSeries(entries, pv.Name, now.Add(-24*time.Hour), 15*time.Minute, 96, now))
	binTo := now.Truncate(time.Hour).Add(time.Hour)
	waited, ran := tally.Waits(entries, pv.Name, binTo.Add(-24*time.Hour), binTo, time.Hour)
	pv.Waited = spreadChart("queue wait (queued to started), by hour", waited)
	pv.Ran = spreadChart("job duration, by hour", ran)
}

func stateChart(title string, ss []tally.States) template.HTML {
	times := make([]time.Time, len(ss))
	starting, idle, busy := make([]float64, len(ss)), make([]float64, len(ss)), make([]float64, len(ss))
	for i, s := range ss {
		times[i] = s.At
		starting[i], idle[i], busy[i] = s.Starting, s.Idle, s.Busy
	}
	return chart.Stacked(title, times, []chart.Series{
		{Name: "busy", Class: "busy", Values: busy},
		{Name: "idle", Class: "idle", Values: idle},
		{Name: "starting", Class: "starting", Values: starting},
	})
}

func spreadChart(title string, ss []tally.Spread) template.HTML {
	times := make([]time.Time, len(ss))
	p50, p95 := make([]float64, len(ss)), make([]float64, len(ss))
	for i, s := range ss {
		times[i] = s.At
		p50[i], p95[i] = math.NaN(), math.NaN()
		if s.N > 0 {
			p50[i], p95[i] = s.P50.Seconds(), s.P95.Seconds()
		}
	}
	return chart.Lines(title, times, []chart.Series{{Name: "p50", Class: "p50", Values: p50}, {Name: "p95", Class: "p95", Values: p95}})
}

// midnight is the start of now's day, in its location.
func midnight(now time.Time) time.Time {
	y, m, d := now.Date()
	return time.Date(y, m, d, 0, 0, 0, 0, now.Location())
}

// costWords writes a pool's cost today and this week, and its GPU time.
func costWords(day, week tally.PoolCost) (string, string, string) {
	money := func(c tally.PoolCost) string {
		if c.Currency == "" {
			return ""
		}
		return fmt.Sprintf("%.2f %s", c.Cost, c.Currency)
	}
	gpu := ""
	if week.GPUHours > 0 {
		gpu = fmt.Sprintf("%.1f GPU-hours today, %.1f this week", day.GPUHours, week.GPUHours)
	}
	return money(day), money(week), gpu
}

// jobRow is one of the recent jobs' rows.
func (f *Fleet) jobRow(j demand.JobView, now time.Time) server.JobRow {
	row := server.JobRow{Name: j.Name, Pool: j.Pool, Status: j.Status.String(), Conclusion: j.Conclusion, Runner: j.Runner, Wait: "-", Duration: "-", Record: f.recordOf(j)}
	if row.Name == "" {
		row.Name = fmt.Sprintf("job %d", j.ID)
	}
	if !j.Started.IsZero() && !j.Queued.IsZero() {
		row.Wait = j.Started.Sub(j.Queued).Round(time.Second).String()
	}
	switch {
	case !j.Completed.IsZero() && !j.Started.IsZero():
		row.Duration = j.Completed.Sub(j.Started).Round(time.Second).String()
	case j.Status == demand.InProgress && !j.Started.IsZero():
		row.Duration = now.Sub(j.Started).Round(time.Second).String() + " so far"
	}
	return row
}

// A timeline's rows, and how many of them queued jobs may take.
const (
	timelineRows   = 40
	timelineQueued = 5
	timelineSpan   = 10 * time.Minute
)

// timeline draws the last hour's jobs: those the history knows, and those
// still queued, which have no runner and no record yet.
func timeline(entries []tally.Entry, jobs []demand.JobView, waiting int, now time.Time) template.HTML {
	from := now.Add(-time.Hour)
	var bars []chart.Bar
	for _, e := range entries {
		j := e.Job
		if j == nil || !j.Completed.IsZero() && j.Completed.Before(from) {
			continue
		}
		start := cmp.Or(j.Queued, j.Started, e.JobStarted)
		if start.IsZero() {
			continue
		}
		class := strings.ToLower(j.Conclusion)
		if j.Completed.IsZero() {
			class = "running"
		}
		end := j.Completed
		if end.IsZero() && !e.Ended.IsZero() {
			end = e.Ended // its runner ended without a report of how
		}
		bars = append(bars, chart.Bar{
			Label: e.Pool + " · " + cmp.Or(j.Name, fmt.Sprint(j.ID)), Href: "jobs/" + e.ID, Class: class,
			Title: fmt.Sprintf("%s on %s: %s", cmp.Or(j.Name, fmt.Sprint(j.ID)), e.Runner, cmp.Or(j.Conclusion, j.Status)),
			Start: start, Mid: cmp.Or(j.Started, e.JobStarted), End: end,
		})
	}
	// The newest last, and at most the rows a chart shows, with room for
	// the longest-waiting of the jobs still queued.
	slices.SortStableFunc(bars, func(a, b chart.Bar) int { return a.Start.Compare(b.Start) })
	var queued []chart.Bar
	for _, j := range jobs {
		if j.Status == forge.JobQueued && !j.Queued.IsZero() {
			queued = append(queued, chart.Bar{Label: j.Pool + " · " + cmp.Or(j.Name, fmt.Sprint(j.ID)), Class: "queued", Title: cmp.Or(j.Name, fmt.Sprint(j.ID)) + ": queued", Start: j.Queued})
		}
	}
	slices.SortStableFunc(queued, func(a, b chart.Bar) int { return a.Start.Compare(b.Start) })
	title := "jobs: waiting, then running, by result"
	if len(queued) > timelineQueued {
		queued = queued[:timelineQueued]
	}
	if waiting > len(queued) {
		title += fmt.Sprintf(" (%d of the %d jobs queued shown)", len(queued), waiting)
	}
	if n := len(bars) + len(queued) - timelineRows; n > 0 {
		bars = bars[min(n, len(bars)):]
	}
	bars = append(bars, queued...)
	// From the first job shown, within the hour, so that a burst of
	// minutes fills the width; timelineSpan at least.
	start := now.Add(-timelineSpan)
	for _, b := range bars {
		if b.Start.Before(start) {
			start = b.Start.Truncate(time.Minute)
		}
	}
	if start.After(from) {
		from = start
	}
	return chart.Timeline(title, bars, from, now)
}

// gpuView shows the host's GPUs: which runner and job hold each, and how
// busy each is where the driver tells.
func gpuView(inv gpu.Inventory, alloc *gpu.Allocator, usage map[string]gpu.Usage, byRunner map[string]demand.JobView) *server.GPUView {
	gv := &server.GPUView{Summary: fmt.Sprintf("driver %s, CUDA %s, %d GPUs (%s)", inv.Driver, inv.CUDA, len(inv.GPUs), inv.Source)}
	if len(inv.GPUs) == 0 {
		gv.Summary = "no GPU: " + inv.Reason
	}
	holders := map[string]string{}
	if alloc != nil {
		for runner, ids := range alloc.Holders() {
			for _, id := range ids {
				holders[id] = runner
			}
		}
	}
	for _, u := range inv.Units() {
		row := server.GPURow{Index: fmt.Sprint(u.Device.Index), ID: u.ID, Name: u.Device.Name, Memory: gib(u.Device.MemoryMiB), Runner: holders[u.ID], Busy: -1}
		if u.MIG != nil {
			row.Index = fmt.Sprintf("%d:%d", u.Device.Index, u.MIG.Index)
			row.Name += " MIG " + u.MIG.Profile
			row.Memory = gib(u.MIG.MemoryMiB)
		} else if use, ok := usage[u.Device.UUID]; ok {
			row.Busy, row.Use = useWords(use, u.Device.MemoryMiB)
		}
		if j, ok := byRunner[row.Runner]; ok && row.Runner != "" {
			row.Job = j.Name
		}
		gv.Units = append(gv.Units, row)
	}
	return gv
}

func useWords(u gpu.Usage, total uint64) (int, string) {
	var parts []string
	if u.Percent >= 0 {
		parts = append(parts, fmt.Sprintf("%d%%", u.Percent))
	}
	if u.MemoryKnown {
		parts = append(parts, fmt.Sprintf("%s of %s", gibExact(u.MemoryUsedMiB), gib(total)))
	}
	return u.Percent, strings.Join(parts, " · ")
}

func gib(mib uint64) string { return fmt.Sprintf("%.0f GiB", float64(mib)/1024) }

func gibExact(mib uint64) string { return fmt.Sprintf("%.1f GiB", float64(mib)/1024) }

// elsewhere adds to the panel the GPUs that live runners hold on other
// machines (a Slurm node's, a pod's, an instance's), from their records.
func elsewhere(gv *server.GPUView, entries []tally.Entry, byRunner map[string]demand.JobView) *server.GPUView {
	here := map[string]bool{}
	if gv != nil {
		for _, u := range gv.Units {
			here[u.ID] = true
		}
	}
	var rows []server.GPURow
	for _, e := range entries {
		if !e.Ended.IsZero() || len(e.GPUList) == 0 {
			continue
		}
		for _, g := range e.GPUList {
			if here[g.ID] || here[g.UUID] {
				continue
			}
			row := server.GPURow{Host: cmp.Or(e.Where, "-"), ID: cmp.Or(g.UUID, g.ID), Name: cmp.Or(g.Model, "-"), Memory: "-", Runner: e.Runner, Busy: -1}
			if g.MemoryMiB > 0 {
				row.Memory = gib(g.MemoryMiB)
			}
			if g.MIGProfile != "" {
				row.Name += " MIG " + g.MIGProfile
			}
			if j, ok := byRunner[e.Runner]; ok {
				row.Job = j.Name
			} else if e.Job != nil {
				row.Job = e.Job.Name
			}
			rows = append(rows, row)
		}
	}
	if len(rows) == 0 {
		return gv
	}
	if gv == nil {
		gv = &server.GPUView{Summary: "no GPU read on this host"}
	}
	gv.Elsewhere = rows
	return gv
}
