package cli

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/version"
)

// TestRunnerHelpListsEveryCMLOption: every option of `cml runner launch`
// is accepted by `runfleet runner` and by `runfleet runner launch`, and
// --help lists each one CML lists.
func TestRunnerHelpListsEveryCMLOption(t *testing.T) {
	for _, args := range [][]string{{"runner", "--help"}, {"runner", "launch", "--help"}} {
		var out bytes.Buffer
		if code := Main(args, &out, &out); code != 0 {
			t.Fatalf("%v: exit %d\n%s", args, code, out.String())
		}
		for _, o := range cmlOptions {
			listed := strings.Contains(out.String(), "--"+o.name+" ")
			if listed == (o.ignored != "") {
				t.Errorf("%v: --%s listed %v, want %v", args, o.name, listed, o.ignored == "")
			}
		}
	}
}

// parseRunner parses args as `runfleet runner` would, with env as the
// environment.
func parseRunner(t *testing.T, args []string, env map[string]string) (runnerSettings, error) {
	t.Helper()
	cmd := runnerCmd()
	if err := cmd.Flags().Parse(cmlArrays(append([]string{"runner"}, args...))[1:]); err != nil {
		return runnerSettings{}, err
	}
	return resolveRunner(cmd.Flags(), func(k string) (string, bool) { v, ok := env[k]; return v, ok })
}

