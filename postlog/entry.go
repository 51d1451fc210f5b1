package postlog

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/cfguard/cfguard/bnn"
)

// Format is the version of the entry encoding this package writes and reads. A replica meeting a
// newer one stops rather than skip it (ErrUnknownFormat).
const Format = 1

// Kind is what an entry does to the chain.
type Kind string

// Entry kinds.
const (
	// Genesis is entry 0: the first posterior, whole (Body). A genesis with Epoch > 0 starts a
	// new epoch at the head of the chain (cfguard new-epoch): it moves past the record Past
	// names, one the replicas could not apply, with the head's posterior and coverage.
	Genesis Kind = "genesis"
	// Claim opens a new term for its writer; the posterior does not change.
	Claim Kind = "claim"
	// Increment covers a range of input records: a new version when its outcome is promoted or
	// clipped, the same version otherwise (rejected, failed, or only dead letters).
	Increment Kind = "increment"
)

// Outcomes of an increment (certify.Outcome's names).
const (
	Promoted = "promoted"
	Clipped  = "clipped"
	Rejected = "rejected"
	Failed   = "failed"
	// Skipped covers records that were all dead-lettered or lost: nothing to update.
	Skipped = "skipped"
)

// Entry is one record of the posterior log. Its value is JSON; parameters are little-endian
// float64 in base64, so that they round-trip bit for bit.
type Entry struct {
	Format  int    `json:"format"`
	Kind    Kind   `json:"kind"`
	Seq     uint64 `json:"seq"`
	Parent  string `json:"parent,omitempty"` // hex SHA-256 of the parent entry's value bytes
	Term    uint64 `json:"term"`
	Writer  string `json:"writer"` // replica id and a nonce per process start: "<id>/<nonce>"
	Version uint64 `json:"version"`
	// ParentVersion is the posterior version before the entry.
	ParentVersion uint64 `json:"parent_version"`
	// InputTopic and Covers: per partition of the input topic, the next offset after the records
	// this entry and its ancestors covered. An increment covers [parent's, own) of each partition.
	InputTopic string        `json:"input_topic,omitempty"`
	Covers     map[int]int64 `json:"covers,omitempty"`
	Counts     *Counts       `json:"counts,omitempty"`
	Outcome    string        `json:"outcome,omitempty"`
	KL         float64       `json:"kl,omitempty"`   // KL(q_version || q_parent_version) of the update
	Seed       uint64        `json:"seed,omitempty"` // the update's seed
	LastLayer  *LastLayer    `json:"last_layer,omitempty"`
	// Records is the number of records the entry's posterior stands for (bnn.Model.Records);
	// 0 (omitted) in logs written before posteriors carried it: the parent's is kept.
	Records float64 `json:"records,omitempty"`
	// Quality is the increment's prequential record (the daemon's JSON): its records' scores
	// under the parent posterior and the change detector after them, so that every replica
	// stores and reports the same figures.
	Quality json.RawMessage `json:"quality,omitempty"`
	// PosteriorSHA256 is the hex SHA-256 of the posterior's safetensors weights as bnn.Encode
	// writes them (the Cfguard-Weights-Sha256 of the API).
	PosteriorSHA256 string `json:"posterior_sha256"`
	// Body is genesis only: the whole first posterior.
	Body *Body `json:"body,omitempty"`
	// Settings is genesis only: the cluster-wide settings (config.ClusterSettings and the
	// derived keys model.sha256, schema.features, schema.classes) of the replica that wrote
	// it, which every replica must share to join. Part of the value bytes, so the entry's
	// authenticator covers them. Absent in a genesis of a log written before it was recorded.
	Settings map[string]string `json:"settings,omitempty"`
	// Epoch and Past are a new epoch's (a genesis after the first): its number, the head's
	// epoch + 1, and the record it moves past (the one the chain stopped at, or the head). A
	// claim's or an increment's Epoch is that of the genesis it names (Genesis).
	Epoch uint64 `json:"epoch,omitempty"`
	Past  *Past  `json:"past,omitempty"`
	// Genesis is a claim's or an increment's: the hex SHA-256 of the genesis that begins its
	// epoch (Head.GenesisHash), so that an entry signed with the cluster's key for another log,
	// or for an epoch this log moved past, is not taken for one of this log's (OtherLog).
	// Empty in entries written before it was recorded, which are judged without it.
	Genesis string `json:"genesis,omitempty"`
	// Build and Generation are claim only, for forensics: the writer's build and the consumer
	// group generation that made it the updater.
	Build      string `json:"build,omitempty"`
	Generation int    `json:"generation,omitempty"`
	// Events are an increment's posterior events (kl_over_budget, increment_held,
	// update_failed) as its writer put them in its outbox, so that a later claimant can publish
	// them when the writer may not have (it dies between the append and its own apply).
	Events []Event `json:"events,omitempty"`
	// Marks identify, per partition of the input topic the increment read, the last record it
	// read before its coverage (stream.RecordMark): an updater that starts from the coverage
	// checks first that the topic still holds it, so a topic deleted and recreated is found
	// and no record of the new log is skipped.
	Marks map[int]Mark `json:"marks,omitempty"`
	// EventsThrough is an increment's statement that the posterior events of every entry up to
	// this seq are in the outbox of their writer or of a later claimant: what its writer had
	// applied (and so published) before it appended. It is below the entry's own seq.
	EventsThrough uint64 `json:"events_through,omitempty"`
	// Point is an increment's or a claim's mark that the version it leaves is a confirmation
	// point: a posterior under which replicas measure the CEs that became due since the point
	// before (Head.PointsIn). The updater marks an increment that closes while its consumer is
	// caught up, one that leaves the version as it was (an increment of no records, when the
	// input went quiet after a version that is not a point, among them), and otherwise every
	// few versions; a claim marks the head's version when it is not one.
	Point bool `json:"point,omitempty"`
}

