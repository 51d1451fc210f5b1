package stream

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

func testSchema(t testing.TB) *Schema {
	t.Helper()
	s, err := NewSchema([]string{"a", "b", "c"}, []string{"benign", "malicious"}, 512)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestDecodeGood(t *testing.T) {
	s := testSchema(t)
	ts := time.Date(2024, 5, 6, 7, 8, 9, 500_000_000, time.UTC)
	for _, tc := range []struct {
		name string
		in   string
		want Record
	}{
		{"array and index", `{"id":"r1","features":[1,2.5,-3e2],"label":1}`,
			Record{ID: "r1", X: []float64{1, 2.5, -300}, Label: 1}},
		{"array and class name", `{"id":"r2","features":[0,0,0],"label":"benign"}`,
			Record{ID: "r2", X: []float64{0, 0, 0}, Label: 0}},
		{"map in any order and name", `{"label":"malicious","features":{"c":3,"a":1,"b":2},"id":"r3"}`,
			Record{ID: "r3", X: []float64{1, 2, 3}, Label: 1}},
		{"map and index", `{"id":"r4","features":{"a":-0.5,"b":1E-3,"c":0},"label":0}`,
			Record{ID: "r4", X: []float64{-0.5, 0.001, 0}, Label: 0}},
		{"integral float label", `{"id":"r5","features":[1,2,3],"label":1.0}`,
			Record{ID: "r5", X: []float64{1, 2, 3}, Label: 1}},
		{"ts RFC 3339", `{"id":"r6","features":[1,2,3],"label":0,"ts":"2024-05-06T07:08:09.5Z"}`,
			Record{ID: "r6", X: []float64{1, 2, 3}, Time: ts}},
		{"ts Unix seconds", `{"id":"r7","features":[1,2,3],"label":0,"ts":1714979289.5}`,
			Record{ID: "r7", X: []float64{1, 2, 3}, Time: ts}},
		{"ts null", `{"id":"r8","features":[1,2,3],"label":0,"ts":null}`,
			Record{ID: "r8", X: []float64{1, 2, 3}}},
		{"whitespace and escapes", " {\n\t\"id\" : \"r\\u0031\\u002e\" , \"feat\\u0075res\":[ 1 , 2 , 3 ] ,\"label\":\"ben\\u0069gn\" }\r\n",
			Record{ID: "r1.", X: []float64{1, 2, 3}, Label: 0}},
		{"largest finite", `{"id":"r9","features":[1.7976931348623157e308,-1.7976931348623157e308,4.9e-324],"label":1}`,
			Record{ID: "r9", X: []float64{math.MaxFloat64, -math.MaxFloat64, 5e-324}, Label: 1}},
		{"underflow to zero is finite", `{"id":"r10","features":[1e-400,0,0],"label":1}`,
			Record{ID: "r10", X: []float64{0, 0, 0}, Label: 1}},
		{"no id", `{"features":[1,2,3],"label":0}`,
			Record{X: []float64{1, 2, 3}}},
		{"null id", `{"id":null,"features":[1,2,3],"label":"malicious"}`,
			Record{X: []float64{1, 2, 3}, Label: 1}},
		{"20 digits, past a uint64", `{"id":"r11","features":[18446744073709551616,1844674407370955161.7,36893488147419103233],"label":0}`,
			Record{ID: "r11", X: []float64{18446744073709551616, 1844674407370955161.7, 36893488147419103233}}},
		{"ts the last second of year 9999", `{"id":"r12","features":[1,2,3],"label":0,"ts":253402300799}`,
			Record{ID: "r12", X: []float64{1, 2, 3}, Time: time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)}},
		// The first Unix second is in range: ts accepts [0, 253402300799].
		{"ts 0, the Unix epoch", `{"id":"r13","features":[1,2,3],"label":0,"ts":0}`,
			Record{ID: "r13", X: []float64{1, 2, 3}, Time: time.Unix(0, 0)}},
		// 1.000000007 as a float64 is 1 + 6.99999991e-9: the nanoseconds are rounded, not truncated.
		{"ts nanoseconds rounded", `{"id":"r14","features":[1,2,3],"label":0,"ts":1.000000007}`,
			Record{ID: "r14", X: []float64{1, 2, 3}, Time: time.Unix(1, 7)}},
		// Exponents of three digits, which the exact fast path must leave to strconv.
		{"three-digit exponents", `{"id":"r15","features":[1e150,2.5e-123,-7E+100],"label":0}`,
			Record{ID: "r15", X: []float64{1e150, 2.5e-123, -7e100}}},
		// RFC 3339 allows a lower-case t and z (section 5.6), and a leap second (section 5.7),
		// which is read as the next second: 2016-12-31T23:59:60Z is 2017-01-01T00:00:00Z.
		{"ts RFC 3339 in lower case", `{"id":"r16","features":[1,2,3],"label":0,"ts":"2024-05-06t07:08:09.5z"}`,
			Record{ID: "r16", X: []float64{1, 2, 3}, Time: ts}},
		{"ts a leap second", `{"id":"r17","features":[1,2,3],"label":0,"ts":"2016-12-31T23:59:60Z"}`,
			Record{ID: "r17", X: []float64{1, 2, 3}, Time: time.Date(2017, 1, 1, 0, 0, 0, 0, time.UTC)}},
		{"ts a leap second with a fraction and an offset", `{"id":"r18","features":[1,2,3],"label":0,"ts":"2016-12-31T18:59:60.25-05:00"}`,
			Record{ID: "r18", X: []float64{1, 2, 3}, Time: time.Date(2017, 1, 1, 0, 0, 0, 250_000_000, time.UTC)}},
		// An RFC 3339 ts has the range of Unix seconds, its bounds included, whatever its offset.
		{"ts RFC 3339 at the Unix epoch, by its offset", `{"id":"r19","features":[1,2,3],"label":0,"ts":"1970-01-01T01:00:00+01:00"}`,
			Record{ID: "r19", X: []float64{1, 2, 3}, Time: time.Unix(0, 0)}},
		{"ts RFC 3339 the last second of year 9999", `{"id":"r20","features":[1,2,3],"label":0,"ts":"9999-12-31T23:59:59Z"}`,
			Record{ID: "r20", X: []float64{1, 2, 3}, Time: time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)}},
		// \u escapes take hex digits in either case, a-f and A-F included.
		{"hex digits of both cases", `{"id":"r\u006f\u006F\u004a\u004A","features":[1,2,3],"label":0}`,
			Record{ID: "rooJJ", X: []float64{1, 2, 3}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := s.Decode([]byte(tc.in))
			if err != nil {
				t.Fatalf("Decode(%s): %v", tc.in, err)
			}
			if got.ID != tc.want.ID || !slices.Equal(got.X, tc.want.X) || got.Label != tc.want.Label || !got.Time.Equal(tc.want.Time) {
				t.Fatalf("Decode(%s) = %+v, want %+v", tc.in, got, tc.want)
			}
		})
	}
}

