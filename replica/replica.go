package replica

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
)

// Replica is a daemon's part in a replicated deployment (replication.enabled, docs/DESIGN.md):
//
//   - the follower plays the posterior log (package postlog) through the acceptance rule and
//     applies each accepted entry to the ledger (Host.Commit), which re-certifies this replica's
//     CEs against it; it never recomputes an update, it applies the recorded last layer and
//     checks the hash;
//   - the updater is the replica whose member of the consumer group <kafka.group_id>.updater
//     is assigned the log's partition: it claims a term, forms increments from kafka.topic
//     starting where the log's head covers, computes each (Host.Compute), appends it, and
//     trusts it only once its own follower has read it back as accepted.
//
// Nothing here decides who writes by time or lease: the group says who should, the log's
// acceptance rule says whose entries count.
type Replica struct {
	host       Host
	ledger     Ledger
	cfg        *config.Config
	configPath string
	conn       stream.ConnConfig // set by Join
	plog       *postlog.Log
	id         string // replication.replica_id, or the host name
	writer     string // "<replica id>/<nonce>": a restarted replica is a new writer
	group      string
	bal        *updaterBalancer // the updater group's balancer: keeps the role where it is
	lg         *slog.Logger
	m          *alerts.ReplicaMetrics
	keys       *clusterkey.Keyring // replication.key_file: signs what this replica writes, verifies what it reads
	// incCaughtUp is Options.CaughtUp: nil but in tests.
	incCaughtUp func(stream.Stats) bool

	mu         sync.Mutex
	chain      *postlog.Chain         // the follower's view; the ledger stores its head
	read       int64                  // the next offset the follower reads
	accepted   map[uint64]string      // seq -> hash of accepted entries, for the updater's read-back
	changed    chan struct{}          // closed and replaced whenever read advances
	stopped    error                  // following stopped for good (unknown format, failed verification)
	halts      int                    // halt calls: an offer in flight across one halts the chain it forked
	epochHalts int                    // halts when the follower last accepted an epoch: a halt since is a reset no epoch began again
	caughtUp   bool                   // read the log to its end once since the start
	logEnds    []logEnd               // the log's ends watchEnd found, from the last not past read (see sawEnd)
	pending    map[string]pendingStep // the updater's steps appended and not yet accepted, by entry hash
	consumer   *stream.Consumer       // the updater's, while it is one
	recent     map[uint64]*bnn.Model  // the last posteriors applied, by version (Past)
	resumed    bool                   // Join resumed from the ledger's head: recent holds no version before it (Recall)
	lag        int64                  // records of the log not read yet, as watchEnd last saw
	ends       map[int]int64          // the input topic's end offsets as last asked (checkCoverage)

	unreadable time.Time // since when the follower failed to read the log (zero once it read a record again)
	starved    time.Time // since when the follower has waited for a record, failing or not (zero while it applies one)
	behind     time.Time // since when the log holds records the follower has not read (watchEnd; zero when none)
	endUnknown time.Time // since when watchEnd has failed to read the log's end (zero while it reads it)
	endErr     error     // why watchEnd's latest read of the log's end failed
	// coverageUnknown is since when the follower has asked for the input topic's end offsets,
	// which the entry coverageEntry it read must be checked against before it is applied
	// (checkCoverage; zero once answered); coverageErr is why the last attempt failed.
	coverageUnknown time.Time
	coverageEntry   uint64
	coverageErr     error
	// refusedNext says why an entry that extends the head, read while catching up, was refused
	// for covering input records that do not exist; nil once an entry is accepted. The replicas
	// that applied it before the input topic was reset or cut serve a later posterior.
	refusedNext error
	rewind      chan struct{} // halt asks Follow to read the log again from its start
	// inputReset is why the updater stopped ingesting (a *stream.TopicResetError), while it keeps
	// the role in that generation.
	inputReset error
	settings   map[string]string // this replica's cluster-wide settings (ClusterSettings)
	refused    error             // why it did not join (a *SettingsError), nil when it did
	// recorded: the genesis or epoch this replica follows recorded the cluster-wide settings
	// (checkSettings), so an epoch recording others changes them.
	recorded atomic.Bool

	updater atomic.Bool
	// failedTerms counts this replica's consecutive terms that ended on an error (a claim or
	// the consumer failing), none of them long (failedTermSpan) and no other writer's term in
	// between: the updater's pause before it rejoins doubles with each (rejoinWait). Guarded
	// by mu (a lead of a generation kafka-go no longer tracks may overlap the next).
	failedTerms int

	pastMu   sync.Mutex        // one play of the log for Past at a time
	pastAt   *pastCursor       // where the last one stopped (pastMu)
	pastKept keptCursors       // where the last ones found versions (pastMu)
	pastHash bnn.WeightsHasher // hashes the posteriors a play applies (pastMu)

	// hash hashes the posteriors the follower applies (applyEntry), guarded by hashMu.
	hashMu sync.Mutex
	hash   bnn.WeightsHasher
}

