package daemon

import (
	"errors"
	"testing"
	"time"

	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/ledger"
)

// TestAuditorBusyGuessAndLastResult: while an audit runs, begin refuses another with an
// auditBusyError whose remaining time (Retry-After of the 409) is what the last finished audit
// took minus how long the running one has run, at least a second (a second too before any
// audit finished); the error matches cluster.ErrPeerBusy. end records the audit's duration for
// that guess, clears running, and keeps in the status the last successful report: a failed
// audit sets last_error (without the ledger's directory) and leaves last as it was, and the
// next successful audit clears last_error.
func TestAuditorBusyGuessAndLastResult(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	var a auditor
	busy := func(now time.Time) *auditBusyError {
		t.Helper()
		err := a.begin("api", now)
		var b *auditBusyError
		if !errors.As(err, &b) {
			t.Fatalf("begin at %v while an audit runs: %v, want an auditBusyError", now.Sub(t0), err)
		}
		if !errors.Is(err, cluster.ErrPeerBusy) {
			t.Fatalf("the busy error %v does not match cluster.ErrPeerBusy", err)
		}
		return b
	}

	// No audit finished yet: a second.
	if err := a.begin("schedule", at(0)); err != nil {
		t.Fatal(err)
	}
	if b := busy(at(2 * time.Second)); b.remaining != time.Second || b.trigger != "schedule" || !b.started.Equal(at(0)) {
		t.Fatalf("busy before any audit finished: %+v, want 1s left of the scheduled audit started at t0", b)
	}
	a.end(ledger.AuditReport{Evaluated: 7}, nil, at(10*time.Second)) // took 10 s

	steps := []struct {
		name      string
		begin     time.Duration
		probe     time.Duration // a second begin at this time
		want      time.Duration
		end       time.Duration
		err       error
		lastEval  int
		lastError string
	}{
		{"3 s into an audit after one of 10 s", 20 * time.Second, 23 * time.Second, 7 * time.Second,
			35 * time.Second, errors.New("reading /var/lib/cfguard/cfguard.db: input/output error"), 7, "reading cfguard.db: input/output error"},
		// The last audit (failed) took 15 s.
		{"14 s into an audit after one of 15 s", 40 * time.Second, 54 * time.Second, time.Second,
			44 * time.Second, nil, 9, ""},
		// The last audit took 4 s.
		{"1 s into an audit after one of 4 s", 50 * time.Second, 51 * time.Second, 3 * time.Second,
			60 * time.Second, nil, 9, ""},
		// The last audit took 10 s; the running one has run 30 s: still a second.
		{"30 s into an audit after one of 10 s", 70 * time.Second, 100 * time.Second, time.Second,
			101 * time.Second, nil, 9, ""},
	}
	for _, s := range steps {
		if err := a.begin("api", at(s.begin)); err != nil {
			t.Fatalf("%s: begin after the last audit ended: %v", s.name, err)
		}
		if st := a.status(); !st.Running || st.Trigger != "api" || st.StartedAt == nil || !st.StartedAt.Equal(at(s.begin)) {
			t.Fatalf("%s: status while running %+v", s.name, st)
		}
		if b := busy(at(s.probe)); b.remaining != s.want {
			t.Fatalf("%s: busy error says %v left, want %v", s.name, b.remaining, s.want)
		}
		a.end(ledger.AuditReport{Evaluated: 9}, s.err, at(s.end))
		st := a.status()
		if st.Running || st.Trigger != "" || st.StartedAt != nil || st.LastFinished == nil || !st.LastFinished.Equal(at(s.end)) {
			t.Fatalf("%s: status after the end %+v", s.name, st)
		}
		if st.Last == nil || st.Last.Evaluated != s.lastEval || st.LastError != s.lastError {
			t.Fatalf("%s: last %+v, last_error %q; want the report of the last successful audit (%d evaluated) and last_error %q",
				s.name, st.Last, st.LastError, s.lastEval, s.lastError)
		}
	}
}
