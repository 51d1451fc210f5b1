package replica

import (
	"context"
	"encoding/json"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
)

// Host is what a replica may do to the daemon it runs in. The replica decides what the
// posterior log says and when it is applied; the host computes increments and writes the
// ledger, as a single daemon does.
type Host interface {
	// Current is the posterior the daemon serves.
	Current() *bnn.Model
	// SetCurrent makes m the posterior the daemon serves, once Join has found it in the ledger
	// or the log's genesis (the ledger already stores it).
	SetCurrent(m *bnn.Model)
	// InitialModel is the first posterior the configuration names (model.path's, or one trained
	// on model.dataset): the genesis this replica appends to an empty log.
	InitialModel(ctx context.Context) (*bnn.Model, error)
	// Consumer reads kafka.topic from resume (the log head's coverage) for the updater, after
	// checking that the topic still holds the records marks identify (the head's marks).
	Consumer(ctx context.Context, resume map[int]int64, marks map[int]stream.RecordMark) (*stream.Consumer, error)
	// TopicReset says that the updater's consumer found kafka.topic reset (e): ingest stops;
	// nil once a new epoch moved past it.
	TopicReset(e *stream.TopicResetError)
	// Compute runs inc through the update and the on-breach policy from prev, writing nothing.
	Compute(ctx context.Context, prev *bnn.Model, inc *stream.Increment) (Step, error)
	// Commit writes the accepted increment entry e, which takes the posterior from prev to next
	// (the posterior the entry records on prev), with cp (the covered offsets and the log's head),
	// and makes next current. own is the Step this replica computed for e when e is its own
	// entry, nil otherwise. An error stops following.
	//
	// When own is nil the host publishes none of e's events: e's writer does, or, when it may
	// not have, the next claimant (Checkpoint with cp.Events).
	Commit(ctx context.Context, e *postlog.Entry, prev, next *bnn.Model, own Step, cp *ledger.Checkpoint) error
	// Checkpoint writes cp (the log's head, and the events a claimant publishes again), keeping
	// the posterior.
	Checkpoint(ctx context.Context, cp *ledger.Checkpoint) error
	// DeadLettered counts n records the updater dead-lettered, once its entry is accepted.
	DeadLettered(n int)
}

// Step is an increment as Host.Compute decided it. The replica reads only its Summary (what
// the log entry records) and hands the Step back to Host.Commit once its entry is accepted.
type Step interface {
	// Summary is what the log's entry number entry records of the step.
	Summary(entry uint64) Summary
}

// Summary is what an increment's log entry records of its step.
type Summary struct {
	Outcome  certify.Outcome // "" for an increment without records
	KL       float64
	Seed     uint64
	Counters map[string]int64 // "failed" and "held" are recorded; the rest the entry counts itself
	Quality  json.RawMessage  // the increment's prequential record, nil without one
	Next     *bnn.Model       // the promoted posterior, nil when the posterior is kept
	Records  int              // the records applied, when Next is set
	// Events are the step's posterior events as the host's outbox will hold them once the
	// entry is accepted (each naming the entry), for the entry to carry.
	Events []postlog.Event
}

// Ledger is what a replica reads and writes of the daemon's ledger itself (*ledger.Ledger):
// the log's head it applied last, and the genesis's first checkpoint.
type Ledger interface {
	LogHead() ([]byte, error)
	Current() (*bnn.Model, error)
	Checkpoint(cp *ledger.Checkpoint) error
	Path() string
}
