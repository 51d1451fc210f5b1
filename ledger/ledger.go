package ledger

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// FileName is the database file inside the state directory.
const FileName = "cfguard.db"

// schemaVersion is stored in the meta bucket; Open refuses other versions.
const schemaVersion = 1

// Errors. Every error the package returns about bad input wraps ErrInvalid and names the field.
var (
	ErrInvalid        = errors.New("invalid input")
	ErrNotFound       = errors.New("counterfactual not found")
	ErrExists         = errors.New("counterfactual id already stored")
	ErrNoPosterior    = errors.New("no current posterior (checkpoint a model first)")
	ErrUnknownAnchor  = errors.New("anchor posterior not stored")
	ErrVersion        = errors.New("posterior version does not advance")
	ErrNotRecertified = errors.New("posterior change without a matching re-certification")
	// ErrStale: the store changed (CEs registered, deleted or audited, or a new current posterior)
	// between Recertify (or an audit batch) and the write; nothing was written; run it again.
	ErrStale   = errors.New("re-certification is stale")
	ErrCorrupt = errors.New("ledger corrupt")
)

// Options configure a Ledger. The zero value is usable: defaults are applied by Open.
type Options struct {
	// Policy judges certificates. Default: certify.DefaultPolicy().
	Policy certify.Policy
	// MCSamples is the number of Monte-Carlo draws used when a bound fails and the caller gives
	// none (RecertifyOptions.Samples = 0, and Put of a CE anchored before the current posterior).
	// Default: 200.
	MCSamples int
	// MCBatch is how many CEs go into one bnn.Model.Predict call, bounding memory. Default: 4096.
	MCBatch int
	// KLHistory is how many checkpoint steps the KL history keeps. Default: 1000.
	KLHistory int
	// LockTimeout is how long Open waits for another process's lock on the file. Default: 2s.
	LockTimeout time.Duration
	// Logger. Default: slog.Default().
	Logger *slog.Logger
	// Now is the clock. Default: time.Now.
	Now func() time.Time
}

func (o *Options) defaults() error {
	if o.Policy == (certify.Policy{}) {
		o.Policy = certify.DefaultPolicy()
	}
	if err := o.Policy.Validate(); err != nil {
		return fmt.Errorf("%w: ledger options: %w", ErrInvalid, err)
	}
	if o.MCSamples == 0 {
		o.MCSamples = 200
	}
	if o.MCSamples < 2 {
		return fmt.Errorf("%w: ledger options: mc_samples = %d, want >= 2", ErrInvalid, o.MCSamples)
	}
	if o.MCBatch == 0 {
		o.MCBatch = 4096
	}
	if o.MCBatch < 1 {
		return fmt.Errorf("%w: ledger options: mc_batch = %d, want >= 1", ErrInvalid, o.MCBatch)
	}
	if o.KLHistory == 0 {
		o.KLHistory = 1000
	}
	if o.KLHistory < 1 {
		return fmt.Errorf("%w: ledger options: kl_history = %d, want >= 1", ErrInvalid, o.KLHistory)
	}
	if o.LockTimeout == 0 {
		o.LockTimeout = 2 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return nil
}

// Bucket and meta key names.
var (
	bMeta         = []byte("meta")
	bCounters     = []byte("counters")
	bOffsets      = []byte("offsets")
	bHeaders      = []byte("ce_hdr")
	bBodies       = []byte("ce_body")
	bAnchors      = []byte("anchors")
	bAnchorModels = []byte("anchor_models")
	bKLHistory    = []byte("kl_history")

	kSchema  = []byte("schema")
	kCurrent = []byte("current")     // posterior blob
	kCurSHA  = []byte("current_sha") // SHA-256 of the blob
	kCurVer  = []byte("current_version")
	kGen     = []byte("generation")
	kCounts  = []byte("counts") // 4 x u64 by status - 1
	kApplied = []byte("applied")
	kKLSeq   = []byte("kl_seq")
)

// Ledger is cfguard's durable state: the current posterior, the anchor posteriors stored
// counterfactuals were certified under, the CEs, consumed offsets and counters, in one bbolt file.
// Every change is one bbolt transaction, fsynced on commit. A Ledger is safe for concurrent use:
// reads run in parallel with each other and with one writer.
type Ledger struct {
	db   *bolt.DB
	opts Options
	log  *slog.Logger

	// wmu serialises the ledger's own writers (Put, Delete, Checkpoint, Commit, audit batches),
	// so that Commit can hold it across re-certification and checkpoint.
	wmu sync.Mutex

	// Decoded posteriors by version (current and anchors; immutable once stored).
	cmu    sync.Mutex
	models map[uint64]*bnn.Model
}

// maxCachedModels bounds the decoded-posterior cache.
const maxCachedModels = 256

// Open opens (creating if needed) <stateDir>/cfguard.db.
func Open(stateDir string, opts Options) (*Ledger, error) {
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	if stateDir == "" {
		return nil, fmt.Errorf("%w: ledger: empty state dir", ErrInvalid)
	}
	if err := os.MkdirAll(stateDir, 0o755); err != nil {
		return nil, fmt.Errorf("ledger: state dir: %w", err)
	}
	path := filepath.Join(stateDir, FileName)
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: opts.LockTimeout, FreelistType: bolt.FreelistMapType})
	if err != nil {
		return nil, fmt.Errorf("ledger: open %s: %w", path, err)
	}
	l := &Ledger{db: db, opts: opts, log: opts.Logger, models: map[uint64]*bnn.Model{}}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bMeta, bCounters, bOffsets, bHeaders, bBodies, bAnchors, bAnchorModels, bKLHistory} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		meta := tx.Bucket(bMeta)
		if v := meta.Get(kSchema); v == nil {
			return meta.Put(kSchema, u64bytes(schemaVersion))
		} else if len(v) != 8 || binary.BigEndian.Uint64(v) != schemaVersion {
			return fmt.Errorf("%w: schema version %x, this build reads %d", ErrCorrupt, v, schemaVersion)
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("ledger: open %s: %w", path, err)
	}
	return l, nil
}

