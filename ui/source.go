package ui

import (
	"context"
	"errors"
	"time"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
)

// ErrNotYet is matched (errors.Is) by the error of a Source that cannot answer now and will in
// a moment: on replicas, while a partition of counterfactuals has no owner (a rebalance) or its
// owner is still rebuilding it. Its page is 503 with Retry-After and says so, with the error.
var ErrNotYet = errors.New("not available yet")

// ErrBlocked is matched (errors.Is) by the error of a Source whose answer waits on a CE
// partition blocked at a request the owner's build cannot read: it will not answer by itself
// (an upgrade, or a skipped request, ends it).
var ErrBlocked = errors.New("blocked")

// Source is what the pages read: the daemon's state, as the API reads it.
type Source interface {
	// Snapshot is the overview's figures, read at one posterior version.
	Snapshot(ctx context.Context) (Snapshot, error)
	// List returns up to limit stored CEs after the id after, in id order, with status s (0:
	// every status), and the cursor of the next page ("" after the last), as GET
	// /v1/counterfactuals does (on replicas, the whole cluster's).
	List(ctx context.Context, s certify.Status, limit int, after string) (ces []*ledger.CE, next string, err error)
	// Get returns a stored CE (ledger.ErrNotFound when there is none).
	Get(ctx context.Context, id string) (*ledger.CE, error)
	// Events returns up to n events not yet published, newest first.
	Events(n int) ([]ledger.OutboxEntry, error)
	// Publishing says whether the events leave for the events topic: the zero value while the
	// publisher's attempts work.
	Publishing() Publishing
}

// Publishing is the state of the publisher that moves events to the events topic (and, on
// replicas, CE states to the CE state topic).
type Publishing struct {
	FailingSince time.Time // when its attempts began to fail; zero while they work
	Attempts     int       // failed attempts since then
	Err          string    // the latest attempt's error
}

// Snapshot is the state the overview shows.
type Snapshot struct {
	PosteriorVersion uint64
	Features         []string // input feature names; empty when the model has none
	Classes          []string
	Budget           float64 // the KL budget (Theorem 1 from p1 = 1 - delta)
	Delta, Epsilon   float64
	EpsilonMax       float64 // certify.epsilon_max: Theorem 2's ceiling is max(EpsilonMax, a CE's epsilon); 0: not known
	Alpha            float64 // the verdicts' and renewals' miss probability (certify.verdict_alpha)
	Mode             string
	State            ledger.State
	// History is the newest update KL entries, oldest first.
	History []ledger.KLEntry
	// Replication is GET /v1/model's replication block, nil for a single daemon.
	Replication map[string]any
	// Quality is GET /v1/model's prequential block, nil before the first scored increment.
	Quality map[string]any
	// Gauges are the daemon's own metrics at the time of the snapshot, by series: the name, with
	// its labels in braces when it has some (`cfguard_counterfactuals{status="at_risk"}`). The
	// overview evaluates the alerts' conditions on them. Nil: not known.
	Gauges map[string]float64
	// NotReady is why the daemon's /readyz answers 503 (a broker that does not answer, a ledger
	// that cannot be written, ...), "" when it is ready.
	NotReady string
	// Now is when the snapshot was read.
	Now time.Time
}
