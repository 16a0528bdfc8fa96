package peers

import (
	"bytes"
	"cmp"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"

	sdk "code.gitea.io/sdk/gitea"
)

// Gitea is a running Gitea server with an admin user.
type Gitea struct {
	URL   string
	User  string
	Token string // the admin's API token
	Dir   string // its data; removed by Stop unless Keep is set
	Keep  bool
	cmd   *exec.Cmd
	log   *os.File
}

// GiteaOptions configures StartGitea.
type GiteaOptions struct {
	// Dir holds the server's data; a temporary directory when empty.
	Dir string
	// Port to listen on; a free one when 0.
	Port int
	// ListenAddr is the address to listen on, 127.0.0.1 by default;
	// 0.0.0.0 lets containers reach it through the bridge. The URL stays
	// on 127.0.0.1.
	ListenAddr string
	// Progress receives build progress on first use.
	Progress io.Writer
}

// StartGitea builds Gitea if needed and starts a fresh server with an
// admin user and token.
func StartGitea(ctx context.Context, opt GiteaOptions) (*Gitea, error) {
	if opt.Progress == nil {
		opt.Progress = io.Discard
	}
	bin, err := GiteaBinary(ctx, opt.Progress)
	if err != nil {
		return nil, err
	}
	modDir, err := ModuleDir(ctx, "code.gitea.io/gitea@v"+GiteaVersion)
	if err != nil {
		return nil, err
	}
	if _, err := exec.LookPath("git"); err != nil {
		return nil, fmt.Errorf("gitea needs git on PATH: %w", err)
	}
	dir := opt.Dir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "runfleet-gitea-"); err != nil {
			return nil, err
		}
	}
	port := opt.Port
	if port == 0 {
		if port, err = freePort(); err != nil {
			return nil, err
		}
	}
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	ini := fmt.Sprintf(`APP_NAME = runfleet
RUN_MODE = prod
WORK_PATH = %[1]s
I_AM_BEING_UNSAFE_RUNNING_AS_ROOT = true

[server]
PROTOCOL = http
HTTP_ADDR = %[5]s
HTTP_PORT = %[2]d
ROOT_URL = %[3]s/
OFFLINE_MODE = true
DISABLE_SSH = true
START_SSH_SERVER = false
LFS_START_SERVER = false
STATIC_ROOT_PATH = %[4]s
APP_DATA_PATH = %[1]s/data

[database]
DB_TYPE = sqlite3
PATH = %[1]s/data/gitea.db
SQLITE_JOURNAL_MODE = WAL

[repository]
ROOT = %[1]s/repos

[security]
INSTALL_LOCK = true

[service]
DISABLE_REGISTRATION = true

[actions]
ENABLED = true
; A task whose runner vanished mid-job (a pod evicted, a machine lost)
; fails after this without updates, not 10 minutes: the tests wait for
; it. Longer than the outage test's freeze of Gitea itself.
ZOMBIE_TASK_TIMEOUT = 90s

[cron.stop_zombie_tasks]
SCHEDULE = @every 15s

[webhook]
ALLOWED_HOST_LIST = loopback,private

[log]
MODE = file
LEVEL = Warn
ROOT_PATH = %[1]s/log

[session]
PROVIDER = memory

[cache]
ADAPTER = memory

[mailer]
ENABLED = false

[cron.update_checker]
ENABLED = false
`, dir, port, url, modDir, cmp.Or(opt.ListenAddr, "127.0.0.1"))
	if err := os.MkdirAll(filepath.Join(dir, "custom", "conf"), 0o755); err != nil {
		return nil, err
	}
	conf := filepath.Join(dir, "custom", "conf", "app.ini")
	if _, err := os.Stat(conf); err != nil {
		if err := os.WriteFile(conf, []byte(ini), 0o600); err != nil {
			return nil, err
		}
	}
	logf, err := os.Create(filepath.Join(dir, "gitea.out"))
	if err != nil {
		return nil, err
	}
	env := append(os.Environ(), "GITEA_WORK_DIR="+dir, "GITEA_CUSTOM="+filepath.Join(dir, "custom"), "HOME="+dir)

	// Migrate and create the admin before the server starts.
	g := &Gitea{URL: url, User: "runfleet", Dir: dir, log: logf}
	if out, err := g.run(ctx, bin, env, conf, "migrate"); err != nil {
		return nil, fmt.Errorf("gitea migrate: %w\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(dir, "admin-token")); err == nil {
		b, _ := os.ReadFile(filepath.Join(dir, "admin-token"))
		g.Token = string(bytes.TrimSpace(b))
	} else {
		out, err := g.run(ctx, bin, env, conf, "admin", "user", "create", "--admin", "--username", g.User,
			"--email", "runfleet@example.invalid", "--random-password", "--must-change-password=false",
			"--access-token", "--access-token-name", "runfleet")
		if err != nil {
			return nil, fmt.Errorf("gitea admin user create: %w\n%s", err, redactTokens(out))
		}
		m := tokenRE.FindSubmatch(out)
		if m == nil {
			return nil, fmt.Errorf("gitea admin user create: no token in its output")
		}
		g.Token = string(m[1])
		if err := os.WriteFile(filepath.Join(dir, "admin-token"), m[1], 0o600); err != nil {
			return nil, err
		}
	}

	g.cmd = exec.Command(bin, "web", "--config", conf)
	g.cmd.Dir = dir
	g.cmd.Env = env
	g.cmd.Stdout, g.cmd.Stderr = logf, logf
	g.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := g.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start gitea: %w", err)
	}
	if err := g.waitReady(ctx, 2*time.Minute); err != nil {
		g.Stop()
		out, _ := os.ReadFile(logf.Name())
		return nil, fmt.Errorf("gitea did not become ready: %w\n%s", err, tail(out, 3000))
	}
	return g, nil
}