// TestRunnerFlagsAndEnvironment maps each CML option, each of its
// spellings and each variable CML reads for it to the same setting, with
// CML's precedence.
func TestRunnerFlagsAndEnvironment(t *testing.T) {
	defaults := runnerSettings{Labels: []string{"cml"}, IdleTimeout: 5 * time.Minute, Log: "info"}
	type tc struct {
		args []string
		env  map[string]string
		want func(*runnerSettings)
	}
	cases := map[string]tc{
		"defaults": {want: func(*runnerSettings) {}},
	}
	add := func(name string, flag []string, envs []string, val string, want func(*runnerSettings)) {
		if len(flag) > 0 {
			cases[name+" "+strings.Join(flag, " ")] = tc{args: flag, want: want}
		}
		for _, e := range envs {
			cases[name+" "+e] = tc{env: map[string]string{e: val}, want: want}
		}
	}
	add("labels", []string{"--labels", "gpu,a100, gpu"}, []string{"CML_RUNNER_LABELS", "RUNNER_LABELS"}, "gpu,a100, gpu", func(s *runnerSettings) { s.Labels = []string{"gpu", "a100"} })
	add("idle seconds", []string{"--idle-timeout", "90"}, []string{"CML_RUNNER_IDLE_TIMEOUT", "RUNNER_IDLE_TIMEOUT"}, "90", func(s *runnerSettings) { s.IdleTimeout = 90 * time.Second })
	// CML reads a time with the timestring package.
	for in, d := range map[string]time.Duration{"5min": 5 * time.Minute, "5 minutes": 5 * time.Minute, "1h30m": 90 * time.Minute, "2m30s": 150 * time.Second,
		"1 hour": time.Hour, "2d": 48 * time.Hour, "1.5h": 90 * time.Minute, "3mins": 3 * time.Minute} {
		add("idle "+in, []string{"--idle-timeout", in}, []string{"CML_RUNNER_IDLE_TIMEOUT"}, in, func(s *runnerSettings) { s.IdleTimeout = d })
	}
	add("idle =-1", []string{"--idle-timeout=-1"}, nil, "", func(s *runnerSettings) { s.IdleTimeout = 0 })
	for _, never := range []string{"never", "0", "-1"} {
		add("idle "+never, []string{"--idle-timeout", never}, []string{"CML_RUNNER_IDLE_TIMEOUT", "RUNNER_IDLE_TIMEOUT"}, never, func(s *runnerSettings) { s.IdleTimeout = 0 })
	}
	add("name", []string{"--name", "trainer"}, []string{"CML_RUNNER_NAME"}, "trainer", func(s *runnerSettings) { s.Name = "trainer" })
	add("single", []string{"--single"}, []string{"CML_RUNNER_SINGLE", "RUNNER_SINGLE"}, "true", func(s *runnerSettings) { s.Single = true })
	add("reuse", []string{"--reuse"}, []string{"CML_RUNNER_REUSE", "RUNNER_REUSE"}, "true", func(s *runnerSettings) { s.Reuse = true })
	add("reuse-idle", []string{"--reuse-idle"}, []string{"CML_RUNNER_REUSE_IDLE"}, "true", func(s *runnerSettings) { s.ReuseIdle = true })
	add("no-retry", []string{"--no-retry"}, []string{"CML_RUNNER_NO_RETRY", "RUNNER_NO_RETRY"}, "true", func(s *runnerSettings) { s.NoRetry = true })
	add("workdir", []string{"--workdir", "/srv/cml"}, []string{"CML_RUNNER_WORKDIR", "CML_RUNNER_PATH", "RUNNER_PATH"}, "/srv/cml", func(s *runnerSettings) { s.Workdir = "/srv/cml" })
	add("path", []string{"--path", "/srv/cml"}, nil, "", func(s *runnerSettings) { s.Workdir = "/srv/cml" })
	add("docker-volumes", []string{"--docker-volumes", "/data:/data", "--docker-volumes", "/out:/out:rw"}, []string{"CML_RUNNER_DOCKER_VOLUMES"}, "/data:/data,/out:/out:rw", func(s *runnerSettings) { s.DockerVolumes = []string{"/data:/data", "/out:/out:rw"} })
	add("docker-volumes greedy", []string{"--docker-volumes", "/data:/data", "/out:/out:rw", "--single"}, nil, "", func(s *runnerSettings) {
		s.DockerVolumes, s.Single = []string{"/data:/data", "/out:/out:rw"}, true
	})
	add("driver", []string{"--driver", "github"}, []string{"CML_DRIVER", "CML_RUNNER_DRIVER", "RUNNER_DRIVER"}, "github", func(s *runnerSettings) { s.Driver = "github" })
	add("repo", []string{"--repo", "https://github.com/acme/app"}, []string{"CML_REPO", "CML_RUNNER_REPO", "RUNNER_REPO"}, "https://github.com/acme/app", func(s *runnerSettings) { s.Repo = "https://github.com/acme/app" })
	for _, flag := range []string{"--token", "--driver-token"} {
		add("token", []string{flag, "t0k"}, []string{"CML_TOKEN", "CML_DRIVER_TOKEN", "CML_RUNNER_TOKEN", "CML_RUNNER_DRIVER_TOKEN",
			"REPO_TOKEN", "repo_token", "GITHUB_TOKEN", "GITLAB_TOKEN", "BITBUCKET_TOKEN"}, "t0k", func(s *runnerSettings) { s.Token = "t0k" })
	}
	// A token from a secret store or a file's variable keeps no newline.
	add("token trimmed", nil, []string{"REPO_TOKEN", "CML_TOKEN"}, "t0k\n", func(s *runnerSettings) { s.Token = "t0k" })
	add("log", []string{"--log", "debug"}, []string{"CML_LOG", "CML_RUNNER_LOG"}, "debug", func(s *runnerSettings) { s.Log = "debug" })
	add("cloud", []string{"--cloud", "aws"}, []string{"CML_RUNNER_CLOUD"}, "aws", func(s *runnerSettings) { s.Cloud = map[string]string{"cloud": "aws"} })
	add("cloud-spot", []string{"--cloud-spot"}, []string{"CML_RUNNER_CLOUD_SPOT"}, "true", func(s *runnerSettings) { s.Cloud = map[string]string{"cloud-spot": "true"} })
	add("cloud-spot-price", []string{"--cloud-spot-price", "-1"}, []string{"CML_RUNNER_CLOUD_SPOT_PRICE"}, "-1", func(s *runnerSettings) { s.Cloud = map[string]string{"cloud-spot-price": "-1"} })
	add("cloud-aws-subnet", []string{"--cloud-aws-subnet", "subnet-1"}, []string{"CML_RUNNER_CLOUD_AWS_SUBNET", "CML_RUNNER_CLOUD_AWS_SUBNET_ID"}, "subnet-1", func(s *runnerSettings) { s.Cloud = map[string]string{"cloud-aws-subnet": "subnet-1"} })
	add("cloud-aws-subnet-id", []string{"--cloud-aws-subnet-id", "subnet-1"}, nil, "", func(s *runnerSettings) { s.Cloud = map[string]string{"cloud-aws-subnet": "subnet-1"} })
	// --cloud-gpu: nogpu is none, tesla is v100 (with CML's warning).
	add("cloud-gpu nogpu", []string{"--cloud-gpu", "nogpu"}, []string{"CML_RUNNER_CLOUD_GPU"}, "nogpu", func(s *runnerSettings) {})
	add("cloud-gpu tesla", []string{"--cloud-gpu", "tesla"}, []string{"CML_RUNNER_CLOUD_GPU"}, "tesla", func(s *runnerSettings) {
		s.Cloud = map[string]string{"cloud-gpu": "v100"}
		s.Warnings = []string{`--cloud-gpu: GPU model "tesla" has been deprecated (as in CML); taking "v100"`}
	})
	// Key=value lists split at the first "=", never at a comma; several
	// flags, or several values after one.
	add("cloud-metadata", []string{"--cloud-metadata", "key=a,b", "--cloud-metadata", "url=http://x/?a=b"}, nil, "", func(s *runnerSettings) {
		s.Metadata = map[string]string{"key": "a,b", "url": "http://x/?a=b"}
	})
	add("cloud-metadata env", nil, []string{"CML_RUNNER_CLOUD_METADATA"}, "key=a,b", func(s *runnerSettings) { s.Metadata = map[string]string{"key": "a,b"} })
	add("cloud-metadata greedy", []string{"--cloud-metadata", "a=1", "b=2", "--single"}, nil, "", func(s *runnerSettings) {
		s.Metadata, s.Single = map[string]string{"a": "1", "b": "2"}, true
	})
	add("node selector", []string{"--cloud-kubernetes-node-selector=disktype=ssd", "--cloud-kubernetes-node-selector", "ram=huge", "--cloud-kubernetes-node-selector", "ram=big"}, nil, "", func(s *runnerSettings) {
		s.NodeSelector = map[string]string{"disktype": "ssd", "ram": "big"}
	})
	// CML's hidden options are taken and noted, not refused.
	for _, h := range [][]string{{"--tpi-version", "= 0.10.4"}, {"--cml-version", "0.20.6"}, {"--destroy-delay", "30"}, {"--tf-resource", "e30="}, {"--tf_resource", "e30="},
		{"--gcp-access-token", "ya29.x"}, {"--runner-path", "/opt/r"}} {
		add("hidden", h, nil, "", func(s *runnerSettings) {
			s.Ignored = []string{h[0] + " (" + cmlOptionNamed(strings.ReplaceAll(strings.TrimPrefix(h[0], "--"), "_", "-")).ignored + ")"}
		})
	}
	// Precedence, as bin/cml.js sets it: the flag, then CML's global
	// variable, then the legacy RUNNER_*, then CML_RUNNER_*.
	cases["flag wins"] = tc{args: []string{"--labels", "a"}, env: map[string]string{"CML_RUNNER_LABELS": "b", "RUNNER_LABELS": "c"}, want: func(s *runnerSettings) { s.Labels = []string{"a"} }}
	cases["legacy over CML_RUNNER"] = tc{env: map[string]string{"CML_RUNNER_LABELS": "b", "RUNNER_LABELS": "c"}, want: func(s *runnerSettings) { s.Labels = []string{"c"} }}
	cases["CML_REPO over RUNNER_REPO"] = tc{env: map[string]string{"CML_REPO": "https://a/b/c", "RUNNER_REPO": "https://d/e/f"}, want: func(s *runnerSettings) { s.Repo = "https://a/b/c" }}
	cases["CML_TOKEN over REPO_TOKEN"] = tc{env: map[string]string{"CML_TOKEN": "cml", "REPO_TOKEN": "repo"}, want: func(s *runnerSettings) { s.Token = "cml" }}
	cases["REPO_TOKEN over GITHUB_TOKEN"] = tc{env: map[string]string{"GITHUB_TOKEN": "gh", "REPO_TOKEN": "repo"}, want: func(s *runnerSettings) { s.Token = "repo" }}
	cases["RUNNER_NAME ignored"] = tc{env: map[string]string{"RUNNER_NAME": "GitHub Actions 2"}, want: func(s *runnerSettings) {
		s.Warnings = []string{"ignoring the RUNNER_NAME variable: use CML_RUNNER_NAME or --name instead"}
	}}

	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			got, err := parseRunner(t, c.args, c.env)
			if err != nil {
				t.Fatal(err)
			}
			want := defaults
			want.Labels = append([]string(nil), defaults.Labels...)
			c.want(&want)
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("got  %+v\nwant %+v", got, want)
			}
		})
	}
}

