package owners

import (
	"errors"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// A replica whose ledger cannot be written when it gives CE partitions away releases them once
// it can: the release is retried as every share write is, and the CEs of the partitions it gave
// away leave its ledger, as without the failure, while those it kept stay.
func TestReleaseOnAFailingLedgerIsRetried(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	var failing atomic.Bool
	var failed atomic.Int64
	r1 := launch.With(t, func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), "r1", key) }, func(o *daemon.Options) {
		o.Hooks.LedgerAfterCommit = func() error {
			if failing.Load() {
				failed.Add(1)
				return errors.New("injected: the disk refused the commit")
			}
			return nil
		}
	}, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r1.Get(t, "/readyz"); return code == 200 })
	ids := daemontest.RegisterCEs(t, r1, daemontest.Bundled(t), 12, "")
	parts := r1.Config.Replication.CEPartitions

	failing.Store(true)
	r2 := launch.ReplicaKey(t, b, "r2", key)
	waitfor.Cond(t, 90*time.Second, "r2 owns CE partitions, every one ready, and r1 the others", func() bool {
		return daemontest.ShareReady(r2) && len(r1.D.Share().Member().Owned())+len(r2.D.Share().Member().Owned()) == parts
	})
	waitfor.Cond(t, 30*time.Second, "r1's release failing", func() bool { return failed.Load() > 0 })
	gone := func() (moved, left int) {
		for _, id := range ids {
			if slices.Contains(r1.D.Share().Member().Owned(), ceshare.Partition(id, parts)) {
				continue
			}
			moved++
			if _, err := r1.D.Ledger().Get(id); !errors.Is(err, ledger.ErrNotFound) {
				left++
			}
		}
		return moved, left
	}
	if moved, left := gone(); moved == 0 || left != moved {
		t.Fatalf("while r1's ledger fails: %d CEs moved to r2, %d of them still in r1's ledger; want some moved, all still there", moved, left)
	}

	// What the log and /readyz say is of a share write, not of an increment (none is held).
	waitfor.Cond(t, 30*time.Second, "r1's /readyz naming the failing CE share write", func() bool {
		code, body := r1.Get(t, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(string(body), "CE share write to")
	})
	failing.Store(false)
	waitfor.Cond(t, 60*time.Second, "the CEs r1 gave away gone from its ledger", func() bool {
		_, left := gone()
		return left == 0
	})
	if logs := r1.Logs.String(); !strings.Contains(logs, "CE share write could not be written") || strings.Contains(logs, "the increment is held") {
		t.Errorf("r1's log while its release failed does not name the CE share write, or names an increment:\n%s", logs)
	}
	for _, id := range ids {
		if !slices.Contains(r1.D.Share().Member().Owned(), ceshare.Partition(id, parts)) {
			continue
		}
		if _, err := r1.D.Ledger().Get(id); err != nil {
			t.Errorf("%s, of a partition r1 kept: %v", id, err)
		}
	}
	t.Logf("r1: %d commits refused; %v failed share writes retried", failed.Load(), r1.Metric(t, "cfguard_checkpoint_failures_total"))
}
