package vm

import (
	"context"
	"log/slog"
	"maps"
	"sync"
	"time"

	"github.com/runfleet/runfleet/provider"
)

// Poller is what a cloud provider's Watch and WatchPreemption share: the
// subscribers, one poll every Interval from the first subscription until
// Stop, its failures logged when they start, once a minute and when they
// end, and the preemption notices handed on once per instance.
type Poller struct {
	Interval time.Duration
	// Poll reads the cloud once; What names it in the log ("listing
	// instances").
	Poll   func(context.Context) error
	What   string
	Logger *slog.Logger

	start            sync.Once
	ctx              context.Context
	stop             context.CancelFunc
	mu               sync.Mutex
	changed          map[int]func(string)
	notices          map[int]func(provider.Notice)
	noticed          map[string]bool
	next             int
	failing, failLog time.Time // only the polling goroutine uses them
}

func (p *Poller) init() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.changed == nil {
		p.changed, p.notices, p.noticed = map[int]func(string){}, map[int]func(provider.Notice){}, map[string]bool{}
		p.ctx, p.stop = context.WithCancel(context.Background())
	}
}

// Watch adds a subscriber to the changes Changed reports, until ctx ends.
func (p *Poller) Watch(ctx context.Context, changed func(name string)) {
	p.subscribe(ctx, func(id int) { p.changed[id] = changed }, func(id int) { delete(p.changed, id) })
}

// WatchPreemption adds a subscriber to the notices Notify hands on.
func (p *Poller) WatchPreemption(ctx context.Context, notice func(provider.Notice)) {
	p.subscribe(ctx, func(id int) { p.notices[id] = notice }, func(id int) { delete(p.notices, id) })
}

func (p *Poller) subscribe(ctx context.Context, add, remove func(int)) {
	p.init()
	p.mu.Lock()
	id := p.next
	p.next++
	add(id)
	p.mu.Unlock()
	p.start.Do(func() { go p.run() })
	context.AfterFunc(ctx, func() {
		p.mu.Lock()
		remove(id)
		p.mu.Unlock()
	})
}

// Stop ends the polling.
func (p *Poller) Stop() {
	p.init()
	p.stop()
}

// run polls every Interval until Stop. A failing poll is retried at the
// next interval, never sooner.
func (p *Poller) run() {
	t := time.NewTicker(p.Interval)
	defer t.Stop()
	for {
		p.noteFailure(p.Poll(p.ctx))
		select {
		case <-p.ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (p *Poller) noteFailure(err error) {
	now := time.Now()
	switch {
	case err == nil && !p.failing.IsZero():
		p.Logger.Info(p.What+" works again", "after", now.Sub(p.failing).Round(time.Second))
		p.failing, p.failLog = time.Time{}, time.Time{}
	case err != nil && p.ctx.Err() == nil && now.Sub(p.failLog) >= time.Minute:
		if p.failing.IsZero() {
			p.failing = now
		}
		p.failLog = now
		p.Logger.Warn(p.What+" failed; trying again each poll interval", "err", err, "since", p.failing.Format(time.RFC3339))
	}
}

// Changed tells the subscribers that these runners' machines changed.
func (p *Poller) Changed(names []string) {
	p.init()
	p.mu.Lock()
	subs := maps.Clone(p.changed)
	p.mu.Unlock()
	for _, name := range names {
		for _, f := range subs {
			f(name)
		}
	}
}

// Notify hands a notice to the subscribers, once per machine (n.ID), and
// logs it with msg.
func (p *Poller) Notify(n provider.Notice, msg string) {
	p.init()
	p.mu.Lock()
	if p.noticed[n.ID] || n.Name == "" {
		p.mu.Unlock()
		return
	}
	p.noticed[n.ID] = true
	subs := maps.Clone(p.notices)
	p.mu.Unlock()
	p.Logger.Warn(msg, "runner", n.Name, "id", n.ID, "at", n.At.Format(time.RFC3339))
	for _, f := range subs {
		f(n)
	}
}

// Noticed says whether a machine's notice was given.
func (p *Poller) Noticed(id string) bool {
	p.init()
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.noticed[id]
}

// Forget drops the notices of the machines keep does not keep.
func (p *Poller) Forget(keep func(id string) bool) {
	p.init()
	p.mu.Lock()
	defer p.mu.Unlock()
	maps.DeleteFunc(p.noticed, func(id string, _ bool) bool { return !keep(id) })
}
