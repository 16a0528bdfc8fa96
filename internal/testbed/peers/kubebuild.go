package peers

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
)

// Pinned Kubernetes versions (see DESIGN.md): kube-apiserver and
// kube-scheduler from k8s.io/kubernetes with its staging modules at the
// matching v0 version, etcd's server, and kwok for fake nodes.
const (
	KubeVersion    = "v1.37.1"
	KubeStaging    = "v0.37.1"
	EtcdVersion    = "v3.7.3"
	KwokVersion    = "v0.8.0"
	kubeModule     = "k8s.io/kubernetes"
	kwokModule     = "sigs.k8s.io/kwok"
	kubeCacheDir   = "kubernetes-" + KubeVersion
	etcdCacheDir   = "etcd-" + EtcdVersion
	kwokCacheDir   = "kwok-" + KwokVersion
	stagingReplace = `(?m)^\s*(k8s\.io/[a-z0-9-]+) => \./staging/`
)

// KubeAPIServer returns the path of a kube-apiserver build, building it on
// first use (about 5 minutes on two cores).
func KubeAPIServer(ctx context.Context, w io.Writer) (string, error) {
	return kubeBinary(ctx, w, "kube-apiserver")
}

// KubeScheduler returns the path of a kube-scheduler build (about a minute
// after kube-apiserver).
func KubeScheduler(ctx context.Context, w io.Writer) (string, error) {
	return kubeBinary(ctx, w, "kube-scheduler")
}

func kubeBinary(ctx context.Context, w io.Writer, name string) (string, error) {
	return cached(ctx, w, kubeCacheDir, name, func(ctx context.Context, out string) error {
		dir, err := wrapperModule(ctx, kubeModule, KubeVersion, "k8s.io/kubernetes/cmd/"+name)
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		return goCmd(ctx, w, dir, []string{"CGO_ENABLED=0"}, "build", "-v", "-o", out, "k8s.io/kubernetes/cmd/"+name)
	})
}

// wrapperModule makes a module that requires mod@version and imports pkg,
// with k8s.io/kubernetes's staging modules (which its go.mod replaces
// with directories the module proxy does not serve) at KubeStaging.
func wrapperModule(ctx context.Context, mod, version, pkg string) (string, error) {
	dir, err := os.MkdirTemp("", "runfleet-peer-build-")
	if err != nil {
		return "", err
	}
	gomod := fmt.Sprintf("module runfleetpeer\n\ngo 1.26\n\nrequire %s %s\n", mod, version)
	if mod == kubeModule {
		src, err := ModuleDir(ctx, mod+"@"+version)
		if err != nil {
			os.RemoveAll(dir)
			return "", err
		}
		b, err := os.ReadFile(filepath.Join(src, "go.mod"))
		if err != nil {
			os.RemoveAll(dir)
			return "", err
		}
		var rep strings.Builder
		for _, m := range regexp.MustCompile(stagingReplace).FindAllStringSubmatch(string(b), -1) {
			fmt.Fprintf(&rep, "\t%s => %s %s\n", m[1], m[1], KubeStaging)
		}
		gomod += "\nreplace (\n" + rep.String() + ")\n"
	}
	files := map[string]string{
		"go.mod":   gomod,
		"tools.go": fmt.Sprintf("//go:build tools\n\npackage tools\n\nimport _ %q\n", pkg),
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			os.RemoveAll(dir)
			return "", err
		}
	}
	if err := goCmd(ctx, io.Discard, dir, nil, "mod", "tidy"); err != nil {
		os.RemoveAll(dir)
		return "", err
	}
	return dir, nil
}

// EtcdBinary returns the path of an etcd build (about a minute).
func EtcdBinary(ctx context.Context, w io.Writer) (string, error) {
	return cached(ctx, w, etcdCacheDir, "etcd", func(ctx context.Context, out string) error {
		dir, err := os.MkdirTemp("", "runfleet-etcd-build-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		// etcd's main lives in its root module, which pulls in its
		// tools; the server's etcdmain is all a test needs.
		files := map[string]string{
			"go.mod":  "module runfleetpeer\n\ngo 1.26\n\nrequire go.etcd.io/etcd/server/v3 " + EtcdVersion + "\n",
			"main.go": "package main\n\nimport (\n\t\"os\"\n\n\t\"go.etcd.io/etcd/server/v3/etcdmain\"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n",
		}
		for name, content := range files {
			if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
				return err
			}
		}
		if err := goCmd(ctx, io.Discard, dir, nil, "mod", "tidy"); err != nil {
			return err
		}
		return goCmd(ctx, w, dir, []string{"CGO_ENABLED=0"}, "build", "-v", "-o", out, ".")
	})
}

// KwokBinary returns the path of a kwok build (about 3 minutes) and the
// directory of its stage files (kustomize/stage in its module).
func KwokBinary(ctx context.Context, w io.Writer) (bin, stages string, err error) {
	bin, err = cached(ctx, w, kwokCacheDir, "kwok", func(ctx context.Context, out string) error {
		dir, err := wrapperModule(ctx, kwokModule, KwokVersion, "sigs.k8s.io/kwok/cmd/kwok")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		return goCmd(ctx, w, dir, []string{"CGO_ENABLED=0"}, "build", "-v", "-o", out, "sigs.k8s.io/kwok/cmd/kwok")
	})
	if err != nil {
		return "", "", err
	}
	src, err := ModuleDir(ctx, kwokModule+"@"+KwokVersion)
	if err != nil {
		return "", "", err
	}
	return bin, filepath.Join(src, "kustomize", "stage"), nil
}
