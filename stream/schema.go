package stream

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Reason codes carried by DecodeError.Reason and by the cfguard-reason header of dead letters.
// They form a closed set (see Reasons), so they are safe as metric label values.
const (
	ReasonBadJSON        = "bad_json"        // not a JSON object (syntax error, empty, array, ...)
	ReasonTooLarge       = "too_large"       // more bytes than the schema's limit
	ReasonUnknownField   = "unknown_field"   // a top-level key other than id, features, label, ts
	ReasonDuplicateField = "duplicate_field" // a key repeated in the record or in its feature map
	ReasonMissingField   = "missing_field"   // id, features or label absent or null
	ReasonBadType        = "bad_type"        // a value of the wrong JSON type
	ReasonBadID          = "bad_id"          // id empty, blank, too long or not UTF-8
	ReasonWrongDimension = "wrong_dimension" // feature array of the wrong length
	ReasonNotFinite      = "not_finite"      // a feature that is NaN, ±Inf or overflows float64
	ReasonUnknownFeature = "unknown_feature" // a feature map key the model does not know
	ReasonMissingFeature = "missing_feature" // a feature map without some model feature
	ReasonUnknownLabel   = "unknown_label"   // label not a class index in range nor a class name
	ReasonBadTimestamp   = "bad_timestamp"   // ts neither RFC 3339 nor Unix seconds in range
)

// Reasons returns the decode reason codes, in a fixed order (for creating metric series up
// front).
func Reasons() []string {
	return []string{ReasonBadJSON, ReasonTooLarge, ReasonUnknownField, ReasonDuplicateField,
		ReasonMissingField, ReasonBadType, ReasonBadID, ReasonWrongDimension, ReasonNotFinite,
		ReasonUnknownFeature, ReasonMissingFeature, ReasonUnknownLabel, ReasonBadTimestamp}
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
	// MaxIDBytes is the longest accepted id.
	MaxIDBytes = 256
	// maxUnixSeconds is 9999-12-31T23:59:59Z.
	maxUnixSeconds = 253402300799
)

// Record is one decoded, validated labelled record.
type Record struct {
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
//	"id":       non-empty string, at most MaxIDBytes bytes of UTF-8        (required)
//	"features": [x0, x1, ...] with one number per model feature, in order, or
//	            {"name": x, ...} naming every model feature exactly once    (required)
//	"label":    class index (an integer-valued number in [0, C)) or class name (required)
//	"ts":       RFC 3339 string or Unix seconds (number); null = absent     (optional)
//
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
	return rec, nil
}

