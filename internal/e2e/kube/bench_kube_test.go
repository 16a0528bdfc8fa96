package kube

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/runfleet/runfleet/internal/testbed/harness"
)

// BenchmarkKubeScale starts a pool of 500, then 1,000 runner pods from nothing, on
// kwok's fake nodes (the pods run no containers) with registrations at
// the GitHub simulator (whose runners never come online here): the time
// from the manager's start until the apiserver lists all the pods Running,
// the apiserver requests per pod (runfleet_provider_api_calls_total), and
// the manager's RSS then. ARC publishes 0 to 30 pods in about 15 s.
//
//	go test ./internal/e2e -run '^$' -bench KubeScale -benchtime 1x
func BenchmarkKubeScale(b *testing.B) {
	harness.NeedKube(b)
	for _, pods := range []int{500, 1000} {
		b.Run(fmt.Sprintf("pods=%d", pods), func(b *testing.B) { kubeScale(b, pods) })
	}
}

func kubeScale(b *testing.B, pods int) {
	for i := range b.N {
		name := fmt.Sprintf("kscale%d-%d", pods, i)
		top, _, status := harness.Listeners(b)
		f := harness.NewGitHubFleet(b, name, harness.GitHubOptions{Size: pods, Max: pods, Top: top,
			Forge: "    calls_per_hour: 10000000\n    call_burst: 5000\n",
			Pool: "    provider: kubernetes\n    kubernetes:\n      kubeconfig: " + harness.KubeconfigPath + "\n      namespace: " + harness.KubeRunnerNamespace +
				"\n      image: runner:fake\n      node_selector: {" + harness.KubeNodeLabel + ": kwok}\n"})
		f.Kube = true
		cfg, _ := os.ReadFile(f.Config)
		os.WriteFile(f.Config, []byte(strings.Replace(string(cfg), "bootstrap_timeout: 1m", "bootstrap_timeout: 30m", 1)), 0o600)

		start := time.Now()
		f.Start()
		var running int
		deadline := start.Add(5 * time.Minute)
		for running < pods {
			if time.Now().After(deadline) {
				b.Fatalf("%d of %d pods running after 5m", running, pods)
			}
			time.Sleep(250 * time.Millisecond)
			l, err := harness.KubeCP.Client.CoreV1().Pods(harness.KubeRunnerNamespace).List(context.Background(), metav1.ListOptions{LabelSelector: f.KubeSelector()})
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
		calls := harness.MetricValue(b, status+"/metrics", "runfleet_provider_api_calls_total")
		rss := harness.RSSMiB(f.Cmd.Process.Pid)
		b.ReportMetric(took.Seconds(), "s-to-all-running")
		b.ReportMetric(calls/float64(pods), "apiserver-requests/pod")
		b.ReportMetric(rss, "manager-RSS-MiB")
		b.Logf("0 -> %d pods running in %s; %.0f apiserver requests (%.2f per pod); manager RSS %.1f MiB",
			pods, took.Round(100*time.Millisecond), calls, calls/float64(pods), rss)
		if err := f.Stop(3 * time.Minute); err != nil {
			b.Fatal(err)
		}
		f.KubeLeavesNothing()
	}
}