func TestDecodeBad(t *testing.T) {
	s := testSchema(t)
	for _, tc := range []struct {
		name, in, reason string
	}{
		{"empty", ``, ReasonBadJSON},
		{"syntax", `{"id":"x",`, ReasonBadJSON},
		{"array top level", `[1,2,3]`, ReasonBadJSON},
		{"string top level", `"x"`, ReasonBadJSON},
		{"trailing data", `{"id":"x","features":[1,2,3],"label":0} {}`, ReasonBadJSON},
		{"trailing comma", `{"id":"x","features":[1,2,3],"label":0,}`, ReasonBadJSON},
		{"NaN literal", `{"id":"x","features":[NaN,2,3],"label":0}`, ReasonBadJSON},
		{"hex number", `{"id":"x","features":[0x1,2,3],"label":0}`, ReasonBadJSON},
		{"leading plus", `{"id":"x","features":[+1,2,3],"label":0}`, ReasonBadJSON},
		{"leading zero", `{"id":"x","features":[01,2,3],"label":0}`, ReasonBadJSON},
		{"bare dot", `{"id":"x","features":[.5,2,3],"label":0}`, ReasonBadJSON},
		{"control char", "{\"id\":\"a\tb\",\"features\":[1,2,3],\"label\":0}", ReasonBadJSON},
		{"bad escape", `{"id":"a\qb","features":[1,2,3],"label":0}`, ReasonBadJSON},
		{"unknown field wins over later syntax error", `{"extra":1,"id":`, ReasonBadJSON},
		{"too large", `{"id":"` + strings.Repeat("x", 600) + `","features":[1,2,3],"label":0}`, ReasonTooLarge},
		{"unknown field", `{"id":"x","features":[1,2,3],"label":0,"weight":2}`, ReasonUnknownField},
		{"case matters", `{"ID":"x","features":[1,2,3],"label":0}`, ReasonUnknownField},
		{"duplicate field", `{"id":"x","features":[1,2,3],"label":0,"label":1}`, ReasonDuplicateField},
		{"duplicate after null", `{"id":null,"id":"x","features":[1,2,3],"label":0}`, ReasonDuplicateField},
		{"duplicate feature", `{"id":"x","features":{"a":1,"b":2,"a":3,"c":4},"label":0}`, ReasonDuplicateField},
		{"no features", `{"id":"x","label":0}`, ReasonMissingField},
		{"no label", `{"id":"x","features":[1,2,3]}`, ReasonMissingField},
		{"null label", `{"id":"x","features":[1,2,3],"label":null}`, ReasonMissingField},
		{"empty object", `{}`, ReasonMissingField},
		{"numeric id", `{"id":7,"features":[1,2,3],"label":0}`, ReasonBadType},
		{"features string", `{"id":"x","features":"1,2,3","label":0}`, ReasonBadType},
		{"feature string", `{"id":"x","features":[1,"2",3],"label":0}`, ReasonBadType},
		{"feature null", `{"id":"x","features":[1,null,3],"label":0}`, ReasonBadType},
		{"feature bool", `{"id":"x","features":{"a":1,"b":true,"c":3},"label":0}`, ReasonBadType},
		{"nested array", `{"id":"x","features":[[1],2,3],"label":0}`, ReasonBadType},
		{"label bool", `{"id":"x","features":[1,2,3],"label":true}`, ReasonBadType},
		{"empty id", `{"id":"","features":[1,2,3],"label":0}`, ReasonBadID},
		{"blank id", `{"id":"  ","features":[1,2,3],"label":0}`, ReasonBadID},
		{"long id", `{"id":"` + strings.Repeat("x", MaxIDBytes+1) + `","features":[1,2,3],"label":0}`, ReasonBadID},
		{"invalid utf8 id", "{\"id\":\"\xff\",\"features\":[1,2,3],\"label\":0}", ReasonBadID},
		// Record ids follow the rule of CE ids given to the API (ident.Check).
		{"path id", `{"id":"../etc/passwd","features":[1,2,3],"label":0}`, ReasonBadID},
		{"dot-dot id", `{"id":"..","features":[1,2,3],"label":0}`, ReasonBadID},
		{"NUL in id", `{"id":"a\u0000b","features":[1,2,3],"label":0}`, ReasonBadID},
		{"escaped slash id", `{"id":"a\/b","features":[1,2,3],"label":0}`, ReasonBadID},
		{"space in id", `{"id":"a b","features":[1,2,3],"label":0}`, ReasonBadID},
		{"non-ASCII id", `{"id":"r\u00e9","features":[1,2,3],"label":0}`, ReasonBadID},
		{"too few", `{"id":"x","features":[1,2],"label":0}`, ReasonWrongDimension},
		{"too many", `{"id":"x","features":[1,2,3,4],"label":0}`, ReasonWrongDimension},
		{"empty array", `{"id":"x","features":[],"label":0}`, ReasonWrongDimension},
		{"NaN string", `{"id":"x","features":[1,"NaN",3],"label":0}`, ReasonNotFinite},
		{"Infinity string", `{"id":"x","features":{"a":"-Infinity","b":2,"c":3},"label":0}`, ReasonNotFinite},
		{"overflow", `{"id":"x","features":[1,2,1e999],"label":0}`, ReasonNotFinite},
		{"negative overflow", `{"id":"x","features":[-1.8e308,2,3],"label":0}`, ReasonNotFinite},
		{"unknown feature", `{"id":"x","features":{"a":1,"b":2,"z":3},"label":0}`, ReasonUnknownFeature},
		{"missing feature", `{"id":"x","features":{"a":1,"b":2},"label":0}`, ReasonMissingFeature},
		{"empty feature map", `{"id":"x","features":{},"label":0}`, ReasonMissingFeature},
		{"label out of range", `{"id":"x","features":[1,2,3],"label":2}`, ReasonUnknownLabel},
		{"negative label", `{"id":"x","features":[1,2,3],"label":-1}`, ReasonUnknownLabel},
		{"fractional label", `{"id":"x","features":[1,2,3],"label":0.5}`, ReasonUnknownLabel},
		{"huge label", `{"id":"x","features":[1,2,3],"label":1e999}`, ReasonUnknownLabel},
		{"unknown class", `{"id":"x","features":[1,2,3],"label":"Benign"}`, ReasonUnknownLabel},
		{"ts garbage", `{"id":"x","features":[1,2,3],"label":0,"ts":"yesterday"}`, ReasonBadTimestamp},
		{"ts negative", `{"id":"x","features":[1,2,3],"label":0,"ts":-5}`, ReasonBadTimestamp},
		{"ts year 10000", `{"id":"x","features":[1,2,3],"label":0,"ts":253402300800}`, ReasonBadTimestamp},
		{"ts bool", `{"id":"x","features":[1,2,3],"label":0,"ts":false}`, ReasonBadTimestamp},
		// Only a second of 60 is a leap second; a minute of 60, a second of 61 or another letter
		// than t or z is no RFC 3339 date-time.
		{"ts second 61", `{"id":"x","features":[1,2,3],"label":0,"ts":"2016-12-31T23:59:61Z"}`, ReasonBadTimestamp},
		{"ts minute 60", `{"id":"x","features":[1,2,3],"label":0,"ts":"2016-12-31T23:60:00Z"}`, ReasonBadTimestamp},
		{"ts leap second without a zone", `{"id":"x","features":[1,2,3],"label":0,"ts":"2016-12-31T23:59:60"}`, ReasonBadTimestamp},
		{"ts another separator", `{"id":"x","features":[1,2,3],"label":0,"ts":"2024-05-06x07:08:09Z"}`, ReasonBadTimestamp},
		{"ts before 1970", `{"id":"x","features":[1,2,3],"label":0,"ts":"1969-12-31T23:59:59Z"}`, ReasonBadTimestamp},
		{"ts the zero time", `{"id":"x","features":[1,2,3],"label":0,"ts":"0001-01-01T00:00:00Z"}`, ReasonBadTimestamp},
		{"ts past 9999 by its offset", `{"id":"x","features":[1,2,3],"label":0,"ts":"9999-12-31T23:59:59-00:01"}`, ReasonBadTimestamp},
		// Each of the four members may appear once, whatever its value; null features are absent.
		{"duplicate features", `{"id":"x","features":[1,2,3],"features":[4,5,6],"label":0}`, ReasonDuplicateField},
		{"duplicate ts", `{"id":"x","features":[1,2,3],"label":0,"ts":1,"ts":2}`, ReasonDuplicateField},
		{"null features", `{"id":"x","features":null,"label":0}`, ReasonMissingField},
		// Syntax the scanner must refuse itself: a record it accepts is never re-checked.
		{"one trailing byte", `{"id":"x","features":[1,2,3],"label":0}x`, ReasonBadJSON},
		{"null misspelt", `{"id":nulx,"features":[1,2,3],"label":0}`, ReasonBadJSON},
		{"no colon", `{"id":"x","features":[1,2,3],"label"=0}`, ReasonBadJSON},
		{"NUL for a comma", "{\"id\":\"x\",\"features\":{\"a\":1\x00\"b\":2,\"c\":3},\"label\":0}", ReasonBadJSON},
		// Truncated records (a cut message) are bad_json, never a panic.
		{"truncated feature array", `{"id":"x","label":0,"features":[1,2,3`, ReasonBadJSON},
		{"truncated after the first feature", `{"id":"x","label":0,"features":[1`, ReasonBadJSON},
		{"truncated feature name", `{"id":"x","label":0,"features":{"a`, ReasonBadJSON},
		{"truncated second feature name", `{"id":"x","label":0,"features":{"a":1,"b`, ReasonBadJSON},
		// A key past the model's features: repeated or unknown, never an index past the end.
		{"feature repeated after all", `{"id":"x","features":{"a":1,"b":2,"c":3,"a":4},"label":0}`, ReasonDuplicateField},
		{"unknown feature after all", `{"id":"x","features":{"a":1,"b":2,"c":3,"z":4},"label":0}`, ReasonUnknownFeature},
		// Strings that spell a number that is not finite are not_finite (blanks around too), not bad_type.
		{"overflowing string", `{"id":"x","features":[1,"1e999",3],"label":0}`, ReasonNotFinite},
		{"NaN string with blanks", `{"id":"x","features":[1," NaN ",3],"label":0}`, ReasonNotFinite},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec, err := s.Decode([]byte(tc.in))
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("Decode(%q) = %+v, %v; want a *DecodeError", tc.in, rec, err)
			}
			if de.Reason != tc.reason {
				t.Fatalf("Decode(%q) reason %q (%s), want %q", tc.in, de.Reason, de.Detail, tc.reason)
			}
			if !errors.Is(err, ErrDecode) || de.Detail == "" {
				t.Fatalf("error %v: not ErrDecode or no detail", err)
			}
			// The reason codes are a closed set.
			if !slices.Contains(Reasons(), de.Reason) {
				t.Fatalf("reason %q not in Reasons()", de.Reason)
			}
		})
	}
}