// Close closes the database. Pending reads finish first.
func (l *Ledger) Close() error { return l.db.Close() }

// Path is the database file.
func (l *Ledger) Path() string { return l.db.Path() }

// Policy is the certificate policy the ledger judges with.
func (l *Ledger) Policy() certify.Policy { return l.opts.Policy }

func u64bytes(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }

func getU64(b *bolt.Bucket, k []byte) uint64 {
	v := b.Get(k)
	if len(v) != 8 {
		return 0
	}
	return binary.BigEndian.Uint64(v)
}

// cur is what the meta bucket says about the current posterior.
type cur struct {
	ok      bool
	version uint64
	sha     [32]byte
}

func readCur(tx *bolt.Tx) cur {
	meta := tx.Bucket(bMeta)
	sha := meta.Get(kCurSHA)
	if len(sha) != 32 {
		return cur{}
	}
	c := cur{ok: true, version: getU64(meta, kCurVer)}
	copy(c.sha[:], sha)
	return c
}

// counts are the per-status CE counts kept in meta, indexed by status - 1.
type counts [4]int64

func readCounts(tx *bolt.Tx) counts {
	var c counts
	v := tx.Bucket(bMeta).Get(kCounts)
	if len(v) == 8*len(c) {
		for i := range c {
			c[i] = int64(binary.BigEndian.Uint64(v[8*i:]))
		}
	}
	return c
}

func (c *counts) add(s certify.Status, d int64) { c[s-1] += d }

func (c counts) put(tx *bolt.Tx) error {
	v := make([]byte, 0, 8*len(c))
	for _, n := range c {
		if n < 0 {
			return fmt.Errorf("%w: negative status count", ErrCorrupt)
		}
		v = binary.BigEndian.AppendUint64(v, uint64(n))
	}
	return tx.Bucket(bMeta).Put(kCounts, v)
}

func (c counts) asMap() map[certify.Status]int {
	m := make(map[certify.Status]int, len(c))
	for _, s := range certify.Statuses() {
		m[s] = int(c[s-1])
	}
	return m
}

func (c counts) total() int64 { return c[0] + c[1] + c[2] + c[3] }

func bumpGen(tx *bolt.Tx) error {
	meta := tx.Bucket(bMeta)
	return meta.Put(kGen, u64bytes(getU64(meta, kGen)+1))
}