// Mark identifies one record of an input partition: its offset, Kafka timestamp (Unix
// milliseconds) and the checksum of its key and value (stream.RecordMark).
type Mark struct {
	Offset    int64  `json:"offset"`
	Timestamp int64  `json:"timestamp"`
	Sum       uint64 `json:"sum"`
}

// Event is one posterior event of an increment as an outbox holds it: the events topic's key and
// the event's JSON (the daemon's format).
type Event struct {
	Key   string          `json:"key"`
	Value json.RawMessage `json:"value"`
}

// Past is a record of the log by offset and the hex SHA-256 of its value bytes.
type Past struct {
	Offset int64  `json:"offset"`
	SHA256 string `json:"sha256"`
}

// Counts are an increment's records by fate.
type Counts struct {
	Applied      int64 `json:"applied,omitempty"`
	DeadLettered int64 `json:"dead_lettered,omitempty"`
	Lost         int64 `json:"lost,omitempty"`
	Failed       int64 `json:"failed,omitempty"`
	Held         int64 `json:"held,omitempty"`
}

// LastLayer is the last layer's Gaussian parameters (torchbnn names: weight_mu, ...).
type LastLayer struct {
	WeightMu       Floats `json:"weight_mu"`
	WeightLogSigma Floats `json:"weight_log_sigma"`
	BiasMu         Floats `json:"bias_mu"`
	BiasLogSigma   Floats `json:"bias_log_sigma"`
}

// Body is a whole posterior: bnn.Encode's sidecar JSON and safetensors weights.
type Body struct {
	Sidecar []byte `json:"sidecar"` // base64 by encoding/json
	Weights []byte `json:"weights"`
}

// Floats marshals as base64 of little-endian float64: exact, and a third of decimal's size.
type Floats []float64

// MarshalJSON encodes f bit for bit.
func (f Floats) MarshalJSON() ([]byte, error) {
	b := make([]byte, 8*len(f))
	for i, v := range f {
		binary.LittleEndian.PutUint64(b[8*i:], math.Float64bits(v))
	}
	return json.Marshal(base64.StdEncoding.EncodeToString(b))
}

// UnmarshalJSON is MarshalJSON's inverse.
func (f *Floats) UnmarshalJSON(data []byte) error {
	var s string
	if err := json.Unmarshal(data, &s); err != nil {
		return err
	}
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return err
	}
	if len(b)%8 != 0 {
		return fmt.Errorf("%d bytes of float64, not a multiple of 8", len(b))
	}
	out := make([]float64, len(b)/8)
	for i := range out {
		out[i] = math.Float64frombits(binary.LittleEndian.Uint64(b[8*i:]))
	}
	*f = out
	return nil
}

