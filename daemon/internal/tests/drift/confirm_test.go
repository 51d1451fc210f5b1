package drift

import (
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// confirmCEs is the number of CEs of TestDriftConfirmationDoesNotStopIngest: 3000 (measured in
// about 3 s on one core at 1000 draws, ten times the three increments it must outlast), or
// CFGUARD_CONFIRM_CES (e.g. 100000 or 1000000; about 700 bytes of ledger per CE).
func confirmCEs(t *testing.T) int {
	if s := os.Getenv("CFGUARD_CONFIRM_CES"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("CFGUARD_CONFIRM_CES=%q: want a positive integer", s)
		}
		return n
	}
	return 3000
}

// TestDriftConfirmationDoesNotStopIngest: a drift fails the bound of every stored CE at once.
// The commit marks their certificates lapsed by the bound (no sampling) and the next increments
// are applied while the confirmer is still measuring them in the background (renewing or judging
// each); once ingest pauses, every failing CE has a verdict under the last posterior and no
// certificate is left lapsed.
func TestDriftConfirmationDoesNotStopIngest(t *testing.T) {
	n := confirmCEs(t)
	r := launch.Daemon(t, func(c *config.Config) {
		daemontest.PaperLearner(c, 3e-3)
		c.Certify.Samples = 1000
		c.Audit.Workers = 1 // one confirmer lane, on any machine: the confirmation must outlast three increments
	})
	data := daemontest.Bundled(t)
	start := time.Now()
	daemontest.StoreCEs(t, r, data, n)
	t.Logf("stored %d CEs in %v", n, time.Since(start).Round(time.Millisecond))
	if got := r.Metric(t, "cfguard_counterfactuals", "status", "certified"); got != float64(n) {
		t.Fatalf("certified = %v, want %d", got, n)
	}
	// 96 benign rows labelled malignant (a drift), then 96 clean records: six increments of 32.
	var drift, clean [][]byte
	for i := range data.X {
		if data.Y[i] == 1 && len(drift) < 96 {
			drift = append(drift, daemontest.Record(fmt.Sprintf("flip%d", i), data.X[i], "malignant"))
		}
		if len(clean) < 96 {
			clean = append(clean, daemontest.Record(fmt.Sprintf("clean%d", i), data.X[i], data.Y[i]))
		}
	}
	applied := func() float64 { return r.Metric(t, "cfguard_records_total", "result", "applied") }
	registeredUnder := r.D.Posterior().Version
	r.Produce(t, drift...)
	waitfor.Cond(t, 60*time.Second, "the drift applied", func() bool { return applied() == 96 })
	// Every CE's certificate lapsed at the drift: each is now lapsed, judged, or renewed to a
	// posterior after the one it was registered under.
	untouched := 0
	daemontest.EachCE(t, r.D.Ledger(), func(ce *ledger.CE) {
		if ce.Status == certify.Certified && !ce.RenewalPending && ce.AnchorVersion == registeredUnder {
			untouched++
		}
	})
	if untouched != 0 {
		t.Fatalf("%d of %d CEs still certified from their first anchor after the drift (anchor KL %v, budget %v), want none", untouched, n, r.Metric(t, "cfguard_posterior_kl_max_anchor"), certify.KLBudget(r.Config.Certify.Delta))
	}
	driftAt := time.Now()
	r.Produce(t, clean...)
	waitfor.Cond(t, 60*time.Second, "the next increments applied", func() bool { return applied() == 192 })
	ingestTook := time.Since(driftAt)
	unconfirmed := r.Metric(t, "cfguard_counterfactuals_unconfirmed")
	if unconfirmed == 0 {
		t.Fatalf("confirmation had finished before the three increments after the drift were applied (%v): this test shows nothing", ingestTook)
	}
	t.Logf("3 increments applied %v after the drift while %v CEs still waited for a verdict", ingestTook.Round(time.Millisecond), unconfirmed)
	// About 1 µs per CE and draw on one core (measured: 10^5 CEs x 1000 draws in 84 s). Each check
	// gathers the metrics twice, and each gather scans the indexes of the n CEs: polled every
	// 100 ms, not every waitfor.Interval, the checks cost a small part of the confirmation's CPU.
	limit := max(2*time.Minute, time.Duration(n)*time.Duration(r.Config.Certify.Samples)*3*time.Microsecond)
	waitfor.CondEvery(t, 100*time.Millisecond, limit, "every failing CE confirmed", func() bool {
		return r.Metric(t, "cfguard_counterfactuals_unconfirmed") == 0 && r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0
	})
	t.Logf("confirmed %d CEs %v after the drift", n, time.Since(driftAt).Round(time.Millisecond))
	v := r.D.Posterior().Version
	daemontest.EachCE(t, r.D.Ledger(), func(ce *ledger.CE) {
		if ce.RenewalPending {
			t.Fatalf("%s still waits for renewal after the confirmer finished", ce.ID)
		}
		if ce.Status == certify.AtRisk || ce.Status == certify.Invalidated {
			// A verdict under version v, or one from an earlier version that carries to v: it
			// has the bound that decided it (whether it carries is the ledger's rule,
			// certify.Carries, held there by TestCarriedVerdictsAreTrue; the unconfirmed count
			// of 0 says the ledger found none due).
			switch {
			case ce.ConfirmedVersion == nil || *ce.ConfirmedVersion > v:
				t.Fatalf("%s is %v without a verdict under posterior version %d: %+v", ce.ID, ce.Status, v, ce.ConfirmedVersion)
			case *ce.ConfirmedVersion < v && ce.VerdictBound == nil:
				t.Fatalf("%s is %v with a verdict from version %d < %d that has no bound to carry it", ce.ID, ce.Status, *ce.ConfirmedVersion, v)
			}
		}
	})
}