// acceptedWindow is how many recent accepted entries the follower remembers for read-back.
const acceptedWindow = 4096

// Options are what New needs: the daemon's configuration (read only), where the replica's
// metrics go, its logger, the daemon it acts on (Host) and the daemon's ledger.
type Options struct {
	Config *config.Config
	// ConfigPath is the configuration file's path, for the errors that name it.
	ConfigPath string
	Registry   prometheus.Registerer
	Logger     *slog.Logger
	Host       Host
	Ledger     Ledger
	// CaughtUp, when set (by tests), replaces the updater's judgement that its consumer was
	// caught up when an increment closed (stream.Stats.CaughtUp): a test says it was not, as a
	// transaction marker fetched only after the increment closed would.
	CaughtUp func(stream.Stats) bool
}

// ID is the id of a replica configured with replication.replica_id configured: that id, or the
// host name when it is empty.
func ID(configured string) (string, error) {
	if configured != "" {
		return configured, nil
	}
	h, err := os.Hostname()
	if err == nil && h == "" {
		err = errors.New("the system gives an empty one")
	}
	if err != nil {
		return "", fmt.Errorf("replication.replica_id is empty and the host name cannot be read (%w): set replication.replica_id", err)
	}
	return h, nil
}

// New names this process's writer, loads replication.key_file and registers the replication
// metrics. It does not talk to Kafka: Join does.
func New(opts Options) (*Replica, error) {
	cfg := opts.Config
	id, err := ID(cfg.Replication.ReplicaID)
	if err != nil {
		return nil, err
	}
	nonce := make([]byte, 4)
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	keys, err := clusterkey.Load(cfg.Replication.KeyFile)
	if err != nil {
		return nil, err
	}
	r := &Replica{host: opts.Host, ledger: opts.Ledger, cfg: cfg, configPath: opts.ConfigPath, id: id, incCaughtUp: opts.CaughtUp,
		writer: id + "/" + hex.EncodeToString(nonce), group: cfg.Kafka.GroupID + ".updater", bal: &updaterBalancer{topic: cfg.Replication.PosteriorTopic},
		accepted: map[uint64]string{}, changed: make(chan struct{}), pending: map[string]pendingStep{},
		recent: map[uint64]*bnn.Model{}, keys: keys, rewind: make(chan struct{}, 1)}
	r.lg = opts.Logger.With("component", "replica", "writer", r.writer)
	var reasons []string
	for _, reason := range []postlog.Reason{postlog.NotSuccessor, postlog.StaleTerm, postlog.Invalid, postlog.Malformed, postlog.UnknownFormat, postlog.Unauthenticated, postlog.PastEnd, postlog.OtherLog} {
		reasons = append(reasons, string(reason))
	}
	r.m = alerts.NewReplicaMetrics(opts.Registry, reasons, cfg.Replication.PosteriorTopic, cfg.Replication.CETopic,
		ceshare.StateTopic(cfg.Replication.CETopic), ceshare.GroupSource(ceshare.GroupOf(cfg.Kafka.GroupID)))
	r.lg.Info("cluster key loaded", "key_file", keys.Source(), "signs_with", keys.IDs()[0], "verifies", keys.IDs())
	if mode, exposed := clusterkey.Exposed(cfg.Replication.KeyFile); exposed {
		r.lg.Warn("the cluster key file can be read or written by every user of this machine: whoever reads it can write records every replica accepts; "+
			"chmod o-rw it (a Kubernetes Secret mounted with defaultMode 0440 is not exposed)", "key_file", keys.Source(), "mode", mode.String())
	}
	return r, nil
}

// ID is replication.replica_id, or the host name.
func (r *Replica) ID() string { return r.id }

// Keys is replication.key_file's keyring: the CE topic's requests are signed and verified with it too.
func (r *Replica) Keys() *clusterkey.Keyring { return r.keys }

