package slurm

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"

	"github.com/runfleet/runfleet/config"
	"github.com/runfleet/runfleet/provider"
)

func init() { provider.Register("slurm", driver{}) }

type driver struct{}

func (driver) Check(c provider.PoolConfig) error {
	_, err := DecodeSection(c.Section, c.GPUsPerRunner)
	return config.Within("slurm", err)
}

func (d driver) Open(ctx context.Context, c provider.PoolConfig) (provider.Provider, error) {
	s, err := DecodeSection(c.Section, c.GPUsPerRunner)
	if err != nil {
		return nil, config.Within("slurm", err)
	}
	log := c.Logger
	if log == nil {
		log = slog.Default()
	}
	spool := filepath.Join(c.StateDir, "slurm", c.Pool)
	if s.SpoolDir != "" {
		spool = filepath.Join(s.SpoolDir, c.Manager, c.Pool)
	}
	q := clusters.get(s.Bin)
	if u := spoolOwner(spool); u != "" {
		// The jobs are the spool's owner's, the manager's user, also for
		// `status` or `gc` run by someone else (an admin, root).
		q.cluster.(*CLI).setUser(u)
	}
	return New(Options{Manager: c.Manager, Pool: c.Pool, ReadOnly: c.ReadOnly, Section: s, Spool: spool, Workdir: c.Workdir,
		GPUs: max(c.GPUsPerRunner, 0), MaxLifetime: c.MaxLifetime, JobTimeout: c.JobTimeout, IdleTimeout: c.IdleTimeout, Cluster: q.cluster, queue: q,
		Logger: log.With("provider", "slurm", "pool", c.Pool)})
}

// clusters holds one queue per cluster (the commands' directory and the
// SLURM_CONF they read), which the pools on it share: one squeue a poll
// interval for all of them.
var clusters = &clusterSet{byKey: map[string]*queue{}}

type clusterSet struct {
	mu    sync.Mutex
	byKey map[string]*queue
}

func (s *clusterSet) get(bin string) *queue {
	key := fmt.Sprintf("%s|%s", bin, os.Getenv("SLURM_CONF"))
	s.mu.Lock()
	defer s.mu.Unlock()
	q, ok := s.byKey[key]
	if !ok {
		q = &queue{cluster: &CLI{Bin: bin}}
		s.byKey[key] = q
	}
	return q
}

// spoolOwner is the user who owns the spool, "" before it exists.
func spoolOwner(spool string) string {
	st, err := os.Stat(spool)
	if err != nil {
		return ""
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return ""
	}
	if u, err := user.LookupId(strconv.FormatUint(uint64(sys.Uid), 10)); err == nil {
		return u.Username
	}
	return strconv.FormatUint(uint64(sys.Uid), 10)
}
