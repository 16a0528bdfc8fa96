package slurm

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/runfleet/runfleet/provider"
)

// Accounts is implemented by Clusters that can act as a pool's run_as
// accounts (through sudo): each runner's job is submitted, and its files
// written, as a local account no other live runner has, so that a job can
// read neither another runner's credential nor the manager's files, as
// ECP's Jacamar CI runs each job as a user of its own.
type Accounts interface {
	// As is the cluster as the account: Submit and Cancel run as it;
	// Queue reads the manager's jobs and those of every account As was
	// asked for.
	As(account string) Cluster
	// Install makes dir as the account, for it alone, and unpacks the
	// tar archive there.
	Install(ctx context.Context, account, dir string, archive []byte) error
	// RemoveAll removes dir as the account.
	RemoveAll(ctx context.Context, account, dir string) error
}

// As is the CLI acting as a run_as account.
func (c *CLI) As(account string) Cluster {
	c.mu.Lock()
	if !slices.Contains(c.accounts, account) {
		c.accounts = append(c.accounts, account)
	}
	c.mu.Unlock()
	return asAccount{c: c, account: account}
}

type asAccount struct {
	c       *CLI
	account string
}

func (a asAccount) Submit(ctx context.Context, script []byte, args []string) (string, error) {
	return a.c.submitAs(ctx, a.account, script, args)
}

func (a asAccount) Queue(ctx context.Context) ([]Job, error) { return a.c.Queue(ctx) }

func (a asAccount) Cancel(ctx context.Context, ids []string) error {
	return a.c.cancelAs(ctx, a.account, ids)
}

// Install runs `sh -c` as the account: the one command, fixed here, is
// its whole use of the account beyond sbatch and scancel.
func (c *CLI) Install(ctx context.Context, account, dir string, archive []byte) error {
	_, err := c.runAs(ctx, account, archive, "/bin/sh", "-c", `umask 077 && mkdir "$1" && tar -x -C "$1"`, "sh", dir)
	return err
}

func (c *CLI) RemoveAll(ctx context.Context, account, dir string) error {
	_, err := c.runAs(ctx, account, nil, "/bin/sh", "-c", `rm -rf "$1"`, "sh", dir)
	return err
}

// spoolArchive is a runner's spool (writeSpool's files and env) as a tar
// archive, for Install.
func spoolArchive(spec provider.Spec) ([]byte, error) {
	env, err := envFile(spec)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(name string, data []byte, dir bool) error {
		h := &tar.Header{Name: name, Mode: 0o600, Size: int64(len(data)), ModTime: time.Unix(0, 0), Typeflag: tar.TypeReg}
		if dir {
			h.Mode, h.Size, h.Typeflag = 0o700, 0, tar.TypeDir
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	if err := add("files/", nil, true); err != nil {
		return nil, err
	}
	dirs := map[string]bool{}
	for rel := range spec.Files {
		for d := filepath.Dir(filepath.Clean("/" + rel)[1:]); d != "."; d = filepath.Dir(d) {
			dirs[d] = true
		}
	}
	for _, d := range slices.Sorted(maps.Keys(dirs)) { // parents first
		if err := add("files/"+d+"/", nil, true); err != nil {
			return nil, err
		}
	}
	for _, rel := range slices.Sorted(maps.Keys(spec.Files)) {
		if err := add("files/"+filepath.Clean("/" + rel)[1:], spec.Files[rel], false); err != nil {
			return nil, err
		}
	}
	if err := add("env", env, false); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("runner files: %w", err)
	}
	return buf.Bytes(), nil
}

// openAccounts checks that the cluster can act as the pool's run_as
// accounts, and has the queue read theirs.
func (p *Provider) openAccounts() error {
	if len(p.opt.Section.RunAs) == 0 {
		return nil
	}
	acc, ok := p.opt.Cluster.(Accounts)
	if !ok {
		return errors.New("slurm.run_as: this cluster cannot act as other accounts")
	}
	for _, a := range p.opt.Section.RunAs {
		acc.As(a)
	}
	return nil
}

// shareSpool opens the spool to the accounts as far as they need: its
// directory and the manager's above it to pass through, not to list; the
// runners' files, the jobs' output and notices to add to (sticky, as
// /tmp: each account makes its own entries, which the others cannot
// remove). The records stay the manager's alone.
func (p *Provider) shareSpool() error {
	for _, d := range []string{filepath.Dir(p.opt.Spool), p.opt.Spool} {
		if err := os.Chmod(d, 0o711); err != nil {
			return err
		}
	}
	for _, d := range []string{p.filesDir(), p.logDir(), p.noticeDir()} {
		if err := os.Chmod(d, os.ModeSticky|0o733); err != nil {
			return err
		}
	}
	return nil
}

// claim picks a run_as account that no runner of the pool has (its record
// names it) and no Create under way took; "" without run_as. release
// ends the claim once Create has written the record, or failed.
func (p *Provider) claim(name string) (account string, release func(), err error) {
	if len(p.opt.Section.RunAs) == 0 {
		return "", func() {}, nil
	}
	recs, err := p.records(p.opt.Manager)
	if err != nil {
		return "", nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	used := map[string]bool{}
	for _, r := range recs {
		used[r.User] = true
	}
	for n, a := range p.claimed {
		if n != name {
			used[a] = true
		}
	}
	for _, a := range p.opt.Section.RunAs {
		if !used[a] {
			p.claimed[name] = a
			return a, func() {
				p.mu.Lock()
				delete(p.claimed, name)
				p.mu.Unlock()
			}, nil
		}
	}
	return "", nil, fmt.Errorf("every run_as account (%d) has a runner: give the pool as many accounts as its max", len(p.opt.Section.RunAs))
}

// as is the cluster acting as the account ("": the manager's user).
func (p *Provider) as(account string) Cluster {
	if acc, ok := p.opt.Cluster.(Accounts); ok && account != "" {
		return acc.As(account)
	}
	return p.opt.Cluster
}

// writeSpool writes a runner's spool, as its account where it has one.
func (p *Provider) writeSpool(ctx context.Context, account, dir string, spec provider.Spec) error {
	if account == "" {
		return writeSpool(dir, spec)
	}
	archive, err := spoolArchive(spec)
	if err != nil {
		return err
	}
	return p.opt.Cluster.(Accounts).Install(ctx, account, dir, archive)
}

// removeSpool removes a runner's spool, as its account where it has one.
func (p *Provider) removeSpool(ctx context.Context, account, dir string) error {
	if account == "" {
		return os.RemoveAll(dir)
	}
	return p.opt.Cluster.(Accounts).RemoveAll(ctx, account, dir)
}
