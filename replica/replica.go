package replica

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/ledger"
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
	lag        int64                  // records of the log not read yet, as watchEnd last saw
	ends       map[int]int64          // the input topic's end offsets as last asked (checkCoverage)

	unreadable time.Time // since when the follower failed to read the log (zero once it read a record again)
	starved    time.Time // since when the follower has waited for a record, failing or not (zero while it applies one)
	behind     time.Time // since when the log holds records the follower has not read (watchEnd; zero when none)
	endUnknown time.Time // since when watchEnd has failed to read the log's end (zero while it reads it)
	endErr     error     // why watchEnd's latest read of the log's end failed
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

	pastMu   sync.Mutex  // one play of the log for Past at a time
	pastAt   *pastCursor // where the last one stopped (pastMu)
	pastKept keptCursors // where the last ones found versions (pastMu)
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
	r := &Replica{host: opts.Host, ledger: opts.Ledger, cfg: cfg, configPath: opts.ConfigPath, id: id,
		writer: id + "/" + hex.EncodeToString(nonce), group: cfg.Kafka.GroupID + ".updater", bal: &updaterBalancer{topic: cfg.Replication.PosteriorTopic},
		accepted: map[uint64]string{}, changed: make(chan struct{}), pending: map[string]pendingStep{},
		recent: map[uint64]*bnn.Model{}, keys: keys, rewind: make(chan struct{}, 1)}
	r.lg = opts.Logger.With("component", "replica", "writer", r.writer)
	var reasons []string
	for _, reason := range []postlog.Reason{postlog.NotSuccessor, postlog.StaleTerm, postlog.Invalid, postlog.Malformed, postlog.Unauthenticated, postlog.PastEnd} {
		reasons = append(reasons, string(reason))
	}
	r.m = alerts.NewReplicaMetrics(opts.Registry, reasons, cfg.Replication.PosteriorTopic, cfg.Replication.CETopic,
		ceshare.StateTopic(cfg.Replication.CETopic), ceshare.GroupSource(ceshare.GroupOf(cfg.Kafka.GroupID)))
	r.lg.Info("cluster key loaded", "key_file", keys.Source(), "signs_with", keys.IDs()[0], "verifies", keys.IDs())
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

// Join opens the posterior log on conn and sets the current posterior from it: the ledger's,
// checked against the log when this replica followed it before; else the log's genesis, appended
// by this replica first when the log is empty (the first valid genesis wins, whoever wrote it).
// A replica whose cluster-wide settings differ from the genesis's returns a *SettingsError. Join
// may be called again after it failed (a broker that could not be reached): it opens the log again.
func (r *Replica) Join(ctx context.Context, conn stream.ConnConfig) error {
	r.conn = conn
	if r.plog != nil {
		r.plog.Close()
		r.plog = nil
	}
	var err error
	if r.settings, err = ClusterSettings(r.cfg); err != nil {
		return err
	}
	if r.plog, err = postlog.Open(ctx, r.conn, r.cfg.Replication.PosteriorTopic, r.keys, r.lg); err != nil {
		return err
	}
	stored, err := r.ledger.LogHead()
	if err != nil {
		return err
	}
	head, err := postlog.UnmarshalHead(stored)
	if err != nil {
		return fmt.Errorf("%w (the ledger %s is damaged: move state_dir aside and the replica rebuilds from Kafka)", err, r.ledger.Path())
	}
	if head != nil {
		m, err := r.ledger.Current()
		if err != nil {
			return err
		}
		if err := r.checkHead(ctx, head); err != nil {
			return err
		}
		g, at, err := r.genesisOf(ctx, head)
		if err != nil {
			return err
		}
		if err := r.checkSettings(g, at); err != nil {
			return err
		}
		r.chain, r.read = postlog.Resume(head, r.keys), head.Offset+1
		r.host.SetCurrent(m)
		r.remember(m)
		r.lg.Info("following the posterior log", "topic", r.plog.Topic(), "entry", head.Seq, "term", head.Term,
			"posterior_version", head.Version, "posterior_sha256", head.PosteriorSHA256)
		return nil
	}
	if _, err := r.ledger.Current(); err == nil {
		return fmt.Errorf("state_dir %s holds the ledger of a single daemon (%s), which a replica does not follow: "+
			"start the replica with an empty state_dir, or set replication.enabled: false", r.cfg.StateDir, r.ledger.Path())
	} else if !errors.Is(err, ledger.ErrNoPosterior) {
		return err
	}
	return r.genesis(ctx)
}

// checkHead verifies that the entry the ledger applied last is still in the log, at its offset
// with its bytes: a log that lost it (a recreated topic, an unclean election) would otherwise be
// followed from another history.
func (r *Replica) checkHead(ctx context.Context, head *postlog.Head) error {
	end, err := r.plog.End(ctx)
	if err != nil {
		return err
	}
	if end <= head.Offset { // no record to wait for: the log ends before it
		return r.resetError(head, fmt.Sprintf("the topic ends at offset %d", end))
	}
	rd, err := r.plog.Read(head.Offset)
	if err != nil {
		return err
	}
	defer rd.Close()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	rec, err := rd.Next(cctx)
	if err == nil && rec.Offset == head.Offset && hashHex(rec.Value) == head.Hash {
		if aerr := postlog.Authenticate(r.keys, rec); aerr != nil {
			return fmt.Errorf("the entry the ledger %s applied last (offset %d of replication.posterior_topic %s) does not authenticate "+
				"under the keys of replication.key_file %s (%w): this is not the key file the cluster uses. Give this replica the cluster's "+
				"key file (keep every key that signed entries the log still holds); the ledger was not changed",
				r.ledger.Path(), head.Offset, r.plog.Topic(), r.keys.Source(), aerr)
		}
		return nil
	}
	found := "no record"
	if err == nil {
		found = fmt.Sprintf("the record at offset %d hashes to %s", rec.Offset, hashHex(rec.Value))
	} else if ctx.Err() == nil {
		found = err.Error()
	}
	return r.resetError(head, found)
}

// resetError is checkHead's refusal: the log no longer holds head, the entry the ledger applied
// last (found says what is there instead).
func (r *Replica) resetError(head *postlog.Head, found string) error {
	return fmt.Errorf("posterior log reset: the ledger %s applied entry %d (offset %d, sha256 %s) of replication.posterior_topic %s, "+
		"and the topic no longer holds it (%s). The ledger was not changed. Once a new epoch gives the log a start again (cfguard "+
		"new-epoch --head-from, docs/RUNBOOK.md, CfguardPosteriorLogStopped), move state_dir aside and restart: the replica rebuilds "+
		"from it", r.ledger.Path(), head.Seq, head.Offset, head.Hash, r.plog.Topic(), found)
}

func hashHex(v []byte) string {
	h := postlog.Hash(v)
	return hex.EncodeToString(h[:])
}

