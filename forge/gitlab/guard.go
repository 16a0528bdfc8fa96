package gitlab

import (
	"bytes"
	"fmt"
	"strings"
	"time"

	"github.com/BurntSushi/toml"
)

// guardWait is how long a job's first command waits for its runner's
// token to die before the job fails: the manager resets the token within
// a pass of the runner taking its job, or, down, once it is back.
const guardWait = 10 * time.Minute

// runnerConfig is the config.toml gitlab-runner's --runner reads (the
// [[runners]] of common/config.go): the runner's name, URL, token and
// executor, and the hooks that hold the job until the token is dead.
func runnerConfig(name, url, token, executor string) ([]byte, error) {
	guard := tokenGuard(name)
	type runner struct {
		Name                string `toml:"name"`
		URL                 string `toml:"url"`
		Token               string `toml:"token"`
		Executor            string `toml:"executor"`
		PreGetSourcesScript string `toml:"pre_get_sources_script"`
		PreBuildScript      string `toml:"pre_build_script"`
	}
	var b bytes.Buffer
	err := toml.NewEncoder(&b).Encode(struct {
		Runners []runner `toml:"runners"`
	}{[]runner{{name, url, token, executor, guard, guard}}})
	if err != nil {
		return nil, fmt.Errorf("writing its config: %w", err)
	}
	return b.Bytes(), nil
}

// tokenGuard is the shell the runner runs before anything of its job's:
// as pre_get_sources_script, the first of the get_sources stage, before
// the job's own hooks and git (which a job's variables can make run a
// command: GIT_FETCH_EXTRA_FLAGS); and as pre_build_script, the first of
// step_script, for jobs whose GIT_STRATEGY none or empty skips
// get_sources and its hooks (shells/abstract.go,
// guardGetSourcesScriptHooks). Job variables are exported before it.
//
// It finds gitlab-runner among its ancestors (the process whose working
// directory holds ConfigFile) and asks it to verify the token in that
// file, until GitLab refuses it ("is not valid", network/gitlab.go
// VerifyRunner: a 403) or guardWait passes. The token's reset
// (Forge.Cordon) is what lets the job on, so nothing the job runs can
// find a live token, in the file, in gitlab-runner's memory or anywhere.
// http_proxy is dropped for the check: where GitLab's URL is plain HTTP a
// proxy chosen by the job's variables would read the token.
func tokenGuard(name string) string {
	tries := int(guardWait / time.Second)
	return fmt.Sprintf(`# runfleet: the job runs once this runner's token is dead
runfleet_p=$PPID
while [ "${runfleet_p:-1}" -gt 1 ] && [ ! -f "/proc/$runfleet_p/cwd/%[1]s" ]; do
  runfleet_p=$(sed -n 's/^PPid:[[:space:]]*//p' "/proc/$runfleet_p/status" 2>/dev/null)
done
if [ "${runfleet_p:-1}" -le 1 ]; then
  echo "runfleet: gitlab-runner's %[1]s is not among this job's ancestors: the job does not run" >&2
  exit 1
fi
runfleet_i=0
while :; do
  runfleet_out=$(env -u http_proxy -u HTTP_PROXY "/proc/$runfleet_p/exe" verify --config "/proc/$runfleet_p/cwd/%[1]s" --name %[2]s 2>&1) || true
  case "$runfleet_out" in *"is not valid"* | *"is removed"*) break ;; esac
  runfleet_i=$((runfleet_i + 1))
  if [ "$runfleet_i" -ge %[3]d ]; then
    echo "runfleet: this runner's token is still live after %[4]s: the manager did not reset it, so the job does not run" >&2
    exit 1
  fi
  sleep 1
done
unset runfleet_p runfleet_i runfleet_out
`, ConfigFile, shellQuote(name), tries, guardWait)
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