// anchorMeta is the small record kept per anchor posterior in bucket anchors (the model bytes
// are in anchor_models under the same key):
//
//	refs u64 (CEs holding a certificate under it), kl f64 = KL(q_now || q_anchor),
//	klVersion u64 (the current version kl was computed against), created unix ns i64
type anchorMeta struct {
	refs      uint64
	kl        float64
	klVersion uint64
	created   int64
}

func decodeAnchor(v []byte) (anchorMeta, error) {
	if len(v) != 32 {
		return anchorMeta{}, fmt.Errorf("%w: anchor record of %d bytes", ErrCorrupt, len(v))
	}
	return anchorMeta{refs: binary.BigEndian.Uint64(v), kl: math.Float64frombits(binary.BigEndian.Uint64(v[8:])),
		klVersion: binary.BigEndian.Uint64(v[16:]), created: int64(binary.BigEndian.Uint64(v[24:]))}, nil
}

func (a anchorMeta) encode() []byte {
	v := make([]byte, 0, 32)
	v = binary.BigEndian.AppendUint64(v, a.refs)
	v = binary.BigEndian.AppendUint64(v, math.Float64bits(a.kl))
	v = binary.BigEndian.AppendUint64(v, a.klVersion)
	return binary.BigEndian.AppendUint64(v, uint64(a.created))
}

// model returns the decoded posterior stored under version (the current one or an anchor),
// from the cache when possible. The result is shared: callers must not modify it.
func (l *Ledger) model(tx *bolt.Tx, version uint64) (*bnn.Model, error) {
	// The cache says what a version decodes to, never whether it is still stored.
	if c := readCur(tx); (!c.ok || c.version != version) && tx.Bucket(bAnchors).Get(u64bytes(version)) == nil {
		return nil, fmt.Errorf("%w: posterior version %d is neither current nor a live anchor", ErrUnknownAnchor, version)
	}
	l.cmu.Lock()
	m := l.models[version]
	l.cmu.Unlock()
	if m != nil {
		return m, nil
	}
	var blob []byte
	if c := readCur(tx); c.ok && c.version == version {
		blob = tx.Bucket(bMeta).Get(kCurrent)
	} else {
		blob = tx.Bucket(bAnchorModels).Get(u64bytes(version))
	}
	if blob == nil {
		return nil, fmt.Errorf("%w: posterior version %d is neither current nor a live anchor", ErrUnknownAnchor, version)
	}
	m, err := decodeModel(blob)
	if err != nil {
		return nil, fmt.Errorf("posterior version %d: %w", version, err)
	}
	if m.Version != version {
		return nil, fmt.Errorf("%w: posterior stored as version %d says version %d", ErrCorrupt, version, m.Version)
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
	err := l.db.View(func(tx *bolt.Tx) error {
		c := readCur(tx)
		if !c.ok {
			return ErrNoPosterior
		}
		var err error
		m, err = l.model(tx, c.version)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: current posterior: %w", err)
	}
	return m.Clone(), nil
}

// State is a consistent snapshot of the ledger's scalars.
type State struct {
	HasPosterior     bool                   `json:"has_posterior"`
	PosteriorVersion uint64                 `json:"posterior_version"`
	Applied          int64                  `json:"applied"`
	Offsets          map[int]int64          `json:"offsets"`
	Counters         map[string]int64       `json:"counters"`
	Counts           map[certify.Status]int `json:"counts"`
	Anchors          int                    `json:"anchors"`
	Generation       uint64                 `json:"generation"`
}

// State reads every scalar in one transaction.
func (l *Ledger) State() (State, error) {
	var s State
	err := l.db.View(func(tx *bolt.Tx) error {
		c := readCur(tx)
		s.HasPosterior, s.PosteriorVersion = c.ok, c.version
		meta := tx.Bucket(bMeta)
		s.Applied = int64(getU64(meta, kApplied))
		s.Generation = getU64(meta, kGen)
		s.Counts = readCounts(tx).asMap()
		s.Anchors = tx.Bucket(bAnchors).Stats().KeyN
		var err error
		if s.Offsets, err = readOffsets(tx); err != nil {
			return err
		}
		s.Counters, err = readCounters(tx)
		return err
	})
	return s, err
}

func readOffsets(tx *bolt.Tx) (map[int]int64, error) {
	m := map[int]int64{}
	err := tx.Bucket(bOffsets).ForEach(func(k, v []byte) error {
		if len(k) != 4 || len(v) != 8 {
			return fmt.Errorf("%w: offset record %x=%x", ErrCorrupt, k, v)
		}
		m[int(binary.BigEndian.Uint32(k))] = int64(binary.BigEndian.Uint64(v))
		return nil
	})
	return m, err
}

func readCounters(tx *bolt.Tx) (map[string]int64, error) {
	m := map[string]int64{}
	err := tx.Bucket(bCounters).ForEach(func(k, v []byte) error {
		if len(v) != 8 {
			return fmt.Errorf("%w: counter %q", ErrCorrupt, k)
		}
		m[string(k)] = int64(binary.BigEndian.Uint64(v))
		return nil
	})
	return m, err
}

// Offsets returns the next offset to consume per partition, as of the last checkpoint.
func (l *Ledger) Offsets() (map[int]int64, error) {
	var m map[int]int64
	err := l.db.View(func(tx *bolt.Tx) (err error) { m, err = readOffsets(tx); return err })
	return m, err
}

// Counts returns the number of stored CEs per status (every status present, possibly 0).
func (l *Ledger) Counts() (map[certify.Status]int, error) {
	var c counts
	err := l.db.View(func(tx *bolt.Tx) error { c = readCounts(tx); return nil })
	return c.asMap(), err
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
	err := l.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bAnchors).ForEach(func(k, v []byte) error {
			a, err := decodeAnchor(v)
			if err != nil {
				return err
			}
			out = append(out, Anchor{Version: binary.BigEndian.Uint64(k), Refs: int(a.refs), KL: a.kl,
				KLVersion: a.klVersion, CreatedAt: time.Unix(0, a.created).UTC()})
			return nil
		})
	})
	return out, err
}

