package stream

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/cfguard/cfguard/internal/ident"
)

// Reason codes carried by DecodeError.Reason and by the cfguard-reason header of dead letters.
// They form a closed set (see Reasons), so they are safe as metric label values.
const (
	ReasonBadJSON        = "bad_json"        // not a JSON object (syntax error, empty, array, ...)
	ReasonTooLarge       = "too_large"       // more bytes than the schema's limit
	ReasonUnknownField   = "unknown_field"   // a top-level key other than id, features, label, ts
	ReasonDuplicateField = "duplicate_field" // a key repeated in the record or in its feature map
	ReasonMissingField   = "missing_field"   // features or label absent or null
	ReasonBadType        = "bad_type"        // a value of the wrong JSON type
	ReasonBadID          = "bad_id"          // id given but not an id (ident.Check: 1-128 of [A-Za-z0-9._:-], not "." or "..")
	ReasonWrongDimension = "wrong_dimension" // feature array of the wrong length
	ReasonNotFinite      = "not_finite"      // a feature that is NaN, ±Inf or overflows float64
	ReasonUnknownFeature = "unknown_feature" // a feature map key the model does not know
	ReasonMissingFeature = "missing_feature" // a feature map without some model feature
	ReasonUnknownLabel   = "unknown_label"   // label not a class index in range nor a class name
	ReasonBadTimestamp   = "bad_timestamp"   // ts neither RFC 3339 nor Unix seconds, or outside 1970 .. 9999
	ReasonOutOfRange     = "out_of_range"    // a feature more than MaxScaledFeature standard deviations from the model's mean
)

// MaxScaledFeature bounds |x_j - mean_j| / std_j, a feature's distance from the model's mean in
// its standard deviations (Schema.WithScale): a record past it is dead-lettered. Such a record
// dominates the update of the increment it lands in, the more the further it is (far enough, it
// alone moves the posterior past the KL budget), and from about 1e150 its scaled square
// overflows and fails the whole increment. Legitimate data stays below it: a near-constant
// feature (a rare pixel, a feature constant in training, whose scaler gives it std 1) is the
// furthest a fitted model's own data set goes.
const MaxScaledFeature = 1e5

// Reasons returns the decode reason codes, in a fixed order (for creating metric series up
// front).
func Reasons() []string {
	return []string{ReasonBadJSON, ReasonTooLarge, ReasonUnknownField, ReasonDuplicateField,
		ReasonMissingField, ReasonBadType, ReasonBadID, ReasonWrongDimension, ReasonNotFinite,
		ReasonUnknownFeature, ReasonMissingFeature, ReasonUnknownLabel, ReasonBadTimestamp, ReasonOutOfRange}
}

// DecodeError is the error of Schema.Decode: a short machine reason (one of the Reason*
// constants) and a human detail naming the field and value.
type DecodeError struct {
	Reason string
	Detail string
}

func (e *DecodeError) Error() string { return e.Reason + ": " + e.Detail }

// ErrDecode is matched by every *DecodeError (errors.Is(err, ErrDecode)).
var ErrDecode = errors.New("bad record")

// Is reports target == ErrDecode.
func (e *DecodeError) Is(target error) bool { return target == ErrDecode }

func decodeErr(reason, format string, args ...any) *DecodeError {
	return &DecodeError{Reason: reason, Detail: fmt.Sprintf(format, args...)}
}

// Limits of the record format.
const (
	// DefaultMaxRecordBytes is the record size limit used when NewSchema gets maxBytes <= 0.
	DefaultMaxRecordBytes = 64 << 10
	// MaxIDBytes is the longest accepted id (ident.MaxLen, as for CE ids).
	MaxIDBytes = ident.MaxLen
	// maxUnixSeconds is 9999-12-31T23:59:59Z.
	maxUnixSeconds = 253402300799
)

// Record is one decoded, validated labelled record.
type Record struct {
	// ID is the record's id. Records without one get "<topic>/<partition>/<offset>" from the
	// Consumer (see DefaultID); Decode leaves it empty.
	ID string
	// X holds the raw (unstandardised) features in the schema's feature order; every value is
	// finite.
	X []float64
	// Label is the class index, in [0, number of classes).
	Label int
	// Time is the record's ts, or the Kafka message time when the record has none.
	Time time.Time
	// Partition and Offset locate the Kafka message the record came from (zero from Decode).
	Partition int
	Offset    int64
}