// Encode is the value stored in Kafka.
func (e *Entry) Encode() ([]byte, error) { return json.Marshal(e) }

// ErrMalformed is wrapped by the errors of Decode.
var ErrMalformed = errors.New("postlog: malformed entry")

// ErrUnknownFormat is returned for an entry of a newer format: the replica must stop, never skip.
var ErrUnknownFormat = errors.New("postlog: entry of an unknown format")

// Decode parses a stored value. It checks the format and the fields every kind needs; the chain
// checks the rest (Chain.Offer).
func Decode(value []byte) (*Entry, error) {
	var e Entry
	if err := json.Unmarshal(value, &e); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	switch {
	case e.Format > Format:
		return nil, fmt.Errorf("%w: format %d, this build reads up to %d: upgrade cfguard", ErrUnknownFormat, e.Format, Format)
	case e.Format < 1:
		return nil, fmt.Errorf("%w: format %d", ErrMalformed, e.Format)
	case e.Kind != Genesis && e.Kind != Claim && e.Kind != Increment:
		return nil, fmt.Errorf("%w: kind %q", ErrMalformed, e.Kind)
	case e.Writer == "":
		return nil, fmt.Errorf("%w: no writer", ErrMalformed)
	case !isHexSHA256(e.PosteriorSHA256):
		return nil, fmt.Errorf("%w: posterior_sha256 %q, want 64 lower-case hex digits", ErrMalformed, e.PosteriorSHA256)
	case e.Kind == Genesis && (e.Body == nil || len(e.Body.Weights) == 0):
		return nil, fmt.Errorf("%w: genesis without a body", ErrMalformed)
	case e.Kind == Genesis && e.Genesis != "":
		return nil, fmt.Errorf("%w: a genesis naming a genesis", ErrMalformed)
	case e.Genesis != "" && !isHexSHA256(e.Genesis):
		return nil, fmt.Errorf("%w: genesis %q, want 64 lower-case hex digits", ErrMalformed, e.Genesis)
	case e.Kind != Genesis && e.Epoch > 0 && e.Genesis == "":
		return nil, fmt.Errorf("%w: a %s of epoch %d naming no genesis", ErrMalformed, e.Kind, e.Epoch)
	case e.Kind != Increment && (len(e.Events) > 0 || e.EventsThrough > 0):
		return nil, fmt.Errorf("%w: a %s with events", ErrMalformed, e.Kind)
	case e.Kind == Increment && !knownOutcome(e.Outcome):
		return nil, fmt.Errorf("%w: increment outcome %q, want %s, %s, %s, %s or %s", ErrMalformed, e.Outcome, Promoted, Clipped, Rejected, Failed, Skipped)
	case e.Kind == Increment && e.EventsThrough >= e.Seq && e.EventsThrough > 0:
		return nil, fmt.Errorf("%w: entry %d says its events are through entry %d", ErrMalformed, e.Seq, e.EventsThrough)
	}
	for p, off := range e.Covers {
		if p < 0 || off < 0 {
			return nil, fmt.Errorf("%w: covers partition %d offset %d", ErrMalformed, p, off)
		}
	}
	return &e, nil
}

// knownOutcome reports whether o is an outcome an increment may record.
func knownOutcome(o string) bool {
	switch o {
	case Promoted, Clipped, Rejected, Failed, Skipped:
		return true
	}
	return false
}

