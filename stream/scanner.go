package stream

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// This file is the record decoder: a strict JSON scanner for exactly the record shape Schema
// documents. Every value position has an expected type, so it never has to skip an arbitrary
// value, and it consumes the whole input, so a document it accepts is valid JSON.
//
// Why not encoding/json: BenchmarkScannerVsEncodingJSON decodes the same records into the same
// Record with both, in the same run. Measured on a shared 2-core machine (go test -run '^$'
// -bench ScannerVsEncodingJSON -count 3 ./stream/), the scanner took 0.05-0.07x (array form)
// and 0.03-0.04x (map form) of encoding/json's time per record (about 450 ns against 6-20 us
// for 30 features), and encoding/json, besides, cannot see a repeated key (it keeps the last),
// which a record must not have. Decoding is most of the consumer's per-record CPU, so the
// scanner stays.

// decode walks the object once.
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
		haveX, haveY                 bool // with a non-null value
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
					derr = s.id(&p, &rec)
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
	case !haveX:
		return Record{}, decodeErr(ReasonMissingField, "record %s has no features", describeID(rec.ID))
	case !haveY:
		return Record{}, decodeErr(ReasonMissingField, "record %s has no label", describeID(rec.ID))
	}
	return rec, nil
}

// describeID names a record in an error detail.
func describeID(id string) string {
	if id == "" {
		return "without id"
	}
	return strconv.Quote(id)
}