// noLiveUpdaters fails when the updater group has members: replicas that run on a log this
// replica does not see (it was deleted and recreated, or emptied), which only a new epoch from
// one of their heads may start again. Members are waited out for a session timeout first (a
// process of this replica's, killed, stays a member that long). A group that cannot be described
// is asked again while the error is one a retry fixes (a coordinator not ready on a new cluster).
func (r *Replica) noLiveUpdaters(ctx context.Context) error {
	tr, err := r.conn.Transport(ctx)
	if err != nil {
		return err
	}
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(r.conn.Brokers...), Transport: tr}
	bo := backoff.Backoff{Min: 100 * time.Millisecond, Max: 2 * time.Second}
	deadline := time.Now().Add(r.cfg.Replication.SessionTimeout + 5*time.Second)
	for {
		res, err := cl.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{r.group}})
		if err == nil && len(res.Groups) == 1 {
			err = res.Groups[0].Error
		}
		var members []string
		switch {
		case errors.Is(err, kafka.GroupIdNotFound):
			return nil // a new cluster's group, not created yet
		case err == nil && (len(res.Groups) != 1 || len(res.Groups[0].Members) == 0):
			return nil
		case err == nil:
			for _, m := range res.Groups[0].Members {
				members = append(members, m.ClientHost)
			}
			if end, eerr := r.plog.End(ctx); eerr == nil && end > 0 {
				return errLogGrew // a genesis landed meanwhile: the caller reads it
			}
		case ctx.Err() != nil:
			return ctx.Err()
		case !stream.Retryable(err):
			hint := ""
			if errors.Is(err, kafka.GroupAuthorizationFailed) {
				hint = "; the replicas' principal needs Describe on it"
			}
			return fmt.Errorf("replication.posterior_topic %s is empty, and whether replicas run on it cannot be told (describing the "+
				"group %s: %w%s): nothing was written", r.plog.Topic(), r.group, err, hint)
		}
		if time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("replication.posterior_topic %s is empty, and whether replicas run on it cannot be told (describing the "+
					"group %s: %w): nothing was written; retry", r.plog.Topic(), r.group, err)
			}
			return fmt.Errorf("replication.posterior_topic %s is empty, but %d replicas run in the updater group %s (hosts %s, still there "+
				"after replication.session_timeout): either this replica's replication.posterior_topic is not the topic they follow "+
				"(every replica names the same: compare the configuration files; this start created %s if it did not exist), or "+
				"the log they follow was deleted or emptied under them, and a genesis of this "+
				"replica's would start a second history beside theirs; nothing was written: a new log starts from one of their heads "+
				"(cfguard new-epoch --head-from <a running replica's URL>, see docs/RUNBOOK.md, CfguardPosteriorLogStopped), then start "+
				"this replica again", r.plog.Topic(), len(members), r.group, strings.Join(members, ", "), r.plog.Topic())
		}
		if err := bo.Wait(ctx); err != nil {
			return err
		}
	}
}

// errLogGrew: the posterior log, empty when looked at, holds records now.
var errLogGrew = errors.New("the posterior log grew meanwhile")

// appendGenesis appends a genesis of this replica's first posterior (Host.InitialModel) to the
// log.
func (r *Replica) appendGenesis(ctx context.Context) error {
	m, err := r.host.InitialModel(ctx)
	if err != nil {
		return err
	}
	body, err := postlog.NewBody(m)
	if err != nil {
		return err
	}
	sha, err := postlog.PosteriorHash(m)
	if err != nil {
		return err
	}
	e := &postlog.Entry{Format: postlog.Format, Kind: postlog.Genesis, Writer: r.writer, Version: m.Version,
		ParentVersion: m.Version, PosteriorSHA256: sha, Body: body, Settings: r.settings}
	v, err := e.Encode()
	if err != nil {
		return err
	}
	if err := r.plog.Append(ctx, "genesis", v); err != nil {
		return err
	}
	r.lg.Info("posterior log empty: genesis appended", "posterior_sha256", sha, "bytes", len(v))
	return nil
}

// genesis finds the log's genesis, appending one from this replica's first posterior when the
// log has none, and checkpoints the accepted one as the ledger's first posterior.
func (r *Replica) genesis(ctx context.Context) error {
	end, err := r.plog.End(ctx)
	if err != nil {
		return err
	}
	rd, err := r.plog.Read(0)
	if err != nil {
		return err
	}
	defer rd.Close()
	chain := postlog.NewChain(r.keys)
	awaited := false          // a genesis was appended: read on until one is accepted
	authentic, forged := 0, 0 // records below end that authenticate, and that do not
	for next := int64(0); ; {
		if next >= end && !awaited && forged > 0 && authentic == 0 {
			// A replica with another key would otherwise write a genesis of its own, accept it
			// alone, and follow a log no other replica follows.
			return fmt.Errorf("replication.posterior_topic %s holds %d records and none authenticates under the keys of replication.key_file %s (%s): "+
				"this replica's key file is not the cluster's (give it the same file as the other replicas), or the records were written by someone "+
				"without the key (check the topic's ACLs: only the replicas' principal may write it; if the log holds no entry of this cluster, "+
				"delete the topic and start the replicas again)", r.plog.Topic(), forged, r.keys.Source(), strings.Join(r.keys.IDs(), ", "))
		}
		if next >= end && !awaited && authentic > 0 {
			// Entries of this cluster and no genesis: the log lost its start. A genesis of this
			// replica's own would be accepted by it alone: a replica that serves another history.
			return fmt.Errorf("replication.posterior_topic %s holds %d entries of this cluster (they authenticate under replication.key_file %s) "+
				"and no genesis: the topic lost its start (it was deleted and recreated while replicas wrote to it, or records were deleted), "+
				"and a replica cannot start from it: a new epoch written from a replica's head gives it a start (cfguard new-epoch "+
				"--head-from <a running replica's URL> when the replicas stopped on the reset, --force when they follow), "+
				"see docs/RUNBOOK.md, CfguardPosteriorLogStopped; nothing was written",
				r.plog.Topic(), authentic, r.keys.Source())
		}
		if next >= end && !awaited {
			// No entry at all. A new cluster's, or a log deleted under running replicas: those
			// are members of the updater group, and a genesis of this replica's would start a
			// second history beside theirs.
			if err := r.noLiveUpdaters(ctx); errors.Is(err, errLogGrew) {
				// A new cluster whose first replica appended its genesis and joined the group
				// since this one asked for the log's end: read what landed; the checks above run
				// again at the new end.
				if end, err = r.plog.End(ctx); err != nil {
					return fmt.Errorf("reading the end of the posterior log %s: %w", r.plog.Topic(), err)
				}
			} else if err != nil {
				return err
			} else if err := r.appendGenesis(ctx); err != nil {
				return err
			} else {
				awaited = true
			}
		}
		rec, err := rd.Next(ctx)
		if err != nil {
			return fmt.Errorf("reading the posterior log %s for its genesis: %w", r.plog.Topic(), err)
		}
		next = rec.Offset + 1
		e, reason, err := chain.Offer(rec)
		if err != nil {
			return err
		}
		if reason == postlog.Unauthenticated {
			r.unauthenticated(rec)
			if rec.Offset < end {
				forged++
			}
			continue
		}
		if rec.Offset < end {
			authentic++
		}
		if reason != postlog.Accepted {
			r.ignored(rec, reason)
			continue
		}
		if err := r.checkSettings(e, rec.Offset); err != nil {
			return err
		}
		m, err := e.Body.Model(e.PosteriorSHA256)
		if err != nil {
			return fmt.Errorf("the posterior log's genesis (offset %d): %w", rec.Offset, err)
		}
		hb, err := postlog.MarshalHead(chain.Head())
		if err != nil {
			return err
		}
		origin := fmt.Sprintf("posterior log %s genesis %s", r.plog.Topic(), e.PosteriorSHA256)
		if err := r.ledger.Checkpoint(&ledger.Checkpoint{Model: m, Origin: origin, LogHead: hb}); err != nil {
			return err
		}
		r.chain, r.read = chain, rec.Offset+1
		r.host.SetCurrent(m)
		r.remember(m)
		r.lg.Info("posterior log genesis applied", "entry_writer", e.Writer, "posterior_version", m.Version, "posterior_sha256", e.PosteriorSHA256)
		return nil
	}
}

// Head is the follower's head.
func (r *Replica) Head() *postlog.Head {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := *r.chain.Head()
	return &h
}

