// Package bitbucket is the forge driver for Bitbucket Pipelines (Bitbucket
// Cloud) runners.
//
// Bitbucket publishes no API for runners. The driver makes the calls that
// Atlassian's own runner autoscaler makes (atlassian/runners-autoscaler),
// under /internal: POST .../pipelines-config/runners with a name and labels
// answers the runner with its uuid and its OAuth client (id and secret),
// GET lists them (pagelen, next), PUT .../runners/{uuid}/state with
// {"status": "DISABLED"} disables one, DELETE removes it; a runner's state
// says UNREGISTERED, ONLINE, OFFLINE or DISABLED, and names the step it
// runs. The scope is a workspace or one of its repositories. No Go client
// covers these calls, nor the documented ones it reads for demand
// (pipelines, their steps, the pipeline's bitbucket-pipelines.yml), so the
// client here is written by hand, on net/http.
//
// A runner's OAuth client is what its agent authenticates with; the
// manager's API token or access token never reaches it. The
// runner carries the manager id in its name (<manager>.<runner>), since
// labels take only lowercase letters, digits and dots: a manager lists
// only its own runners. Bitbucket's runner has no single-job mode, so the
// driver is a forge.Cordoner: a runner is disabled as soon as it takes a
// step, and deleted as soon as that step ends; a runner is deleted only
// when, disabled, it runs no step.
package bitbucket

import (
	"bytes"
	"cmp"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"golang.org/x/time/rate"

	"github.com/runfleet/runfleet/forge"
)

// DefaultURL is Bitbucket Cloud's API.
const DefaultURL = "https://api.bitbucket.org"

// Config configures a Forge.
type Config struct {
	// URL is the API's address (DefaultURL when empty).
	URL string
	// RunnerURL is the API as the runners reach it; URL when empty.
	RunnerURL string
	// Workspace is the workspace's slug or {uuid}.
	Workspace string
	// Repository, when set, makes the runners the repository's (its
	// slug or {uuid}); otherwise they are the workspace's.
	Repository string
	// Repositories are the repositories whose pipelines are read for
	// demand in a workspace scope; the scope's own repository otherwise.
	Repositories []string
	// Token authenticates the manager: a workspace, project or
	// repository access token (sent as a bearer token); with Username
	// (the Atlassian account's email), an API token (basic; API tokens
	// replaced app passwords, turned off in June 2026); or CML's
	// REPO_TOKEN, base64 of user:token.
	Token    string
	Username string
	// Manager is the manager's id, carried in its runners' names.
	Manager    string
	HTTPClient *http.Client
	// CallTimeout bounds each call, its rate-limit waits included (30s
	// if 0).
	CallTimeout time.Duration
	// Budget paces the API calls (forge.Budgeted); nil is none.
	Budget *rate.Limiter
	// Owed keeps the lost runners\' re-runs the connection owes, for
	// the next manager (forge.Following.Ledger); nil keeps none.
	Owed forge.Ledger
	// CacheTTL is how long a listing of runners is reused (5s if 0;
	// negative: never).
	CacheTTL time.Duration
	// IdleCacheTTL is how long a listing is reused while it is calm:
	// every runner online, idle and enabled, none made since (idleGap of
	// the budget if 0; never longer than CacheTTL when that is negative).
	IdleCacheTTL time.Duration
	// IdlePollMax is the longest the pipelines of a repository go unread
	// while none is pending or in progress and the runners are calm: the
	// wait doubles from firstIdleGap to it (idleGap of the budget if 0).
	IdlePollMax time.Duration
	// Clock is the driver's clock (time.Now if nil), for tests that
	// compress time.
	Clock   func() time.Time
	Version string
	Logger  *slog.Logger
}

