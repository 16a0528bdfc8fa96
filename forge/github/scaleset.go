package github

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/actions/scaleset"
	"github.com/actions/scaleset/listener"

	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/lazyregexp"
)

// ScaleSetConfig configures a scale-set connection: the REST driver's
// settings, and the scale set.
type ScaleSetConfig struct {
	Config
	// Name is the scale set's name, which jobs name in runs-on.
	Name string
	// RunnerGroup is the runner group it is in ("default" if empty).
	RunnerGroup string
	// ConflictWait is how long Listen waits for another message session
	// of the scale set to go before it gives up (sessionConflictWait if
	// 0).
	ConflictWait time.Duration
}

// ScaleSet is a GitHub connection in scale-set mode (GitHub's way to
// autoscale, which actions-runner-controller uses): runners are registered
// into a runner scale set, and demand comes from the scale set's message
// session (statistics of the jobs assigned to it, and job started and
// completed messages), through github.com/actions/scaleset. It needs no
// webhook and no poll of each repository, so it serves an organisation as
// well as a repository. Listing runners and re-running a lost job go
// through the REST driver it embeds.
type ScaleSet struct {
	*Forge
	client *scaleset.Client
	name   string
	group  string
	owner  string
	// conflictWait is ScaleSetConfig.ConflictWait.
	conflictWait time.Duration

	service atomic.Int64 // Actions service calls sent

	ensureMu sync.Mutex // one lookup or creation of the scale set at a time
	mu       sync.Mutex
	setID    int
	stats    scaleset.RunnerScaleSetStatistic
	// next is the statistics of the message being handled: they count
	// once its job messages are (the listener records them first).
	next scaleset.RunnerScaleSetStatistic
	// started holds the runners whose job the service reported started
	// or completed, and when: the pool reports a runner that took a job
	// for a while after its job ends.
	started map[int64]time.Time
}

// NewScaleSet returns a scale-set connection. It makes no network call.
func NewScaleSet(cfg ScaleSetConfig) (*ScaleSet, error) {
	d, err := New(cfg.Config)
	if err != nil {
		return nil, err
	}
	if cfg.Name == "" {
		return nil, errors.New("github scale set: a name is required")
	}
	if cfg.RunnerGroup == "" {
		cfg.RunnerGroup = scaleset.DefaultRunnerGroup
	}
	s := &ScaleSet{Forge: d, name: cfg.Name, group: cfg.RunnerGroup, started: map[int64]time.Time{}, conflictWait: cmp.Or(cfg.ConflictWait, sessionConflictWait)}
	s.owner, _ = os.Hostname()
	if s.owner == "" {
		s.owner = "runfleet"
	}
	// No HTTP client of ours goes to the library: given one, it shares it
	// between every call and session, and its admin-token call sets that
	// client to retry 401 and 403 (client.go,
	// getActionsServiceAdminConnectionRequest), so that every queue poll
	// with an expired token was then tried five times over 15 s before
	// the session was refreshed, and a 403 retried where it should halt;
	// and, set while sessions poll, a data race. Left alone, it makes a
	// client per session and per admin-token call. The connection's budget
	// and call count go in the one per-request hook its transport leaves:
	// the proxy function (http.Transport calls it for every request).
	proxy := func(req *http.Request) (*url.URL, error) {
		if cfg.Budget != nil {
			if err := cfg.Budget.Wait(req.Context()); err != nil {
				return nil, err
			}
		}
		s.service.Add(1)
		return http.ProxyFromEnvironment(req)
	}
	// The client's and the listener's own logs (every request, every
	// poll) are debug detail: what fails comes back as an error, which
	// this driver words and logs.
	opts := []scaleset.HTTPOption{scaleset.WithProxy(proxy), scaleset.WithRetryMax(4), scaleset.WithRetryWaitMax(30 * time.Second),
		scaleset.WithLogger(debugOnly(d.log.With("component", "scaleset")))}
	info := scaleset.SystemInfo{System: "runfleet", Version: cfg.Version, Subsystem: "manager"}
	if cfg.AppID != 0 {
		s.client, err = scaleset.NewClientWithGitHubApp(scaleset.ClientWithGitHubAppConfig{
			GitHubConfigURL: cfg.URL, SystemInfo: info,
			GitHubAppAuth: scaleset.GitHubAppAuth{ClientID: strconv.FormatInt(cfg.AppID, 10), InstallationID: cfg.InstallationID, PrivateKey: string(cfg.PrivateKey)},
		}, opts...)
	} else {
		s.client, err = scaleset.NewClientWithPersonalAccessToken(scaleset.NewClientWithPersonalAccessTokenConfig{
			GitHubConfigURL: cfg.URL, PersonalAccessToken: cfg.Token, SystemInfo: info,
		}, opts...)
	}
	if err != nil {
		return nil, fmt.Errorf("github scale set %s: %w", cfg.Name, err)
	}
	return s, nil
}