// Follow plays the log from the follower's position until ctx ends. An entry it cannot apply
// (an unknown format, a posterior that does not hash to its entry) stops following: the replica
// keeps serving the last version it verified, and /readyz says why. It goes on reading: a new
// epoch that moves past that entry (cfguard new-epoch) resumes it. A log it cannot read (the
// broker down, a leader moving) is read again with backoff, from where the follower is, while
// the replica serves its posterior (a WARN line per episode); only an error no retry fixes
// (credentials, ACLs) ends Follow.
func (r *Replica) Follow(ctx context.Context) error {
	// The watch of the log's end stops with follow: the log is closed after follow returns.
	wctx, stopWatch := context.WithCancel(ctx)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		r.watchEnd(wctx)
	}()
	defer func() {
		stopWatch()
		<-watched
	}()
	bo := backoff.Backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	for {
		r.mu.Lock()
		from := r.read
		r.mu.Unlock()
		err := r.followFrom(ctx, from)
		r.mu.Lock()
		unreadable := r.unreadable
		r.mu.Unlock()
		if unreadable.IsZero() {
			bo.Reset()
		}
		switch {
		case errors.Is(err, errRewind):
		case err == nil || ctx.Err() != nil:
			return nil
		case !stream.Retryable(err):
			return err
		default:
			if unreadable.IsZero() {
				r.mu.Lock()
				r.unreadable = time.Now()
				r.mu.Unlock()
				r.lg.Warn("posterior log: reading it failed; reading it again with backoff, serving the last posterior applied", "topic", r.plog.Topic(),
					"from", from, "err", err)
			}
			if bo.Wait(ctx) != nil {
				return nil
			}
			continue
		}
		// The log was reset under the follower (halt): what it holds now is read from its
		// start, where only a new epoch that moves past the head is accepted.
		r.mu.Lock()
		r.read = 0
		r.logEnds = nil // what the log holds now was not appended when the ends seen say
		r.mu.Unlock()
		r.lg.Info("posterior log reset: reading it again from its start, for a new epoch that moves past the head", "topic", r.plog.Topic())
	}
}

// later is the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// pendingStep is a step the updater appended as entry seq, kept until an entry is accepted there.
type pendingStep struct {
	seq  uint64
	step Step
}

// storeError is a failure of this replica to store an entry it accepted (its ledger): not the
// entry's fault, and not one a new epoch moves past.
type storeError struct{ err error }

func (e *storeError) Error() string { return "storing the entry: " + e.err.Error() }
func (e *storeError) Unwrap() error { return e.err }

// storeErr is err as a storeError, unless the ledger refused the entry for what it holds (an
// invalid field): that is the entry's, and every restart meets it again.
func storeErr(err error) error {
	if errors.Is(err, ledger.ErrInvalid) {
		return err
	}
	return &storeError{err}
}

// errRewind ends followFrom when the follower must read the log again from its start (halt).
var errRewind = errors.New("posterior log: read again from the start")

// followFrom plays the log from offset from until ctx ends (nil), a record cannot be read, or
// halt asks for a rewind (errRewind).
func (r *Replica) followFrom(ctx context.Context, from int64) error {
	rd, err := r.plog.Read(from)
	if err != nil {
		return err
	}
	defer rd.Close()
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var rewound atomic.Bool
	go func() {
		select {
		case <-r.rewind:
			rewound.Store(true)
			cancel()
		case <-rctx.Done():
		}
	}()
	for {
		r.mu.Lock()
		if r.starved.IsZero() {
			r.starved = time.Now() // kept across failed reads and reopened readers
		}
		r.mu.Unlock()
		rec, err := rd.Next(rctx)
		if err != nil {
			if rewound.Load() && ctx.Err() == nil {
				return errRewind
			}
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("posterior log %s: %w", r.plog.Topic(), err)
		}
		r.mu.Lock()
		since := r.unreadable
		r.unreadable, r.starved = time.Time{}, time.Time{}
		r.mu.Unlock()
		if !since.IsZero() {
			r.lg.Info("posterior log readable again", "topic", r.plog.Topic(), "unreadable_for", time.Since(since).Round(time.Second))
		}
		if err := r.offer(ctx, rec); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			r.mu.Lock()
			if r.chain.Stuck() == nil {
				r.chain.Block(rec)
			}
			recovery := "once every replica runs a build that reads it, or after cfguard new-epoch moves the log past it, the replicas resume: "
			runbook := "CfguardPosteriorLogStopped"
			var se *storeError
			var settings *SettingsError
			switch {
			case errors.As(err, &settings):
				recovery = "" // the error says how to recover
				runbook = "CfguardReplicaSettingsDiffer"
			case errors.As(err, &se):
				recovery = "the entry is valid: this replica could not store it; once what the error names is fixed, restart this replica " +
					"and it applies the entry again: "
			case errors.Is(err, postlog.ErrDiverged):
				recovery = "if the other replicas follow on, this one alone refused the entry: stop it, move its state_dir aside and start it, " +
					"and it rebuilds its ledger from the log and the CE topic; if every replica stopped here, a holder of the cluster key " +
					"wrote these entries: cfguard new-epoch moves the log past them: "
			}
			r.stopped = fmt.Errorf("%w (offset %d of %s; %ssee docs/RUNBOOK.md, %s)", err, rec.Offset, r.plog.Topic(), recovery, runbook)
			r.read = rec.Offset + 1
			// The line and the gauge before the lock is released, as in halt.
			r.lg.Error("stopped following the posterior log; serving the last verified posterior", "offset", rec.Offset, "err", err)
			r.m.Stopped.Set(1)
			close(r.changed)
			r.changed = make(chan struct{})
			r.mu.Unlock()
		}
	}
}

// offer judges one record and applies it when accepted.
func (r *Replica) offer(ctx context.Context, rec postlog.Record) error {
	r.mu.Lock()
	c := r.chain.Fork()
	halts := r.halts
	r.mu.Unlock()
	e, reason, err := c.Offer(rec)
	if err != nil {
		return err
	}
	if reason == postlog.Unauthenticated {
		r.unauthenticated(rec)
		r.advance(rec.Offset+1, nil, 0)
		return nil
	}
	if reason != postlog.Accepted {
		r.ignored(rec, reason)
		if e != nil {
			r.lg.Info("posterior log record ignored", "offset", rec.Offset, "reason", reason, "seq", e.Seq, "term", e.Term, "entry_writer", e.Writer)
			if err := c.Diverged(rec, e); err != nil {
				return err // the follower stops, blocking its chain at rec
			}
		}
		r.advance(rec.Offset+1, nil, 0)
		return nil
	}
	if err := r.checkCoverage(ctx, e); errors.Is(err, postlog.ErrPastEnd) {
		r.lg.Warn("posterior log entry refused: it covers input records that do not exist", "topic", r.plog.Topic(), "partition", 0,
			"offset", rec.Offset, "seq", e.Seq, "term", e.Term, "entry_writer", e.Writer, "input_topic", r.cfg.Kafka.Topic, "err", err)
		r.m.Ignored.WithLabelValues(string(postlog.PastEnd)).Inc() // after the line: whoever sees the count finds it
		r.mu.Lock()
		if !r.caughtUp {
			// Read while catching up: the replicas that followed the log judged it earlier, on
			// the input as it was then, and may have applied it. One refused live was judged by
			// every follower on the same input, and the updater's next entry takes its place.
			r.refusedNext = fmt.Errorf("entry %d at offset %d, which extends this replica's head and was read while catching up, was refused: %w", e.Seq, rec.Offset, err)
		}
		r.mu.Unlock()
		r.advance(rec.Offset+1, nil, 0)
		return nil
	} else if err != nil {
		return err
	}
	head := c.Head()
	hb, err := postlog.MarshalHead(head)
	if err != nil {
		return err
	}
	switch e.Kind {
	case postlog.Genesis: // a new epoch: the posterior and coverage stay the head's (judgeEpoch)
		if err := r.checkSettings(e, rec.Offset); err != nil {
			if se := (*SettingsError)(nil); errors.As(err, &se) {
				r.mu.Lock() // now, not at the offer's start: a halt meanwhile is a reset too
				reset := r.halts > r.epochHalts
				r.mu.Unlock()
				se.following = stoppedAtEpoch(r.recorded.Load(), reset)
			}
			return err
		}
		if err := r.host.Checkpoint(ctx, &ledger.Checkpoint{LogHead: hb}); err != nil {
			return storeErr(err)
		}
		r.mu.Lock()
		resumed := r.stopped != nil
		r.stopped = nil
		r.epochHalts = halts
		r.mu.Unlock()
		r.m.Stopped.Set(0)
		r.lg.Warn("posterior log: new epoch", "epoch", e.Epoch, "entry", e.Seq, "offset", rec.Offset, "moved_past", e.Past.Offset,
			"entry_writer", e.Writer, "resumed", resumed, "covers", e.Covers)
	case postlog.Claim:
		// The claimant publishes the events the entries before its claim owe: their writer
		// may have died between its append and its own apply. They may be published twice.
		var owed []ledger.OutboxEntry
		if e.Writer == r.writer {
			for _, u := range head.Unpublished {
				for _, ev := range u.Events {
					owed = append(owed, ledger.OutboxEntry{Key: ev.Key, Value: ev.Value})
				}
			}
		}
		if err := r.host.Checkpoint(ctx, &ledger.Checkpoint{LogHead: hb, Events: owed}); err != nil {
			return storeErr(err)
		}
		r.lg.Info("posterior log: new term", "term", e.Term, "claimant", e.Writer, "entry", e.Seq, "generation", e.Generation, "build", e.Build)
		if len(owed) > 0 {
			r.lg.Info("updater: published again the events of entries whose writer may not have", "events", len(owed),
				"entries", len(head.Unpublished), "from_entry", head.Unpublished[0].Seq)
			r.m.Republished.Add(float64(len(owed)))
		}
	case postlog.Increment:
		prev := r.host.Current()
		next, err := e.Apply(prev)
		if err != nil {
			return err
		}
		// The step this updater computed for this very entry (by hash: an entry of its that
		// lands late, after it appended another at the same place, is told apart).
		var own Step
		r.mu.Lock()
		if p, ok := r.pending[head.Hash]; ok && e.Writer == r.writer {
			own = p.step
		}
		r.mu.Unlock()
		if err := r.host.Commit(ctx, e, prev, next, own, &ledger.Checkpoint{Offsets: e.Covers, LogHead: hb, At: r.replayedAt(rec)}); err != nil {
			return storeErr(err)
		}
		r.remember(next)
	}
	r.advance(rec.Offset+1, c, halts)
	return nil
}

