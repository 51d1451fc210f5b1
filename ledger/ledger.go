package ledger

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"fmt"
	"log/slog"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger/store"
)

// FileName is the database file inside the state directory; PIDFileName is the lock file beside
// it, holding the pid of the process that has the ledger open.
const (
	FileName    = store.FileName
	PIDFileName = store.PIDFileName
)

// schemaVersion is stored in the meta bucket. Schema 1 (no record checksums, no indexes, no
// outbox) is migrated at Open; later versions are refused.
const schemaVersion = 2

// Defaults of Options.
const (
	DefaultMCBatch   = 4096
	DefaultKLHistory = 1000
)

// Options configure a Ledger. The zero value is usable: defaults are applied by Open.
type Options struct {
	// Policy judges certificates. Default: certify.DefaultPolicy(). The indexes depend on it:
	// Open rebuilds them (and re-judges every CE) when it differs from the one they were built for.
	Policy certify.Policy
	// MCBatch is how many CEs one audit batch samples (one Predict call, one short write
	// transaction). Default: DefaultMCBatch.
	MCBatch int
	// KLHistory is how many updates the KL history keeps. Default: DefaultKLHistory.
	KLHistory int
	// VerdictAlpha is the miss probability of the one-sided confidence bounds on p that renew
	// certificates and decide verdicts (certify.Renewable, certify.Verdict). Default:
	// certify.DefaultVerdictAlpha.
	VerdictAlpha float64
	// AdmitByEvidence certifies a new CE only when its certificate's measurements admit it as a
	// renewal would (certify.Certificate.Admits at VerdictAlpha: the lower confidence bound of
	// p1 at least 1 - delta), else it is stored uncertified. False: when its point estimate is in
	// the set (certify.Certificate.InSet).
	AdmitByEvidence bool
	// RemeasureVerdicts makes Confirm measure every at_risk or invalidated CE again under each
	// newer posterior, even when its verdict carries there (certify.Carries): the confirmer's
	// behaviour before verdicts carried, kept to measure what carrying saves. Default: false.
	RemeasureVerdicts bool
	// EncodeChange, when set, turns each status change the ledger writes (Commit, Checkpoint,
	// Confirm, Audit, a policy change at Open) into an outbox entry written in the same
	// transaction. Nil: status changes are not put in the outbox.
	EncodeChange func(StatusChange) OutboxEntry
	// Reissue, when set, selects the status changes after which a CE waits for a reissue: the
	// transaction that records one stores the CE in the reissue bucket (PendingReissues), where
	// it stays until a Checkpoint settles it (Checkpoint.Reissued) or the CE is deleted, across
	// restarts and crashes. Nil: nothing is stored there.
	Reissue func(StatusChange) bool
	// EncodeState, when set, turns the state of each stored CE a transaction changes (its
	// header or its history: a status change, a renewal, a verdict) into an outbox entry of
	// StreamStates written in the same transaction, after its status changes: the CE as the
	// transaction leaves it, without the bounds and decision derived from the current posterior.
	// A replica publishes them to its CE state topic, from which a later owner of the CE's
	// partition restores it (ShareOp.State). A CE stored from a registration that came with a
	// state (ShareOp.State, used or not) has its state put there too, so that the topic's last
	// record of it is its new owner's; a CE deleted (Delete, a deletion of ApplyShare) gets an
	// entry of StreamStates with an empty value, a tombstone. Nil: states are not put in the
	// outbox.
	EncodeState func(*CE) (OutboxEntry, error)
	// Past, when set, gives the posteriors of past versions the caller holds (a daemon's last
	// served ones): Get and List compute from them the version at which a decided verdict
	// stopped carrying (CE.VerdictPendingSince). It is called from reads, concurrently, and must
	// not read the ledger. Nil: that version is not given.
	Past Past
	// RequestWindow is how long the outcome of a request with a request id is kept
	// (ApplyShare, PutRequests): a request that arrives again within it is not applied again.
	// Default: DefaultRequestWindow.
	RequestWindow time.Duration
	// Origin, when set, names the first posterior the caller's configuration asks for
	// (Checkpoint.Origin). Open refuses a ledger whose first posterior records another origin
	// with an *OriginError, before it rebuilds indexes or re-judges a CE for a changed Policy,
	// so that a configuration refused for its model leaves the ledger as it was. A ledger that
	// records no origin (no posterior yet, or one written by an older release) is opened.
	Origin string
	// Logger. Default: slog.Default().
	Logger *slog.Logger
	// Now is the clock. Default: time.Now.
	Now func() time.Time
	// AfterCommit, when set, runs after each commit that succeeded; an error it returns fails
	// the commit as a failed final fsync does (ErrWrite, the ledger as it was before it). Tests
	// make the disk fail with it. It must not read the ledger: a read then waits for the
	// commit's outcome, which waits for AfterCommit.
	AfterCommit func() error

	// syncFreelist makes every commit write bbolt's freelist, as ledgers were written before
	// cfguard stopped syncing it (store.Options.SyncFreelist); benchmarks set it to measure the
	// difference.
	syncFreelist bool
}