func TestNewSchemaRejects(t *testing.T) {
	for _, tc := range []struct {
		name              string
		features, classes []string
	}{
		{"no features", nil, []string{"a", "b"}},
		{"one class", []string{"x"}, []string{"a"}},
		{"duplicate feature", []string{"x", "x"}, []string{"a", "b"}},
		{"empty feature", []string{""}, []string{"a", "b"}},
		{"duplicate class", []string{"x"}, []string{"a", "a"}},
		{"empty class", []string{"x"}, []string{"a", ""}},
	} {
		if _, err := NewSchema(tc.features, tc.classes, 0); err == nil {
			t.Errorf("%s: NewSchema accepted %v / %v", tc.name, tc.features, tc.classes)
		}
	}
	s, err := NewSchema([]string{"x"}, []string{"a", "b"}, 0)
	if err != nil || s.MaxBytes() != DefaultMaxRecordBytes {
		t.Fatalf("default max bytes: %v, %v", s, err)
	}
	// A negative limit is no limit either: it means the default too.
	if s, err := NewSchema([]string{"x"}, []string{"a", "b"}, -1); err != nil || s.MaxBytes() != DefaultMaxRecordBytes {
		t.Fatalf("max bytes -1: %v, %v", s, err)
	}
}

// A record of exactly the schema's limit decodes; one byte more is too_large, whatever it holds.
func TestRecordSizeLimitIsInclusive(t *testing.T) {
	s := testSchema(t)
	pad := func(n int) []byte {
		b := []byte(`{"id":"big","features":[1,2,3],"label":0}`)
		return append(b, bytes.Repeat([]byte(" "), n-len(b))...)
	}
	if rec, err := s.Decode(pad(s.MaxBytes())); err != nil || rec.ID != "big" {
		t.Errorf("a record of %d bytes, the limit: %+v, %v", s.MaxBytes(), rec, err)
	}
	var de *DecodeError
	if _, err := s.Decode(pad(s.MaxBytes() + 1)); !errors.As(err, &de) || de.Reason != ReasonTooLarge {
		t.Errorf("a record of %d bytes: %v, want %s", s.MaxBytes()+1, err, ReasonTooLarge)
	}
}

