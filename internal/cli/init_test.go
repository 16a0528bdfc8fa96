package cli

import (
	"bytes"
	"strings"
	"testing"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/provider"
)

// Every registered forge and provider has a starter, and what init prints
// for each pair is a config serve takes as printed once the token's
// variable is set: a user's first config never fails on a placeholder.
func TestInitEveryPairIsAValidConfig(t *testing.T) {
	for _, ft := range forge.Types() {
		d, _ := forge.Lookup(ft)
		if _, ok := d.(forge.Starter); !ok {
			t.Errorf("forge %s has no starter config (forge.Starter)", ft)
		}
		for _, pn := range provider.Names() {
			d, _ := provider.Lookup(pn)
			if _, ok := d.(provider.Starter); !ok {
				t.Errorf("provider %s has no starter config (provider.Starter)", pn)
			}
			var out, errb bytes.Buffer
			code := Main([]string{"init", "--forge", ft, "--provider", pn}, &out, &errb)
			if code != 0 {
				t.Errorf("init --forge %s --provider %s: exit %d: %s", ft, pn, code, errb.String())
				continue
			}
			env := tokenEnv(out.String())
			if env == "" {
				t.Errorf("%s × %s: the config names no token variable:\n%s", ft, pn, out.String())
				continue
			}
			t.Setenv(env, "a-token-of-the-user")
			cfg, err := config.Parse(out.Bytes())
			if err != nil {
				t.Errorf("%s × %s: serve would refuse it: %v\n%s", ft, pn, err, out.String())
				continue
			}
			if cfg.Forges[0].Type != ft || cfg.Pools[0].Provider != pn || cfg.Pools[0].Forge != cfg.Forges[0].Name {
				t.Errorf("%s × %s: forge %s, pool's provider %s", ft, pn, cfg.Forges[0].Type, cfg.Pools[0].Provider)
			}
			if !strings.Contains(out.String(), "Set "+env+", then:") {
				t.Errorf("%s × %s: the header does not say to set %s", ft, pn, env)
			}
		}
	}
}

// tokenEnv is the variable the config's token is read from.
func tokenEnv(cfg string) string {
	_, rest, ok := strings.Cut(cfg, "token: ${")
	if !ok {
		return ""
	}
	name, _, _ := strings.Cut(rest, "}")
	return name
}

func TestInitFlags(t *testing.T) {
	var out, errb bytes.Buffer
	code := Main([]string{"init", "--forge", "gitea", "--provider", "docker", "--url", "http://127.0.0.1:3000", "--runner-url", "http://host.docker.internal:3000",
		"--scope", "acme/models", "--image", "runfleet/gitea-runner:cuda12.4", "--pool", "gpu", "--labels", "gpu,linux"}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	t.Setenv("GITEA_TOKEN", "x")
	cfg, err := config.Parse(out.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	f, p := cfg.Forges[0], cfg.Pools[0]
	if f.URL != "http://127.0.0.1:3000" || f.RunnerURL != "http://host.docker.internal:3000" || p.Name != "gpu" || strings.Join(p.Labels, ",") != "gpu,linux" ||
		!strings.Contains(string(p.Section), "runfleet/gitea-runner:cuda12.4") || !strings.Contains(string(f.Section), "acme/models") {
		t.Errorf("forge %+v\npool %+v", f, p)
	}
	for _, c := range []struct{ args, want string }{
		{"--forge jenkins --provider docker", `--forge: "jenkins" is not one of`},
		{"--forge gitea --provider lxd", `--provider: "lxd" is not one of`},
		{"--forge gitea --provider docker --pool GPU", `--pool: "GPU"`},
	} {
		out.Reset()
		errb.Reset()
		if code := Main(append([]string{"init"}, strings.Fields(c.args)...), &out, &errb); code != ExitUsage || !strings.Contains(errb.String(), c.want) || out.Len() != 0 {
			t.Errorf("init %s: exit %d, %q; stdout %q", c.args, code, errb.String(), out.String())
		}
	}
}
