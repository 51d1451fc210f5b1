// Package hooks holds the points at which a test steps into a running daemon: callbacks called
// at a moment of its work, to hold it there as a starved CPU or a slow group would, or to act
// there as a concurrent client can; and shorter waits than a daemon's own. The daemon takes them
// from daemon.Options.Hooks, a *Set; only packages under daemon can import this one, so only
// they can make one, and a program outside them leaves that field nil: a daemon's normal
// behaviour.
package hooks

import (
	"context"
	"time"

	"github.com/cfguard/cfguard/stream"
)

// Set is the hooks of one daemon; nil callbacks are not called, zero durations are the daemon's
// own.
type Set struct {
	// Registered is called when a single daemon's registration stored its CE, before its answer
	// reads the CE back: a test deletes it there, as a concurrent DELETE can.
	Registered func(id string)
	// ConfirmRound is called by each confirmer lane before each of its rounds.
	ConfirmRound func(ctx context.Context)
	// OutboxPublish is called before each attempt of the outbox publisher: an error fails the
	// attempt, as a broker that refuses it would (the entries stay in the outbox).
	OutboxPublish func(ctx context.Context) error
	// UpdaterCaughtUp, when set, replaces a replica's updater's judgement that its consumer was
	// caught up when an increment closed (replica.Options.CaughtUp).
	UpdaterCaughtUp func(stream.Stats) bool
	// CEGeneration is called with each CE group generation's assignment before this replica
	// takes it up (ceshare.MemberConfig.OnGeneration).
	CEGeneration func(ctx context.Context, generation int32, assigned []int)
	// CEClock is the clock this replica's CE group member reads to find a pause of the process
	// (ceshare.MemberConfig.Now): a test moves it on past the session, as a SIGSTOP would.
	CEClock func() time.Time
	// AuditBatchDone is called after each batch an audit writes, with the CEs evaluated so far:
	// a test holds an audit between its batches there.
	AuditBatchDone func(done, total int)
	// AuditPoolReady is called when an audit has its networks, before the ledger reads its
	// first batch: a test promotes posteriors there, as busy ingestion does.
	AuditPoolReady func(ctx context.Context, version uint64)
	// FollowCommit is called by a replica's follower before it commits the entry that makes
	// version current: a test holds the follower there, as a starved one would be.
	FollowCommit func(ctx context.Context, version uint64)
	// ShareAwait is called when a batch of CE requests waits for the posterior version it
	// needs (cluster.Share.Apply), before it waits.
	ShareAwait func(version uint64)
	// PredictAwait is called when a prediction waits for the posterior version its
	// min_version names, before its first wait: a test learns that the request is in the
	// daemon, waiting.
	PredictAwait func(version uint64)
	// Reissue is called by the reissuer before it generates the replacement of CE id: a test
	// holds it there, as a slow generation would, and stops the daemon with CEs still queued.
	Reissue func(ctx context.Context, id string)
	// AuditRebuildWait, when set, replaces cluster.AuditRebuildWait (a test does not wait 2
	// minutes).
	AuditRebuildWait time.Duration
	// LedgerFailureHold, when set, replaces how long /readyz and cfguard_ledger_write_failing
	// report a failed ledger commit after the last one (a minute: a test does not wait that long).
	LedgerFailureHold time.Duration
	// LedgerAfterCommit is the ledger's ledger.Options.AfterCommit: a test fails its commits.
	LedgerAfterCommit func() error
	// Recall is called by a replica before it recalls the posteriors it served before its
	// start: a test holds it there, as a long posterior log or a broker that does not answer
	// would.
	Recall func(ctx context.Context)
	// RecallWait, when set, replaces recallWait (a test does not wait a minute).
	RecallWait time.Duration
}