// Encode renders r in the array form with a numeric label (and ts in RFC 3339 when set). It
// checks what Decode checks, so Decode(Encode(r)) gives r back.
func (s *Schema) Encode(r Record) ([]byte, error) {
	if len(r.X) != len(s.features) {
		return nil, decodeErr(ReasonWrongDimension, "record %q has %d features, schema has %d", r.ID, len(r.X), len(s.features))
	}
	for j, v := range r.X {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return nil, decodeErr(ReasonNotFinite, "feature %d (%s) is %v", j, s.features[j], v)
		}
	}
	if r.Label < 0 || r.Label >= len(s.classes) {
		return nil, decodeErr(ReasonUnknownLabel, "label %d not in [0, %d)", r.Label, len(s.classes))
	}
	if err := checkID(r.ID); err != nil {
		return nil, err
	}
	out := struct {
		ID       string    `json:"id"`
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

// decode walks the object once. It is a strict JSON scanner for exactly our shape: every
// value position has an expected type, so it never has to skip an arbitrary value, and it
// consumes the whole input, so a document it accepts is valid JSON.
//
// x, when len(x) == Dim(), receives the features (the consumer hands out slices of one array
// per batch); otherwise they get a fresh slice.
func (s *Schema) decode(data []byte, x []float64) (Record, *DecodeError) {
	p := scanner{b: data}
	p.ws()
	if p.peek() != '{' {
		return Record{}, decodeErr(ReasonBadJSON, "record is not a JSON object")
	}
	p.i++
	var (
		rec                          Record
		seenID, seenX, seenY, seenTS bool // the key appeared
		haveID, haveX, haveY         bool // with a non-null value
		derr                         *DecodeError
	)
	rec.X = x
	p.ws()
	if p.peek() == '}' {
		p.i++
	} else {
		for {
			p.ws()
			key, esc, err := p.str()
			if err != nil {
				return Record{}, err
			}
			if esc {
				name, err := unquote(key, esc)
				if err != nil {
					return Record{}, err
				}
				key = []byte(name)
			}
			p.ws()
			if p.peek() != ':' {
				return Record{}, decodeErr(ReasonBadJSON, "expected ':' at byte %d", p.i)
			}
			p.i++
			p.ws()
			var dup bool
			switch string(key) {
			case "id":
				dup, seenID = seenID, true
				if !dup {
					haveID, derr = s.id(&p, &rec)
				}
			case "features":
				dup, seenX = seenX, true
				if !dup {
					haveX, derr = s.featureValue(&p, &rec)
				}
			case "label":
				dup, seenY = seenY, true
				if !dup {
					haveY, derr = s.label(&p, &rec)
				}
			case "ts":
				dup, seenTS = seenTS, true
				if !dup {
					derr = s.timestamp(&p, &rec)
				}
			default:
				return Record{}, decodeErr(ReasonUnknownField, "unknown field %q (want id, features, label, ts)", clip(string(key)))
			}
			if dup {
				return Record{}, decodeErr(ReasonDuplicateField, "field %q appears twice", key)
			}
			if derr != nil {
				return Record{}, derr
			}
			p.ws()
			c := p.peek()
			p.i++
			if c == '}' {
				break
			}
			if c != ',' {
				return Record{}, decodeErr(ReasonBadJSON, "expected ',' or '}' at byte %d", p.i-1)
			}
		}
	}
	p.ws()
	if p.i < len(p.b) {
		return Record{}, decodeErr(ReasonBadJSON, "trailing data after the record at byte %d", p.i)
	}
	switch {
	case !haveID:
		return Record{}, decodeErr(ReasonMissingField, "record has no id")
	case !haveX:
		return Record{}, decodeErr(ReasonMissingField, "record %q has no features", rec.ID)
	case !haveY:
		return Record{}, decodeErr(ReasonMissingField, "record %q has no label", rec.ID)
	}
	return rec, nil
}

// id parses the id value; null counts as absent.
func (s *Schema) id(p *scanner, rec *Record) (bool, *DecodeError) {
	if p.null() {
		return false, nil
	}
	if p.peek() != '"' {
		return false, decodeErr(ReasonBadType, "id must be a string, got %s", p.kind())
	}
	raw, esc, err := p.str()
	if err != nil {
		return false, err
	}
	id, err := unquote(raw, esc)
	if err != nil {
		return false, err
	}
	if err := checkID(id); err != nil {
		return false, err
	}
	rec.ID = id
	return true, nil
}

func checkID(id string) *DecodeError {
	switch {
	case strings.TrimSpace(id) == "":
		return decodeErr(ReasonBadID, "id is empty")
	case len(id) > MaxIDBytes:
		return decodeErr(ReasonBadID, "id is %d bytes, limit %d", len(id), MaxIDBytes)
	case !utf8.ValidString(id):
		return decodeErr(ReasonBadID, "id is not valid UTF-8")
	}
	return nil
}

// featureValue parses the features value (array or object); null counts as absent.
func (s *Schema) featureValue(p *scanner, rec *Record) (bool, *DecodeError) {
	switch p.peek() {
	case '[':
		return true, s.featureArray(p, rec)
	case '{':
		return true, s.featureMap(p, rec)
	case 'n':
		if p.null() {
			return false, nil
		}
	}
	return false, decodeErr(ReasonBadType, "features must be an array or an object, got %s", p.kind())
}

func (s *Schema) featureArray(p *scanner, rec *Record) *DecodeError {
	p.i++ // '['
	d := len(s.features)
	if len(rec.X) != d {
		rec.X = make([]float64, d)
	}
	X := rec.X
	b, i, n := p.b, p.i, 0
	i = skipWS(b, i)
	if i < len(b) && b[i] == ']' {
		i++
	} else {
		for {
			i = skipWS(b, i)
			if n == d {
				return decodeErr(ReasonWrongDimension, "more than %d features", d)
			}
			v, j, ok := fastFloat(b, i)
			if !ok { // exponent, many digits, not a number: the careful path
				p.i = i
				var err *DecodeError
				if v, err = p.featureNumber(s, n, false); err != nil {
					return err
				}
				j = p.i
			}
			X[n] = v
			n++
			i = skipWS(b, j)
			if i >= len(b) {
				return decodeErr(ReasonBadJSON, "unterminated feature array")
			}
			c := b[i]
			i++
			if c == ']' {
				break
			}
			if c != ',' {
				return decodeErr(ReasonBadJSON, "expected ',' or ']' at byte %d", i-1)
			}
		}
	}
	p.i = i
	if n != d {
		return decodeErr(ReasonWrongDimension, "%d features, want %d", n, d)
	}
	return nil
}

// skipWS returns the index of the first non-whitespace byte of b at or after i.
func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\n' || b[i] == '\t' || b[i] == '\r') {
		i++
	}
	return i
}