// KLStep is one entry of the KL history.
type KLStep struct {
	Seq              uint64    `json:"seq"`
	At               time.Time `json:"at"`
	PosteriorVersion uint64    `json:"posterior_version"`
	// KL is the step's KL(q_new || q_prev); MaxAnchorKL the largest KL(q_now || q_anchor) over live
	// anchors after the step (0 when the checkpoint carried no re-certification).
	KL          float64 `json:"kl"`
	MaxAnchorKL float64 `json:"max_anchor_kl"`
	Outcome     string  `json:"outcome"`
}

// KLHistory returns the last n steps (all kept ones if n <= 0), oldest first.
func (l *Ledger) KLHistory(n int) ([]KLStep, error) {
	var out []KLStep
	err := l.db.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(bKLHistory).Cursor()
		for k, v := c.Last(); k != nil && (n <= 0 || len(out) < n); k, v = c.Prev() {
			s, err := decodeKLStep(k, v)
			if err != nil {
				return err
			}
			out = append(out, s)
		}
		return nil
	})
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	return out, err
}

func (s KLStep) encode() []byte {
	v := make([]byte, 0, 33+len(s.Outcome))
	v = binary.BigEndian.AppendUint64(v, uint64(s.At.UnixNano()))
	v = binary.BigEndian.AppendUint64(v, s.PosteriorVersion)
	v = binary.BigEndian.AppendUint64(v, math.Float64bits(s.KL))
	v = binary.BigEndian.AppendUint64(v, math.Float64bits(s.MaxAnchorKL))
	v = append(v, byte(len(s.Outcome)))
	return append(v, s.Outcome...)
}

func decodeKLStep(k, v []byte) (KLStep, error) {
	if len(k) != 8 || len(v) < 33 || len(v) != 33+int(v[32]) {
		return KLStep{}, fmt.Errorf("%w: kl history record", ErrCorrupt)
	}
	return KLStep{Seq: binary.BigEndian.Uint64(k), At: time.Unix(0, int64(binary.BigEndian.Uint64(v))).UTC(),
		PosteriorVersion: binary.BigEndian.Uint64(v[8:]), KL: math.Float64frombits(binary.BigEndian.Uint64(v[16:])),
		MaxAnchorKL: math.Float64frombits(binary.BigEndian.Uint64(v[24:])), Outcome: string(v[33:])}, nil
}