// What CML refuses is refused, with its reason; what it accepts is not.
func TestRunnerRefusesWhatCMLRefuses(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"--single", "--reuse"}, nil, "--single and --reuse: cannot be used together, as in CML (arguments single and reuse are mutually exclusive)"},
		{[]string{"--single", "--reuse-idle"}, nil, "--single and --reuse-idle: cannot be used together"},
		{[]string{"--reuse", "--reuse-idle"}, nil, "--reuse and --reuse-idle: cannot be used together"},
		{[]string{"--reuse"}, map[string]string{"RUNNER_SINGLE": "true"}, "RUNNER_SINGLE and --reuse: cannot be used together"},
		{[]string{"--cloud", "ibm"}, nil, `--cloud: "ibm" is not one of aws, azure, gcp, kubernetes`},
		{[]string{"--log", "trace"}, nil, `--log: "trace" is not one of error, warn, info, debug`},
		{[]string{"--cloud-hdd-size", "big"}, nil, `--cloud-hdd-size: "big" is not a number`},
		{nil, map[string]string{"CML_RUNNER_CLOUD_SPOT_PRICE": "cheap"}, `CML_RUNNER_CLOUD_SPOT_PRICE: "cheap" is not a number`},
		{[]string{"--idle-timeout", "soon"}, nil, `--idle-timeout: "soon" is not seconds, a time (5min, 1h30m) or never`},
		{[]string{"--idle-timeout", "5 fortnights"}, nil, `"fortnights" is not a unit of time`},
		{[]string{"--single=maybe"}, nil, "invalid argument"},
	} {
		_, err := parseRunner(t, tc.args, tc.env)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v %v: %v, want %q", tc.args, tc.env, err, tc.want)
		}
	}
}