func TestEncodeRoundTrip(t *testing.T) {
	s := testSchema(t)
	in := Record{ID: "e1", X: []float64{0.1, -2, 3e10}, Label: 1, Time: time.Unix(1700000000, 123).UTC()}
	b, err := s.Encode(in)
	if err != nil {
		t.Fatal(err)
	}
	out, err := s.Decode(b)
	if err != nil {
		t.Fatalf("Decode(Encode(r)) = %v for %s", err, b)
	}
	if out.ID != in.ID || !slices.Equal(out.X, in.X) || out.Label != in.Label || !out.Time.Equal(in.Time) {
		t.Fatalf("round trip %+v -> %s -> %+v", in, b, out)
	}
	for _, bad := range []Record{
		{ID: "e", X: []float64{1, 2}, Label: 0},
		{ID: "e", X: []float64{1, math.NaN(), 3}, Label: 0},
		{ID: "e", X: []float64{1, 2, 3}, Label: 2},
		{ID: " ", X: []float64{1, 2, 3}, Label: 0},
	} {
		if b, err := s.Encode(bad); err == nil {
			t.Errorf("Encode(%+v) = %s, want an error", bad, b)
		}
	}
}

// FuzzDecode checks that Decode never panics, that everything it accepts is valid, and that
// it agrees with encoding/json on what the accepted document says.
func FuzzDecode(f *testing.F) {
	for _, seed := range []string{
		`{"id":"r1","features":[1,2.5,-3e2],"label":1}`,
		`{"label":"malicious","features":{"c":3,"a":1,"b":2},"id":"r3"}`,
		`{"id":"r6","features":[1,2,3],"label":0,"ts":"2024-05-06T07:08:09.5Z"}`,
		`{"id":"r7","features":[1,2,3],"label":0,"ts":1714979289.5}`,
		`{"id":"r\u00e9","features":[1,"NaN",3],"label":0}`,
		`{"id":"x","features":{"a":1,"b":2,"a":3},"label":0}`,
		`{"id":"x","features":[1,2,1e999],"label":2}`,
		`[]`, `{}`, `{"id":`, "",
	} {
		f.Add([]byte(seed))
	}
	s := testSchema(f)
	// Re-encoding may be longer than the input (1e300 becomes 1e+300), so it gets room.
	roomy, err := NewSchema(s.features, s.classes, 4*s.MaxBytes())
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		rec, err := s.Decode(data)
		if err != nil {
			var de *DecodeError
			if !errors.As(err, &de) || !slices.Contains(Reasons(), de.Reason) {
				t.Fatalf("Decode error %v is not a DecodeError with a known reason", err)
			}
			if de.Reason != ReasonBadJSON && de.Reason != ReasonTooLarge && !json.Valid(data) {
				t.Fatalf("invalid JSON %q got reason %q", data, de.Reason)
			}
			return
		}
		if len(data) > s.MaxBytes() || !json.Valid(data) {
			t.Fatalf("accepted oversized or invalid JSON %q", data)
		}
		if (rec.ID != "" && checkID(rec.ID) != nil) || len(rec.X) != s.Dim() || rec.Label < 0 || rec.Label >= len(s.classes) {
			t.Fatalf("accepted invalid record %+v from %q", rec, data)
		}
		for _, v := range rec.X {
			if math.IsNaN(v) || math.IsInf(v, 0) {
				t.Fatalf("accepted non-finite feature in %+v from %q", rec, data)
			}
		}
		// Independent reading with encoding/json.
		var doc map[string]json.RawMessage
		if err := json.Unmarshal(data, &doc); err != nil {
			t.Fatalf("encoding/json rejects accepted %q: %v", data, err)
		}
		var id *string // absent and null both mean no id
		if raw, ok := doc["id"]; ok {
			if err := json.Unmarshal(raw, &id); err != nil {
				t.Fatalf("id %s: %v", raw, err)
			}
		}
		if (id == nil) != (rec.ID == "") || id != nil && *id != rec.ID {
			t.Fatalf("id: encoding/json says %v, we say %q", id, rec.ID)
		}
		var arr []float64
		var obj map[string]float64
		if json.Unmarshal(doc["features"], &arr) == nil {
			if !slices.Equal(arr, rec.X) {
				t.Fatalf("features: encoding/json says %v, we say %v", arr, rec.X)
			}
		} else if err := json.Unmarshal(doc["features"], &obj); err == nil {
			for j, name := range s.features {
				if obj[name] != rec.X[j] {
					t.Fatalf("feature %s: encoding/json says %v, we say %v", name, obj[name], rec.X[j])
				}
			}
		} else {
			t.Fatalf("features %s unreadable by encoding/json: %v", doc["features"], err)
		}
		var label any
		if err := json.Unmarshal(doc["label"], &label); err != nil {
			t.Fatal(err)
		}
		switch l := label.(type) {
		case float64:
			if int(l) != rec.Label {
				t.Fatalf("label: encoding/json says %v, we say %d", l, rec.Label)
			}
		case string:
			if s.classes[rec.Label] != l {
				t.Fatalf("label: encoding/json says %q, we say %d", l, rec.Label)
			}
		default:
			t.Fatalf("label %s accepted", doc["label"])
		}
		// Whatever we accept re-encodes to something we accept with the same content.
		b, err := roomy.Encode(rec)
		if err != nil {
			t.Fatalf("Encode(%+v): %v", rec, err)
		}
		again, err := roomy.Decode(b)
		if err != nil || again.ID != rec.ID || !slices.Equal(again.X, rec.X) || again.Label != rec.Label || !again.Time.Equal(rec.Time) {
			t.Fatalf("re-encode %+v -> %s -> %+v, %v", rec, b, again, err)
		}
	})
}