// Forge talks to one Bitbucket workspace or repository.
type Forge struct {
	cfg   Config
	log   *slog.Logger
	hc    *http.Client
	auth  string // the Authorization header
	calls atomic.Int64
	rl    *limits

	kept forge.Kept
	mu   sync.Mutex
	// ws and repo are the scope's uuids, looked up once.
	ws, repo string
	// uuids maps the ids the pool knows runners by to their uuids.
	uuids map[int64]string
	// cordoned holds the runners the driver disabled; ended those a
	// listing showed disabled and without a step: their step is over,
	// and none can come.
	cordoned map[int64]bool
	// late holds the runners disabled after their step ended, or listed
	// offline while enabled: they may have failed a step unrun.
	late  map[int64]bool
	ended map[int64]bool
	// pipelinesYML keeps each commit's runs-on per step name.
	pipelinesYML map[string]map[string][]string
	// steps holds the step each runner was last listed running, for
	// the re-run of a lost one (kept after the runner goes: a lost
	// runner may be deleted before the pool reports it); rerun the
	// pipelines run again.
	steps map[int64]string
	rerun map[string]bool
	// checked holds the ended pipelines rescueUnrun has read;
	// scanning is set while it reads, scanAgain when it was called then.
	checked             map[string]bool
	scanning, scanAgain bool
	losing              forge.Following
	// pace is, per repository, when its pipelines are read next while
	// none runs (idle.go).
	pace map[string]*pace
	// reads are the repositories' jobs as last read, by repository and
	// status, reused while the limit is near.
	reads map[string]jobsRead
}

// New returns a driver. It makes no call.
func New(cfg Config) (*Forge, error) {
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = 30 * time.Second
	}
	if cfg.CacheTTL == 0 {
		cfg.CacheTTL = 5 * time.Second
	}
	if cfg.IdleCacheTTL == 0 {
		cfg.IdleCacheTTL = idleGap(cfg.Budget)
	}
	if cfg.CacheTTL < 0 {
		cfg.IdleCacheTTL = cfg.CacheTTL
	}
	if cfg.IdlePollMax == 0 {
		cfg.IdlePollMax = idleGap(cfg.Budget)
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Manager == "" {
		return nil, errors.New("bitbucket: no manager id")
	}
	cfg.URL = strings.TrimRight(cmp.Or(cfg.URL, DefaultURL), "/")
	if u, err := url.Parse(cfg.URL); err != nil || u.Host == "" {
		return nil, fmt.Errorf("bitbucket: %q is not an API URL", cfg.URL)
	}
	cfg.RunnerURL = strings.TrimRight(cmp.Or(cfg.RunnerURL, cfg.URL), "/")
	if cfg.Workspace == "" {
		return nil, errors.New("bitbucket: no workspace")
	}
	d := &Forge{cfg: cfg, log: cfg.Logger, auth: authorization(cfg.Username, cfg.Token),
		uuids: map[int64]string{}, cordoned: map[int64]bool{}, late: map[int64]bool{}, ended: map[int64]bool{},
		pipelinesYML: map[string]map[string][]string{}, steps: map[int64]string{}, rerun: map[string]bool{}, checked: map[string]bool{}, pace: map[string]*pace{}, reads: map[string]jobsRead{}}
	d.losing.Ledger = cfg.Owed
	d.kept.Now = cfg.Clock
	d.rl = &limits{}
	hc := &http.Client{}
	if cfg.HTTPClient != nil {
		c := *cfg.HTTPClient
		hc = &c
	}
	// Each attempt waits for the budget and is counted; the limits wrap
	// them all, so that a 429 waits and is sent again.
	hc.Transport = d.rl.transport(forge.Budgeted(forge.CountCalls(hc.Transport, &d.calls), cfg.Budget))
	// A redirect would carry the credentials to wherever it points.
	hc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	d.hc = hc
	return d, nil
}

// authorization is the Authorization header for the credentials: basic
// with a username (an API token), basic when the token is CML's
// REPO_TOKEN (base64 of user:token), bearer otherwise (a
// workspace, project or repository access token).
func authorization(user, token string) string {
	if user != "" {
		return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+token))
	}
	if isUserPassword(token) {
		return "Basic " + token
	}
	return "Bearer " + token
}