// id parses the id value; null counts as absent.
func (s *Schema) id(p *scanner, rec *Record) *DecodeError {
	if p.null() {
		return nil
	}
	if p.peek() != '"' {
		return decodeErr(ReasonBadType, "id must be a string, got %s", p.kind())
	}
	raw, esc, err := p.str()
	if err != nil {
		return err
	}
	id, err := unquote(raw, esc)
	if err != nil {
		return err
	}
	if err := checkID(id); err != nil {
		return err
	}
	rec.ID = id
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
			j, v, exact, ok := scanNumber(b, i)
			if !ok || !exact { // a string, an error, or too many digits: the careful path
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

func (s *Schema) featureMap(p *scanner, rec *Record) *DecodeError {
	p.i++ // '{'
	d := len(s.features)
	if len(rec.X) != d {
		rec.X = make([]float64, d)
	}
	var seenBuf [256]bool // no allocation for models with up to 256 features
	var seen []bool
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
			end, v, exact, ok := scanNumber(p.b, p.i)
			if ok && exact {
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
		lit, v, err := p.number()
		if err != nil {
			return false, err
		}
		if math.IsInf(v, 0) || v != math.Trunc(v) || v < 0 || v >= float64(c) {
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
		t, perr := parseRFC3339(str)
		if perr != nil {
			return decodeErr(ReasonBadTimestamp, "ts %q is not RFC 3339", clip(str))
		}
		// The range of Unix seconds below, so that a date before 1970 (or the zero time, which
		// would read as no ts) is refused in either form.
		if u := t.Unix(); u < 0 || u > maxUnixSeconds {
			return decodeErr(ReasonBadTimestamp, "ts %q is outside 1970-01-01T00:00:00Z .. 9999-12-31T23:59:59Z", clip(str))
		}
		rec.Time = t
		return nil
	case ch == '-' || (ch >= '0' && ch <= '9'):
		lit, v, err := p.number()
		if err != nil {
			return err
		}
		if !(v >= 0 && v <= maxUnixSeconds) {
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

// parseRFC3339 parses an RFC 3339 date-time, which time.Parse does not take whole: RFC 3339 allows
// a lower-case t and z (its section 5.6) and a leap second, 60 (section 5.7), read here as the
// second after 59 (Unix time has no leap seconds). Upper-casing changes nothing else in a valid
// date-time: its only letters are T and Z.
func parseRFC3339(s string) (time.Time, error) {
	s = strings.ToUpper(s)
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil && len(s) >= 19 && s[16] == ':' && s[17:19] == "60" {
		if t, lerr := time.Parse(time.RFC3339Nano, s[:17]+"59"+s[19:]); lerr == nil {
			return t.Add(time.Second), nil
		}
	}
	return t, err
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

func (p *scanner) ws() { p.i = skipWS(p.b, p.i) }

// skipWS returns the index of the first non-whitespace byte of b at or after i.
func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\n' || b[i] == '\t' || b[i] == '\r') {
		i++
	}
	return i
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
	if p.i >= len(p.b) {
		return JSONKind(nil)
	}
	return JSONKind(p.b[p.i:])
}

// JSONKind names the JSON type of the value b begins with ("a string", "null", ...), for error
// details, from its first byte, and for the literals from their words: "txt" is not a boolean
// but byte 't'. Empty b is the end of input.
func JSONKind(b []byte) string {
	if len(b) == 0 {
		return "end of input"
	}
	switch c := b[0]; {
	case c == '"':
		return "a string"
	case c == '{':
		return "an object"
	case c == '[':
		return "an array"
	case bytes.HasPrefix(b, []byte("true")) || bytes.HasPrefix(b, []byte("false")):
		return "a boolean"
	case bytes.HasPrefix(b, []byte("null")):
		return "null"
	case c == '-' || (c >= '0' && c <= '9'):
		return "a number"
	}
	return fmt.Sprintf("byte %q", b[0])
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

// scanNumber scans a number at b[i:] following JSON's grammar exactly:
//
//	-? (0 | [1-9][0-9]*) (\.[0-9]+)? ([eE][+-]?[0-9]+)?
//
// (strconv.ParseFloat alone would also take "inf", "0x1p3", "+1", ".5" and "1_0"). ok is false
// when b[i:] does not start with such a number; otherwise end is the index after it. When the
// literal is m * 10^e with an integer m < 2^53 of at most 19 digits and |e| <= 22, it also
// returns the value with exact = true: m and 10^e are then exact float64 values, so one
// multiplication or division, correctly rounded, gives the correctly rounded result
// (Clinger's fast path, the one strconv takes first). Otherwise (exact = false) the caller
// parses the literal b[i:end] with strconv.ParseFloat.
//
// This is the only number scanner: the feature loops call it directly (their hot path), the
// other value positions through scanner.number.
func scanNumber(b []byte, i int) (end int, v float64, exact, ok bool) {
	neg := i < len(b) && b[i] == '-'
	if neg {
		i++
	}
	// All digits, integer and fraction, go into mant; leading zeros add nothing. With at most
	// 19 digits mant cannot overflow (10^19 < 2^64); past that it may wrap and exact is false.
	var mant uint64
	intStart := i
	for i < len(b) && b[i]-'0' <= 9 {
		mant = mant*10 + uint64(b[i]-'0')
		i++
	}
	nInt := i - intStart
	if nInt == 0 || (nInt > 1 && b[intStart] == '0') {
		return 0, 0, false, false
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
			return 0, 0, false, false
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
			return 0, 0, false, false
		}
		exp += sign * e
	}
	if nInt+nFrac > 19 || mant >= 1<<53 || exp < -22 || exp > 22 {
		return i, 0, false, true
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
	return i, v, true, true
}

// pow10 holds the powers of ten that are exact float64 values.
var pow10 = [23]float64{1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
	1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22}

// number scans the number at the cursor and returns its literal and its value: the exact
// value when scanNumber has it, otherwise strconv.ParseFloat's, which is ±Inf for a literal
// out of float64's range (1e999) and the correctly rounded value for everything else.
func (p *scanner) number() (lit []byte, v float64, err *DecodeError) {
	start := p.i
	end, v, exact, ok := scanNumber(p.b, p.i)
	if !ok {
		return nil, 0, decodeErr(ReasonBadJSON, "malformed number at byte %d", start)
	}
	p.i = end
	lit = p.b[start:end]
	if !exact {
		// After the grammar check the only possible error is ErrRange, with v = ±Inf (or 0
		// for an underflow, which is finite and correct).
		v, _ = strconv.ParseFloat(string(lit), 64)
	}
	return lit, v, nil
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
		lit, v, err := p.number()
		if err != nil {
			return 0, err
		}
		if math.IsInf(v, 0) {
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