// Stats counts the REST calls and the Actions service's together.
func (s *ScaleSet) Stats() forge.Stats {
	st := s.Forge.Stats()
	st.Calls += s.service.Load()
	return st
}

// ensure finds the scale set in its runner group, or creates it, and
// returns its id.
func (s *ScaleSet) ensure(ctx context.Context) (int, error) {
	s.ensureMu.Lock()
	defer s.ensureMu.Unlock()
	s.mu.Lock()
	id := s.setID
	s.mu.Unlock()
	if id != 0 {
		return id, nil
	}
	group, err := s.client.GetRunnerGroupByName(ctx, s.group)
	if err != nil {
		return 0, fmt.Errorf("github scale set %s: runner group %q: %w", s.name, s.group, err)
	}
	set, err := s.client.GetRunnerScaleSet(ctx, group.ID, s.name)
	if err != nil {
		return 0, fmt.Errorf("github scale set %s: %w", s.name, err)
	}
	if set == nil {
		set, err = s.client.CreateRunnerScaleSet(ctx, &scaleset.RunnerScaleSet{
			Name: s.name, RunnerGroupID: group.ID,
			Labels:        []scaleset.Label{{Name: s.name}},
			RunnerSetting: scaleset.RunnerSetting{DisableUpdate: true},
		})
		if err != nil {
			return 0, fmt.Errorf("github scale set %s: create: %w", s.name, err)
		}
		s.log.Info("github: created the runner scale set", "scale_set", s.name, "id", set.ID, "runner_group", s.group)
	}
	s.mu.Lock()
	s.setID = set.ID
	s.mu.Unlock()
	return set.ID, nil
}

// Register creates a just-in-time runner in the scale set. A registration
// left under the same name is removed first, unless it runs a job.
func (s *ScaleSet) Register(ctx context.Context, req forge.RunnerRequest) (forge.Credential, error) {
	id, err := s.ensure(ctx)
	if err != nil {
		return forge.Credential{}, refused(err)
	}
	setting := &scaleset.RunnerScaleSetJitRunnerSetting{Name: req.Name, WorkFolder: "_work"}
	jit, err := s.client.GenerateJitRunnerConfig(ctx, setting, id)
	if errors.Is(err, scaleset.RunnerExistsError) {
		if rerr := s.removeByName(ctx, req.Name); rerr != nil {
			return forge.Credential{}, fmt.Errorf("runner name %s is taken: %w", req.Name, rerr)
		}
		jit, err = s.client.GenerateJitRunnerConfig(ctx, setting, id)
	}
	if err != nil {
		return forge.Credential{}, refused(fmt.Errorf("github scale set %s: register runner %s: %w", s.name, req.Name, err))
	}
	if jit.Runner == nil || jit.Runner.ID == 0 || jit.EncodedJITConfig == "" {
		return forge.Credential{}, fmt.Errorf("github scale set %s: register runner %s: answer has no JIT config", s.name, req.Name)
	}
	rid := int64(jit.Runner.ID)
	s.remember(forge.Runner{ID: rid, Name: req.Name, Status: forge.StatusOffline, Labels: []string{s.name}})
	return forge.Credential{RunnerID: rid, Env: map[string]string{EnvJITConfig: jit.EncodedJITConfig}}, nil
}

// removeByName removes a leftover registration of that name.
func (s *ScaleSet) removeByName(ctx context.Context, name string) error {
	r, err := s.client.GetRunnerByName(ctx, name)
	if err != nil {
		return fmt.Errorf("github scale set %s: find runner %s: %w", s.name, name, err)
	}
	if r == nil {
		return nil
	}
	s.log.Info("github: removing a stale registration of the same name", "runner", name, "id", r.ID)
	if err := s.RemoveRunner(ctx, int64(r.ID)); err != nil && !errors.Is(err, forge.ErrNotFound) {
		return err
	}
	return nil
}

// RemoveRunner removes a scale set's runner; the service refuses while it
// runs a job (ErrBusy).
func (s *ScaleSet) RemoveRunner(ctx context.Context, id int64) error {
	if id == 0 {
		return forge.ErrNotFound
	}
	err := s.client.RemoveRunner(ctx, id)
	switch {
	case err == nil:
		s.forget(id)
		return nil
	case errors.Is(err, scaleset.JobStillRunningError):
		s.markBusy(id)
		return fmt.Errorf("github runner %d: %w", id, forge.ErrBusy)
	case errors.Is(err, scaleset.RunnerNotFoundError):
		s.forget(id)
		return fmt.Errorf("github runner %d: %w", id, forge.ErrNotFound)
	}
	return fmt.Errorf("github scale set %s: remove runner %d: %w", s.name, id, err)
}