func (o *Options) defaults() error {
	if o.Policy == (certify.Policy{}) {
		o.Policy = certify.DefaultPolicy()
	}
	if err := o.Policy.Validate(); err != nil {
		return fmt.Errorf("%w: ledger options: %w", ErrInvalid, err)
	}
	o.MCBatch = cmp.Or(o.MCBatch, DefaultMCBatch)
	if o.MCBatch < 1 {
		return fmt.Errorf("%w: ledger options: mc_batch = %d, want >= 1", ErrInvalid, o.MCBatch)
	}
	o.KLHistory = cmp.Or(o.KLHistory, DefaultKLHistory)
	o.RequestWindow = cmp.Or(o.RequestWindow, DefaultRequestWindow)
	if o.RequestWindow < 0 {
		return fmt.Errorf("%w: ledger options: request window %v, want > 0", ErrInvalid, o.RequestWindow)
	}
	o.VerdictAlpha = cmp.Or(o.VerdictAlpha, certify.DefaultVerdictAlpha)
	if !(o.VerdictAlpha > 0 && o.VerdictAlpha < 1) {
		return fmt.Errorf("%w: ledger options: verdict_alpha = %v, want within (0, 1)", ErrInvalid, o.VerdictAlpha)
	}
	if o.KLHistory < 1 {
		return fmt.Errorf("%w: ledger options: kl_history = %d, want >= 1", ErrInvalid, o.KLHistory)
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return nil
}

// Ledger is cfguard's durable state: the current posterior, the anchor posteriors stored
// counterfactuals were certified under, the CEs and their indexes, consumed offsets, counters,
// the KL history and the event outbox, in one bbolt file. Every change is one bbolt
// transaction, fsynced on commit. A Ledger is safe for concurrent use: reads run in parallel
// with each other and with one writer, and never see a commit before it returned as committed
// (a read that starts during a commit's final fsync waits for it: store.File).
type Ledger struct {
	path string
	opts Options
	log  *slog.Logger
	file *store.File // the bbolt file, its lock, its checks and its recovery from faults
	// idBits draws the random bits of the ids Put gives CEs without one.
	idBits func() uint32

	// wmu serialises the ledger's own writers, so that Commit can hold it across
	// re-certification and checkpoint, and Confirm and Audit can write short batches.
	wmu sync.Mutex

	// Damaged CE records (quarantine.go): the last quarantine count read, and the ids reads
	// found damaged since Open.
	dmu            sync.Mutex
	quarantined    int
	runtimeDamaged map[string]bool
	repairs        Repairs // what Open's record check repaired (Restore reports it)

	// Decoded posteriors by version (current and anchors; immutable once stored).
	cmu    sync.Mutex
	models map[uint64]*bnn.Model

	// The posteriors recent verdicts were measured under, and their KL from the current one
	// (confirm.go).
	carry carryCache

	// oldIndexes is set on a Ledger that only verifies a file whose indexes have an older
	// layout (parsePolicyFingerprint): its index entries are not checked.
	oldIndexes bool
}

// maxCachedModels bounds the decoded-posterior cache.
const maxCachedModels = 256

// Path is the database file.
func (l *Ledger) Path() string { return l.path }

// Created reports whether this Open created the file (the first start). Only a missing file is
// created; an existing file that is empty or damaged is an error, never reinitialised.
func (l *Ledger) Created() bool { return l.file.Created() }

// Policy is the certificate policy the ledger judges with.
func (l *Ledger) Policy() certify.Policy { return l.opts.Policy }

// cur is what the meta bucket says about the current posterior.
type cur struct {
	ok      bool
	version uint64
	sha     [32]byte
}

func readCur(tx *bolt.Tx) (cur, error) {
	meta := tx.Bucket(bMeta)
	sha, err := getSealed(meta, kCurSHA, "meta current_sha")
	if err != nil || sha == nil {
		return cur{}, err
	}
	if len(sha) != 32 {
		return cur{}, corruptf("meta current_sha of %d bytes", len(sha))
	}
	v, err := getU64(meta, kCurVer, "meta current_version")
	if err != nil {
		return cur{}, err
	}
	c := cur{ok: true, version: v}
	copy(c.sha[:], sha)
	return c, nil
}

func readCounts(tx *bolt.Tx) (counts, error) {
	v, err := getSealed(tx.Bucket(bMeta), kCounts, "meta counts")
	if err != nil {
		return counts{}, err
	}
	c, err := decodeCounts(v)
	return c, inRecord(err, "meta counts")
}

func (c counts) put(tx *bolt.Tx) error {
	v, err := c.encode()
	if err != nil {
		return err
	}
	return putSealed(tx.Bucket(bMeta), kCounts, v)
}

func bumpGen(tx *bolt.Tx) error {
	g, err := metaU64(tx, kGen)
	if err != nil {
		return err
	}
	return putU64(tx.Bucket(bMeta), kGen, g+1)
}

// readAnchor reads the record of anchor v (ok = false when not stored).
func readAnchor(tx *bolt.Tx, v uint64) (anchorMeta, bool, error) {
	raw, err := getSealed(tx.Bucket(bAnchors), u64bytes(v), fmt.Sprintf("anchor %d", v))
	if err != nil || raw == nil {
		return anchorMeta{}, false, err
	}
	a, err := decodeAnchor(raw)
	return a, true, inRecord(err, "anchor %d", v)
}

func putAnchor(tx *bolt.Tx, v uint64, a anchorMeta) error {
	return putSealed(tx.Bucket(bAnchors), u64bytes(v), a.encode())
}

// forEachAnchor calls fn for every anchor record, in version order.
func forEachAnchor(tx *bolt.Tx, fn func(v uint64, a anchorMeta) error) error {
	return tx.Bucket(bAnchors).ForEach(func(k, raw []byte) error {
		if len(k) != 8 {
			return corruptf("anchor key %x", k)
		}
		v := binary.BigEndian.Uint64(k)
		p, ok := unseal(k, raw)
		if !ok {
			return corruptf("anchor %d: checksum mismatch", v)
		}
		a, err := decodeAnchor(p)
		if err != nil {
			return inRecord(err, "anchor %d", v)
		}
		return fn(v, a)
	})
}

// model returns the decoded posterior stored under version (the current one or an anchor),
// from the cache when possible. The result is shared: callers must not modify it.
func (l *Ledger) model(tx *bolt.Tx, version uint64) (*bnn.Model, error) {
	c, err := readCur(tx)
	if err != nil {
		return nil, err
	}
	isCur := c.ok && c.version == version
	if !isCur {
		if _, ok, err := readAnchor(tx, version); err != nil || !ok {
			if err == nil {
				err = fmt.Errorf("%w: posterior version %d is neither current nor a live anchor", ErrUnknownAnchor, version)
			}
			return nil, err
		}
	}
	l.cmu.Lock()
	m := l.models[version]
	l.cmu.Unlock()
	if m != nil {
		return m, nil
	}
	var blob []byte
	what := fmt.Sprintf("posterior version %d", version)
	if isCur {
		blob, err = getSealed(tx.Bucket(bMeta), kCurrent, what+" (current)")
	} else {
		blob, err = getSealed(tx.Bucket(bAnchorModels), u64bytes(version), what+" (anchor)")
	}
	if err != nil {
		return nil, err
	}
	if blob == nil {
		return nil, corruptf("%s is recorded but its blob is missing", what)
	}
	if m, err = decodeModel(blob); err != nil {
		return nil, inRecord(err, "%s", what)
	}
	if m.Version != version {
		return nil, corruptf("posterior stored as version %d says version %d", version, m.Version)
	}
	l.cmu.Lock()
	if len(l.models) >= maxCachedModels {
		for k := range l.models { // evict an arbitrary entry
			delete(l.models, k)
			break
		}
	}
	l.models[version] = m
	l.cmu.Unlock()
	return m, nil
}

// Current returns a copy of the current posterior, or ErrNoPosterior.
func (l *Ledger) Current() (*bnn.Model, error) {
	var m *bnn.Model
	err := l.view(func(tx *bolt.Tx) error {
		c, err := readCur(tx)
		if err != nil {
			return err
		}
		if !c.ok {
			return ErrNoPosterior
		}
		m, err = l.model(tx, c.version)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: current posterior: %w", err)
	}
	return m.Clone(), nil
}

// Origin returns where the first posterior came from, as given by the checkpoint that stored
// it (Checkpoint.Origin), or "" when none was given.
func (l *Ledger) Origin() (string, error) {
	var o string
	err := l.view(func(tx *bolt.Tx) error {
		v, err := getSealed(tx.Bucket(bMeta), kOrigin, "meta origin")
		o = string(v)
		return err
	})
	if err != nil {
		return "", fmt.Errorf("ledger: origin: %w", err)
	}
	return o, nil
}

// LogHead returns the posterior log's head stored by the last checkpoint that gave one
// (Checkpoint.LogHead), nil when none did.
func (l *Ledger) LogHead() ([]byte, error) {
	var h []byte
	err := l.view(func(tx *bolt.Tx) error {
		v, err := getSealed(tx.Bucket(bMeta), kLogHead, "meta log_head")
		h = bytes.Clone(v)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: log head: %w", err)
	}
	return h, nil
}

// State is a consistent snapshot of the ledger's scalars.
type State struct {
	HasPosterior     bool             `json:"has_posterior"`
	PosteriorVersion uint64           `json:"posterior_version"`
	Applied          int64            `json:"applied"`
	Offsets          map[int]int64    `json:"offsets"`
	Counters         map[string]int64 `json:"counters"`
	// CountersAt is when each counter last increased.
	CountersAt map[string]time.Time   `json:"counters_at"`
	Counts     map[certify.Status]int `json:"counts"`
	Anchors    int                    `json:"anchors"`
	Generation uint64                 `json:"generation"`
	OutboxLen  int                    `json:"outbox_len"`
	// Pending is the renewal backlog: certified CEs whose bound has lapsed, waiting for Confirm.
	Pending int `json:"pending"`
	// Unconfirmed is how many CEs wait for a measurement under the current posterior (lapsed
	// certificates, and at_risk or invalidated CEs whose last verdict is older and does not carry
	// to it, certify.Carries): what Confirm still has to do at this version.
	Unconfirmed int `json:"unconfirmed"`
	// Decided counts, by status, the CEs whose status is decided under the current posterior
	// (CE.Decided): certified ones whose certificate has not lapsed, at_risk and invalidated ones
	// whose verdict carries to it. Counts minus Decided are the undecided ones.
	Decided map[certify.Status]int `json:"decided"`
	// AppliedAt is when records were last applied (zero before the first).
	AppliedAt time.Time `json:"applied_at"`
	// LastUpdate is the newest entry of the KL history (nil before the first update).
	LastUpdate *KLEntry `json:"last_update,omitempty"`
	// MaxAnchorKL is the largest KL(q_now || q_anchor) over the anchors CEs refer to, as of the
	// last checkpoint.
	MaxAnchorKL float64 `json:"max_anchor_kl"`
	// MinBound is the smallest Theorem 1 bound that holds (>= 1/2) over the certified CEs; HasBound
	// is false (and MinBound 0) when there is none.
	MinBound float64 `json:"min_bound"`
	HasBound bool    `json:"has_bound"`
}

// State reads every scalar in one transaction, so that its fields describe one moment: the
// metrics a scrape reports come from one State.
func (l *Ledger) State() (State, error) {
	var s State
	err := l.view(func(tx *bolt.Tx) error {
		c, err := readCur(tx)
		if err != nil {
			return err
		}
		s.HasPosterior, s.PosteriorVersion = c.ok, c.version
		applied, err := metaU64(tx, kApplied)
		if err != nil {
			return err
		}
		s.Applied = int64(applied)
		if s.Generation, err = metaU64(tx, kGen); err != nil {
			return err
		}
		cnt, err := readCounts(tx)
		if err != nil {
			return err
		}
		s.Counts, s.Pending = cnt.asMap(), int(cnt[lapsedSlot])
		at, err := metaU64(tx, kAppliedAt)
		if err != nil {
			return err
		}
		if at > 0 {
			s.AppliedAt = time.Unix(0, int64(at)).UTC()
		}
		if err := l.boundState(tx, &s); err != nil {
			return err
		}
		if s.LastUpdate, err = lastKLEntry(tx); err != nil {
			return err
		}
		if s.Decided, s.Unconfirmed, err = l.countDecided(tx, c, cnt); err != nil {
			return err
		}
		if s.OutboxLen, err = outboxLen(tx); err != nil {
			return err
		}
		if s.Offsets, err = readOffsets(tx); err != nil {
			return err
		}
		if s.Counters, err = readCounters(tx); err != nil {
			return err
		}
		s.CountersAt, err = readCountersAt(tx)
		return err
	})
	if err != nil {
		return State{}, fmt.Errorf("ledger: state: %w", err)
	}
	return s, nil
}

func readOffsets(tx *bolt.Tx) (map[int]int64, error) {
	m := map[int]int64{}
	err := tx.Bucket(bOffsets).ForEach(func(k, v []byte) error {
		p, ok := unseal(k, v)
		if len(k) != 4 || !ok || len(p) != 8 {
			return corruptf("offsets: record %x (%d bytes) is damaged", k, len(v))
		}
		m[int(binary.BigEndian.Uint32(k))] = int64(binary.BigEndian.Uint64(p))
		return nil
	})
	return m, err
}

// counterAtPrefix prefixes the meta key of a counter's last increase: unix ns, sealed.
const counterAtPrefix = "counter_at/"

// addCounter adds d (>= 0) to counter name and, when d > 0, records now as its last increase.
func addCounter(tx *bolt.Tx, name string, d int64, now time.Time) error {
	ctrs := tx.Bucket(bCounters)
	n, err := getU64(ctrs, []byte(name), fmt.Sprintf("counter %q", name))
	if err != nil {
		return err
	}
	if err := putU64(ctrs, []byte(name), n+uint64(d)); err != nil {
		return err
	}
	if d <= 0 {
		return nil
	}
	return putU64(tx.Bucket(bMeta), []byte(counterAtPrefix+name), uint64(now.UnixNano()))
}

// readCountersAt returns when each counter last increased (counters that never did, or did
// before the ledger recorded it, have none).
func readCountersAt(tx *bolt.Tx) (map[string]time.Time, error) {
	m := map[string]time.Time{}
	c := tx.Bucket(bMeta).Cursor()
	prefix := []byte(counterAtPrefix)
	for k, v := c.Seek(prefix); k != nil && bytes.HasPrefix(k, prefix); k, v = c.Next() {
		p, ok := unseal(k, v)
		if !ok || len(p) != 8 {
			return nil, corruptf("meta %q (%d bytes) is damaged", k, len(v))
		}
		m[string(k[len(prefix):])] = time.Unix(0, int64(binary.BigEndian.Uint64(p))).UTC()
	}
	return m, nil
}

func readCounters(tx *bolt.Tx) (map[string]int64, error) {
	m := map[string]int64{}
	err := tx.Bucket(bCounters).ForEach(func(k, v []byte) error {
		p, ok := unseal(k, v)
		if !ok || len(p) != 8 {
			return corruptf("counter %q (%d bytes) is damaged", k, len(v))
		}
		m[string(k)] = int64(binary.BigEndian.Uint64(p))
		return nil
	})
	return m, err
}

// Offsets returns the next offset to consume per partition, as of the last checkpoint.
func (l *Ledger) Offsets() (map[int]int64, error) {
	var m map[int]int64
	err := l.view(func(tx *bolt.Tx) (err error) { m, err = readOffsets(tx); return err })
	if err != nil {
		return nil, fmt.Errorf("ledger: offsets: %w", err)
	}
	return m, nil
}

// Counts returns the number of stored CEs per status (every status present, possibly 0).
func (l *Ledger) Counts() (map[certify.Status]int, error) {
	var c counts
	err := l.view(func(tx *bolt.Tx) (err error) { c, err = readCounts(tx); return err })
	if err != nil {
		return nil, fmt.Errorf("ledger: counts: %w", err)
	}
	return c.asMap(), nil
}

// Waiting reports whether a CE waits for a measurement under the current posterior: a certified
// CE whose bound has lapsed, or an at_risk or invalidated one whose verdict is missing, or older
// and not carried to it (certify.Carries). It reads at most one such CE, so that the confirmer
// can ask it before drawing a pool of networks it would not use.
func (l *Ledger) Waiting() (bool, error) {
	var n int
	err := l.view(func(tx *bolt.Tx) error {
		c, err := readCur(tx)
		if err != nil || !c.ok {
			return err
		}
		n, err = l.countWaiting(tx, c, 1)
		return err
	})
	if err != nil {
		return false, fmt.Errorf("ledger: waiting: %w", err)
	}
	return n > 0, nil
}

// Anchor describes one stored anchor posterior.
type Anchor struct {
	Version uint64 `json:"version"`
	// Refs is the number of CEs whose certificate was measured under this posterior.
	Refs int `json:"refs"`
	// KL is KL(q_now || q_anchor) as of KLVersion, the current posterior of the last checkpoint.
	KL        float64   `json:"kl"`
	KLVersion uint64    `json:"kl_version"`
	CreatedAt time.Time `json:"created_at"`
}

// Anchors lists the stored anchor posteriors by version.
func (l *Ledger) Anchors() ([]Anchor, error) {
	var out []Anchor
	err := l.view(func(tx *bolt.Tx) error {
		return forEachAnchor(tx, func(v uint64, a anchorMeta) error {
			out = append(out, Anchor{Version: v, Refs: int(a.refs), KL: a.kl, KLVersion: a.klVersion,
				CreatedAt: time.Unix(0, a.created).UTC()})
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: anchors: %w", err)
	}
	return out, nil
}

// KLHistory returns the last n entries (all kept ones if n <= 0), oldest first.
func (l *Ledger) KLHistory(n int) ([]KLEntry, error) {
	var out []KLEntry
	err := l.view(func(tx *bolt.Tx) error {
		c := tx.Bucket(bKLHistory).Cursor()
		for k, v := c.Last(); k != nil && (n <= 0 || len(out) < n); k, v = c.Prev() {
			p, ok := unseal(k, v)
			if !ok {
				return corruptf("kl history entry %x: checksum mismatch", k)
			}
			s, err := decodeKLEntry(k, p)
			if err != nil {
				return inRecord(err, "kl history entry %x", k)
			}
			out = append(out, s)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: kl history: %w", err)
	}
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	return out, nil
}

// KLEvents are the newest updates of two kinds an alert dates: the last that breached the KL
// budget and the last that failed (nil when none is known).
type KLEvents struct {
	Breach, Failed *KLEntry
}

// LastKLEvents reads both in one pass over the KL history. The newest of each kind is also kept
// apart from the history (meta kl_breach, kl_failed: a checkpoint writes it), so that it is known
// after the history (its last Options.KLHistory updates) has dropped it; LastKLOver says where a
// breach comes from.
func (l *Ledger) LastKLEvents(budget float64) (ev KLEvents, err error) {
	err = l.view(func(tx *bolt.Tx) error {
		// A kept event damaged since Open (which deletes it) is not known: the history alone answers.
		breach, hasBreach, err := readKept(tx, kKLBreach)
		hasBreach = hasBreach && err == nil
		failed, hasFailed, err := readKept(tx, kKLFailed)
		hasFailed = hasFailed && err == nil
		// Each kind is done once it is found in the history, or once what is left of the
		// history is older than the kept one.
		breachDone, failedDone := false, false
		c := tx.Bucket(bKLHistory).Cursor()
		for k, v := c.Last(); k != nil && !(breachDone && failedDone); k, v = c.Prev() {
			if len(k) != 8 {
				return corruptf("kl history key %x: %d bytes, want 8", k, len(k))
			}
			seq := binary.BigEndian.Uint64(k)
			breachDone = breachDone || hasBreach && seq <= breach.Seq
			failedDone = failedDone || hasFailed && seq <= failed.Seq
			p, sealed := unseal(k, v)
			if !sealed {
				return corruptf("kl history entry %x: checksum mismatch", k)
			}
			s, err := decodeKLEntry(k, p)
			if err != nil {
				return inRecord(err, "kl history entry %x", k)
			}
			if !breachDone && s.Breached(budget) {
				ev.Breach, breachDone = &s, true
			}
			if !failedDone && s.Outcome == certify.OutcomeFailed {
				ev.Failed, failedDone = &s, true
			}
		}
		if ev.Breach == nil && hasBreach {
			ev.Breach = &breach
		}
		if ev.Failed == nil && hasFailed {
			ev.Failed = &failed
		}
		return nil
	})
	if err != nil {
		return KLEvents{}, fmt.Errorf("ledger: kl history: %w", err)
	}
	return ev, nil
}

// LastKLOver returns the newest update that breached budget (ok false when none is known): when
// an update last breached the budget, whatever its outcome (promoted, clipped or rejected). It is
// the newer of the newest KL history entry that breached budget (KLEntry.Breached) and the
// newest update a checkpoint marked breached (UpdateRecord.Breached, under the budget of its
// time), which the ledger keeps after its history window (Options.KLHistory updates) has
// dropped the entry.
func (l *Ledger) LastKLOver(budget float64) (e KLEntry, ok bool, err error) {
	ev, err := l.LastKLEvents(budget)
	if err != nil || ev.Breach == nil {
		return KLEntry{}, false, err
	}
	return *ev.Breach, true, nil
}

// readKept reads the update a checkpoint kept under key (kKLBreach, kKLFailed; found false when
// none did).
func readKept(tx *bolt.Tx, key []byte) (e KLEntry, found bool, err error) {
	name := "meta " + string(key)
	v, err := getSealed(tx.Bucket(bMeta), key, name)
	if err != nil || v == nil {
		return KLEntry{}, false, err
	}
	if len(v) < 8 {
		return KLEntry{}, false, corruptf("%s: %d bytes", name, len(v))
	}
	e, err = decodeKLEntry(v[:8], v[8:])
	if err != nil {
		return KLEntry{}, false, inRecord(err, "%s", name)
	}
	return e, true, nil
}

// boundState counts the anchors and sets MaxAnchorKL and MinBound from the anchors' stored KL and
// the first idx_p1 entry of each live anchor's certified class whose Theorem 1 bound holds.
func (l *Ledger) boundState(tx *bolt.Tx, s *State) error {
	pol := l.opts.Policy
	return forEachAnchor(tx, func(v uint64, a anchorMeta) error {
		s.Anchors++
		if a.refs == 0 {
			return nil
		}
		s.MaxAnchorKL = max(s.MaxAnchorKL, a.kl)
		sl := pol.Slack(a.kl)
		g := pol.Gate(sl)
		b, ok, err := firstHolding(tx, v, &g, sl)
		if ok && (!s.HasBound || b < s.MinBound) {
			s.MinBound, s.HasBound = b, true
		}
		return err
	})
}

// lastKLEntry is the newest KL history entry, or nil.
func lastKLEntry(tx *bolt.Tx) (*KLEntry, error) {
	k, v := tx.Bucket(bKLHistory).Cursor().Last()
	if k == nil {
		return nil, nil
	}
	p, ok := unseal(k, v)
	if !ok {
		return nil, corruptf("kl_history entry %x: checksum mismatch", k)
	}
	e, err := decodeKLEntry(k, p)
	if err != nil {
		return nil, err
	}
	return &e, nil
}
