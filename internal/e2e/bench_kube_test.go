package e2e

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// BenchmarkKubeScale starts a pool of 500 runner pods from nothing, on
// kwok's fake nodes (the pods run no containers) with registrations at
// the GitHub simulator (whose runners never come online here): the time
// from the manager's start until the apiserver lists all 500 pods Running,
// the apiserver requests per pod (runfleet_provider_api_calls_total), and
// the manager's RSS then. ARC publishes 0 to 30 pods in about 15 s.
//
//	go test ./internal/e2e -run '^$' -bench KubeScale -benchtime 1x
func BenchmarkKubeScale(b *testing.B) {
	const pods = 500
	needKube(b)
	for i := range b.N {
		name := fmt.Sprintf("kscale%d", i)
		top, _, status := listeners(b)
		f := newGitHubFleet(b, name, ghOptions{Size: pods, Max: pods, Top: top,
			Forge: "    calls_per_hour: 10000000\n    call_burst: 5000\n",
			Pool: "    provider: kubernetes\n    kubernetes:\n      kubeconfig: " + kubeconfigPath + "\n      namespace: " + kubeNamespace +
				"\n      image: runner:fake\n      node_selector: {" + kubeNodeLabel + ": kwok}\n"})
		f.kube = true
		cfg, _ := os.ReadFile(f.config)
		os.WriteFile(f.config, []byte(strings.Replace(string(cfg), "bootstrap_timeout: 1m", "bootstrap_timeout: 30m", 1)), 0o600)

		start := time.Now()
		f.start()
		var running int
		deadline := start.Add(5 * time.Minute)
		for running < pods {
			if time.Now().After(deadline) {
				b.Fatalf("%d of %d pods running after 5m", running, pods)
			}
			time.Sleep(250 * time.Millisecond)
			l, err := kubeCP.Client.CoreV1().Pods(kubeNamespace).List(context.Background(), metav1.ListOptions{LabelSelector: f.kubeSelector()})
			if err != nil {
				continue
			}
			running = 0
			for _, p := range l.Items {
				if p.Status.Phase == corev1.PodRunning {
					running++
				}
			}
		}
		took := time.Since(start)
		calls := metricValue(b, status+"/metrics", "runfleet_provider_api_calls_total")
		rss := rssMiB(f.cmd.Process.Pid)
		b.ReportMetric(took.Seconds(), "s-to-500-running")
		b.ReportMetric(calls/pods, "apiserver-requests/pod")
		b.ReportMetric(rss, "manager-RSS-MiB")
		b.Logf("0 -> %d pods running in %s; %.0f apiserver requests (%.2f per pod); manager RSS %.1f MiB",
			pods, took.Round(100*time.Millisecond), calls, calls/pods, rss)
		if err := f.stop(3 * time.Minute); err != nil {
			b.Fatal(err)
		}
		f.kubeLeavesNothing()
	}
}

// metricValue reads one sample of a metric from a Prometheus endpoint.
func metricValue(t testing.TB, url, name string) float64 {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(httpGet(t, url)))
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, name) {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			return v
		}
	}
	t.Fatalf("no %s at %s", name, url)
	return 0
}

// rssMiB is a process's resident set size.
func rssMiB(pid int) float64 {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}
