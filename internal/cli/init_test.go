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

// A process pool's starter names its own forge's agent (each named
// gitea-runner before), and runner_url is named only where a container
// cannot reach the forge's address (each starter named it before).
func TestInitNamesTheForgesAgent(t *testing.T) {
	for _, ft := range forge.Types() {
		d, _ := forge.Lookup(ft)
		agent := d.(forge.Starter).Starter(forge.StarterOptions{}).Agent
		var out bytes.Buffer
		if code := Main([]string{"init", "--forge", ft, "--provider", "process", "--url", "http://127.0.0.1:3000"}, &out, &out); code != 0 {
			t.Fatalf("%s: exit %d: %s", ft, code, out.String())
		}
		if agent == "" || !strings.Contains(out.String(), "# agent: {path: ") || !strings.Contains(out.String(), agent+"}") ||
			ft != "gitea" && strings.Contains(out.String(), "gitea-runner") {
			t.Errorf("%s × process names another forge's agent, or none (want %q):\n%s", ft, agent, out.String())
		}
		if strings.Contains(out.String(), "runner_url") {
			t.Errorf("%s × process names runner_url: a process reaches what the manager reaches", ft)
		}
	}
	for args, want := range map[string]bool{
		"--forge gitea --provider docker --url http://127.0.0.1:3000":     true,
		"--forge gitea --provider docker --url https://gitea.example.com": false,
		"--forge gitea --provider aws --url http://127.0.0.1:3000":        false,
	} {
		var out bytes.Buffer
		Main(append([]string{"init"}, strings.Fields(args)...), &out, &out)
		if got := strings.Contains(out.String(), "runner_url: http://host.docker.internal:3000"); got != want {
			t.Errorf("init %s: runner_url named %v, want %v", args, got, want)
		}
	}
}