// isHexSHA256 reports whether s is a SHA-256 as PosteriorHash writes it: 64 lower-case hex
// digits. Another spelling of the same hash would compare unequal to it.
func isHexSHA256(s string) bool {
	if len(s) != 2*sha256.Size {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// Hash is the SHA-256 of an entry's value bytes as stored: the chain links bytes, not a
// re-encoding, so that another encoder still verifies an old chain.
func Hash(value []byte) [32]byte { return sha256.Sum256(value) }

// PosteriorHash is the hex SHA-256 of m's weights as bnn.Encode writes them.
func PosteriorHash(m *bnn.Model) (string, error) { return bnn.WeightsSHA256(m) }

// LastLayerOf copies m's last layer.
func LastLayerOf(m *bnn.Model) *LastLayer {
	l := m.Last()
	return &LastLayer{WeightMu: slices.Clone(l.WeightMu), WeightLogSigma: slices.Clone(l.WeightLogSigma),
		BiasMu: slices.Clone(l.BiasMu), BiasLogSigma: slices.Clone(l.BiasLogSigma)}
}

// NewBody encodes m whole, for a genesis.
func NewBody(m *bnn.Model) (*Body, error) {
	sc, w, err := bnn.Encode(m)
	if err != nil {
		return nil, err
	}
	return &Body{Sidecar: sc, Weights: w}, nil
}

// NewGenesis is a log's first entry, written by writer: m whole (NewBody), its hash
// (PosteriorHash), and the cluster-wide settings it records; m is encoded once.
func NewGenesis(m *bnn.Model, writer string, settings map[string]string) (*Entry, error) {
	sc, w, err := bnn.Encode(m)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(w)
	return &Entry{Format: Format, Kind: Genesis, Writer: writer, Version: m.Version, ParentVersion: m.Version,
		PosteriorSHA256: hex.EncodeToString(sum[:]), Body: &Body{Sidecar: sc, Weights: w}, Settings: settings}, nil
}

// ErrMismatch is wrapped when an entry's posterior does not hash to what it records.
var ErrMismatch = errors.New("postlog: posterior does not match its entry")

// Model is the genesis's posterior, checked against the entry's hash.
func (b *Body) Model(want string) (*bnn.Model, error) {
	m, err := bnn.Decode(b.Sidecar, b.Weights)
	if err != nil {
		return nil, fmt.Errorf("postlog: genesis body: %w", err)
	}
	return m, check(m, want, nil)
}

// Apply returns the posterior an increment (or a claim) leads to from prev, its parent's
// posterior: prev itself when the version does not move, else prev with the recorded last layer
// and the next version. The result is checked against the entry's posterior_sha256; prev is
// never modified.
func (e *Entry) Apply(prev *bnn.Model) (*bnn.Model, error) { return e.ApplyHashing(prev, nil) }

// ApplyHashing is Apply, hashing the result with h (nil: PosteriorHash): a caller that applies a
// log's entries one after another gives them one h, which hashes the layers the entries leave
// unchanged once (bnn.WeightsHasher).
func (e *Entry) ApplyHashing(prev *bnn.Model, h *bnn.WeightsHasher) (*bnn.Model, error) {
	if prev.Version != e.ParentVersion {
		return nil, fmt.Errorf("postlog: entry %d applies to version %d, the posterior is version %d", e.Seq, e.ParentVersion, prev.Version)
	}
	if e.Version == e.ParentVersion {
		return prev, check(prev, e.PosteriorSHA256, h)
	}
	ll := e.LastLayer
	last := prev.Last()
	if ll == nil || len(ll.WeightMu) != len(last.WeightMu) || len(ll.WeightLogSigma) != len(last.WeightLogSigma) ||
		len(ll.BiasMu) != len(last.BiasMu) || len(ll.BiasLogSigma) != len(last.BiasLogSigma) {
		return nil, fmt.Errorf("%w: entry %d's last layer does not have the shapes of layer %q (%d x %d)", ErrMismatch, e.Seq, last.Name, last.Out, last.In)
	}
	next := prev.Clone()
	l := next.Last()
	copy(l.WeightMu, ll.WeightMu)
	copy(l.WeightLogSigma, ll.WeightLogSigma)
	copy(l.BiasMu, ll.BiasMu)
	copy(l.BiasLogSigma, ll.BiasLogSigma)
	next.Version = e.Version
	if e.Records > 0 {
		next.Records = e.Records
	}
	if err := next.Validate(); err != nil {
		return nil, fmt.Errorf("%w: entry %d: %w", ErrMismatch, e.Seq, err)
	}
	return next, check(next, e.PosteriorSHA256, h)
}

// check compares m's hash (h's Sum, PosteriorHash without h) with want.
func check(m *bnn.Model, want string, h *bnn.WeightsHasher) error {
	var (
		got string
		err error
	)
	if h != nil {
		got, err = h.Sum(m)
	} else {
		got, err = PosteriorHash(m)
	}
	if err != nil {
		return err
	}
	if got != want {
		return fmt.Errorf("%w: version %d hashes to %s, the entry records %s", ErrMismatch, m.Version, got, want)
	}
	return nil
}