// Listen holds the scale set's message session and follows its statistics
// and job messages until ctx ends; the session is deleted on the way out.
// A session a killed manager left is waited out (the service drops it
// when it is no longer polled) and replaced.
func (s *ScaleSet) Listen(ctx context.Context, max int, changed func()) error {
	id, err := s.ensure(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil // stopped as it began: no failure
		}
		return refused(err)
	}
	sess, err := s.session(ctx, id)
	if err != nil {
		if ctx.Err() != nil {
			// Stopped while the session was asked for: its answer (a
			// session the service made) is not waited for; the service
			// drops a session that is not polled.
			return nil
		}
		return err
	}
	defer func() {
		// Without a session the figures go stale: no demand until the
		// next session's first statistics.
		s.mu.Lock()
		s.stats, s.next = scaleset.RunnerScaleSetStatistic{}, scaleset.RunnerScaleSetStatistic{}
		s.mu.Unlock()
		// Within a manager's stand-down on a lost lease (the daemon's
		// standDownWait, 2 s), so that the next leader finds no session.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), sessionCloseWait)
		defer cancel()
		if err := sess.Close(cctx); err != nil {
			s.log.Warn("github: could not delete the scale set's message session; the service drops it in time", "scale_set", s.name, "err", err)
		}
	}()
	s.mu.Lock()
	clear(s.started)
	s.mu.Unlock()
	l, err := listener.New(acquireFirst{sess}, listener.Config{ScaleSetID: id, MaxRunners: max, Logger: debugOnly(s.log.With("component", "scaleset-listener"))},
		listener.WithMetricsRecorder(recorder{s, changed}))
	if err != nil {
		return fmt.Errorf("github scale set %s: %w", s.name, err)
	}
	s.log.Info("github: listening to the runner scale set", "scale_set", s.name, "id", id, "max", max)
	err = l.Run(ctx, scaler{s, changed})
	if ctx.Err() != nil {
		return nil
	}
	return fmt.Errorf("github scale set %s: %w", s.name, err)
}

// sessionCloseWait bounds the deletion of the message session as the
// listener stops.
const sessionCloseWait = 1500 * time.Millisecond

// sessionConflictWait is how long a listener waits for another message
// session of its scale set to go before it gives up: a session a killed
// manager left goes once the service stops seeing it polled (minutes); one
// still there after this is another manager's, serving the same scale set.
const sessionConflictWait = 3 * time.Minute

// session opens the scale set's message session. While another holds it
// (409, whose message names its owner), it tries again with backoff, for
// up to its conflictWait.
func (s *ScaleSet) session(ctx context.Context, id int) (*scaleset.MessageSessionClient, error) {
	wait, began := time.Second, time.Now()
	for {
		sess, err := s.client.MessageSessionClient(ctx, id, s.owner)
		if err == nil {
			return sess, nil
		}
		if !sessionConflict(err) {
			return nil, fmt.Errorf("github scale set %s: message session: %w", s.name, err)
		}
		if time.Since(began) >= s.conflictWait {
			return nil, fmt.Errorf("%w: github scale set %s: another message session has held it for %s, so another manager serves it (this one is %q): stop the other, then restart this one: %w",
				forge.ErrRejected, s.name, s.conflictWait, s.owner, err)
		}
		s.log.Warn("github: another message session holds the scale set (a manager stopped without closing it, or another serving it); waiting for the service to drop it",
			"scale_set", s.name, "err", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(wait):
		}
		wait = min(2*wait, 30*time.Second)
	}
}

// acquireFirst hands the listener a message whose available jobs are
// already acquired: the listener (v0.4.0, listener.go handleMessage)
// deletes a message before it acquires its jobs, so an acquire that then
// fails leaves their offers deleted, where ARC's listener acquires first.
// An acquire that fails here fails the poll: the message stays, and the
// listener's session is opened again.
type acquireFirst struct{ listener.Client }

func (a acquireFirst) GetMessage(ctx context.Context, lastMessageID, maxCapacity int) (*scaleset.RunnerScaleSetMessage, error) {
	msg, err := a.Client.GetMessage(ctx, lastMessageID, maxCapacity)
	if err != nil || msg == nil || len(msg.JobAvailableMessages) == 0 {
		return msg, err
	}
	ids := make([]int64, 0, len(msg.JobAvailableMessages))
	for _, j := range msg.JobAvailableMessages {
		ids = append(ids, j.RunnerRequestID)
	}
	if _, err := a.Client.AcquireJobs(ctx, ids); err != nil {
		return nil, fmt.Errorf("acquiring %d jobs of message %d, before it is deleted: %w", len(ids), msg.MessageID, err)
	}
	msg.JobAvailableMessages = nil
	return msg, nil
}

