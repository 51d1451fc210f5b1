package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// Each kind of write durably retries has its own failure episode: on a full disk a small share
// write can succeed while a checkpoint keeps failing, and that success ends neither the
// checkpoint's episode nor its gauge; /readyz names each kind that is failing.
func TestRetriedWritesFailApart(t *testing.T) {
	l, err := ledger.Open(t.TempDir(), ledger.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	reg := prometheus.NewRegistry()
	d := &Daemon{ledger: l, metrics: alerts.NewMetrics(reg), log: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	full := fmt.Errorf("no space left on device: %w", ledger.ErrWrite)
	go func() { done <- d.durably(ctx, checkpointWrite, func() error { return full }) }()
	defer func() { cancel(); <-done }()
	waitfor.Cond(t, 10*time.Second, "the checkpoint failing", func() bool { return d.checkpointHealth() != nil })

	attempts := 0
	err = d.durably(ctx, shareWrite, func() error {
		attempts++
		if attempts == 1 {
			if h := d.checkpointHealth(); h != nil && strings.Contains(h.Error(), "CE share write") {
				t.Errorf("/readyz names a share write before one failed: %v", h)
			}
			return full
		}
		if h := d.checkpointHealth(); h == nil || !strings.Contains(h.Error(), "checkpoint to") || !strings.Contains(h.Error(), "CE share write to") {
			t.Errorf("/readyz while both fail: %v; want each kind named", h)
		}
		return nil
	})
	if err != nil || attempts != 2 {
		t.Fatalf("the share write: %v after %d attempts", err, attempts)
	}
	h := d.checkpointHealth()
	if h == nil || !strings.Contains(h.Error(), "checkpoint to") || strings.Contains(h.Error(), "CE share write") {
		t.Errorf("/readyz after the share write succeeded, the checkpoint failing still: %v", h)
	}
	want := "# HELP cfguard_checkpoint_failing 1 while the daemon cannot write its checkpoint (and has stopped consuming) or, on a replica, a write of its CE share, else 0.\n" +
		"# TYPE cfguard_checkpoint_failing gauge\ncfguard_checkpoint_failing 1\n"
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), alerts.NameCheckpointFailing); err != nil {
		t.Errorf("after the share write succeeded, the checkpoint failing still: %v", err)
	}
}