// isUserPassword reports whether a token is base64 of user:password, as
// CML's REPO_TOKEN for Bitbucket is. Access tokens are not valid base64 of
// printable text with a colon.
func isUserPassword(token string) bool {
	b, err := base64.StdEncoding.DecodeString(token)
	if err != nil || !utf8.Valid(b) {
		return false
	}
	s := string(b)
	user, pass, ok := strings.Cut(s, ":")
	if !ok || user == "" || pass == "" {
		return false
	}
	for _, r := range s {
		if !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

// Stats reports the calls sent, the rate limit left and the waits for it.
func (d *Forge) Stats() forge.Stats {
	return forge.Stats{Calls: d.calls.Load(), RateRemaining: -1, RateLimitWaits: d.rl.Waits()}
}

// apiError is an answer other than 2xx, with Bitbucket's words: its
// standardized error object (developer.atlassian.com/cloud/bitbucket/rest/intro,
// "Standardized error responses": {"type": "error", "error": {"message",
// "detail", "fields"}}), whose detail is words or an object; for a
// credential without a scope, the scopes it lacks.
type apiError struct {
	Status  int
	Message string
	// Required are the scopes Bitbucket said the call requires, where it
	// refused it for them (error.detail.required).
	Required []string
}

func (e *apiError) Error() string {
	switch {
	case len(e.Required) > 0:
		return fmt.Sprintf("%d %s: the credential lacks the scope for it: Bitbucket requires %s (docs/forges/bitbucket.md lists what runfleet needs)",
			e.Status, http.StatusText(e.Status), strings.Join(e.Required, " and "))
	case e.Message == "":
		return fmt.Sprintf("%d %s", e.Status, http.StatusText(e.Status))
	}
	return fmt.Sprintf("%d %s: %s", e.Status, http.StatusText(e.Status), e.Message)
}

// answerError reads an answer's error object: its message, its detail
// (words, or an object whose required names the scopes a refused call
// needs) and its fields' complaints, in that order.
func answerError(code int, body []byte) *apiError {
	e := &apiError{Status: code}
	var eb struct {
		Error struct {
			Message string                     `json:"message"`
			Detail  json.RawMessage            `json:"detail"`
			Fields  map[string]json.RawMessage `json:"fields"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &eb) != nil {
		return e
	}
	words := []string{}
	if m := strings.TrimSpace(eb.Error.Message); m != "" {
		words = append(words, m)
	}
	var detail string
	var scopes struct{ Required []string }
	switch {
	case json.Unmarshal(eb.Error.Detail, &detail) == nil && strings.TrimSpace(detail) != "":
		words = append(words, strings.TrimSpace(detail))
	case json.Unmarshal(eb.Error.Detail, &scopes) == nil:
		e.Required = scopes.Required
	}
	for _, k := range slices.Sorted(maps.Keys(eb.Error.Fields)) {
		words = append(words, k+": "+strings.Trim(string(eb.Error.Fields[k]), "[]\""))
	}
	e.Message = strings.Join(words, "; ")
	return e
}

// status is an error's HTTP status, 0 when it has none.
func status(err error) int {
	if e, ok := errors.AsType[*apiError](err); ok {
		return e.Status
	}
	return 0
}

// rejectDefinitive marks an answer that no retry can fix (credentials
// refused or without the permission, a workspace or repository that does
// not exist, a request refused as invalid) as forge.ErrRejected.
func rejectDefinitive(err error) error {
	if errors.Is(err, forge.ErrRejected) {
		return err
	}
	switch status(err) {
	case http.StatusBadRequest, http.StatusUnauthorized, http.StatusForbidden, http.StatusNotFound:
		return fmt.Errorf("%w: %w", forge.ErrRejected, err)
	}
	return err
}

// call sends one request with the call timeout and decodes a JSON answer
// into out (when not nil). path is below the API's URL, or a whole URL of
// the API (a page's next). Its error names what it did and where.
func (d *Forge) call(ctx context.Context, what, method, path string, body, out any) error {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.CallTimeout)
	defer cancel()
	if err := d.send(ctx, method, path, body, out); err != nil {
		if e, ok := errors.AsType[*apiError](err); ok && len(e.Required) > 0 {
			// A credential without the scope: no retry fixes it.
			return fmt.Errorf("%w: bitbucket %s (%s): %w", forge.ErrRejected, what, d.where(), err)
		}
		return fmt.Errorf("bitbucket %s (%s): %w", what, d.where(), err)
	}
	return nil
}

func (d *Forge) send(ctx context.Context, method, path string, body, out any) error {
	u := path
	if !strings.HasPrefix(path, "http://") && !strings.HasPrefix(path, "https://") {
		u = d.cfg.URL + path
	} else if !strings.HasPrefix(path, d.cfg.URL+"/") {
		// A next link elsewhere would be sent the credentials.
		return fmt.Errorf("the answer's link %q is not on %s", path, d.cfg.URL)
	}
	var rd io.Reader
	var raw []byte
	if body != nil {
		var err error
		if raw, err = json.Marshal(body); err != nil {
			return err
		}
		rd = bytes.NewReader(raw)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", d.auth)
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "runfleet/"+cmp.Or(d.cfg.Version, "dev"))
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := d.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return answerError(resp.StatusCode, b)
	}
	if out == nil || len(b) == 0 {
		return nil
	}
	if s, ok := out.(*[]byte); ok {
		*s = b
		return nil
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("%s %s: answer is not what was expected: %w", method, req.URL.Path, err)
	}
	return nil
}

func (d *Forge) where() string {
	if d.cfg.Repository != "" {
		return "repository " + d.cfg.Workspace + "/" + d.cfg.Repository
	}
	return "workspace " + d.cfg.Workspace
}

// page is Bitbucket's paged collection.
type page[T any] struct {
	Values []T    `json:"values"`
	Next   string `json:"next"`
}

// maxPages bounds a listing: at 100 a page, far more than one scope holds.
const maxPages = 20

// listAll reads every page of a collection, following next.
func listAll[T any](ctx context.Context, d *Forge, what, path string) ([]T, error) {
	var out []T
	for range maxPages {
		var p page[T]
		if err := d.call(ctx, what, http.MethodGet, path, nil, &p); err != nil {
			return nil, err
		}
		out = append(out, p.Values...)
		if p.Next == "" {
			return out, nil
		}
		path = p.Next
	}
	d.log.Warn("bitbucket: more pages than are read", "what", what, "pages", maxPages)
	return out, nil
}

// scope returns the workspace's uuid and the repository's (empty for a
// workspace scope), looked up once.
func (d *Forge) scope(ctx context.Context) (ws, repo string, err error) {
	d.mu.Lock()
	ws, repo = d.ws, d.repo
	d.mu.Unlock()
	if ws != "" && (repo != "" || d.cfg.Repository == "") {
		return ws, repo, nil
	}
	var w struct {
		UUID string `json:"uuid"`
	}
	if err := d.call(ctx, "read workspace", http.MethodGet, "/2.0/workspaces/"+url.PathEscape(d.cfg.Workspace), nil, &w); err != nil {
		return "", "", rejectDefinitive(err)
	}
	if d.cfg.Repository != "" {
		var r struct {
			UUID string `json:"uuid"`
		}
		if err := d.call(ctx, "read repository", http.MethodGet, repoPath(d.cfg.Workspace, d.cfg.Repository), nil, &r); err != nil {
			return "", "", rejectDefinitive(err)
		}
		repo = r.UUID
	}
	if w.UUID == "" || (d.cfg.Repository != "" && repo == "") {
		return "", "", fmt.Errorf("%w: bitbucket: %s: the answer names no uuid", forge.ErrRejected, d.where())
	}
	d.mu.Lock()
	d.ws, d.repo = w.UUID, repo
	d.mu.Unlock()
	return w.UUID, repo, nil
}

func repoPath(ws, repo string) string {
	return "/2.0/repositories/" + url.PathEscape(ws) + "/" + url.PathEscape(repo)
}

// runnersPath is the scope's runners, as the autoscaler calls them.
func (d *Forge) runnersPath(ctx context.Context) (string, error) {
	ws, repo, err := d.scope(ctx)
	if err != nil {
		return "", err
	}
	if repo != "" {
		return "/internal/repositories/" + url.PathEscape(ws) + "/" + url.PathEscape(repo) + "/pipelines-config/runners", nil
	}
	return "/internal/workspaces/" + url.PathEscape(ws) + "/pipelines-config/runners", nil
}

// idOf is the id the pool knows a runner by: the first 63 bits of its
// uuid, never 0.
func idOf(uuid string) int64 {
	h := strings.Map(func(r rune) rune {
		if strings.ContainsRune("0123456789abcdefABCDEF", r) {
			return r
		}
		return -1
	}, uuid)
	b, _ := hex.DecodeString((h + "0000000000000000")[:16])
	var id int64
	for _, c := range b {
		id = id<<8 | int64(c)
	}
	id &= 1<<63 - 1
	if id == 0 {
		id = 1
	}
	return id
}

// Refresh drops the kept listing of runners (forge.Refresher).
func (d *Forge) Refresh() { d.kept.Drop() }

// JobLimit is a step's max-time when its pipeline sets none: 120 minutes
// (support.atlassian.com, Bitbucket Pipelines, "Global options",
// max-time).
func (*Forge) JobLimit() time.Duration { return 2 * time.Hour }
