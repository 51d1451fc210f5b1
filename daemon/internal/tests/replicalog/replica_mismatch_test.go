package replicalog

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
)

// TestIncrementWhosePosteriorDoesNotVerifyStopsTheReplica: an increment that the acceptance rule
// takes (on the head, in its term, by its claimant, one version on) but whose last layer does not
// hash to the posterior it records is the entry's fault, not the replica's: the follower stops
// (/readyz 503, cfguard_posterior_log_stopped 1) naming the mismatch and the recovery for an entry
// it cannot apply (a build that reads it, or cfguard new-epoch), not the one for an entry it could
// not store (a restart), and keeps serving the posterior it verified.
func TestIncrementWhosePosteriorDoesNotVerifyStopsTheReplica(t *testing.T) {
	t.Parallel() // mostly waits for its replica
	r, before, _ := appendAnIncrementThatDoesNotVerify(t)
	var body string
	waitfor.Cond(t, 60*time.Second, "the replica stops following", func() bool {
		code, b := r.Get(t, "/readyz")
		body = string(b)
		return code == http.StatusServiceUnavailable && strings.Contains(body, "posterior does not match its entry") &&
			r.Metric(t, "cfguard_posterior_log_stopped") == 1
	})
	for _, want := range []string{"cfguard new-epoch moves the log past it", "CfguardPosteriorLogStopped"} {
		if !strings.Contains(body, want) {
			t.Errorf("/readyz does not say %q: %s", want, body)
		}
	}
	if strings.Contains(body, "could not store it") {
		t.Errorf("/readyz takes the entry for one the replica could not store: %s", body)
	}
	if after := r.Model(t); after.Version != before.Version || after.Replication.Entry != before.Replication.Entry {
		t.Errorf("the stopped replica serves version %d entry %d; want what it verified: version %d entry %d",
			after.Version, after.Replication.Entry, before.Version, before.Replication.Entry)
	}
}

// TestStoppedUpdaterAppendsNothing: an updater whose follower stopped at an entry it cannot
// apply forms the next increment when records arrive but appends nothing on a head that is no
// longer the log's (every replica would ignore it as no successor of the stopping entry); it
// keeps the updater role until a new epoch moves the log on.
func TestStoppedUpdaterAppendsNothing(t *testing.T) {
	t.Parallel() // mostly waits for its replica
	r, _, plog := appendAnIncrementThatDoesNotVerify(t)
	waitfor.Cond(t, 60*time.Second, "the replica stops following", func() bool {
		return r.Metric(t, "cfguard_posterior_log_stopped") == 1
	})
	end, err := plog.End(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	daemontest.ProduceRows(t, r, daemontest.Bundled(t), 0, 16)
	waitfor.Cond(t, 60*time.Second, "the updater forms an increment and keeps its role", func() bool {
		return strings.Contains(r.Logs.String(), "updater: the posterior log stopped; keeping the updater role")
	})
	if got, err := plog.End(context.Background()); err != nil || got != end {
		t.Errorf("the posterior log ends at %d (%v) after the stopped updater read records; want %d, nothing appended", got, err, end)
	}
	if n := r.Metric(t, alerts.NameLogIgnored, "reason", string(postlog.NotSuccessor)); n != 0 {
		t.Errorf("%v records ignored as not_successor; want none", n)
	}
	if !r.D.Replica().Updater() {
		t.Error("the stopped updater gave its role up")
	}
}

// appendAnIncrementThatDoesNotVerify starts replica r1, waits until it is ready in a term it
// claimed, and appends, with the cluster key, an increment that the acceptance rule takes (on the
// head, in its term, by its claimant, one version on) but whose last layer does not hash to the
// posterior it records. It returns the replica, what GET /v1/model answered before the append,
// and the log it appended to.
func appendAnIncrementThatDoesNotVerify(t *testing.T) (*launch.Running, daemontest.ModelView, *postlog.Log) {
	t.Helper()
	b := daemontest.StartCluster(t, 1)
	r := launch.Replica(t, b, "r1")
	waitfor.Cond(t, 60*time.Second, "r1 ready in a term it claimed", func() bool {
		code, _ := r.Get(t, "/readyz")
		return code == http.StatusOK && r.D.Replica().Head().Term > 0
	})
	before := r.Model(t)
	h := r.D.Replica().Head()
	m := r.D.Posterior().Clone()
	m.Last().WeightMu[0] += 0.5
	m.Version = h.Version + 1
	e := &postlog.Entry{Format: postlog.Format, Kind: postlog.Increment, Seq: h.Seq + 1, Parent: h.Hash, Term: h.Term, Writer: h.Writer,
		Version: m.Version, ParentVersion: h.Version, Covers: h.Covers, Outcome: postlog.Promoted, Counts: &postlog.Counts{},
		LastLayer: postlog.LastLayerOf(m), PosteriorSHA256: h.PosteriorSHA256} // the parent's hash, not m's
	h.Lineage(e)
	plog := daemontest.KeyHolderLog(t, r)
	daemontest.AppendEntry(t, plog, e)
	return r, before, plog
}