// fastFloat parses the common number shape -?[0-9]+(\.[0-9]+)? at b[i:] when it is exact by
// Clinger's fast path (at most 19 digits, mantissa < 2^53, at most 22 fraction digits), and
// returns the value and the index after it. Anything else (an exponent, a leading zero
// followed by digits, a string, ...) gives ok = false and is left to numberLiteral, which
// knows the whole grammar and the error messages.
func fastFloat(b []byte, i int) (v float64, end int, ok bool) {
	neg := i < len(b) && b[i] == '-'
	if neg {
		i++
	}
	start := i
	var mant uint64
	for i < len(b) && b[i]-'0' <= 9 {
		mant = mant*10 + uint64(b[i]-'0')
		i++
	}
	nInt := i - start
	if nInt == 0 || (nInt > 1 && b[start] == '0') {
		return 0, 0, false
	}
	nFrac := 0
	if i < len(b) && b[i] == '.' {
		i++
		fs := i
		for i < len(b) && b[i]-'0' <= 9 {
			mant = mant*10 + uint64(b[i]-'0')
			i++
		}
		nFrac = i - fs
		if nFrac == 0 {
			return 0, 0, false
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') || nInt+nFrac > 19 || mant >= 1<<53 || nFrac > 22 {
		return 0, 0, false
	}
	v = float64(mant) / pow10[nFrac]
	if neg {
		v = -v
	}
	return v, i, true
}

func (s *Schema) featureMap(p *scanner, rec *Record) *DecodeError {
	p.i++ // '{'
	d := len(s.features)
	if len(rec.X) != d {
		rec.X = make([]float64, d)
	}
	var seenBuf [256]bool // no allocation for models with up to 256 features
	seen := seenBuf[:0]
	if d <= len(seenBuf) {
		seen = seenBuf[:d]
	} else {
		seen = make([]bool, d)
	}
	n := 0
	p.i = skipWS(p.b, p.i)
	if p.peek() == '}' {
		p.i++
	} else {
		for {
			p.i = skipWS(p.b, p.i)
			// Producers usually write the features in the model's order: if the key at hand
			// is, byte for byte, "<name of feature n>", take it without scanning or hashing.
			j, ok := n, false
			if n < d && s.plain[n] {
				name, b, i := s.features[n], p.b, p.i
				if end := i + 1 + len(name); end < len(b) && b[i] == '"' && b[end] == '"' && string(b[i+1:end]) == name {
					p.i, ok = end+1, true
				}
			}
			if !ok {
				raw, esc, err := p.str()
				if err != nil {
					return err
				}
				if esc {
					name, err := unquote(raw, esc)
					if err != nil {
						return err
					}
					j, ok = s.featureIdx[name]
				} else {
					j, ok = s.featureIdx[string(raw)]
				}
				if !ok {
					name, _ := unquote(raw, esc)
					return decodeErr(ReasonUnknownFeature, "unknown feature %q", clip(name))
				}
			}
			if seen[j] {
				return decodeErr(ReasonDuplicateField, "feature %q appears twice", s.features[j])
			}
			seen[j] = true
			n++
			p.i = skipWS(p.b, p.i)
			if p.peek() != ':' {
				return decodeErr(ReasonBadJSON, "expected ':' at byte %d", p.i)
			}
			p.i = skipWS(p.b, p.i+1)
			v, end, ok := fastFloat(p.b, p.i)
			if ok {
				p.i = end
			} else {
				var derr *DecodeError
				if v, derr = p.featureNumber(s, j, true); derr != nil {
					return derr
				}
			}
			rec.X[j] = v
			p.i = skipWS(p.b, p.i)
			c := p.peek()
			p.i++
			if c == '}' {
				break
			}
			if c != ',' {
				return decodeErr(ReasonBadJSON, "expected ',' or '}' at byte %d", p.i-1)
			}
		}
	}
	if n != d {
		var missing []string
		for j, ok := range seen {
			if !ok && len(missing) < 5 {
				missing = append(missing, s.features[j])
			}
		}
		return decodeErr(ReasonMissingFeature, "%d of %d features missing, e.g. %q", d-n, d, missing)
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

// label parses the label value; null counts as absent.
func (s *Schema) label(p *scanner, rec *Record) (bool, *DecodeError) {
	c := len(s.classes)
	switch ch := p.peek(); {
	case ch == '"':
		raw, esc, err := p.str()
		if err != nil {
			return false, err
		}
		j, ok := s.classIdx[string(raw)]
		if esc {
			name, err := unquote(raw, esc)
			if err != nil {
				return false, err
			}
			j, ok = s.classIdx[name]
		}
		if !ok {
			name, _ := unquote(raw, esc)
			return false, decodeErr(ReasonUnknownLabel, "label %q is not a class name %q", clip(name), s.classes)
		}
		rec.Label = j
		return true, nil
	case ch == '-' || (ch >= '0' && ch <= '9'):
		lit, fv, ok, err := p.numberLiteral()
		if err != nil {
			return false, err
		}
		v, perr := parseNumber(lit, fv, ok)
		if perr != nil || v != math.Trunc(v) || v < 0 || v >= float64(c) {
			return false, decodeErr(ReasonUnknownLabel, "label %s is not a class index in [0, %d)", clip(string(lit)), c)
		}
		rec.Label = int(v)
		return true, nil
	case p.null():
		return false, nil
	}
	return false, decodeErr(ReasonBadType, "label must be a class index or name, got %s", p.kind())
}

// timestamp parses ts: RFC 3339 string, Unix seconds, or null.
func (s *Schema) timestamp(p *scanner, rec *Record) *DecodeError {
	switch ch := p.peek(); {
	case ch == '"':
		raw, esc, err := p.str()
		if err != nil {
			return err
		}
		str, err := unquote(raw, esc)
		if err != nil {
			return err
		}
		t, perr := time.Parse(time.RFC3339Nano, str)
		if perr != nil {
			return decodeErr(ReasonBadTimestamp, "ts %q is not RFC 3339", clip(str))
		}
		rec.Time = t
		return nil
	case ch == '-' || (ch >= '0' && ch <= '9'):
		lit, fv, ok, err := p.numberLiteral()
		if err != nil {
			return err
		}
		v, perr := parseNumber(lit, fv, ok)
		if perr != nil || v < 0 || v > maxUnixSeconds {
			return decodeErr(ReasonBadTimestamp, "ts %s is not Unix seconds in [0, %d]", clip(string(lit)), int64(maxUnixSeconds))
		}
		sec := math.Floor(v)
		rec.Time = time.Unix(int64(sec), int64(math.Round((v-sec)*1e9))).UTC()
		return nil
	case p.null():
		return nil
	}
	return decodeErr(ReasonBadTimestamp, "ts must be an RFC 3339 string or Unix seconds, got %s", p.kind())
}

// clip shortens user-controlled text quoted in error details.
func clip(s string) string {
	const max = 64
	if len(s) <= max {
		return s
	}
	return s[:max] + "..."
}

// scanner is a cursor over a JSON document.
type scanner struct {
	b []byte
	i int
}

func (p *scanner) peek() byte {
	if p.i < len(p.b) {
		return p.b[p.i]
	}
	return 0
}

func (p *scanner) ws() {
	for p.i < len(p.b) {
		switch p.b[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

// null consumes the literal null if it is next.
func (p *scanner) null() bool {
	if len(p.b)-p.i >= 4 && string(p.b[p.i:p.i+4]) == "null" {
		p.i += 4
		return true
	}
	return false
}

// kind names the JSON type of the next value, for error details.
func (p *scanner) kind() string {
	switch c := p.peek(); {
	case c == '"':
		return "a string"
	case c == '{':
		return "an object"
	case c == '[':
		return "an array"
	case c == 't' || c == 'f':
		return "a boolean"
	case c == 'n':
		return "null"
	case c == '-' || (c >= '0' && c <= '9'):
		return "a number"
	case c == 0:
		return "end of input"
	}
	return fmt.Sprintf("byte %q", p.peek())
}

// str scans a string and returns its raw contents (between the quotes) and whether it holds
// escapes. It enforces JSON's string grammar: no control characters, only valid escapes.
func (p *scanner) str() ([]byte, bool, *DecodeError) {
	if p.peek() != '"' {
		return nil, false, decodeErr(ReasonBadJSON, "expected a string at byte %d", p.i)
	}
	p.i++
	start, esc := p.i, false
	for p.i < len(p.b) {
		c := p.b[p.i]
		switch {
		case c == '"':
			raw := p.b[start:p.i]
			p.i++
			return raw, esc, nil
		case c == '\\':
			esc = true
			if p.i+1 >= len(p.b) {
				return nil, false, decodeErr(ReasonBadJSON, "unterminated string")
			}
			switch p.b[p.i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				p.i += 2
			case 'u':
				if p.i+6 > len(p.b) || !isHex4(p.b[p.i+2:p.i+6]) {
					return nil, false, decodeErr(ReasonBadJSON, "bad \\u escape at byte %d", p.i)
				}
				p.i += 6
			default:
				return nil, false, decodeErr(ReasonBadJSON, "bad escape at byte %d", p.i)
			}
		case c < 0x20:
			return nil, false, decodeErr(ReasonBadJSON, "control character in string at byte %d", p.i)
		default:
			p.i++
		}
	}
	return nil, false, decodeErr(ReasonBadJSON, "unterminated string")
}

func isHex4(b []byte) bool {
	for _, c := range b {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

// unquote turns raw string contents into a Go string; raw strings without escapes are used
// as they are (invalid UTF-8 stays invalid, for the caller to reject).
func unquote(raw []byte, esc bool) (string, *DecodeError) {
	if !esc {
		return string(raw), nil
	}
	q := make([]byte, 0, len(raw)+2)
	q = append(append(append(q, '"'), raw...), '"')
	var s string
	if err := json.Unmarshal(q, &s); err != nil {
		return "", decodeErr(ReasonBadJSON, "bad string: %v", err)
	}
	return s, nil
}

// numberLiteral scans a number following JSON's grammar exactly:
//
//	-? (0 | [1-9][0-9]*) (\.[0-9]+)? ([eE][+-]?[0-9]+)?
//
// (strconv.ParseFloat alone would also take "inf", "0x1p3", "+1", ".5" and "1_0"). When the
// literal is m * 10^e with an integer m < 2^53 and |e| <= 22 it also returns the value, with
// ok = true: m and 10^e are then exact float64 values, so one multiplication or division,
// correctly rounded, gives the correctly rounded result (Clinger's fast path, the same one
// strconv takes first). Otherwise the caller falls back to strconv.ParseFloat.
func (p *scanner) numberLiteral() (lit []byte, v float64, ok bool, err *DecodeError) {
	b, i := p.b, p.i
	start := i
	neg := i < len(b) && b[i] == '-'
	if neg {
		i++
	}
	// All digits, integer and fraction, go into mant; leading zeros add nothing. With at most
	// 19 digits mant cannot overflow (10^19 < 2^64).
	var mant uint64
	intStart := i
	for i < len(b) && b[i]-'0' <= 9 {
		mant = mant*10 + uint64(b[i]-'0')
		i++
	}
	nInt := i - intStart
	if nInt == 0 || (nInt > 1 && b[intStart] == '0') {
		return p.badNumber(start)
	}
	nFrac := 0
	if i < len(b) && b[i] == '.' {
		i++
		fracStart := i
		for i < len(b) && b[i]-'0' <= 9 {
			mant = mant*10 + uint64(b[i]-'0')
			i++
		}
		if nFrac = i - fracStart; nFrac == 0 {
			return p.badNumber(start)
		}
	}
	exp := -nFrac
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		sign := 1
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			if b[i] == '-' {
				sign = -1
			}
			i++
		}
		e, expStart := 0, i
		for i < len(b) && b[i]-'0' <= 9 {
			if e < 100000 {
				e = e*10 + int(b[i]-'0')
			}
			i++
		}
		if i == expStart {
			return p.badNumber(start)
		}
		exp += sign * e
	}
	p.i = i
	lit = b[start:i]
	if nInt+nFrac > 19 || mant >= 1<<53 || exp < -22 || exp > 22 {
		return lit, 0, false, nil // mant may have wrapped: only the literal is used
	}
	v = float64(mant)
	if exp < 0 {
		v /= pow10[-exp]
	} else {
		v *= pow10[exp]
	}
	if neg {
		v = -v
	}
	return lit, v, true, nil
}

func (p *scanner) badNumber(start int) ([]byte, float64, bool, *DecodeError) {
	return nil, 0, false, decodeErr(ReasonBadJSON, "malformed number at byte %d", start)
}

// pow10 holds the powers of ten that are exact float64 values.
var pow10 = [23]float64{1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
	1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22}

// parseNumber returns the value of a literal from numberLiteral.
func parseNumber(lit []byte, v float64, ok bool) (float64, error) {
	if ok {
		return v, nil
	}
	return strconv.ParseFloat(string(lit), 64)
}

// featureNumber scans the value of feature j: a finite number. byName says how the feature
// was given, for error details.
func (p *scanner) featureNumber(s *Schema, j int, byName bool) (float64, *DecodeError) {
	what := func() string {
		if byName {
			return fmt.Sprintf("feature %q", s.features[j])
		}
		return fmt.Sprintf("feature %d (%s)", j, s.features[j])
	}
	switch c := p.peek(); {
	case c == '-' || c-'0' <= 9:
		lit, v, ok, err := p.numberLiteral()
		if err != nil {
			return 0, err
		}
		if ok {
			return v, nil
		}
		v, perr := strconv.ParseFloat(string(lit), 64)
		if perr != nil { // only ErrRange is possible after the grammar check
			return 0, decodeErr(ReasonNotFinite, "%s = %s overflows float64", what(), clip(string(lit)))
		}
		return v, nil
	case c == '"':
		raw, esc, err := p.str()
		if err != nil {
			return 0, err
		}
		str, err := unquote(raw, esc)
		if err != nil {
			return 0, err
		}
		if v, perr := strconv.ParseFloat(strings.TrimSpace(str), 64); (perr == nil || errors.Is(perr, strconv.ErrRange)) && (math.IsNaN(v) || math.IsInf(v, 0)) {
			return 0, decodeErr(ReasonNotFinite, "%s = %q is not finite", what(), clip(str))
		}
		return 0, decodeErr(ReasonBadType, "%s = %q is a string, want a number", what(), clip(str))
	}
	return 0, decodeErr(ReasonBadType, "%s must be a number, got %s", what(), p.kind())
}
