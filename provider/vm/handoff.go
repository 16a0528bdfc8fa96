package vm

import (
	"bytes"
	"context"
	"crypto/ecdh"
	"crypto/hpke"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/runfleet/runfleet/bootstrap"
)

// The handoff through the manager. Where no secret store can hold an
// entry that only one instance reads (Compute Engine: every instance of a
// pool shares its service account), an instance asks the manager for its
// assignment, over HTTP, with its cloud's signed identity: a token the
// cloud's metadata service signs for this instance alone, with an
// audience the instance chooses. The audience binds the request's
// one-time public key (Audience), and the manager seals the assignment to
// that key (HPKE, RFC 9180), so the assignment crosses the network
// unreadable, and a token seen on the way is worth nothing with another
// key. The manager hands each instance's assignment once: a second
// request, from a job step on the instance with a token of its own, gets
// 410 Gone.

// Desk is the manager's side: the assignments of a pool's instances,
// each held until its instance takes it or its time ends.
type Desk struct {
	// URL is where the pool's instances reach the desk.
	URL string
	// Verify checks an identity token for the audience and says which
	// instance it names; an error for a token that is not valid.
	Verify func(ctx context.Context, token, audience string) (instance string, err error)
	Logger *slog.Logger
	now    func() time.Time

	mu      sync.Mutex
	held    map[string]held      // by instance id
	taken   map[string]time.Time // instance id → when its assignment was taken
	refused []refusal            // the latest claims refused, oldest first
}

// refusal is a claim the desk refused: a proof that did not verify (a
// machine that powers off without its runner: wrong certificates, another
// project) or a second claim (a job step asking again).
type refusal struct {
	at        time.Time
	from, why string
}

// maxRefusals is how many refused claims a desk remembers.
const maxRefusals = 50

type held struct {
	a     bootstrap.Assignment
	until time.Time
}

// maxClaim bounds a claim's body: a token and a key.
const maxClaim = 16 << 10

// Claim is what an instance sends: its identity token and the public key
// the assignment is sealed to, in base64.
type Claim struct {
	Token string `json:"token"`
	Key   string `json:"key"`
}

// Suite is the HPKE suite assignments are sealed with.
var (
	suiteKEM  = hpke.DHKEM(ecdh.X25519())
	suiteKDF  = hpke.HKDFSHA256()
	suiteAEAD = hpke.ChaCha20Poly1305()
	sealInfo  = []byte("runfleet assignment v1")
)

// Audience is the audience an instance asks its identity token for: the
// desk's URL, bound to the public key the assignment is to be sealed to.
func Audience(url string, key []byte) string {
	h := sha256.Sum256(key)
	return url + "?key=" + base64.RawURLEncoding.EncodeToString(h[:])
}

// DeskURL is where a pool's machines claim their assignment: the
// manager's handoff URL (its webhook listener as they reach it), "" for
// none.
func DeskURL(handoff, pool string) string {
	if handoff == "" {
		return ""
	}
	return strings.TrimRight(handoff, "/") + "/handoff/" + url.PathEscape(pool)
}

// Handoff is the plan's handoff to this desk by the cloud's source; nil
// for no desk.
func (d *Desk) Handoff(source string, wait time.Duration) *bootstrap.Handoff {
	if d == nil {
		return nil
	}
	return &bootstrap.Handoff{Source: source, Wait: wait, Params: map[string]string{"url": d.URL}}
}

// Handler is the desk as the manager serves it; nil for no desk.
func (d *Desk) Handler() http.Handler {
	if d == nil {
		return nil
	}
	return d
}

// Hold keeps an instance's assignment until it is taken or until.
func (d *Desk) Hold(instance string, a bootstrap.Assignment, until time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.held == nil {
		d.held, d.taken = map[string]held{}, map[string]time.Time{}
	}
	d.expire()
	d.held[instance] = held{a: a, until: until}
}

// Drop forgets an instance's assignment: its instance failed or is gone.
func (d *Desk) Drop(instance string) {
	if d == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.held, instance)
}

// holds says whether an instance's assignment waits to be taken.
func (d *Desk) holds(instance string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	_, ok := d.held[instance]
	return ok
}

// expire forgets what ran out of time, and taken marks older than a day.
// Called with d.mu held.
func (d *Desk) expire() {
	now := d.clock()
	for id, h := range d.held {
		if now.After(h.until) {
			delete(d.held, id)
		}
	}
	for id, t := range d.taken {
		if now.Sub(t) > 24*time.Hour {
			delete(d.taken, id)
		}
	}
}

func (d *Desk) clock() time.Time {
	if d.now != nil {
		return d.now()
	}
	return time.Now()
}

