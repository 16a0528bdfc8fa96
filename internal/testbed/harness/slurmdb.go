package harness

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// The test cluster keeps accounting as a site's does: slurmdbd on Debian's
// MariaDB (slurmdbd.conf(5); SchedMD's accounting.html), with
// AccountingStorageEnforce=associations,limits, so that a job of a user
// without an association is refused at submission and an association's
// MaxSubmitJobs holds; sacct tells how a job ended after the queue forgot
// it (MinJobAge=30, where sites keep the 300 s default, so that a test
// can wait for that).

// CappedAccount is a Slurm account in which the Slurm user may have at
// most CappedSubmitJobs jobs queued or running (MaxSubmitJobs of its
// association): sbatch refuses more with AssocMaxSubmitJobLimit.
//
// WallQOS is a QOS the Slurm user may use whose MaxWall (WallQOSMax) is
// shorter than any partition's MaxTime: a job asking for more pends for
// ever (QOSMaxWallDurationPerJobLimit; AccountingStorageEnforce=limits).
const (
	CappedAccount    = "capped"
	CappedSubmitJobs = 2
	WallQOS          = "ciwall"
	WallQOSMax       = "00:20:00"
)

// accountingConf is slurm.conf's part for accounting through slurmdbd on
// port dbd.
func accountingConf(node string, dbd int) string {
	return fmt.Sprintf(`AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=%s
AccountingStoragePort=%d
AccountingStorageEnforce=associations,limits
JobAcctGatherType=jobacct_gather/none
MinJobAge=30
`, node, dbd)
}

// startAccounting starts MariaDB on port db (a data directory of the
// cluster's own, loopback only) and slurmdbd on port dbd, and registers
// the cluster.
func (s *SlurmCluster) startAccounting(db, dbd int) error {
	data, sock := filepath.Join(s.Dir, "db"), filepath.Join(s.Dir, "db.sock")
	if out, err := exec.Command("mariadb-install-db", "--no-defaults", "--user=root", "--datadir="+data,
		"--auth-root-authentication-method=socket", "--skip-test-db").CombinedOutput(); err != nil {
		return fmt.Errorf("mariadb-install-db: %v: %s", err, tail(out, 2000))
	}
	// InnoDB's lock wait as SchedMD's accounting page asks; the log
	// flushed once a second, the data thrown away after the run.
	if err := s.daemon("mariadbd", "--no-defaults", "--user=root", "--datadir="+data, "--socket="+sock,
		fmt.Sprintf("--port=%d", db), "--bind-address=127.0.0.1", "--skip-name-resolve", "--skip-log-bin",
		"--pid-file="+filepath.Join(s.Dir, "db.pid"), "--log-error="+filepath.Join(s.Dir, "log", "mariadb.log"),
		"--innodb-buffer-pool-size=64M", "--innodb-lock-wait-timeout=900", "--innodb-flush-log-at-trx-commit=0"); err != nil {
		return err
	}
	const pass = "runfleet-e2e"
	sql := "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '" + pass + "'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
	if err := retry(30*time.Second, "mariadb", "mariadb", "--no-defaults", "--socket="+sock, "-u", "root", "-e", sql); err != nil {
		log, _ := os.ReadFile(filepath.Join(s.Dir, "log", "mariadb.log"))
		return fmt.Errorf("%w; mariadb log:\n%s", err, tail(log, 2000))
	}
	conf := fmt.Sprintf(`AuthType=auth/munge
DbdHost=%s
DbdPort=%d
SlurmUser=root
LogFile=%[3]s/log/slurmdbd.log
PidFile=%[3]s/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=%[4]d
StorageUser=slurm
StoragePass=%[5]s
StorageLoc=slurm_acct_db
`, s.Node, dbd, s.Dir, db, pass)
	// slurmdbd reads it beside slurm.conf (SLURM_CONF's directory), and
	// only if no one else may read it.
	if err := os.WriteFile(filepath.Join(s.Dir, "slurmdbd.conf"), []byte(conf), 0o600); err != nil {
		return err
	}
	if err := s.daemon("slurmdbd", "-D"); err != nil {
		return err
	}
	if err := retry(30*time.Second, "slurmdbd", "sacctmgr", "-n", "list", "cluster"); err != nil {
		log, _ := os.ReadFile(filepath.Join(s.Dir, "log", "slurmdbd.log"))
		return fmt.Errorf("%w; slurmdbd log:\n%s", err, tail(log, 2000))
	}
	return sacctmgr("add", "cluster", "runfleet")
}

// addAssociations gives the Slurm user and the run_as accounts an
// association in account ci (their default), and the Slurm user one in
// CappedAccount with its MaxSubmitJobs, and WallQOS beside the default
// QOS (normal); root has its own from the start.
func (s *SlurmCluster) addAssociations() error {
	for _, args := range [][]string{
		{"add", "account", "ci", "description=runfleet's tests", "organization=runfleet"},
		{"add", "account", CappedAccount, "description=at most a few jobs", "organization=runfleet"},
		{"add", "user", strings.Join(append([]string{s.User}, RunAsAccounts...), ","), "account=ci", "defaultaccount=ci"},
		{"add", "user", s.User, "account=" + CappedAccount, fmt.Sprintf("maxsubmitjobs=%d", CappedSubmitJobs)},
		{"add", "qos", WallQOS, "maxwall=" + WallQOSMax},
		{"modify", "user", "where", "name=" + s.User, "set", "qos+=" + WallQOS},
	} {
		if err := sacctmgr(args...); err != nil {
			return err
		}
	}
	return nil
}

func sacctmgr(args ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "sacctmgr", append([]string{"-i"}, args...)...).CombinedOutput()
	if err != nil && !strings.Contains(string(out), "Nothing new added") && !strings.Contains(string(out), "Nothing modified") {
		return fmt.Errorf("sacctmgr %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

// retry runs a command until it succeeds, for a daemon coming up.
func retry(within time.Duration, what, name string, args ...string) error {
	deadline := time.Now().Add(within)
	for {
		out, err := exec.Command(name, args...).CombinedOutput()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not answering within %s: %v: %s", what, within, err, tail(out, 500))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// daemon starts one of the cluster's daemons in the foreground, in a
// process group of its own (Stop kills the group), its output in the
// cluster's log directory.
func (s *SlurmCluster) daemon(name string, args ...string) error {
	cmd := exec.Command(name, args...)
	out, err := os.Create(filepath.Join(s.Dir, "log", name+".out"))
	if err != nil {
		return err
	}
	defer out.Close()
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", name, err)
	}
	s.cmds = append(s.cmds, cmd)
	return nil
}