// logEnd is one end of the posterior log (its next offset: the high watermark, past every record
// committed) as watchEnd found it: first, when the first answer that gave it came back, and last,
// when the last question that got it was asked. An entry at offset o was committed after the last
// question that got an end at or below o, and before the first answer that gave an end past o.
type logEnd struct {
	end         int64
	first, last time.Time
}

// maxLogEnds bounds Replica.logEnds: one a second for a follower more than about three hours
// behind a log that grows every second; past it the oldest go, and their entries are dated by
// their own time, no later than the oldest end kept.
const maxLogEnds = 10_000

// sawEnd records that the posterior log ended at offset end when watchEnd asked at asked and had
// the answer at answered, for replayedAt, and returns the lag: the records not read yet. A log
// that ends before an end seen earlier was cut (an unclean leader election, a topic recreated)
// or its new leader's end is catching up: the ends seen past it may not be of the records it
// holds now, and are forgotten; the lower end itself is not recorded either, since after a
// leader change the records past it may be old.
func (r *Replica) sawEnd(end int64, asked, answered time.Time) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch n := len(r.logEnds); {
	case n > 0 && end == r.logEnds[n-1].end:
		r.logEnds[n-1].last = asked
	case n == 0 || end > r.logEnds[n-1].end:
		r.logEnds = append(r.logEnds, logEnd{end: end, first: answered, last: asked})
	default:
		keep := 0
		for keep < n && r.logEnds[keep].end <= end {
			keep++
		}
		r.logEnds = r.logEnds[:keep]
	}
	// Only the entries from read on are dated again: of the ends at or below it, the last is kept.
	drop := 0
	for drop+1 < len(r.logEnds) && r.logEnds[drop+1].end <= r.read {
		drop++
	}
	drop = max(drop, len(r.logEnds)-maxLogEnds)
	r.logEnds = append(r.logEnds[:0], r.logEnds[drop:]...)
	lag := max(end-r.read, 0)
	switch {
	case lag == 0:
		r.caughtUp = true
		r.behind = time.Time{}
	case r.behind.IsZero():
		r.behind = time.Now()
	}
	r.lag = lag
	return lag
}

// replayedAt is when the update of rec was made, for the KL history, so that an alert on a
// breach or a failure is dated by the update, not by when a replica applied it: the record's
// Kafka time, which its writer's clock set, kept within what the ends of the log seen say of
// when it was committed (logEnd) and no later than now. While the follower keeps up, that span is
// about watchEnd's second, so a writer's clock that is off does not date the updates every
// replica alerts on; a follower that fell behind, or that replays the log of a bootstrap or a
// restored backup, dates them by their records, not as new updates.
func (r *Replica) replayedAt(rec postlog.Record) time.Time {
	if rec.Time.IsZero() {
		return time.Time{}
	}
	lo, hi := time.Time{}, time.Now()
	r.mu.Lock()
	for _, e := range r.logEnds {
		if e.end > rec.Offset {
			hi = minTime(hi, e.first)
			break
		}
		lo = e.last
	}
	r.mu.Unlock()
	return minTime(later(rec.Time, lo), hi)
}

// minTime is the earlier of a and b.
func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// checkCoverage returns an error wrapping postlog.ErrPastEnd when the increment e covers
// offsets of kafka.topic past its partitions' ends. The ends are asked of the broker only when e
// covers more than they did the last time (they only grow); a failure to ask is retried until
// ctx ends, since an entry is never accepted unchecked.
func (r *Replica) checkCoverage(ctx context.Context, e *postlog.Entry) error {
	if e.Kind != postlog.Increment {
		return nil
	}
	r.mu.Lock()
	ends := r.ends
	r.mu.Unlock()
	if postlog.CheckCoverage(e.Covers, ends) == nil {
		return nil
	}
	bo := backoff.Backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	for {
		fresh, err := r.plog.InputEnds(ctx, r.cfg.Kafka.Topic)
		if err == nil {
			r.mu.Lock()
			r.ends = fresh
			r.mu.Unlock()
			return postlog.CheckCoverage(e.Covers, fresh)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		r.lg.Warn("posterior log: cannot read the input topic's end offsets to check an entry's coverage; retrying", "entry", e.Seq, "err", err)
		if err := bo.Wait(ctx); err != nil {
			return err
		}
	}
}

// unauthenticated logs and counts a record of the posterior log that does not authenticate.
// It is ignored: never decoded, applied, or counted as covering anything. The line is written
// before the count, so that whoever sees the count (an alert, a test) finds the line.
func (r *Replica) unauthenticated(rec postlog.Record) {
	r.lg.Warn("unauthenticated posterior log record ignored: a writer without the cluster key (replication.key_file) wrote to the topic; check its ACLs",
		"topic", r.plog.Topic(), "partition", 0, "offset", rec.Offset, "err", postlog.Authenticate(r.keys, rec))
	r.m.Ignored.WithLabelValues(string(postlog.Unauthenticated)).Inc()
	r.m.Unauthenticated.WithLabelValues(r.plog.Topic()).Inc()
}

// ignored counts an authenticated record the chain did not accept, and logs at WARN one that is
// not an entry at all (malformed) or names the head but does not follow from it (invalid): a
// holder of the cluster key wrote it, by a bug or with a stolen key (CfguardPosteriorLogRefused).
// The other reasons (a replayed or late entry) are the log's ordinary traffic; the caller logs them.
// As in unauthenticated, the line is written before the count.
func (r *Replica) ignored(rec postlog.Record, reason postlog.Reason) {
	defer r.m.Ignored.WithLabelValues(string(reason)).Inc()
	switch reason {
	case postlog.Malformed:
		if _, err := postlog.Decode(rec.Value); err != nil {
			r.lg.Warn("posterior log record ignored: it authenticates under the cluster key but is not an entry", "topic", r.plog.Topic(),
				"partition", 0, "offset", rec.Offset, "err", err)
		}
	case postlog.Invalid:
		attrs := []any{"topic", r.plog.Topic(), "partition", 0, "offset", rec.Offset}
		if e, err := postlog.Decode(rec.Value); err == nil {
			attrs = append(attrs, "seq", e.Seq, "term", e.Term, "entry_writer", e.Writer, "version", e.Version, "parent_version", e.ParentVersion)
		}
		r.lg.Warn("posterior log entry refused: it authenticates under the cluster key and names the head, but does not follow from it "+
			"(its version or coverage)", attrs...)
	}
}

// advance moves the follower past a record; c is set when the record was accepted, forked from
// the chain when halts (r.halts) halt calls had been made.
func (r *Replica) advance(next int64, c *postlog.Chain, halts int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c != nil {
		if r.halts != halts {
			// Halted while the entry was applied (the log ended before what was read): the
			// fork stops too, after the entry it applied.
			c.Halt()
		}
		r.chain = c
		r.refusedNext = nil
		h := c.Head()
		r.accepted[h.Seq] = h.Hash
		for k, p := range r.pending { // no other entry can be accepted at this place or before
			if p.seq <= h.Seq {
				delete(r.pending, k)
			}
		}
		if h.Seq > acceptedWindow {
			delete(r.accepted, h.Seq-acceptedWindow)
		}
		r.m.Entry.Set(float64(h.Seq))
		r.m.Term.Set(float64(h.Term))
	}
	r.read = next
	close(r.changed)
	r.changed = make(chan struct{})
}

// recentPosteriors is how many of the last posteriors past finds without reading the log.
const recentPosteriors = 256

// remember keeps m among the recent posteriors.
func (r *Replica) remember(m *bnn.Model) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recent[m.Version] = m
	if m.Version >= recentPosteriors {
		delete(r.recent, m.Version-recentPosteriors)
	}
}

