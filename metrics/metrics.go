// Package metrics defines runfleet's Prometheus metrics: runners by pool
// and state, jobs started and completed, how long jobs wait for a runner,
// how long runners take to start, forge API calls and rate limits,
// provider errors and webhook deliveries, and what runners cost and held.
package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/runfleet/runfleet/version"
)

// RunnerCount is the number of a pool's runners in one state.
type RunnerCount struct {
	Pool, State string
	N           int
}

// ForgeStats is what a forge driver counts.
type ForgeStats struct {
	Forge string
	Calls int64
	// RateRemaining is the last X-RateLimit-Remaining seen; -1 when the
	// forge sends none.
	RateRemaining int64
}

// ProviderCalls is what a pool's provider counts.
type ProviderCalls struct {
	Pool  string
	Calls int64
}

// PoolBackoff is why a pool holds off starting runners.
type PoolBackoff struct {
	Pool string
	// Failures counts the runners in a row that failed to start or
	// ended without a job.
	Failures int
	// Seconds is how long until the next runner may start.
	Seconds float64
	// Halted is set when the forge refused the pool's registrations as
	// invalid: nothing starts until the config changes.
	Halted bool
}

// Source is read at every scrape.
type Source interface {
	RunnerCounts() []RunnerCount
	ForgeStats() []ForgeStats
	PoolBackoffs() []PoolBackoff
	ProviderCalls() []ProviderCalls
}

// Metrics are one manager's metrics, in their own registry.
type Metrics struct {
	Registry *prometheus.Registry

	JobsStarted    *prometheus.CounterVec   // pool
	JobsCompleted  *prometheus.CounterVec   // pool, conclusion
	JobWait        *prometheus.HistogramVec // pool: queued until started
	RunnerStart    *prometheus.HistogramVec // pool: decided until running
	ProviderErrors *prometheus.CounterVec   // pool, op
	Webhooks       *prometheus.CounterVec   // forge, result
	Polls          *prometheus.CounterVec   // forge, result
	Cost           *prometheus.CounterVec   // pool, currency
	GPUSeconds     *prometheus.CounterVec   // pool
}

// New registers the metrics, reading runner counts and forge stats from
// src at each scrape.
func New(src Source) *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		JobsStarted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "runfleet_jobs_started_total", Help: "Jobs a runner of the pool took.",
		}, []string{"pool"}),
		JobsCompleted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "runfleet_jobs_completed_total", Help: "Jobs of the pool that ended, by conclusion.",
		}, []string{"pool", "conclusion"}),
		JobWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "runfleet_job_startup_seconds",
			Help:    "Time from a job being queued until a runner started it.",
			Buckets: []float64{0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800},
		}, []string{"pool"}),
		RunnerStart: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "runfleet_replenish_seconds",
			Help:    "Time from a pool deciding to start a runner (a slot freed, or a job queued) until the runner's machine runs.",
			Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300},
		}, []string{"pool"}),
		ProviderErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "runfleet_provider_errors_total", Help: "Provider operations that failed, by operation.",
		}, []string{"pool", "op"}),
		Webhooks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "runfleet_webhook_deliveries_total", Help: "Webhook deliveries by result: accepted, duplicate, ignored, bad_signature, bad_request.",
		}, []string{"forge", "result"}),
		Polls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "runfleet_queue_polls_total", Help: "Polls of a forge's job queue, by result: ok or error.",
		}, []string{"forge", "result"}),
		Cost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "runfleet_job_cost_total", Help: "What the pool's ended runners' machines cost, from creation to end, at the pool's price per hour (price_per_hour, prices), in the currency labelled.",
		}, []string{"pool", "currency"}),
		GPUSeconds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "runfleet_gpu_seconds_total", Help: "GPU time the pool's ended runners held: each runner's GPUs times how long its machine was held.",
		}, []string{"pool"}),
	}
	m.Registry.MustRegister(m.JobsStarted, m.JobsCompleted, m.JobWait, m.RunnerStart, m.ProviderErrors, m.Webhooks, m.Polls, m.Cost, m.GPUSeconds,
		collector{src}, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), buildInfo())
	return m
}