// TestNumberFastPath checks scanNumber's Clinger fast path, and scanner.number's fallback,
// bit for bit against strconv.ParseFloat on literals of every shape: short and long mantissas,
// leading zeros, exponents at and past the exact range.
func TestNumberFastPath(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	lits := []string{"0", "-0", "0.0", "1", "-1", "0.1", "0.3", "123456789012345678", "9007199254740993",
		"9007199254740992", "1e22", "1e23", "1e-22", "1e-23", "4.35", "0.000001", "1.7976931348623157e308",
		"12345678901234567890", "0.1234567890123456789", "100000000000000000000000", "5e-324", "2.5E+3",
		"1e999", "-1e999", "1e-400",
		// 20 digits whose mantissa passes a uint64 (2^64, 2^65 + 1, 2^64 / 10 with a digit after
		// the point): taken exactly, they would wrap.
		"18446744073709551616", "36893488147419103233", "1844674407370955161.6"}
	for range 20000 {
		var sb strings.Builder
		if rng.IntN(2) == 0 {
			sb.WriteByte('-')
		}
		sb.WriteString(strconv.FormatUint(rng.Uint64N(1<<uint(rng.IntN(64))), 10))
		if rng.IntN(2) == 0 {
			sb.WriteByte('.')
			sb.WriteString(strings.Repeat("0", rng.IntN(4)))
			sb.WriteString(strconv.FormatUint(rng.Uint64N(1<<uint(rng.IntN(60)+1)), 10))
		}
		if rng.IntN(3) == 0 {
			fmt.Fprintf(&sb, "e%d", rng.IntN(60)-30)
		}
		lits = append(lits, sb.String())
	}
	fast := 0
	for _, lit := range lits {
		want, _ := strconv.ParseFloat(lit, 64) // ±Inf past the range, as number returns
		end, v, exact, ok := scanNumber([]byte(lit), 0)
		if !ok || end != len(lit) {
			t.Fatalf("scanNumber(%q) = end %d, ok %v", lit, end, ok)
		}
		if exact {
			fast++
			if math.Float64bits(v) != math.Float64bits(want) {
				t.Fatalf("%q: fast path says %v, strconv says %v", lit, v, want)
			}
		}
		p := scanner{b: []byte(lit)}
		l, got, derr := p.number()
		if derr != nil || string(l) != lit || math.Float64bits(got) != math.Float64bits(want) {
			t.Fatalf("number(%q) = %q, %v, %v; strconv says %v", lit, l, got, derr, want)
		}
	}
	t.Logf("%d of %d literals took the fast path", fast, len(lits))
	if fast < len(lits)/4 {
		t.Fatalf("fast path taken for only %d of %d literals", fast, len(lits))
	}
	for _, bad := range []string{"", "-", "+1", ".5", "01", "1.", "1e", "1e+", "0x1", "inf", "NaN", "-.5"} {
		if end, _, _, ok := scanNumber([]byte(bad), 0); ok && end == len(bad) {
			t.Errorf("scanNumber accepted %q", bad)
		}
	}
}