// Metrics are the replication metrics (the CE share counts its own among them).
func (r *Replica) Metrics() *alerts.ReplicaMetrics { return r.m }

// Close closes the posterior log (once Join opened it).
func (r *Replica) Close() error {
	if r.plog == nil {
		return nil
	}
	return r.plog.Close()
}

// Health is the replica's part of /readyz: following (not stopped), caught up with the log once
// since the start, and, on the updater, a healthy consumer.
func (r *Replica) Health() error {
	r.mu.Lock()
	stopped, caughtUp, c, reset, starved, behind, lag := r.stopped, r.caughtUp, r.consumer, r.inputReset, r.starved, r.behind, r.lag
	endUnknown, endErr, refusedNext := r.endUnknown, r.endErr, r.refusedNext
	coverageUnknown, coverageEntry, coverageErr := r.coverageUnknown, r.coverageEntry, r.coverageErr
	r.mu.Unlock()
	switch {
	case stopped != nil:
		return fmt.Errorf("not following the posterior log: %w", stopped)
	case !caughtUp:
		return errors.New("catching up with the posterior log")
	case !endUnknown.IsZero() && time.Since(endUnknown) >= resetAfter:
		// Without the log's end, no entry can be known to wait: the broker is unreachable, and
		// no replica can be the updater meanwhile.
		return fmt.Errorf("the posterior log cannot be read: its end has not been read for %s (%v); serving the last posterior applied",
			time.Since(endUnknown).Round(time.Second), endErr)
	case !starved.IsZero() && !behind.IsZero() && time.Since(later(starved, behind)) >= resetAfter:
		return fmt.Errorf("the posterior log cannot be read: no record for %s while %d wait; serving the last posterior applied",
			time.Since(later(starved, behind)).Round(time.Second), lag)
	case !coverageUnknown.IsZero() && time.Since(coverageUnknown) >= resetAfter:
		// An entry read and not applied: the log moved on while this replica serves its head.
		why := "no answer yet"
		if coverageErr != nil {
			why = coverageErr.Error()
		}
		return fmt.Errorf("the posterior log's entry %d cannot be applied: its coverage is checked against kafka.topic's end offsets, "+
			"asked for %s without an answer (%s); serving the last posterior applied",
			coverageEntry, time.Since(coverageUnknown).Round(time.Second), why)
	case reset != nil:
		return fmt.Errorf("updater: ingest stopped: %w", reset)
	case refusedNext != nil:
		// Either a writer lied about its coverage and the next entry takes its place, or the
		// input topic lost records after replicas applied it: they serve a later posterior.
		return fmt.Errorf("the posterior log's newest entry past this replica's head is refused (%w): either the input topic lost records since the others applied it, and they serve a later posterior, or a holder of the cluster key wrote it and every replica refused it; an entry accepted next (the updater's, at the next input record) ends this", refusedNext)
	}
	if c != nil {
		if h := c.Health(); !h.Ready {
			return fmt.Errorf("updater's consumer not ready: %v", h.Reasons)
		}
	}
	return nil
}

// Status is GET /v1/model's replication block (the lag as of the last check of the log's end,
// at most a second old: a request does not ask the broker).
func (r *Replica) Status() map[string]any {
	h := r.Head()
	r.mu.Lock()
	lag, stopped := r.lag, r.stopped
	r.mu.Unlock()
	covers := h.Covers
	if covers == nil {
		covers = map[int]int64{} // a genesis covers no record
	}
	out := map[string]any{"writer": r.writer, "updater": r.updater.Load(), "entry": h.Seq, "term": h.Term,
		"offset": h.Offset, "hash": h.Hash, "epoch": h.Epoch, "posterior_sha256": h.PosteriorSHA256, "covers": covers,
		"topic": r.plog.Topic(), "lag_records": lag}
	if h.GenesisHash != "" {
		out["genesis"] = h.GenesisHash
	}
	if stopped != nil {
		out["stopped"] = stopped.Error()
	}
	return out
}

// buildString names this build in claims: module version, GOARCH, engine.
func buildString() string {
	v := "devel"
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		v = bi.Main.Version
	}
	return fmt.Sprintf("cfguard %s %s/%s %s", v, runtime.GOOS, runtime.GOARCH, bnn.Backend)
}

// Updater reports whether this replica is the updater now.
func (r *Replica) Updater() bool { return r.updater.Load() }