// buildInfo is runfleet_build_info: 1, labelled with which runfleet this
// is, so that a dashboard can tell the managers' releases apart (the
// convention of Prometheus's own *_build_info).
func buildInfo() prometheus.Collector {
	v := version.Get()
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "runfleet_build_info",
		Help:        "1, labelled with runfleet's version, commit, build date and Go version.",
		ConstLabels: prometheus.Labels{"version": v.Version, "commit": v.Commit, "date": v.Date, "goversion": v.Go},
	})
	g.Set(1)
	return g
}

var (
	runnersDesc = prometheus.NewDesc("runfleet_runners", "Runners by pool and state (starting, idle, busy, stopping, orphan).", []string{"pool", "state"}, nil)
	callsDesc   = prometheus.NewDesc("runfleet_forge_api_calls_total", "HTTP requests sent to the forge's API.", []string{"forge"}, nil)
	provDesc    = prometheus.NewDesc("runfleet_provider_api_calls_total", "HTTP requests sent to the provider's API (the Kubernetes apiserver), by pool.", []string{"pool"}, nil)
	rateDesc    = prometheus.NewDesc("runfleet_forge_rate_limit_remaining", "The forge's last X-RateLimit-Remaining.", []string{"forge"}, nil)
	failDesc    = prometheus.NewDesc("runfleet_pool_start_failures", "Runners of the pool in a row that failed to start or whose agent ended without taking a job; 0 once one takes a job.", []string{"pool"}, nil)
	backoffDesc = prometheus.NewDesc("runfleet_pool_backoff_seconds", "How long until the pool may start its next runner, after runners that failed.", []string{"pool"}, nil)
	haltDesc    = prometheus.NewDesc("runfleet_pool_halted", "1 when the forge refused the pool's runner registrations as invalid: no runner starts until the config changes.", []string{"pool"}, nil)
)

// collector reads what the pools and forges already hold, at scrape time.
type collector struct{ src Source }

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- runnersDesc
	ch <- callsDesc
	ch <- provDesc
	ch <- rateDesc
	ch <- failDesc
	ch <- backoffDesc
	ch <- haltDesc
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	for _, r := range c.src.RunnerCounts() {
		ch <- prometheus.MustNewConstMetric(runnersDesc, prometheus.GaugeValue, float64(r.N), r.Pool, r.State)
	}
	for _, b := range c.src.PoolBackoffs() {
		halted := 0.0
		if b.Halted {
			halted = 1
		}
		ch <- prometheus.MustNewConstMetric(failDesc, prometheus.GaugeValue, float64(b.Failures), b.Pool)
		ch <- prometheus.MustNewConstMetric(backoffDesc, prometheus.GaugeValue, b.Seconds, b.Pool)
		ch <- prometheus.MustNewConstMetric(haltDesc, prometheus.GaugeValue, halted, b.Pool)
	}
	for _, p := range c.src.ProviderCalls() {
		ch <- prometheus.MustNewConstMetric(provDesc, prometheus.CounterValue, float64(p.Calls), p.Pool)
	}
	for _, f := range c.src.ForgeStats() {
		ch <- prometheus.MustNewConstMetric(callsDesc, prometheus.CounterValue, float64(f.Calls), f.Forge)
		if f.RateRemaining >= 0 {
			ch <- prometheus.MustNewConstMetric(rateDesc, prometheus.GaugeValue, float64(f.RateRemaining), f.Forge)
		}
	}
}

// PoolMetrics are one pool's metrics as its reconciler reports them
// (pool.Config's OnStarted and OnError).
type PoolMetrics struct {
	m    *Metrics
	pool string
}

// Pool is a pool's metrics.
func (m *Metrics) Pool(name string) PoolMetrics { return PoolMetrics{m, name} }

// Started observes how long a runner took to start.
func (p PoolMetrics) Started(d time.Duration) {
	p.m.RunnerStart.WithLabelValues(p.pool).Observe(d.Seconds())
}

// Error counts an operation the provider failed ("create", "delete").
func (p PoolMetrics) Error(op string) { p.m.ProviderErrors.WithLabelValues(p.pool, op).Inc() }