// TestFeatureMapKeys covers the fast key match and its fallbacks: names that need escaping,
// keys that merely start like the expected name, escaped keys and out-of-order keys.
func TestFeatureMapKeys(t *testing.T) {
	s, err := NewSchema([]string{"a\"q", "x<y", "f1", "f10"}, []string{"n", "p"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range []string{
		`{"id":"k","label":0,"features":{"a\"q":1,"x<y":2,"f1":3,"f10":4}}`,
		`{"id":"k","label":0,"features":{"f10":4,"f1":3,"x\u003cy":2,"a\u0022q":1}}`,
		`{"id":"k","label":0,"features":{ "a\"q" : 1 , "x<y":2,"f1":3 ,"f10":4 }}`,
	} {
		rec, err := s.Decode([]byte(in))
		if err != nil || !slices.Equal(rec.X, []float64{1, 2, 3, 4}) {
			t.Errorf("Decode(%s) = %v, %v; want features [1 2 3 4]", in, rec.X, err)
		}
	}
	rec, err := s.Decode([]byte(`{"id":"k","label":0,"features":{"a\"q":1,"x<y":2,"f10":4,"f10":3}}`))
	var de *DecodeError
	if !errors.As(err, &de) || de.Reason != ReasonDuplicateField {
		t.Fatalf("duplicate f10 accepted: %v, %v", rec, err)
	}
}

// TestSchemaWithScale: with the model's scale, a feature further than MaxScaledFeature standard
// deviations from its mean is out_of_range, at decode and at encode; one just inside is taken;
// the schema without the scale takes both. A scale that cannot be one is refused.
func TestSchemaWithScale(t *testing.T) {
	plain := testSchema(t)
	s, err := plain.WithScale([]float64{0, 100, -5}, []float64{1, 2, 0.5})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		x    [3]float64
		ok   bool
	}{
		{"at the means", [3]float64{0, 100, -5}, true},
		{"just inside", [3]float64{0.99 * MaxScaledFeature, 100 - 1.99*MaxScaledFeature, -5 + 0.49*MaxScaledFeature}, true},
		{"past the first", [3]float64{1.01 * MaxScaledFeature, 100, -5}, false},
		{"below the second", [3]float64{0, 100 - 2.01*MaxScaledFeature, -5}, false},
		{"the largest finite", [3]float64{0, 100, math.MaxFloat64}, false},
	} {
		data := fmt.Sprintf(`{"features":[%v,%v,%v],"label":0}`, tc.x[0], tc.x[1], tc.x[2])
		_, err := s.Decode([]byte(data))
		var de *DecodeError
		switch {
		case tc.ok && err != nil:
			t.Errorf("%s: %s refused: %v", tc.name, data, err)
		case !tc.ok && (!errors.As(err, &de) || de.Reason != ReasonOutOfRange || !strings.Contains(de.Detail, "standard deviations")):
			t.Errorf("%s: %s: %v, want %s", tc.name, data, err, ReasonOutOfRange)
		}
		if _, err := s.Encode(Record{X: tc.x[:]}); (err == nil) != tc.ok {
			t.Errorf("%s: Encode: %v, want refused %v", tc.name, err, !tc.ok)
		}
		if _, err := plain.Decode([]byte(data)); err != nil {
			t.Errorf("%s: without the scale: %v", tc.name, err)
		}
	}
	for _, bad := range [][2][]float64{{{0, 0}, {1, 1}}, {{0, 0, 0}, {1, 0, 1}}, {{0, math.NaN(), 0}, {1, 1, 1}}, {{0, 0, 0}, {1, math.Inf(1), 1}}} {
		if _, err := plain.WithScale(bad[0], bad[1]); err == nil {
			t.Errorf("WithScale(%v, %v) accepted", bad[0], bad[1])
		}
	}
}

// decodeAll's parallel path, which it takes with enough records and cores, decodes every record
// as Decode does, whatever the number of workers (run here on any machine, one core included).
func TestDecodeOnWorkersAgrees(t *testing.T) {
	s := testSchema(t)
	values := make([][]byte, 203)
	for i := range values {
		values[i] = []byte(goodRecord(fmt.Sprint("r", i), i))
		if i%7 == 3 {
			values[i] = []byte(`{"id":"short","features":[1,2],"label":0}`)
		}
	}
	for _, workers := range []int{1, 2, 3, 8} {
		out := make([]Record, len(values))
		errs := s.decodeOn(values, out, workers)
		for i, v := range values {
			want, werr := s.Decode(v)
			if (werr == nil) != (errs[i] == nil) || out[i].ID != want.ID || !slices.Equal(out[i].X, want.X) || out[i].Label != want.Label {
				t.Fatalf("%d workers, record %d: %+v (%v), want %+v (%v)", workers, i, out[i], errs[i], want, werr)
			}
		}
	}
}

// TestDecodeErrorMatchesOnlyErrDecode: a *DecodeError is errors.Is ErrDecode and nothing else, so
// that a caller telling a bad record (dead-letter it) from another failure (retry) is not fooled.
func TestDecodeErrorMatchesOnlyErrDecode(t *testing.T) {
	_, err := testSchema(t).Decode([]byte(`{}`))
	if !errors.Is(err, ErrDecode) {
		t.Fatalf("%v is not ErrDecode", err)
	}
	for _, other := range []error{io.EOF, context.Canceled, errors.New("bad record")} {
		if errors.Is(err, other) {
			t.Errorf("%v matches %v", err, other)
		}
	}
}

// TestScaledRangeBounds pins the documented bound (docs/API.md, docs/OPERATIONS.md: 10^5
// standard deviations) with values written out: with mean 10 and deviation 2 the range is
// [10 - 2e5, 10 + 2e5] = [-199990, 200010], both ends included (a record is refused only when
// further than the bound).
func TestScaledRangeBounds(t *testing.T) {
	plain := testSchema(t)
	s, err := plain.WithScale([]float64{10, 10, 10}, []float64{2, 2, 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		v  string
		ok bool
	}{
		{"200010", true}, {"-199990", true}, {"200010.001", false}, {"-199990.001", false},
		{"1e6", false}, {"-1e6", false},
	} {
		for j := range 3 {
			x := []string{"10", "10", "10"}
			x[j] = tc.v
			data := `{"features":[` + strings.Join(x, ",") + `],"label":0}`
			_, err := s.Decode([]byte(data))
			var de *DecodeError
			switch {
			case tc.ok && err != nil:
				t.Errorf("%s refused: %v", data, err)
			case !tc.ok && (!errors.As(err, &de) || de.Reason != ReasonOutOfRange):
				t.Errorf("%s: %v, want %s", data, err, ReasonOutOfRange)
			}
		}
	}
}

// TestWithScaleRefuses: a scale is one mean and one positive, finite deviation per feature, and
// a finite mean; anything else is refused (it would refuse every record or none).
func TestWithScaleRefuses(t *testing.T) {
	plain := testSchema(t)
	inf, nan := math.Inf(1), math.NaN()
	for _, tc := range []struct {
		name      string
		mean, std []float64
	}{
		{"two deviations", []float64{0, 0, 0}, []float64{1, 1}},
		{"four deviations", []float64{0, 0, 0}, []float64{1, 1, 1, 1}},
		{"infinite mean", []float64{0, inf, 0}, []float64{1, 1, 1}},
		{"minus infinite mean", []float64{0, 0, -inf}, []float64{1, 1, 1}},
		{"negative deviation", []float64{0, 0, 0}, []float64{1, -1, 1}},
		{"NaN deviation", []float64{0, 0, 0}, []float64{1, 1, nan}},
	} {
		if _, err := plain.WithScale(tc.mean, tc.std); err == nil {
			t.Errorf("%s: WithScale(%v, %v) accepted", tc.name, tc.mean, tc.std)
		}
	}
}

// TestEncodeRefuses: Encode refuses what Decode refuses, with the same reason, and its size limit
// is inclusive. {"id":"e","features":[1,2,3],"label":0} is 39 bytes.
func TestEncodeRefuses(t *testing.T) {
	s := testSchema(t)
	for _, tc := range []struct {
		name   string
		r      Record
		reason string
	}{
		{"+Inf", Record{X: []float64{1, math.Inf(1), 3}}, ReasonNotFinite},
		{"-Inf", Record{X: []float64{math.Inf(-1), 2, 3}}, ReasonNotFinite},
		{"NaN", Record{X: []float64{1, 2, math.NaN()}}, ReasonNotFinite},
		{"negative label", Record{X: []float64{1, 2, 3}, Label: -1}, ReasonUnknownLabel},
		{"label past the classes", Record{X: []float64{1, 2, 3}, Label: 2}, ReasonUnknownLabel},
		{"short", Record{X: []float64{1, 2}}, ReasonWrongDimension},
		{"bad id", Record{ID: "a b", X: []float64{1, 2, 3}}, ReasonBadID},
	} {
		b, err := s.Encode(tc.r)
		var de *DecodeError
		if !errors.As(err, &de) || de.Reason != tc.reason {
			t.Errorf("%s: Encode = %s, %v; want %s", tc.name, b, err, tc.reason)
		}
	}
	r := Record{ID: "e", X: []float64{1, 2, 3}}
	const size = len(`{"id":"e","features":[1,2,3],"label":0}`)
	for _, tc := range []struct {
		limit int
		ok    bool
	}{{size, true}, {size - 1, false}} {
		small, err := NewSchema([]string{"a", "b", "c"}, []string{"benign", "malicious"}, tc.limit)
		if err != nil {
			t.Fatal(err)
		}
		b, err := small.Encode(r)
		var de *DecodeError
		if tc.ok && (err != nil || len(b) != size) {
			t.Errorf("limit %d: Encode = %s, %v; want %d bytes", tc.limit, b, err, size)
		}
		if !tc.ok && (!errors.As(err, &de) || de.Reason != ReasonTooLarge) {
			t.Errorf("limit %d: Encode = %s, %v; want %s", tc.limit, b, err, ReasonTooLarge)
		}
	}
}

// TestFeatureMapNamesThatNeedEscaping: the fast key match takes a feature's name byte for byte
// only when JSON writes it so; a name with a quote, a backslash or a control character must go
// through the JSON string grammar, which decides what the key is, and a key that merely starts
// with a name ("f10" for "f1") is not that name.
func TestFeatureMapNamesThatNeedEscaping(t *testing.T) {
	for _, tc := range []struct {
		name     string
		features []string
		in       string
		want     []float64 // nil: refused with reason
		reason   string
	}{
		{"prefix of a later name", []string{"f1", "f10"}, `{"features":{"f10":2,"f1":1},"label":0}`, []float64{1, 2}, ""},
		{"quote escaped", []string{`a"q`, "b"}, `{"features":{"a\"q":1,"b":2},"label":0}`, []float64{1, 2}, ""},
		{"quote unescaped", []string{`a"q`, "b"}, `{"features":{"a"q":1,"b":2},"label":0}`, nil, ReasonBadJSON},
		{"backslash escaped", []string{`a\b`, "c"}, `{"features":{"a\\b":1,"c":2},"label":0}`, []float64{1, 2}, ""},
		// "a\b" in JSON is a, backspace: not the feature a\b.
		{"backslash as an escape", []string{`a\b`, "c"}, `{"features":{"a\b":1,"c":2},"label":0}`, nil, ReasonUnknownFeature},
		{"control escaped", []string{"a\x1f", "c"}, `{"features":{"a\u001f":1,"c":2},"label":0}`, []float64{1, 2}, ""},
		{"control raw", []string{"a\x1f", "c"}, "{\"features\":{\"a\x1f\":1,\"c\":2},\"label\":0}", nil, ReasonBadJSON},
	} {
		s, err := NewSchema(tc.features, []string{"n", "p"}, 0)
		if err != nil {
			t.Fatal(err)
		}
		rec, err := s.Decode([]byte(tc.in))
		var de *DecodeError
		switch {
		case tc.want != nil && (err != nil || !slices.Equal(rec.X, tc.want)):
			t.Errorf("%s: Decode(%q) = %v, %v; want %v", tc.name, tc.in, rec.X, err, tc.want)
		case tc.want == nil && (!errors.As(err, &de) || de.Reason != tc.reason):
			t.Errorf("%s: Decode(%q) = %v, %v; want %s", tc.name, tc.in, rec.X, err, tc.reason)
		}
	}
}