// Past returns the posteriors of the given versions, each at most the current one: the recent
// ones from memory, the others by playing the posterior log. The play starts from the latest
// place it knows at or before the lowest version asked for: where the last play stopped, or one
// of the places the last plays found a version at (pastKeep of them), or else the log's first
// record. A rebuild asks for the anchors of a partition's registrations in about the order they
// were measured, with the few versions restored verdicts were measured under (a confirmer
// measures a batch of CEs under one), so it reads the log about once, not once per batch.
// Versions the log does not have are not in the answer.
func (r *Replica) Past(ctx context.Context, versions []uint64) (map[uint64]*bnn.Model, error) {
	out := map[uint64]*bnn.Model{}
	want := map[uint64]bool{}
	r.mu.Lock()
	for _, v := range versions {
		if m, ok := r.recent[v]; ok {
			out[v] = m
		} else {
			want[v] = true
		}
	}
	until := r.chain.Head().Offset
	r.mu.Unlock()
	if len(want) == 0 {
		return out, nil
	}
	r.pastMu.Lock()
	defer r.pastMu.Unlock()
	for v := range want {
		if c, ok := r.pastKept.get(v); ok {
			out[v] = c.m
			delete(want, v)
		}
	}
	if len(want) == 0 {
		return out, nil
	}
	at := r.pastKept.from(r.pastAt, slices.Min(slices.Collect(maps.Keys(want))), until)
	if at == nil {
		at = &pastCursor{chain: postlog.NewChain(r.keys)}
	}
	r.pastAt = nil // set again only when this play ends without an error
	found := func() {
		if m := at.m; m != nil && want[m.Version] {
			out[m.Version] = m
			delete(want, m.Version)
			r.pastKept.put(*at)
		}
	}
	found() // the place itself may hold one
	if len(want) > 0 && at.next <= until {
		rd, err := r.plog.Read(at.next)
		if err != nil {
			return nil, err
		}
		defer rd.Close()
		for len(want) > 0 && at.next <= until {
			rec, err := rd.Next(ctx)
			if err != nil {
				return nil, fmt.Errorf("reading the posterior log for past posteriors: %w", err)
			}
			if err := r.replay(ctx, at, rec); err != nil {
				return nil, err
			}
			found()
		}
	}
	r.pastAt = at
	return out, nil
}

// pastCursor is a place in a play of the posterior log: the chain and posterior after the
// record before next. A cursor's chain is never changed once the cursor moves on (replay
// offers each record to a fork), so copies of a cursor share it.
type pastCursor struct {
	chain *postlog.Chain
	m     *bnn.Model // nil before the genesis
	next  int64
}

// pastKeep is how many of the places Past found a version at it keeps.
const pastKeep = 64

// keptCursors are the places Past found versions at, by version, the least recently used first
// out.
type keptCursors struct {
	order []uint64 // least recently used first
	by    map[uint64]pastCursor
}

// get returns the place version v was found at, if it is kept.
func (k *keptCursors) get(v uint64) (pastCursor, bool) {
	c, ok := k.by[v]
	if ok {
		k.touch(v)
	}
	return c, ok
}

func (k *keptCursors) touch(v uint64) {
	k.order = append(slices.DeleteFunc(k.order, func(o uint64) bool { return o == v }), v)
}

// put keeps c, a place where a version was found.
func (k *keptCursors) put(c pastCursor) {
	if k.by == nil {
		k.by = map[uint64]pastCursor{}
	}
	v := c.m.Version
	if _, ok := k.by[v]; !ok && len(k.order) == pastKeep {
		delete(k.by, k.order[0])
		k.order = k.order[1:]
	}
	k.by[v] = c
	k.touch(v)
}

// from returns a copy of the latest place at or before version lo among last (where the last
// play stopped) and the kept ones, nil when there is none; places past until+1 (a log that
// ends before them) are not used. Places and their posteriors outlive a reset of the log: a
// replica follows a recreated log only from a new epoch that moves past its own head, so they
// are of the history the new log goes on with; a play resumed on the new log from a place of the
// old one accepts only records that extend that place (its chain judges them), so it finds
// nothing of another history.
func (k *keptCursors) from(last *pastCursor, lo uint64, until int64) *pastCursor {
	var best *pastCursor
	consider := func(c pastCursor) {
		if c.m != nil && c.m.Version <= lo && c.next <= until+1 && (best == nil || c.next > best.next) {
			cp := c
			best = &cp
		}
	}
	if last != nil {
		consider(*last)
	}
	for _, c := range k.by {
		consider(c)
	}
	if best != nil {
		if _, ok := k.by[best.m.Version]; ok {
			k.touch(best.m.Version)
		}
	}
	return best
}

// replay moves c past rec as the follower would: an accepted entry moves the chain and the
// posterior, any other record only the offset. On an error c is left where it was.
func (r *Replica) replay(ctx context.Context, c *pastCursor, rec postlog.Record) error {
	fork := c.chain.Fork()
	e, reason, err := fork.Offer(rec)
	switch {
	case errors.Is(err, postlog.ErrUnknownFormat):
		c.chain = fork // stopped there until a new epoch moves past it, as the follower
	case err != nil:
		return err
	}
	if reason == postlog.Accepted {
		if err := r.checkCoverage(ctx, e); errors.Is(err, postlog.ErrPastEnd) {
			reason = postlog.PastEnd // refused, as the follower refuses it
		} else if err != nil {
			return err
		}
	}
	switch {
	case reason != postlog.Accepted:
	case e.Kind == postlog.Genesis && e.Epoch > 0 && c.m != nil:
		c.chain = fork // a new epoch keeps the head's posterior: nothing to apply
	default:
		m := c.m
		if e.Kind == postlog.Genesis {
			m, err = e.Body.Model(e.PosteriorSHA256)
		} else {
			m, err = e.Apply(m)
		}
		if err != nil {
			return fmt.Errorf("replaying the posterior log, entry %d: %w", e.Seq, err)
		}
		c.chain, c.m = fork, m
	}
	c.next = rec.Offset + 1
	return nil
}