// Schema validates and decodes records for one model: its feature names (in input order) and
// class names.
//
// The accepted JSON is an object with exactly these members (names are case-sensitive, none
// repeated):
//
//	"features": [x0, x1, ...] with one number per model feature, in order, or
//	            {"name": x, ...} naming every model feature exactly once    (required)
//	"label":    class index (an integer-valued number in [0, C)) or class name (required)
//	"id":       1 to MaxIDBytes characters of [A-Za-z0-9._:-], not "." or ".." (the rule of
//	            CE ids, ident.Check); null = absent
//	            (optional: the Consumer names a record without one by where it was read,
//	            "<topic>/<partition>/<offset>", which is unique and stable across restarts)
//	"ts":       RFC 3339 string or Unix seconds (number), in 1970-01-01T00:00:00Z ..
//	            9999-12-31T23:59:59Z; null = absent                           (optional)
//
// So the smallest record a producer writes is {"features":[...],"label":0}.
// Unknown members are rejected (ReasonUnknownField), not ignored: a producer that adds a field
// we do not understand (a weight, a flag saying features are already scaled) would otherwise
// have its meaning silently dropped, and a misspelt "ts" would silently lose the timestamp.
// Metadata belongs in Kafka headers, which we do not inspect. Numbers must be finite float64
// values: JSON cannot spell NaN or Inf, so strings such as "NaN" or "Infinity" and overflowing
// literals such as 1e999 are rejected as ReasonNotFinite; other strings where a number is due
// are ReasonBadType. A Schema is immutable and safe for concurrent use.
type Schema struct {
	features   []string
	plain      []bool // features[j] is written in JSON as is, between quotes
	featureIdx map[string]int
	classes    []string
	classIdx   map[string]int
	maxBytes   int
	lo, hi     []float64 // each feature's range (WithScale), nil for none
}

// NewSchema builds a Schema. features must be non-empty, distinct, non-empty names; classes
// at least two distinct non-empty names. maxBytes <= 0 means DefaultMaxRecordBytes.
func NewSchema(features, classes []string, maxBytes int) (*Schema, error) {
	if len(features) == 0 {
		return nil, errors.New("stream: schema needs at least one feature name")
	}
	if len(classes) < 2 {
		return nil, fmt.Errorf("stream: schema needs at least two classes, got %d", len(classes))
	}
	s := &Schema{
		features: append([]string(nil), features...), featureIdx: make(map[string]int, len(features)),
		classes: append([]string(nil), classes...), classIdx: make(map[string]int, len(classes)),
		maxBytes: maxBytes,
	}
	if s.maxBytes <= 0 {
		s.maxBytes = DefaultMaxRecordBytes
	}
	for i, f := range features {
		if _, dup := s.featureIdx[f]; dup || f == "" {
			return nil, fmt.Errorf("stream: feature %d: empty or duplicate name %q", i, f)
		}
		s.featureIdx[f] = i
		s.plain = append(s.plain, isPlainJSON(f))
	}
	for i, c := range classes {
		if _, dup := s.classIdx[c]; dup || c == "" {
			return nil, fmt.Errorf("stream: class %d: empty or duplicate name %q", i, c)
		}
		s.classIdx[c] = i
	}
	return s, nil
}

// Dim is the number of features.
func (s *Schema) Dim() int { return len(s.features) }

// Features returns a copy of the feature names.
func (s *Schema) Features() []string { return append([]string(nil), s.features...) }

// Classes returns a copy of the class names.
func (s *Schema) Classes() []string { return append([]string(nil), s.classes...) }

// MaxBytes is the record size limit.
func (s *Schema) MaxBytes() int { return s.maxBytes }

// Decode parses and validates one record. On failure it returns a *DecodeError; a document
// that is not valid JSON always gets ReasonBadJSON, whatever else is wrong with it.
func (s *Schema) Decode(data []byte) (Record, error) {
	rec, err := s.decodeInto(data, nil)
	if err != nil {
		return Record{}, err
	}
	return rec, nil
}

// decodeInto is Decode with a typed error and, optionally, the array for the features (see
// decode).
func (s *Schema) decodeInto(data []byte, x []float64) (Record, *DecodeError) {
	if len(data) > s.maxBytes {
		return Record{}, decodeErr(ReasonTooLarge, "record is %d bytes, limit %d", len(data), s.maxBytes)
	}
	rec, err := s.decode(data, x)
	if err != nil {
		// The scanner stops at the first problem; a later syntax error must still win, so
		// that the reason does not depend on the order of the members.
		if err.Reason != ReasonBadJSON && !json.Valid(data) {
			return Record{}, decodeErr(ReasonBadJSON, "invalid JSON")
		}
		return Record{}, err
	}
	if err := s.inRange(rec.X); err != nil {
		return Record{}, err
	}
	return rec, nil
}

