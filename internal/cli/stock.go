package cli

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"

	"github.com/runfleet/runfleet/fetch"
	"github.com/runfleet/runfleet/forge"
	"github.com/runfleet/runfleet/internal/lazyregexp"
	"github.com/runfleet/runfleet/provider"
	"github.com/runfleet/runfleet/provider/vm"
	"github.com/runfleet/runfleet/version"
)

// ReleaseURLEnv names where runfleet's release files are (the directory
// holding SHA256SUMS and runfleet-<version>-linux-amd64, as `make release`
// names them), for a stock image's boot script to fetch runfleet from:
// a mirror, or a build of one's own. Without it, runfleet's own release of
// this version on GitHub.
const ReleaseURLEnv = "RUNFLEET_RELEASE_URL"

// stockClouds are the clouds whose machines boot a stock image without
// --cloud-image; on Kubernetes a pod runs the forge's own runner image
// where it publishes one (agentImage), else a stock image that fetches
// the agent as it starts.
var stockClouds = []string{"aws", "gcp", "azure", "kubernetes"}

// releaseVersion is a version runfleet publishes releases of: a tag, not
// a pseudo-version or a development build.
var releaseVersion = lazyregexp.New(`^v\d+\.\d+\.\d+(-[0-9A-Za-z.]+)?$`)

// stockInstall finds what a stock image's boot script installs, where
// --cloud asks for a cloud machine without --cloud-image, as CML boots a
// stock image and installs what it needs: this runfleet's release file
// and its SHA-256 (from the release's SHA256SUMS), and the forge's agent
// release that runfleet pins, and where the boot script puts the agent's
// program. nil where no cloud machine or an image was asked for.
func stockInstall(ctx context.Context, s runnerSettings, getenv func(string) (string, bool)) (*provider.Stock, string, error) {
	if !slices.Contains(stockClouds, s.Cloud["cloud"]) || s.Cloud["cloud-image"] != "" || agentImage(s) != "" {
		return nil, "", nil
	}
	d, _ := forge.Lookup(s.Driver)
	if da, ok := d.(forge.DockerAgent); ok {
		return dockerStock(ctx, s, da, getenv)
	}
	rel, ok := d.(forge.AgentReleaser)
	if !ok {
		return nil, "", fmt.Errorf("--cloud-image: is required with --driver %s: runfleet fetches no release of its agent to install on a stock image (an image holding runfleet and the agent: images/)", s.Driver)
	}
	r := rel.AgentRelease()
	agentURL, err := r.URLFor("amd64", s.AgentURL)
	if err != nil {
		return nil, "", err
	}
	agentSum, err := r.Checksum(ctx, "amd64", fetch.Options{Mirror: s.AgentURL, SHA256: s.AgentSHA256, Client: &http.Client{Timeout: checkTimeout}})
	if err != nil {
		return nil, "", fmt.Errorf("--cloud-image: no image was given, and the agent to install cannot be checked: %w", err)
	}
	if s.Cloud["cloud"] == "kubernetes" {
		// The pod runs the agent itself: no runfleet in it.
		return &provider.Stock{AgentURL: agentURL, AgentSHA256: agentSum}, stockAgentPath(r, agentURL), nil
	}
	runfleetURL, runfleetSum, err := runfleetRelease(ctx, getenv)
	if err != nil {
		return nil, "", fmt.Errorf("--cloud-image: no image was given, and %w", err)
	}
	return &provider.Stock{RunfleetURL: runfleetURL, RunfleetSHA256: runfleetSum, AgentURL: agentURL, AgentSHA256: agentSum}, stockAgentPath(r, agentURL), nil
}

// dockerStock is stockInstall for a forge whose agent is an image that
// runs its jobs through the machine's engine (Bitbucket's): the machine
// installs runfleet and Docker, and the pool runs the image. A pod has
// no engine of its own to give it.
func dockerStock(ctx context.Context, s runnerSettings, da forge.DockerAgent, getenv func(string) (string, bool)) (*provider.Stock, string, error) {
	if s.Cloud["cloud"] == "kubernetes" {
		return nil, "", fmt.Errorf("--cloud-image: is required with --driver %s on Kubernetes: its runner starts each job as a container of a Docker engine, which a pod does not have (an image with an engine of its own)", s.Driver)
	}
	runfleetURL, runfleetSum, err := runfleetRelease(ctx, getenv)
	if err != nil {
		return nil, "", fmt.Errorf("--cloud-image: no image was given, and %w", err)
	}
	return &provider.Stock{RunfleetURL: runfleetURL, RunfleetSHA256: runfleetSum, Docker: true}, da.DockerAgentPath(), nil
}

// agentImage is the forge's own runner image for a pod that --cloud-image
// does not name; "" elsewhere, or where the forge publishes none.
func agentImage(s runnerSettings) string {
	if s.Cloud["cloud"] != "kubernetes" || s.Cloud["cloud-image"] != "" {
		return ""
	}
	d, _ := forge.Lookup(s.Driver)
	if im, ok := d.(forge.AgentImager); ok {
		return im.AgentImage()
	}
	return ""
}

// stockAgentPath is where a stock image's boot script puts the agent's
// program: unpacked from a tarball, or the file itself.
func stockAgentPath(r fetch.Release, url string) string {
	if r.Archive() && r.Program != "" {
		return vm.AgentDir + "/" + r.Program
	}
	return vm.AgentDir + "/" + url[strings.LastIndex(url, "/")+1:]
}

// runfleetRelease returns this runfleet's release file for linux/amd64
// and its SHA-256, read from the release's SHA256SUMS.
func runfleetRelease(ctx context.Context, getenv func(string) (string, bool)) (url, sum string, err error) {
	v := version.Get().Version
	base, _ := getenv(ReleaseURLEnv)
	if base == "" {
		if !releaseVersion.MatchString(v) {
			return "", "", fmt.Errorf("this runfleet (%s) is no release to install on a stock image: give an image holding runfleet, or %s, the directory of a release of it", v, ReleaseURLEnv)
		}
		base = "https://github.com/runfleet/runfleet/releases/download/" + v
	}
	base = strings.TrimRight(base, "/")
	name := "runfleet-" + v + "-linux-amd64"
	ctx, cancel := context.WithTimeout(ctx, checkTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/SHA256SUMS", nil)
	if err != nil {
		return "", "", err
	}
	req.Header.Set("User-Agent", version.UserAgent())
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", "", fmt.Errorf("runfleet's release could not be read: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", "", fmt.Errorf("runfleet's release could not be read: %s: %s", base+"/SHA256SUMS", resp.Status)
	}
	sc := bufio.NewScanner(io.LimitReader(resp.Body, 1<<20))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && strings.TrimPrefix(f[1], "*") == name {
			return base + "/" + name, f[0], nil
		}
	}
	return "", "", errors.New("runfleet's release " + base + " lists no " + name + " in its SHA256SUMS")
}
