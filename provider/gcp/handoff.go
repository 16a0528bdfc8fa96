package gcp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"time"

	"cloud.google.com/go/compute/metadata"
	"google.golang.org/api/idtoken"
	"google.golang.org/api/option"

	"github.com/runfleet/runfleet/bootstrap"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
)

// The handoff through the manager, for a pool with handoff_url. An
// instance's metadata is readable for its whole life, by any process on
// it (a job step included) and by anyone with compute.instances.get, so
// it holds no credential: the startup-script is the pool's. Compute
// Engine has no secret store entry only one instance can read (all of a
// pool's instances share a service account, and Secret Manager's
// permissions go by account), so the instance proves who it is to the
// manager with its identity token, which Google signs for that instance
// alone (instance_id among its claims), and takes its assignment once
// (vm.Desk). Cf. Compute Engine's "Verifying the identity of instances".

// SourceIdentity names the handoff in a plan.
const SourceIdentity = "gce-identity"

// HandoffWait is how long an instance waits for its assignment; the
// manager holds it a little longer.
const HandoffWait = 10 * time.Minute

// Issuers are the iss an identity token of Google's carries.
var issuers = []string{"https://accounts.google.com", "accounts.google.com"}

// HandoffHandler is the desk the manager serves at /handoff/<pool>; nil
// without handoff_url.
func (p *Provider) HandoffHandler() http.Handler { return p.desk.Handler() }

// hold keeps the runner's assignment for the instance of that name in
// that zone, from before it is asked for: a name is one instance's in a
// zone while it lives, and only that instance gets an identity token
// that names it there. (The instance id, which the token names too, is
// not known before a bulk insert's instances are listed.)
func (p *Provider) hold(zone, name string, spec provider.Spec) {
	if p.desk != nil {
		p.desk.Hold(deskKey(zone, name), p.boot(nil).Assign(spec), p.opt.now().Add(HandoffWait+5*time.Minute))
	}
}

// drop forgets the assignment held for an instance that was not made.
func (p *Provider) drop(zone, name string) {
	if p.desk != nil {
		p.desk.Drop(deskKey(zone, name))
	}
}

func deskKey(zone, name string) string { return zone + "/" + name }

// Verifier checks a Google-signed identity token.
type Verifier interface {
	Validate(ctx context.Context, token, audience string) (*idtoken.Payload, error)
}

// GoogleCerts is where Google publishes the keys it signs identity
// tokens with, which idtoken fetches.
const GoogleCerts = "https://www.googleapis.com/oauth2/v3/certs"

// NewVerifier checks tokens against Google's published keys, fetched
// from certs (GoogleCerts when empty).
func NewVerifier(ctx context.Context, certs string) (Verifier, error) {
	c := &http.Client{Timeout: 30 * time.Second}
	if certs != "" && certs != GoogleCerts {
		c.Transport = mirror{to: certs}
	}
	return idtoken.NewValidator(ctx, option.WithHTTPClient(c))
}

// mirror sends idtoken's request for Google's keys to another URL:
// idtoken names Google's own and takes no other.
type mirror struct{ to string }

func (m mirror) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.String() != GoogleCerts {
		return nil, fmt.Errorf("not fetched: %s (only Google's keys are)", r.URL)
	}
	u, err := url.Parse(m.to)
	if err != nil {
		return nil, err
	}
	r = r.Clone(r.Context())
	r.URL, r.Host = u, u.Host
	return http.DefaultTransport.RoundTrip(r)
}

// verify checks an instance's identity token: signed by Google for the
// audience (idtoken, which checks the signature, the audience and the
// expiry), issued by Google, for an instance of this project; it returns
// the instance's zone and name (deskKey).
func verify(ctx context.Context, v Verifier, project, token, audience string) (string, error) {
	pl, err := v.Validate(ctx, token, audience)
	if err != nil {
		return "", err
	}
	if !slices.Contains(issuers, pl.Issuer) {
		return "", fmt.Errorf("issued by %q, not Google", pl.Issuer)
	}
	g, _ := pl.Claims["google"].(map[string]any)
	ce, _ := g["compute_engine"].(map[string]any)
	zone, _ := ce["zone"].(string)
	name, _ := ce["instance_name"].(string)
	if pid, _ := ce["project_id"].(string); zone == "" || name == "" || pid != project {
		return "", fmt.Errorf("the token names no instance of project %s (format=full)", project)
	}
	return deskKey(zone, name), nil
}

// identitySource is the instance side: the instance's identity token
// from its metadata server, for vm.ClaimFrom.
type identitySource struct{ c *http.Client }

func init() {
	bootstrap.RegisterSource(SourceIdentity, func() bootstrap.Source {
		return identitySource{c: &http.Client{Timeout: 30 * time.Second}}
	})
}

func (is identitySource) Take(ctx context.Context, h bootstrap.Handoff) (bootstrap.Assignment, error) {
	md := NewMetadata()
	return vm.ClaimFrom(ctx, is.c, h.Params["url"], func(ctx context.Context, audience string) (string, error) {
		tok, err := md.c.GetWithContext(ctx, "instance/service-accounts/default/identity?format=full&audience="+url.QueryEscape(audience))
		var nd metadata.NotDefinedError
		if errors.As(err, &nd) {
			// No service account: nothing here can prove who it is.
			return "", fmt.Errorf("this instance has no service account, so no identity token (the pool's service_account): %w", err)
		}
		if err != nil {
			return "", fmt.Errorf("%w: %v", bootstrap.ErrNotYet, err)
		}
		return tok, nil
	})
}