// ScaledRange is the range a feature of scale mean and std may take in a record:
// MaxScaledFeature standard deviations either side of the mean.
func ScaledRange(mean, std float64) (lo, hi float64) {
	return mean - MaxScaledFeature*std, mean + MaxScaledFeature*std
}

// WithScale returns a copy of s that also refuses (ReasonOutOfRange) a record with a feature j
// outside ScaledRange(mean[j], std[j]): the model's scaler (bnn.Scaler).
func (s *Schema) WithScale(mean, std []float64) (*Schema, error) {
	if len(mean) != len(s.features) || len(std) != len(s.features) {
		return nil, fmt.Errorf("stream: scale of %d means and %d deviations for %d features", len(mean), len(std), len(s.features))
	}
	c := *s
	c.lo, c.hi = make([]float64, len(mean)), make([]float64, len(mean))
	for j := range mean {
		if math.IsNaN(mean[j]) || math.IsInf(mean[j], 0) || !(std[j] > 0) || math.IsInf(std[j], 0) {
			return nil, fmt.Errorf("stream: feature %d (%s): scale mean %v, deviation %v", j, s.features[j], mean[j], std[j])
		}
		c.lo[j], c.hi[j] = ScaledRange(mean[j], std[j])
	}
	return &c, nil
}

// inRange checks x against the range WithScale set, if any.
func (s *Schema) inRange(x []float64) *DecodeError {
	for j, v := range x {
		if s.lo != nil && (v < s.lo[j] || v > s.hi[j]) {
			return decodeErr(ReasonOutOfRange, "feature %d (%s) = %g is further than %g standard deviations from the model's mean (outside [%g, %g])",
				j, s.features[j], v, MaxScaledFeature, s.lo[j], s.hi[j])
		}
	}
	return nil
}

// Encode renders r in the array form with a numeric label (id only when set, ts in RFC 3339
// when set). It checks what Decode checks, so Decode(Encode(r)) gives r back.
func (s *Schema) Encode(r Record) ([]byte, error) {
	if len(r.X) != len(s.features) {
		return nil, decodeErr(ReasonWrongDimension, "record %q has %d features, schema has %d", r.ID, len(r.X), len(s.features))
	}
	for j, v := range r.X {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return nil, decodeErr(ReasonNotFinite, "feature %d (%s) is %v", j, s.features[j], v)
		}
	}
	if err := s.inRange(r.X); err != nil {
		return nil, err
	}
	if r.Label < 0 || r.Label >= len(s.classes) {
		return nil, decodeErr(ReasonUnknownLabel, "label %d not in [0, %d)", r.Label, len(s.classes))
	}
	if r.ID != "" {
		if err := checkID(r.ID); err != nil {
			return nil, err
		}
	}
	out := struct {
		ID       string    `json:"id,omitempty"`
		Features []float64 `json:"features"`
		Label    int       `json:"label"`
		TS       string    `json:"ts,omitempty"`
	}{ID: r.ID, Features: r.X, Label: r.Label}
	if !r.Time.IsZero() {
		out.TS = r.Time.UTC().Format(time.RFC3339Nano)
	}
	b, err := json.Marshal(out)
	if err != nil {
		return nil, fmt.Errorf("stream: encoding record %q: %w", r.ID, err)
	}
	if len(b) > s.maxBytes {
		return nil, decodeErr(ReasonTooLarge, "record %q encodes to %d bytes, limit %d", r.ID, len(b), s.maxBytes)
	}
	return b, nil
}

// DefaultID is the id the Consumer gives a record that has none: where it was read. Kafka
// never reuses an offset within a partition, so it is unique for the topic and the same every
// time the record is read.
func DefaultID(topic string, partition int, offset int64) string {
	b := make([]byte, 0, len(topic)+24)
	b = append(b, topic...)
	b = append(b, '/')
	b = strconv.AppendInt(b, int64(partition), 10)
	b = append(b, '/')
	b = strconv.AppendInt(b, offset, 10)
	return string(b)
}

// checkID applies the rule for CE ids given to the API (ident.Check) to a record's id: a record
// id names the record in events and logs beside CE ids, and may become one.
func checkID(id string) *DecodeError {
	if err := ident.Check(id); err != nil {
		return decodeErr(ReasonBadID, "%v", err)
	}
	return nil
}

// isPlainJSON reports whether name appears in a JSON string as it is: no quote, backslash,
// control character or invalid UTF-8 that an encoder would escape or replace.
func isPlainJSON(name string) bool {
	for _, c := range []byte(name) {
		if c == '"' || c == '\\' || c < 0x20 {
			return false
		}
	}
	return utf8.ValidString(name)
}

// clip shortens user-controlled text quoted in error details to 64 bytes (ident.Clip).
func clip(s string) string { return ident.Clip(s, 64) }
