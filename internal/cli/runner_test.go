package cli

import (
	"bytes"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestRunnerHelpListsEveryCMLOption: every option of `cml runner launch`
// is accepted by `runfleet runner`.
func TestRunnerHelpListsEveryCMLOption(t *testing.T) {
	var out bytes.Buffer
	if code := Main([]string{"runner", "--help"}, &out, &out); code != 0 {
		t.Fatalf("exit %d\n%s", code, out.String())
	}
	for _, opt := range []string{"labels", "idle-timeout", "name", "single", "reuse", "reuse-idle", "no-retry", "docker-volumes", "driver", "repo", "token", "log",
		"cloud", "cloud-region", "cloud-type", "cloud-permission-set", "cloud-metadata", "cloud-gpu", "cloud-hdd-size", "cloud-ssh-private", "cloud-spot", "cloud-spot-price",
		"cloud-startup-script", "cloud-aws-security-group", "cloud-aws-subnet", "cloud-image", "cloud-kubernetes-node-selector"} {
		if !strings.Contains(out.String(), "--"+opt+" ") {
			t.Errorf("--%s missing from runner --help", opt)
		}
	}
}

// TestRunnerFlagsAndEnvironment maps each CML flag and each environment
// variable to the same setting.
func TestRunnerFlagsAndEnvironment(t *testing.T) {
	defaults := runnerSettings{Labels: []string{"cml"}, IdleTimeout: 5 * time.Minute}
	type tc struct {
		args []string
		env  map[string]string
		want func(*runnerSettings)
	}
	cases := map[string]tc{
		"defaults": {want: func(*runnerSettings) {}},
	}
	add := func(name string, flag []string, envs []string, val string, want func(*runnerSettings)) {
		cases[name+" flag"] = tc{args: flag, want: want}
		for _, e := range envs {
			cases[name+" "+e] = tc{env: map[string]string{e: val}, want: want}
		}
	}
	add("labels", []string{"--labels", "gpu,a100, gpu"}, []string{"CML_RUNNER_LABELS", "RUNNER_LABELS"}, "gpu,a100, gpu", func(s *runnerSettings) { s.Labels = []string{"gpu", "a100"} })
	add("idle seconds", []string{"--idle-timeout", "90"}, []string{"CML_RUNNER_IDLE_TIMEOUT", "RUNNER_IDLE_TIMEOUT"}, "90", func(s *runnerSettings) { s.IdleTimeout = 90 * time.Second })
	add("idle duration", []string{"--idle-timeout", "2m30s"}, []string{"CML_RUNNER_IDLE_TIMEOUT"}, "2m30s", func(s *runnerSettings) { s.IdleTimeout = 150 * time.Second })
	for _, never := range []string{"never", "0", "-1"} {
		add("idle "+never, []string{"--idle-timeout", never}, []string{"CML_RUNNER_IDLE_TIMEOUT", "RUNNER_IDLE_TIMEOUT"}, never, func(s *runnerSettings) { s.IdleTimeout = 0 })
	}
	add("name", []string{"--name", "trainer"}, []string{"CML_RUNNER_NAME"}, "trainer", func(s *runnerSettings) { s.Name = "trainer" })
	add("single", []string{"--single"}, []string{"CML_RUNNER_SINGLE", "RUNNER_SINGLE"}, "true", func(s *runnerSettings) { s.Single = true })
	add("reuse", []string{"--reuse"}, []string{"CML_RUNNER_REUSE", "RUNNER_REUSE"}, "true", func(s *runnerSettings) { s.Reuse = true })
	add("reuse-idle", []string{"--reuse-idle"}, []string{"CML_RUNNER_REUSE_IDLE"}, "true", func(s *runnerSettings) { s.ReuseIdle = true })
	add("no-retry", []string{"--no-retry"}, []string{"CML_RUNNER_NO_RETRY", "RUNNER_NO_RETRY"}, "true", func(s *runnerSettings) { s.NoRetry = true })
	add("docker-volumes", []string{"--docker-volumes", "/data:/data", "--docker-volumes", "/out:/out:rw"}, []string{"CML_RUNNER_DOCKER_VOLUMES"}, "/data:/data,/out:/out:rw", func(s *runnerSettings) { s.DockerVolumes = []string{"/data:/data", "/out:/out:rw"} })
	add("driver", []string{"--driver", "github"}, []string{"CML_RUNNER_DRIVER", "RUNNER_DRIVER"}, "github", func(s *runnerSettings) { s.Driver = "github" })
	add("repo", []string{"--repo", "https://github.com/acme/app"}, []string{"CML_RUNNER_REPO", "RUNNER_REPO"}, "https://github.com/acme/app", func(s *runnerSettings) { s.Repo = "https://github.com/acme/app" })
	add("token", []string{"--token", "t0k"}, []string{"CML_RUNNER_TOKEN", "REPO_TOKEN", "repo_token", "GITHUB_TOKEN", "GITLAB_TOKEN"}, "t0k", func(s *runnerSettings) { s.Token = "t0k" })
	add("log", []string{"--log", "debug"}, []string{"CML_RUNNER_LOG"}, "debug", func(s *runnerSettings) { s.Log = "debug" })
	add("cloud", []string{"--cloud", "aws"}, []string{"CML_RUNNER_CLOUD"}, "aws", func(s *runnerSettings) { s.Cloud = map[string]string{"cloud": "aws"} })
	add("cloud-spot", []string{"--cloud-spot"}, []string{"CML_RUNNER_CLOUD_SPOT"}, "true", func(s *runnerSettings) { s.Cloud = map[string]string{"cloud-spot": "true"} })
	// Precedence: the flag over CML_RUNNER_* over RUNNER_*.
	cases["flag wins"] = tc{args: []string{"--labels", "a"}, env: map[string]string{"CML_RUNNER_LABELS": "b", "RUNNER_LABELS": "c"}, want: func(s *runnerSettings) { s.Labels = []string{"a"} }}
	cases["CML_RUNNER wins"] = tc{env: map[string]string{"CML_RUNNER_LABELS": "b", "RUNNER_LABELS": "c"}, want: func(s *runnerSettings) { s.Labels = []string{"b"} }}
	cases["REPO_TOKEN over GITHUB_TOKEN"] = tc{env: map[string]string{"GITHUB_TOKEN": "gh", "REPO_TOKEN": "repo"}, want: func(s *runnerSettings) { s.Token = "repo" }}

	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			cmd := runnerCmd()
			if err := cmd.Flags().Parse(c.args); err != nil {
				t.Fatal(err)
			}
			got, err := resolveRunner(cmd.Flags(), func(k string) (string, bool) { v, ok := c.env[k]; return v, ok })
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

func TestRunnerBadInput(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--idle-timeout", "soon"}, `--idle-timeout: "soon" is not seconds`},
		{[]string{"--single=maybe"}, "invalid argument"},
		{[]string{"--cloud", "ibm", "--repo", "https://github.com/a/b", "--token", "tok-secret-123"}, `--cloud: "ibm" is not a cloud of this build`},
		{[]string{"--cloud", "aws", "--repo", "https://github.com/a/b", "--token", "tok-secret-123"}, `--cloud-image: is required with --cloud=aws`},
		{[]string{"--cloud", "aws", "--cloud-image", "ami-0123456789abcdef0", "--cloud-type", "m+h100", "--repo", "https://github.com/a/b", "--token", "tok-secret-123"}, `--cloud-type: "m+h100" is not one of CML's sizes`},
		{[]string{"--repo", "https://example.com/a/b", "--token", "tok-secret-123"}, "--driver: cannot tell the forge of https://example.com/a/b; pass --driver (azure-pipelines, bitbucket, gitea, github or gitlab)"},
		{[]string{"--repo", "https://example.com/a/b", "--token", "tok-secret-123", "--driver", "bitbucket-server"}, "--driver: bitbucket-server is not supported by this build yet (azure-pipelines, bitbucket, gitea, github, gitlab)"},
		// GitLab told by its host; its agent is looked for in PATH.
		{[]string{"--repo", "https://gitlab.com/a/b", "--token", "tok-secret-123", "--agent", "no-such-gitlab-runner"}, `agent.path: "no-such-gitlab-runner"`},
		{[]string{"--repo", "https://github.com/a/b", "--token", "tok-secret-123", "--docker-volumes", "/a:/a"}, "--docker-volumes: needs --docker"},
		{[]string{"--repo", "https://github.com/a/b", "--token", "tok-secret-123", "--name", "Bad_Name"}, `--name: "Bad_Name" is not a valid name`},
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