// refused marks err as one no retry fixes (forge.ErrRejected) where the
// service answered 403: the token lacks the permission (a registration
// token needs administration rights on the repository or organisation),
// which only a new token and a restart fix. The client's own retries of
// 5xx and 429 were spent before this.
func refused(err error) error {
	if serviceStatus(err) != http.StatusForbidden || errors.Is(err, forge.ErrRejected) {
		return err
	}
	return fmt.Errorf("%w: %w", forge.ErrRejected, err)
}

// statusRE finds the HTTP status in the client's errors, which carry it
// only in their words (errors.go, newRequestResponseError: status="403
// Forbidden").
var statusRE = lazyregexp.New(`status="(\d{3}) `)

// serviceStatus returns the HTTP status an error of the client reports,
// the last one where it wraps several; 0 if none.
func serviceStatus(err error) int {
	m := statusRE.FindAllStringSubmatch(err.Error(), -1)
	if len(m) == 0 {
		return 0
	}
	code, _ := strconv.Atoi(m[len(m)-1][1])
	return code
}

// sessionConflict tells the service's answer to a second session: 409
// with a TaskAgentSessionConflictException. The client does not export
// either, so the words are read.
func sessionConflict(err error) bool {
	return strings.Contains(err.Error(), "SessionConflict") || serviceStatus(err) == http.StatusConflict
}

// Unserved returns the jobs assigned to the scale set that no runner runs
// yet, less those that runners were seen taking before the service said
// so.
func (s *ScaleSet) Unserved(took []int64) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := s.stats.TotalAssignedJobs - s.stats.TotalRunningJobs
	for _, id := range took {
		if _, ok := s.started[id]; !ok {
			n--
		}
	}
	return max(n, 0)
}

// startedKept is how long a runner's started job is remembered, well
// beyond the pool's window for runners that took a job.
const startedKept = time.Hour

// startedRunner notes that a runner's job started (or ended, should its
// start not have been reported), and forgets runners noted long ago.
// Called with s.mu held.
func (s *ScaleSet) startedRunner(id int64) {
	now := time.Now()
	if _, ok := s.started[id]; !ok {
		s.started[id] = now
	}
	for r, at := range s.started {
		if now.Sub(at) > startedKept {
			delete(s.started, r)
		}
	}
}

// scaler receives the listener's job messages and desired counts.
type scaler struct {
	s       *ScaleSet
	changed func()
}

func (sc scaler) HandleJobStarted(_ context.Context, j *scaleset.JobStarted) error {
	sc.s.mu.Lock()
	sc.s.startedRunner(int64(j.RunnerID))
	sc.s.mu.Unlock()
	sc.changed()
	return nil
}

func (sc scaler) HandleJobCompleted(_ context.Context, j *scaleset.JobCompleted) error {
	id := int64(j.RunnerID)
	sc.s.mu.Lock()
	sc.s.startedRunner(id)
	sc.s.mu.Unlock()
	if id != 0 {
		// GitHub deletes an ephemeral runner with its job.
		sc.s.forget(id)
	}
	sc.changed()
	return nil
}

func (sc scaler) HandleDesiredRunnerCount(_ context.Context, count int) (int, error) {
	sc.s.mu.Lock()
	sc.s.stats = sc.s.next
	sc.s.mu.Unlock()
	sc.changed()
	return count, nil
}

// recorder keeps the scale set's latest statistics.
type recorder struct {
	s       *ScaleSet
	changed func()
}

func (r recorder) RecordStatistics(st *scaleset.RunnerScaleSetStatistic) {
	if st == nil {
		return
	}
	r.s.mu.Lock()
	r.s.next = *st
	r.s.mu.Unlock()
}

func (recorder) RecordJobStarted(*scaleset.JobStarted)     {}
func (recorder) RecordJobCompleted(*scaleset.JobCompleted) {}
func (recorder) RecordDesiredRunners(int)                  {}

var _ forge.Demander = (*ScaleSet)(nil)

// debugOnly returns a logger that writes everything at debug level.
func debugOnly(l *slog.Logger) *slog.Logger { return slog.New(debugHandler{l.Handler()}) }

type debugHandler struct{ slog.Handler }

func (h debugHandler) Enabled(ctx context.Context, _ slog.Level) bool {
	return h.Handler.Enabled(ctx, slog.LevelDebug)
}

func (h debugHandler) Handle(ctx context.Context, r slog.Record) error {
	r.Level = slog.LevelDebug
	return h.Handler.Handle(ctx, r)
}

func (h debugHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return debugHandler{h.Handler.WithAttrs(as)}
}

func (h debugHandler) WithGroup(name string) slog.Handler {
	return debugHandler{h.Handler.WithGroup(name)}
}

// JobLimit is GitHub's default timeout-minutes, as for Forge.
func (*ScaleSet) JobLimit() time.Duration { return 6 * time.Hour }