// Bad input to `runfleet runner` exits 2 with a line that names the
// option, and never prints the token.
func TestRunnerBadInput(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--idle-timeout", "soon"}, `--idle-timeout: "soon" is not seconds`},
		{[]string{"--single=maybe"}, "invalid argument"},
		{[]string{"--cloud", "ibm", "--repo", "https://github.com/a/b", "--token", "tok-secret-123"}, `--cloud: "ibm" is not one of aws, azure, gcp, kubernetes`},
		{[]string{"--cloud", "aws", "--cloud-image", "ami-0123456789abcdef0", "--cloud-type", "m+h100", "--repo", "https://github.com/a/b", "--token", "tok-secret-123"}, `--cloud-type: "m+h100" is not one of CML's sizes`},
		{[]string{"--repo", "https://example.com/a/b", "--token", "tok-secret-123"}, "--driver: cannot tell the forge of https://example.com/a/b; pass --driver (azure-pipelines, bitbucket, gitea, github or gitlab)"},
		{[]string{"--repo", "https://example.com/a/b", "--token", "tok-secret-123", "--driver", "bitbucket-server"}, `--driver: "bitbucket-server" is not one of github, gitlab, bitbucket, gitea, azure-pipelines`},
		{[]string{"--repo", "https://github.com/a/b", "--token", "tok-secret-123", "--name", "Bad_Name"}, `--name: "Bad_Name" is not a valid name`},
		{[]string{"launch", "--repo", "https://github.com/a/b", "--token", "tok-secret-123", "--single", "--reuse"}, "--single and --reuse: cannot be used together"},
	} {
		var out bytes.Buffer
		code := Main(append([]string{"runner"}, tc.args...), &out, &out)
		if code != ExitUsage || !strings.Contains(out.String(), tc.want) {
			t.Errorf("runner %v: exit %d\n%s\nwant exit 2 and %q", tc.args, code, out.String(), tc.want)
		}
		if strings.Contains(out.String(), "tok-secret-123") {
			t.Errorf("runner %v printed the token", tc.args)
		}
	}
}

// cmlArrays gives an array option the words after it, up to the next
// flag, as yargs does, and leaves everything else as it was.
func TestCMLArrays(t *testing.T) {
	for in, want := range map[string]string{
		"runner --cloud-metadata a=1 b=2 --single":                   "runner --cloud-metadata a=1 --cloud-metadata=b=2 --single",
		"runner launch --cloud-metadata=a=1 b=2":                     "runner launch --cloud-metadata=a=1 --cloud-metadata=b=2",
		"--log-level debug runner --docker-volumes /a:/a /b:/b":      "--log-level debug runner --docker-volumes /a:/a --docker-volumes=/b:/b",
		"runner --labels a b":                                        "runner --labels a b",
		"status -c f.yaml":                                           "status -c f.yaml",
		"runner --cloud-kubernetes-node-selector gpu=infer --name x": "runner --cloud-kubernetes-node-selector gpu=infer --name x",
	} {
		if got := strings.Join(cmlArrays(strings.Fields(in)), " "); got != want {
			t.Errorf("%s:\n got %s\nwant %s", in, got, want)
		}
	}
}