var errNotReady = errors.New("not ready")

var tokenRE = regexp.MustCompile(`Access token was successfully created\.\.\. ([0-9a-f]{40})`)

func redactTokens(b []byte) []byte {
	return regexp.MustCompile(`[0-9a-f]{40}`).ReplaceAll(b, []byte("[redacted]"))
}

func (g *Gitea) run(ctx context.Context, bin string, env []string, conf string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, bin, append(args, "--config", conf)...)
	cmd.Dir = g.Dir
	cmd.Env = env
	return cmd.CombinedOutput()
}

func (g *Gitea) waitReady(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		resp, err := http.Get(g.URL + "/api/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if g.cmd.ProcessState != nil {
			return fmt.Errorf("gitea exited")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return errNotReady
}

// Stop stops the server and, unless Keep is set, removes its data.
func (g *Gitea) Stop() {
	if g.cmd != nil && g.cmd.Process != nil {
		_ = syscall.Kill(-g.cmd.Process.Pid, syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = g.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-g.cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
	}
	if g.log != nil {
		g.log.Close()
	}
	if !g.Keep {
		os.RemoveAll(g.Dir)
	}
}

// Client returns an API client for the admin.
func (g *Gitea) Client() (*sdk.Client, error) {
	return sdk.NewClient(g.URL, sdk.SetToken(g.Token), sdk.SetGiteaVersion(""))
}

// CreateRepo creates a repository owned by the admin, with a first commit.
func (g *Gitea) CreateRepo(name string) error {
	c, err := g.Client()
	if err != nil {
		return err
	}
	_, _, err = c.CreateRepo(sdk.CreateRepoOption{Name: name, AutoInit: true, DefaultBranch: "main"})
	if err != nil {
		return fmt.Errorf("create repo %s: %w", name, err)
	}
	return nil
}

// PutFile creates or replaces a file on the repository's main branch. A
// workflow file pushed this way starts a workflow run.
func (g *Gitea) PutFile(repo, path, content, message string) error {
	c, err := g.Client()
	if err != nil {
		return err
	}
	enc := base64.StdEncoding.EncodeToString([]byte(content))
	existing, resp, err := c.GetContents(g.User, repo, "main", path)
	if err == nil && existing != nil {
		_, _, err = c.UpdateFile(g.User, repo, path, sdk.UpdateFileOptions{
			FileOptions: sdk.FileOptions{Message: message, BranchName: "main"}, SHA: existing.SHA, Content: enc,
		})
	} else if resp != nil && resp.StatusCode == http.StatusNotFound {
		_, _, err = c.CreateFile(g.User, repo, path, sdk.CreateFileOptions{
			FileOptions: sdk.FileOptions{Message: message, BranchName: "main"}, Content: enc,
		})
	}
	if err != nil {
		return fmt.Errorf("put %s in %s: %w", path, repo, err)
	}
	return nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// LogTail returns the end of the server's output, for test failures.
func (g *Gitea) LogTail() string {
	out, _ := os.ReadFile(filepath.Join(g.Dir, "gitea.out"))
	logs, _ := os.ReadFile(filepath.Join(g.Dir, "log", "gitea.log"))
	return tail(out, 2000) + tail(logs, 4000)
}

// Freeze stops the server's processes (SIGSTOP): connections are still
// accepted by the kernel, and nothing answers, as a hung forge behaves.
// Thaw resumes them.
func (g *Gitea) Freeze() error { return g.signal(syscall.SIGSTOP) }

// Thaw resumes a frozen server.
func (g *Gitea) Thaw() error { return g.signal(syscall.SIGCONT) }

func (g *Gitea) signal(sig syscall.Signal) error {
	if g.cmd == nil || g.cmd.Process == nil {
		return errors.New("gitea: not started")
	}
	return syscall.Kill(-g.cmd.Process.Pid, sig)
}

// ScopedToken makes another API token of the admin user with only the
// given scopes (write:repository, read:repository, ...), as a user would
// make one for runfleet, and returns it.
func (g *Gitea) ScopedToken(ctx context.Context, name string, scopes ...string) (string, error) {
	bin, err := GiteaBinary(ctx, nil)
	if err != nil {
		return "", err
	}
	env := append(os.Environ(), "GITEA_WORK_DIR="+g.Dir, "GITEA_CUSTOM="+filepath.Join(g.Dir, "custom"), "HOME="+g.Dir)
	// With --raw the command prints the token on a line of its own, but
	// Gitea's own log lines go to the same output, before or after it
	// ("[E] You are running Gitea using the root user, ..."): taking the
	// last line gave a CI run a line that was not the token (401 "token
	// is required"). The token is the one line that is one.
	cmd := exec.CommandContext(ctx, bin, "admin", "user", "generate-access-token", "--username", g.User,
		"--token-name", name, "--scopes", strings.Join(scopes, ","), "--raw",
		"--config", filepath.Join(g.Dir, "custom", "conf", "app.ini"))
	cmd.Dir, cmd.Env = g.Dir, env
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("gitea admin user generate-access-token: %w\n%s%s", err, redactTokens(out), redactTokens(stderr.Bytes()))
	}
	var toks []string
	for line := range strings.Lines(string(out)) {
		if line = strings.TrimSpace(line); rawTokenRE.MatchString(line) {
			toks = append(toks, line)
		}
	}
	if len(toks) != 1 {
		return "", fmt.Errorf("gitea admin user generate-access-token: %d tokens in its output: %q", len(toks), redactTokens(out))
	}
	return toks[0], nil
}

var rawTokenRE = regexp.MustCompile(`^[0-9a-f]{40}$`)
