package replicalog

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/runbooktest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestFollowerBehindTheLog puts a replica in the state of CfguardPosteriorLogBehind: its disk
// refuses the ledger's writes (its file size limit is lowered with util-linux prlimit while it
// runs, below the ledger's size: the kernel fails writes past it with EFBIG, as a full disk
// would), so its follower cannot checkpoint the entries the updater keeps appending and falls
// behind the log's end. The runbook's commands for the alert run as written against it; then,
// with the limit lifted, it catches up by itself and agrees with the updater on every record.
func TestFollowerBehindTheLog(t *testing.T) {
	if testing.Short() {
		t.Skip("replica processes and a stream: not with -short")
	}
	if _, err := exec.LookPath("prlimit"); err != nil {
		tooltest.Missing(t, "prlimit not on PATH", "apt-get install util-linux")
	}
	c := proc.StreamingReplicas(t)
	brokers, data, reps, s := c.Brokers, c.Data, c.Reps, c.Stream
	produced := s.End(t)
	proc.WaitAgree(t, "before the disk fills", reps, produced)
	var follower *proc.ReplicaProc
	for _, r := range reps {
		if v, ok := r.View(); ok && !v.Replication.Updater {
			follower = r
		}
	}
	if follower == nil {
		t.Fatal("no follower")
	}
	db := filepath.Join(follower.Dir, "state", ledger.FileName)
	fi, err := os.Stat(db)
	if err != nil {
		t.Fatal(err)
	}
	pid := strconv.Itoa(follower.Child.Cmd.Process.Pid)
	prlimit := func(limit string) {
		t.Helper()
		if out, err := exec.Command("prlimit", "--pid", pid, "--fsize="+limit).CombinedOutput(); err != nil {
			t.Fatalf("prlimit --pid %s --fsize=%s: %v\n%s", pid, limit, err, out)
		}
	}
	prlimit(strconv.FormatInt(fi.Size()/4&^4095, 10) + ":unlimited")
	t.Cleanup(func() { exec.Command("prlimit", "--pid", pid, "--fsize=unlimited").Run() })

	s = proc.StartStream(brokers, data)
	waitfor.Cond(t, 60*time.Second, follower.ID+" behind the log's end, its checkpoints failing", func() bool {
		v, ok := follower.View()
		if !ok || v.Replication.Lag < 1 {
			return false
		}
		code, body := proc.Get(t, "http://"+follower.Child.Addr()+"/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, "file too large")
	})
	if runbooktest.Tools(t, true) {
		checks := []runbooktest.Check{
			{Cmd: "{entry, lag_records}", Want: `(?s)^\{\s*"entry": \d+,\s*"lag_records": [1-9]\d*\s*\}$`},
			{Cmd: "/readyz", Want: `checkpoint to cfguard\.db failing since .*file too large`},
		}
		sec := runbooktest.Named(t, filepath.Join(tooltest.RepoRoot(t), "docs", "RUNBOOK.md"), "CfguardPosteriorLogBehind")
		runbooktest.Covered(t, sec, checks)
		runbooktest.Run(t, sec, checks, strings.NewReplacer("127.0.0.1:8080", follower.Child.Addr()), nil)
	}
	// The remedy: space again. The follower catches up without a restart.
	prlimit("unlimited")
	produced += s.End(t)
	after := proc.WaitAgree(t, "after the disk has space again", reps, produced)
	// lag_records is the log's end, read every second, past what the follower has read.
	waitfor.Cond(t, 30*time.Second, follower.ID+"'s lag_records back to 0", func() bool {
		v, ok := follower.View()
		return ok && v.Replication.Lag == 0
	})
	t.Logf("%s caught up: entry %d covering %d records", follower.ID, after.Replication.Entry, proc.Covered(after))
}