// ServeHTTP answers a claim: 200 with the sealed assignment; 404 while
// the desk holds none for the instance (not stored yet); 410 once it was
// taken; 403 for a token that does not verify.
func (d *Desk) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	log := d.Logger
	if log == nil {
		log = slog.Default()
	}
	var c Claim
	if err := json.NewDecoder(io.LimitReader(r.Body, maxClaim)).Decode(&c); err != nil || c.Token == "" || c.Key == "" {
		http.Error(w, "a claim is JSON with a token and a key", http.StatusBadRequest)
		return
	}
	key, err := base64.StdEncoding.DecodeString(c.Key)
	if err != nil {
		http.Error(w, "key: not base64", http.StatusBadRequest)
		return
	}
	pub, err := suiteKEM.NewPublicKey(key)
	if err != nil {
		http.Error(w, "key: not an X25519 public key", http.StatusBadRequest)
		return
	}
	instance, err := d.Verify(r.Context(), c.Token, Audience(d.URL, key))
	if err != nil {
		// The reason stays in the manager's log: the caller may be
		// anyone.
		log.Warn("handoff refused: the identity token does not verify", "from", r.RemoteAddr, "err", err)
		d.refuse(r.RemoteAddr, "the proof does not verify: "+err.Error())
		http.Error(w, "the identity token does not verify for this audience", http.StatusForbidden)
		return
	}
	d.mu.Lock()
	d.expire()
	h, ok := d.held[instance]
	_, was := d.taken[instance]
	if ok {
		delete(d.held, instance)
		d.taken[instance] = d.clock()
	}
	d.mu.Unlock()
	switch {
	case was:
		log.Warn("handoff refused: the assignment was taken already", "instance", instance, "from", r.RemoteAddr)
		d.refuse(r.RemoteAddr, "a second claim for "+instance+", whose assignment was taken already")
		http.Error(w, "this instance's assignment was taken already", http.StatusGone)
		return
	case !ok:
		http.Error(w, "no assignment for this instance (yet)", http.StatusNotFound)
		return
	}
	sealed, err := seal(pub, h.a)
	if err != nil {
		log.Error("handoff: sealing the assignment failed", "instance", instance, "err", err)
		http.Error(w, "sealing failed", http.StatusInternalServerError)
		return
	}
	log.Info("assignment handed over", "instance", instance, "runner", h.a.Runner)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_ = json.NewEncoder(w).Encode(map[string]string{"sealed": base64.StdEncoding.EncodeToString(sealed)})
}

// refuse remembers a refused claim for Refusals.
func (d *Desk) refuse(from, why string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.refused) == maxRefusals {
		d.refused = d.refused[1:]
	}
	d.refused = append(d.refused, refusal{at: d.clock(), from: from, why: why})
}

// Refusals says, for the status page, how many claims the desk refused
// since a time and why the last one was: a machine whose claim is refused
// powers off without its runner, which the pool sees only as a runner
// that never came online. Nil when none was.
func (d *Desk) Refusals(since time.Time) []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var n int
	var last refusal
	for _, r := range d.refused {
		if !r.at.Before(since) {
			n++
			last = r
		}
	}
	if n == 0 {
		return nil
	}
	count := strconv.Itoa(n)
	if n == maxRefusals && d.refused[0].at.After(since) {
		count = "at least " + count // the older ones are forgotten
	}
	return []string{fmt.Sprintf("%s machine claims refused at %s since %s; the last at %s from %s: %s",
		count, d.URL, since.Format("15:04"), last.at.Format("15:04:05"), last.from, last.why)}
}

func seal(pub hpke.PublicKey, a bootstrap.Assignment) ([]byte, error) {
	v, err := bootstrap.EncodeAssignment(a)
	if err != nil {
		return nil, err
	}
	return hpke.Seal(pub, suiteKDF, suiteAEAD, sealInfo, []byte(v))
}

// ErrTaken is a desk's answer to an instance whose assignment was taken.
var ErrTaken = errors.New("the manager says this instance's assignment was taken already")

// ClaimFrom is the instance's side: it makes a one-time key, asks the
// cloud for an identity token whose audience binds it (identity), sends
// both to the desk at url and opens what comes back. The key lives only
// in this call. It returns bootstrap.ErrNotYet while the desk has nothing
// for the instance or cannot be reached.
func ClaimFrom(ctx context.Context, c *http.Client, url string, identity func(ctx context.Context, audience string) (string, error)) (bootstrap.Assignment, error) {
	priv, err := suiteKEM.GenerateKey()
	if err != nil {
		return bootstrap.Assignment{}, err
	}
	key := priv.PublicKey().Bytes()
	token, err := identity(ctx, Audience(url, key))
	if err != nil {
		// identity wraps bootstrap.ErrNotYet where asking again may do.
		return bootstrap.Assignment{}, fmt.Errorf("this instance's identity token: %w", err)
	}
	body, _ := json.Marshal(Claim{Token: token, Key: base64.StdEncoding.EncodeToString(key)})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return bootstrap.Assignment{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return bootstrap.Assignment{}, fmt.Errorf("%w: %v", bootstrap.ErrNotYet, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	switch {
	case resp.StatusCode == http.StatusGone:
		return bootstrap.Assignment{}, ErrTaken
	case resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500:
		return bootstrap.Assignment{}, fmt.Errorf("%w: %s answered %s: %s", bootstrap.ErrNotYet, url, resp.Status, bytes.TrimSpace(b))
	case resp.StatusCode != http.StatusOK:
		return bootstrap.Assignment{}, fmt.Errorf("%s answered %s: %s", url, resp.Status, bytes.TrimSpace(b))
	}
	var out struct {
		Sealed string `json:"sealed"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return bootstrap.Assignment{}, fmt.Errorf("%s: %w", url, err)
	}
	sealed, err := base64.StdEncoding.DecodeString(out.Sealed)
	if err != nil {
		return bootstrap.Assignment{}, fmt.Errorf("%s: sealed: %w", url, err)
	}
	v, err := hpke.Open(priv, suiteKDF, suiteAEAD, sealInfo, sealed)
	if err != nil {
		return bootstrap.Assignment{}, fmt.Errorf("%s: the assignment does not open with this instance's key: %w", url, err)
	}
	return bootstrap.DecodeAssignment(string(v))
}