// WaitChange waits for the follower's next record, or ctx's end.
func (r *Replica) WaitChange(ctx context.Context) error {
	r.mu.Lock()
	ch := r.changed
	r.mu.Unlock()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-ch:
		return nil
	}
}

// waitRead waits until the follower has read every record below end.
func (r *Replica) waitRead(ctx context.Context, end int64) error {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	start := time.Now()
	for {
		r.mu.Lock()
		read, ch, stopped, starved := r.read, r.changed, r.stopped, r.starved
		r.mu.Unlock()
		if stopped != nil {
			return stopped
		}
		if read >= end {
			return nil
		}
		// The follower waits for a record, failing or not (kafka-go retries some failures
		// inside its reader), while records wait: counted from this wait's start when it began
		// before (an idle log).
		if !starved.IsZero() && time.Since(later(starved, start)) >= resetAfter {
			// An updater whose follower cannot read gives the role up (its caller steps down):
			// another replica may read the log.
			return fmt.Errorf("posterior log %s: this replica's follower has not read it for %s (offset %d of %d)", r.plog.Topic(),
				time.Since(later(starved, start)).Round(time.Second), read, end)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ch:
		case <-tick.C:
		}
	}
}

// catchUp reads the log to its present end. The updater does not append to a log that ends
// before what the follower has read (a leader that lags for a moment, or a recreated topic):
// catchUp waits until the log reaches that offset again, or fails once the follower has stopped
// on it (watchEnd halts after resetAfter). Waiting, not failing, keeps the updater's generation:
// a generation that ends at once is joined again at once, as fast as the group can rebalance.
func (r *Replica) catchUp(ctx context.Context) error {
	bo := backoff.Backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	for {
		end, err := r.plog.End(ctx)
		if err == nil {
			r.mu.Lock()
			read, stopped, changed := r.read, r.stopped, r.changed
			r.mu.Unlock()
			if end >= read {
				return r.waitRead(ctx, end)
			}
			if stopped != nil {
				return fmt.Errorf("posterior log %s ends at offset %d, before offset %d this replica has read", r.plog.Topic(), end, read)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-changed: // halted, or the head moved
			case <-time.After(shortLogPoll):
			}
			continue
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		r.lg.Warn("posterior log: end offset", "err", err)
		if err := bo.Wait(ctx); err != nil {
			return err
		}
	}
}

// resetAfter is how long the posterior log must end before what a follower has read before the
// follower stops as on a reset topic. A partition's new leader may report a lower end for a
// moment (its high watermark catches up with its followers'); a recreated topic stays short.
const resetAfter = 10 * time.Second

// rejoinPause is how long an updater that stepped down (its entry lost, or its term failed)
// keeps its generation before it ends it and rejoins the group.
const rejoinPause = time.Second

// maxRejoinPause bounds rejoinWait: the pause is served holding the generation, so no other
// replica can take the role meanwhile. failedTermSpan is how long a term must have run for its
// failure not to follow the ones before it.
const (
	maxRejoinPause = 30 * time.Second
	failedTermSpan = 10 * time.Minute
)

// rejoinWait is the pause of an updater that steps down after failed consecutive failed terms:
// rejoinPause doubled for each after the first, at most maxRejoinPause. An error no retry fixes
// (credentials refused, a dead-letter topic that refuses a dead letter) fails every term, and
// every replica's: without the doubling the role went round at the speed of rebalances, each
// term logging the error and writing the dead letters before it again.
func rejoinWait(failed int) time.Duration {
	if failed <= 1 {
		return rejoinPause
	}
	return min(rejoinPause<<min(failed-1, 20), maxRejoinPause)
}

// shortLogPoll is how often an updater waiting on a log that ends before what it has read asks
// for the log's end again.
const shortLogPoll = time.Second

// watchEnd keeps the lag gauge and the caught-up flag (readiness) current, and stops following
// when the log ends before what the follower has read for resetAfter (halt).
func (r *Replica) watchEnd(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	var shortSince time.Time
	headChecked := time.Now()
	for {
		asked := time.Now()
		end, err := r.plog.End(ctx)
		answered := time.Now()
		switch {
		case err == nil:
			r.mu.Lock()
			read, failingSince := r.read, r.endUnknown
			r.endUnknown, r.endErr = time.Time{}, nil
			r.mu.Unlock()
			if !failingSince.IsZero() {
				r.lg.Info("posterior log reachable again", "after", time.Since(failingSince).Round(time.Second))
			}
			switch {
			case end >= read:
				shortSince = time.Time{}
			case shortSince.IsZero():
				shortSince = time.Now()
				r.lg.Warn("posterior log ends before what this replica has read", "topic", r.plog.Topic(), "end", end, "read", read)
			case time.Since(shortSince) >= resetAfter:
				r.halt(fmt.Sprintf("has ended at offset %d, before offset %d this replica has read, for %s",
					end, read, time.Since(shortSince).Round(time.Second)))
			}
			if end >= read && time.Since(headChecked) >= resetAfter {
				headChecked = time.Now()
				if found, gone := r.headGone(ctx); gone {
					r.halt(found)
				}
			}
			r.m.Lag.Set(float64(r.sawEnd(end, asked, answered)))
		case ctx.Err() == nil:
			r.mu.Lock()
			first := r.endUnknown.IsZero()
			if first {
				r.endUnknown = time.Now()
			}
			r.endErr = err
			r.mu.Unlock()
			if first {
				r.lg.Warn("posterior log unreachable: serving the last applied posterior", "topic", r.plog.Topic(), "err", err)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// headGone reports whether the log no longer holds the entry this replica applied last, at its
// offset with its bytes, and what it holds there instead: a topic recreated and grown past that
// offset before the log was seen short (watchEnd checks every resetAfter). A record that cannot
// be read now is not judged: the next check asks again.
func (r *Replica) headGone(ctx context.Context) (found string, gone bool) {
	r.mu.Lock()
	head := r.chain.Head()
	reset := r.stoppedByReset()
	r.mu.Unlock()
	if reset || head == nil {
		return "", false
	}
	rd, err := r.plog.Read(head.Offset)
	if err != nil {
		return "", false
	}
	defer rd.Close()
	cctx, cancel := context.WithTimeout(ctx, resetAfter)
	defer cancel()
	rec, err := rd.Next(cctx)
	switch {
	case err != nil:
		return "", false
	case rec.Offset != head.Offset:
		return fmt.Sprintf("no longer holds entry %d this replica applied last at offset %d: its first record from there is at offset %d",
			head.Seq, head.Offset, rec.Offset), true
	case hashHex(rec.Value) != head.Hash:
		return fmt.Sprintf("no longer holds entry %d this replica applied last at offset %d: the record there hashes to %s, not %s",
			head.Seq, head.Offset, hashHex(rec.Value), head.Hash), true
	}
	return "", false
}

// halt stops following a log that is no longer the one the follower read (what says so: the
// topic has ended before what it has read, or no longer holds its head): the topic was recreated
// (or lost records), and what it holds now is another history. The chain accepts nothing more but
// a new epoch on its head; /readyz and cfguard_posterior_log_stopped say so. A replica stopped
// at an entry (one it cannot read or verify) halts too: that entry is in a history the topic no
// longer holds, and only the reset's recovery applies. One stopped by a halt since its last
// epoch is left as it is.
func (r *Replica) halt(what string) {
	r.mu.Lock()
	if r.stoppedByReset() {
		r.mu.Unlock()
		return
	}
	r.chain.Halt()
	r.halts++
	h := r.chain.Head()
	r.stopped = fmt.Errorf("posterior log reset: replication.posterior_topic %s %s: the topic was deleted and recreated, or lost "+
		"records. This replica keeps serving entry %d (posterior version %d) and applies nothing more until a new epoch moves past that "+
		"entry: cfguard new-epoch --head-from <this replica's URL> (docs/RUNBOOK.md, CfguardPosteriorLogStopped)",
		r.plog.Topic(), what, h.Seq, h.Version)
	// The line and the gauge before the lock is released: whoever sees the stop (/readyz, the
	// gauge) finds the line.
	r.lg.Error("stopped following the posterior log; serving the last verified posterior", "err", r.stopped)
	r.m.Stopped.Set(1)
	close(r.changed)
	r.changed = make(chan struct{})
	r.mu.Unlock()
	select {
	case r.rewind <- struct{}{}:
	default:
	}
}

// stoppedByReset reports whether the replica is stopped by a halt since its last epoch (r.mu
// held): a reset it has reported already.
func (r *Replica) stoppedByReset() bool { return r.stopped != nil && r.halts > r.epochHalts }

// errLost: another writer's entry was accepted in this replica's place; it is no longer the
// updater of its term.
var errLost = errors.New("posterior log: this replica's entry lost to another writer's")

// appendAndJudge appends e and reads the log back until an entry is accepted at e's place: it
// reports whether that entry is e. An append that failed is retried after the read-back shows
// it was not stored (a retry that was in fact stored is a duplicate, which the chain ignores).
func (r *Replica) appendAndJudge(ctx context.Context, e *postlog.Entry) (bool, error) {
	v, err := e.Encode()
	if err != nil {
		return false, err
	}
	want := hashHex(v)
	bo := backoff.Backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	for {
		aerr := r.plog.Append(ctx, "e/"+strconv.FormatUint(e.Seq, 10), v)
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		if err := r.catchUp(ctx); err != nil {
			return false, err
		}
		r.mu.Lock()
		got, judged := r.accepted[e.Seq]
		headSeq := r.chain.Head().Seq
		r.mu.Unlock()
		switch {
		case judged:
			return got == want, nil
		case headSeq >= e.Seq:
			return false, nil // accepted entries at e's place are past the window: not e
		case aerr == nil:
			return false, fmt.Errorf("posterior log: entry %d was stored but not accepted (a bug: the updater wrote an entry the acceptance rule refuses)", e.Seq)
		}
		r.lg.Warn("posterior log: append failed, retrying", "entry", e.Seq, "err", aerr)
		if err := bo.Wait(ctx); err != nil {
			return false, err
		}
	}
}

// RunUpdaterGroup is a member of <kafka.group_id>.updater for as long as ctx lasts. In each
// generation that assigns it the log's partition, it is the updater (lead) until the generation
// ends; otherwise it only heartbeats. Leaving the group (ctx's end, SIGTERM) hands the role over
// at once.
func (r *Replica) RunUpdaterGroup(ctx context.Context) error {
	dialer, err := r.conn.Dialer()
	if err != nil {
		return err
	}
	rc := r.cfg.Replication
	cg, err := kafka.NewConsumerGroup(kafka.ConsumerGroupConfig{ID: r.group, Brokers: r.conn.Brokers, Dialer: dialer,
		Topics: []string{rc.PosteriorTopic}, SessionTimeout: rc.SessionTimeout, HeartbeatInterval: rc.HeartbeatInterval,
		GroupBalancers:   []kafka.GroupBalancer{r.bal, kafka.RangeGroupBalancer{}, kafka.RoundRobinGroupBalancer{}},
		RebalanceTimeout: rc.SessionTimeout, JoinGroupBackoff: time.Second, Timeout: 10 * time.Second,
		ErrorLogger: kafka.LoggerFunc(func(msg string, args ...any) {
			r.lg.Debug("updater group: " + fmt.Sprintf(msg, args...))
		})})
	if err != nil {
		return fmt.Errorf("updater group %s: %w", r.group, err)
	}
	defer cg.Close()
	for {
		gen, err := cg.Next(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			r.lg.Warn("updater group: joining", "group", r.group, "err", err)
			continue
		}
		assigned := false
		for _, p := range gen.Assignments[rc.PosteriorTopic] {
			assigned = assigned || p.ID == 0
		}
		r.bal.led(gen.ID, assigned)
		r.lg.Info("updater group: new generation", "generation", gen.ID, "updater", assigned)
		r.m.Generations.Inc()
		if assigned {
			id := gen.ID
			gen.Start(func(gctx context.Context) { r.lead(gctx, id) })
		}
	}
}

// lead is the updater's work in one generation: claim the next term unless the head is already
// this writer's, then ingest until the generation ends or an entry loses. Returning ends the
// generation (kafka-go's Generation.Start), so a replica that lost rejoins and the group's next
// generation decides again. While the follower is stopped at an entry it cannot apply, the
// updater keeps its generation and waits for a new epoch (or a restart on a build that reads
// the entry): returning would end the generation at once, and the group would go through
// generations as fast as it can rebalance for as long as the log stays stopped. For the same
// reason, a replica that steps down keeps its generation for rejoinPause before it returns.
func (r *Replica) lead(ctx context.Context, generation int32) {
	r.updater.Store(true)
	r.m.Updater.Set(1)
	defer func() {
		r.updater.Store(false)
		r.m.Updater.Set(0)
	}()
	for {
		if err := r.awaitFollowing(ctx); err != nil {
			return
		}
		start := time.Now()
		if h := r.Head(); h.Term > 0 && h.Writer != r.writer {
			r.mu.Lock()
			r.failedTerms = 0 // another writer held the role since: its failures are not ours
			r.mu.Unlock()
		}
		keep, termErr := r.leadTerm(ctx, generation)
		if !keep {
			// Rejoin, but not at once: a failure that persists would otherwise end generations
			// as fast as the group can rebalance. It is no longer the updater meanwhile; unless
			// the generation ended, it gave the role up, and says so to the group's balancer,
			// which gives the role to another member if there is one.
			r.updater.Store(false)
			r.m.Updater.Set(0)
			if ctx.Err() == nil {
				r.bal.steppedDown()
			}
			r.mu.Lock()
			switch {
			case termErr == nil:
				r.failedTerms = 0
			case time.Since(start) > failedTermSpan:
				r.failedTerms = 1
			default:
				r.failedTerms++
			}
			failed := r.failedTerms
			r.mu.Unlock()
			pause := rejoinWait(failed) // rejoinPause unless terms keep failing (failed > 1 only after errors)
			if failed > 1 {
				r.lg.Warn("updater: terms keep failing; rejoining the group after a longer pause", "failed_terms", failed,
					"pause", pause, "err", termErr)
			}
			select {
			case <-ctx.Done():
			case <-time.After(pause):
			}
			return
		}
		if r.isStopped() {
			r.lg.Warn("updater: the posterior log stopped; keeping the updater role until a new epoch moves past the entry (see /readyz)")
		}
	}
}

// isStopped reports whether the follower is stopped at an entry it cannot apply.
func (r *Replica) isStopped() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stopped != nil
}

// awaitFollowing waits while the follower is stopped at an entry it cannot apply; it returns
// ctx's error when ctx ends first.
func (r *Replica) awaitFollowing(ctx context.Context) error {
	for {
		r.mu.Lock()
		stopped, ch := r.stopped, r.changed
		r.mu.Unlock()
		if stopped == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ch:
		}
	}
}

// leadTerm claims a term and ingests in it (lead). It reports whether the updater keeps its
// role (the follower stopped, or a new epoch moved the log on while ingest was stopped on a
// reset input topic), and the error that ended the term, if one did.
func (r *Replica) leadTerm(ctx context.Context, generation int32) (keep bool, failed error) {
	for attempt := 0; ; attempt++ {
		if err := r.catchUp(ctx); err != nil {
			stopped := ctx.Err() == nil && r.isStopped()
			if ctx.Err() == nil && !stopped {
				r.lg.Warn("updater: the posterior log cannot be read to its end; giving the role up", "err", err)
			}
			return stopped, nil
		}
		head := r.Head()
		if head.Writer == r.writer {
			break
		}
		claim := &postlog.Entry{Format: postlog.Format, Kind: postlog.Claim, Seq: head.Seq + 1, Parent: head.Hash, Term: head.Term + 1,
			Writer: r.writer, Version: head.Version, ParentVersion: head.Version, Covers: head.Covers, InputTopic: r.cfg.Kafka.Topic,
			PosteriorSHA256: head.PosteriorSHA256, Build: buildString(), Generation: int(generation)}
		won, err := r.appendAndJudge(ctx, claim)
		if err != nil {
			if ctx.Err() == nil && r.isStopped() {
				return true, nil
			}
			if ctx.Err() != nil {
				return false, nil
			}
			r.lg.Error("updater: claim failed", "err", err)
			return false, err
		}
		if won {
			r.lg.Info("updater: term claimed", "term", claim.Term, "entry", claim.Seq, "generation", generation, "covers", claim.Covers)
			break
		}
		r.m.AppendsLost.Inc()
		// An entry of the old term that arrived before the claim is no rival: claim again on it.
		// A claim of another writer is: rejoin, and let the group's next generation decide.
		if h := r.Head(); h.Writer != head.Writer || attempt >= 5 {
			r.lg.Warn("updater: another replica claimed first; rejoining the group", "term", h.Term, "claimant", h.Writer)
			return false, nil
		}
	}
	err := r.ingestTerm(ctx)
	var reset *stream.TopicResetError
	switch {
	case errors.As(err, &reset) && ctx.Err() == nil:
		// The input topic no longer holds what the log covers: reading on would skip the new
		// log's first records. The updater keeps its role, reading nothing, until its
		// generation ends; /readyz and cfguard_consumer_topic_mismatch say why.
		r.mu.Lock()
		r.inputReset = err
		r.mu.Unlock()
		r.host.TopicReset(reset)
		r.lg.Error("updater: kafka.topic was reset; ingest stopped, keeping the updater role (see docs/RUNBOOK.md, CfguardTopicReset)",
			"err", err)
		// Until the log moves (an operator's new epoch), or the generation ends.
		seq := r.Head().Seq
		for ctx.Err() == nil && r.Head().Seq == seq {
			r.WaitChange(ctx)
		}
		r.mu.Lock()
		r.inputReset = nil
		r.mu.Unlock()
		// Cleared whether the log moved or the role ended: an updater that is not this replica
		// reads the topic now, and finds the reset itself.
		r.host.TopicReset(nil)
		return ctx.Err() == nil, nil
	case err != nil && ctx.Err() == nil && r.isStopped():
		return true, nil // the follower logged why; the records read and not appended are read again from the head's coverage
	case errors.Is(err, errLost):
		r.lg.Warn("updater: an entry lost to another writer's; stepping down and rejoining the group", "head", r.Head().Seq, "term", r.Head().Term)
		r.m.AppendsLost.Inc()
	case err != nil && ctx.Err() == nil:
		r.lg.Error("updater stopped", "err", err)
		return false, err
	}
	return false, nil
}

// ingestTerm forms increments from kafka.topic starting at the head's coverage and appends one
// entry per increment, each read back before the next.
func (r *Replica) ingestTerm(ctx context.Context) error {
	head := r.Head()
	marks := make(map[int]stream.RecordMark, len(head.Marks))
	for p, m := range head.Marks {
		marks[p] = stream.RecordMark{Offset: m.Offset, Timestamp: m.Timestamp, Sum: m.Sum}
	}
	c, err := r.host.Consumer(ctx, head.Covers, marks)
	if err != nil {
		return err
	}
	defer c.Close()
	r.mu.Lock()
	r.consumer = c
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.consumer = nil
		r.mu.Unlock()
	}()
	r.lg.Info("updater: consuming", "topic", r.cfg.Kafka.Topic, "from", head.Covers, "term", head.Term)
	// at is the entry whose coverage the consumer's position is: the head it started from, then
	// each entry of this term it won. A head that is another entry (one of this updater's own,
	// appended before its generation ended and accepted late) covers what the consumer reads
	// next: an increment on it would apply those records twice.
	at := head.Hash
	for {
		inc, err := c.Next(ctx)
		if err != nil {
			return err
		}
		head := r.Head()
		prev := r.host.Current()
		if prev.Version != head.Version || head.Writer != r.writer || head.Hash != at {
			return errLost
		}
		// The order of an increment's records is part of its boundary, not of the fetch.
		slices.SortFunc(inc.Records, func(a, b stream.Record) int {
			return cmp.Or(cmp.Compare(a.Partition, b.Partition), cmp.Compare(a.Offset, b.Offset))
		})
		s, err := r.host.Compute(ctx, prev, inc)
		if err != nil {
			return err
		}
		e, err := r.entryOf(head, s, inc)
		if err != nil {
			return err
		}
		v, err := e.Encode()
		if err != nil {
			return err
		}
		h := hashHex(v)
		r.mu.Lock()
		r.pending[h] = pendingStep{seq: e.Seq, step: s} // kept when the append fails: the entry may still land, late
		r.mu.Unlock()
		won, err := r.appendAndJudge(ctx, e)
		if err != nil {
			return err
		}
		if !won {
			r.mu.Lock()
			delete(r.pending, h)
			r.mu.Unlock()
			return errLost
		}
		at = h
		r.host.DeadLettered(inc.DeadLettered)
		c.MarkDurable(inc)
	}
}

// entryOf is the log entry of step s on head.
func (r *Replica) entryOf(head *postlog.Head, s Step, inc *stream.Increment) (*postlog.Entry, error) {
	sum := s.Summary(head.Seq + 1)
	covers := maps.Clone(head.Covers)
	if covers == nil {
		covers = map[int]int64{}
	}
	maps.Copy(covers, inc.NextOffsets)
	var marks map[int]postlog.Mark
	for p := range inc.NextOffsets {
		if m, ok := inc.Mark(p); ok {
			if marks == nil {
				marks = map[int]postlog.Mark{}
			}
			marks[p] = postlog.Mark{Offset: m.Offset, Timestamp: m.Timestamp, Sum: m.Sum}
		}
	}
	e := &postlog.Entry{Format: postlog.Format, Kind: postlog.Increment, Seq: head.Seq + 1, Parent: head.Hash, Term: head.Term,
		Writer: r.writer, Version: head.Version, ParentVersion: head.Version, InputTopic: r.cfg.Kafka.Topic, Covers: covers,
		Outcome: string(sum.Outcome), KL: sum.KL, Seed: sum.Seed, PosteriorSHA256: head.PosteriorSHA256,
		Counts:  &postlog.Counts{DeadLettered: int64(inc.DeadLettered), Lost: inc.Lost(), Failed: sum.Counters["failed"], Held: sum.Counters["held"]},
		Quality: sum.Quality, Events: sum.Events, Marks: marks,
		// The updater applied (and so published) the head before it computed this step.
		EventsThrough: head.Seq}
	if sum.Outcome == "" {
		e.Outcome = postlog.Skipped
	}
	if sum.Next != nil {
		sha, err := postlog.PosteriorHash(sum.Next)
		if err != nil {
			return nil, err
		}
		e.Version, e.LastLayer, e.PosteriorSHA256, e.Records = sum.Next.Version, postlog.LastLayerOf(sum.Next), sha, sum.Next.Records
		e.Counts.Applied = int64(sum.Records)
	}
	return e, nil
}

// Health is the replica's part of /readyz: following (not stopped), caught up with the log once
// since the start, and, on the updater, a healthy consumer.
func (r *Replica) Health() error {
	r.mu.Lock()
	stopped, caughtUp, c, reset, starved, behind, lag := r.stopped, r.caughtUp, r.consumer, r.inputReset, r.starved, r.behind, r.lag
	endUnknown, endErr, refusedNext := r.endUnknown, r.endErr, r.refusedNext
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