// cmlOptionNamed returns the option of that name.
func cmlOptionNamed(name string) cmlOption {
	i := slices.IndexFunc(cmlOptions, func(o cmlOption) bool { return o.name == name })
	return cmlOptions[i]
}

// --cloud=kubernetes without --cloud-image: GitHub's and GitLab's own
// runner images; for Gitea, CML's image with gitea-runner fetched by the
// pod (its checksum read now, from the list beside it, and no runfleet
// release wanted, which a development build has none of); for a forge
// with neither, --cloud-image is required.
func TestRunnerKubernetesDefaultImage(t *testing.T) {
	sum := strings.Repeat("cd", 32)
	mirror := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/gitea-runner-1.0.8-linux-amd64.sha256" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprintf(w, "%s  gitea-runner-1.0.8-linux-amd64\n", sum)
	}))
	defer mirror.Close()
	for _, tc := range []struct {
		driver, image string
		stock         bool
		err           string
	}{
		{"github", "ghcr.io/actions/actions-runner:2.337.0", false, ""},
		{"gitlab", "gitlab/gitlab-runner:v18.6.0", false, ""},
		{"gitea", "", true, ""},
		{"azure-pipelines", "", false, "--cloud-image: is required with --driver azure-pipelines"},
		{"bitbucket", "", false, "--cloud-image: is required with --driver bitbucket on Kubernetes"},
	} {
		t.Run(tc.driver, func(t *testing.T) {
			s := runnerSettings{Driver: tc.driver, AgentURL: mirror.URL, Cloud: map[string]string{"cloud": "kubernetes"}}
			if got := agentImage(s); got != tc.image {
				t.Errorf("image %q, want %q", got, tc.image)
			}
			stock, path, err := stockInstall(context.Background(), s, func(string) (string, bool) { return "", false })
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Errorf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if (stock != nil) != tc.stock {
				t.Fatalf("stock %+v", stock)
			}
			if tc.stock && (stock.AgentURL != mirror.URL+"/gitea-runner-1.0.8-linux-amd64" || stock.AgentSHA256 != sum || stock.RunfleetURL != "" ||
				path != "/opt/runfleet/agent/gitea-runner-1.0.8-linux-amd64") {
				t.Errorf("stock %+v, agent at %s", stock, path)
			}
			// --cloud-image wins over both.
			s.Cloud["cloud-image"] = "mine:1"
			if agentImage(s) != "" {
				t.Error("--cloud-image did not win")
			}
			if stock, _, _ := stockInstall(context.Background(), s, nil); stock != nil {
				t.Error("--cloud-image did not win")
			}
		})
	}
}

// cml.dev's Bitbucket example on a cloud without --cloud-image: the
// machine installs runfleet (its checksum read from the release's
// SHA256SUMS) and Docker, and the pool runs Atlassian's runner image, as
// CML does; the runner is found from Bitbucket Pipelines' variables.
func TestRunnerBitbucketStock(t *testing.T) {
	sum := strings.Repeat("ef", 32)
	rel := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/SHA256SUMS" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprintf(w, "%s  runfleet-%s-linux-amd64\n", sum, version.Get().Version)
	}))
	defer rel.Close()
	env := map[string]string{"RUNFLEET_RELEASE_URL": rel.URL, "BITBUCKET_GIT_HTTP_ORIGIN": "http://bitbucket.org/acme/models"}
	getenv := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	if got := inferRepo(getenv); got != "http://bitbucket.org/acme/models" {
		t.Errorf("repository %q, want Bitbucket's origin", got)
	}
	s := runnerSettings{Driver: "bitbucket", Cloud: map[string]string{"cloud": "aws"}}
	stock, path, err := stockInstall(context.Background(), s, getenv)
	if err != nil {
		t.Fatal(err)
	}
	want := provider.Stock{RunfleetURL: rel.URL + "/runfleet-" + version.Get().Version + "-linux-amd64", RunfleetSHA256: sum, Docker: true}
	if stock == nil || *stock != want || path != "docker://docker-public.packages.atlassian.com/sox/atlassian/bitbucket-pipelines-runner:1" {
		t.Errorf("stock %+v, agent %q; want %+v and Atlassian's image", stock, path, want)
	}
}
