package daemon

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/cluster"
)

// TestDecodeJSONIsStrict holds decodeJSON's refusals, each a 400 bodyError whose message names
// what is wrong: a body that is empty, starts with a byte order mark or is not an object; a key
// given twice at any depth, also inside a value the struct does not take; a key matching a field
// only by case; null for a field or in it; a value of the wrong type, named in JSON's terms; and
// anything after the object but white space.
func TestDecodeJSONIsStrict(t *testing.T) {
	type withString struct {
		S string `json:"s"`
	}
	for _, c := range []struct {
		name, body string
		into       func() any
		says       string // "" when the body decodes
	}{
		{"an object", `{"x":[1,2]}`, func() any { return new(predictRequest) }, ""},
		{"white space after it", " {\"x\":[1]} \n\t\n", func() any { return new(predictRequest) }, ""},
		{"strings equal to the keys", `{"s":"s"}`, func() any { return new(withString) }, ""},
		{"an empty object, no fields", `{}`, func() any { return new(struct{}) }, ""},
		{"strings that hold null", `{"x":[1],"id":"null","method":"null-ish"}`, func() any {
			return new(struct {
				X      []float64 `json:"x"`
				ID     string    `json:"id"`
				Method string    `json:"method"`
			})
		}, ""},
		{"empty", " \n", func() any { return new(predictRequest) }, "the body is empty"},
		{"a byte order mark", "\ufeff{}", func() any { return new(predictRequest) }, "byte order mark"},
		{"an array", `[{"x":[1]}]`, func() any { return new(predictRequest) }, "must be a JSON object"},
		{"a closing brace after it", `{"x":[1]}}`, func() any { return new(predictRequest) }, "trailing data"},
		{"a closing bracket after it", `{"x":[1]}]`, func() any { return new(predictRequest) }, "trailing data"},
		{"a second object", `{"x":[1]}{"x":[1]}`, func() any { return new(predictRequest) }, "trailing data"},
		{"a word after it", `{"x":[1]} x`, func() any { return new(predictRequest) }, "trailing data"},
		{"a key twice", `{"x":[1],"x":[1]}`, func() any { return new(predictRequest) }, `duplicate key "x"`},
		{"a key twice in an object for an array", `{"x":{"a":1,"a":2}}`, func() any { return new(predictRequest) }, `in "x": duplicate key "a"`},
		{"a key twice after an array of strings", `{"xs":["s","t","s",{"a":1,"a":2}]}`, func() any { return new(predictRequest) }, `in "xs": duplicate key "a"`},
		{"a negative version", `{"x":[1],"min_version":-1}`, func() any { return new(predictRequest) }, `field "min_version": number -1 is not a whole number from 0 to 18446744073709551615`},
		{"a fractional version", `{"x":[1],"min_version":2.5}`, func() any { return new(predictRequest) }, `field "min_version": number 2.5 is not a whole number from 0`},
		{"a key by case", `{"X":[1]}`, func() any { return new(predictRequest) }, `unknown field "X" (keys are case-sensitive: did you mean "x"?)`},
		{"an unknown key", `{"z":1}`, func() any { return new(predictRequest) }, `unknown field "z" (fields: x, xs, min_version)`},
		{"a key for no fields", `{"z":1}`, func() any { return new(struct{}) }, `unknown field "z" (this body takes no fields`},
		{"null", `{"x":null}`, func() any { return new(predictRequest) }, `"x" is null`},
		{"a null inside", `{"xs":[[1],[null]]}`, func() any { return new(predictRequest) }, `"xs" holds a null`},
		{"a number for a string", `{"s":1}`, func() any { return new(withString) }, `field "s": number is not a string`},
		{"a string for numbers", `{"x":"a"}`, func() any { return new(predictRequest) }, `field "x": string is not an array of numbers`},
		{"a number too large", `{"x":[1e400]}`, func() any { return new(predictRequest) }, `is not a finite number of 64 bits`},
		{"a huge value in a custom type's error", `{"id":[` + strings.Repeat("0,", 50000) + `0]}`, func() any { return new(explainRequest) }, "id must be a string"},
		{"a syntax error", `{"x":[1,]}`, func() any { return new(predictRequest) }, `bad JSON at byte 9: invalid character`},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := decodeJSON([]byte(c.body), c.into())
			if c.says == "" {
				if err != nil {
					t.Fatalf("decodeJSON(%q): %v, want it decoded", c.body, err)
				}
				return
			}
			var be *bodyError
			if !errors.As(err, &be) || be.code != http.StatusBadRequest || !strings.Contains(be.msg, c.says) {
				t.Fatalf("decodeJSON(%.200q): %.300v, want a 400 saying %q", c.body, err, c.says)
			}
			if len(be.msg) > 4200 { // 4 KiB and the note of what was cut
				t.Fatalf("decodeJSON(%.200q): an error of %d bytes: it repeats the request", c.body, len(be.msg))
			}
		})
	}
}

// TestNoDuplicateKeys holds that only a key given twice in one object is reported: strings
// that are values or array elements are not keys, and each object, nested or a sibling, has keys
// of its own.
func TestNoDuplicateKeys(t *testing.T) {
	for _, c := range []struct {
		raw string
		dup string // "" when none
	}{
		{`{"a":1,"a":2}`, "a"},
		{`{"a":1,"b":[1,{"c":1}],"a":3}`, "a"},
		{`[1,{"d":1,"d":1}]`, "d"},
		{`{"a":"a"}`, ""},
		{`{"a":"b","c":"b"}`, ""},
		{`["s","t","s",{"a":1}]`, ""},
		{`{"b":{"a":1},"a":2}`, ""},
		{`[{"a":1},{"a":1}]`, ""},
		{`{"a":[{"a":1}],"b":{"a":{"a":1}}}`, ""},
		{`{"a":1,"b":{"a":1`, ""}, // a syntax error is the decoder's to report
	} {
		err := noDuplicateKeys([]byte(c.raw))
		switch {
		case c.dup == "" && err != nil:
			t.Errorf("noDuplicateKeys(%s): %v, want none", c.raw, err)
		case c.dup != "" && (err == nil || err.Error() != `duplicate key "`+c.dup+`"`):
			t.Errorf("noDuplicateKeys(%s): %v, want duplicate key %q", c.raw, err, c.dup)
		}
	}
}

// errReader fails every read with err.
type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }

// TestReadBodyErrors holds the statuses readBody gives a body it cannot read, as writeBodyError
// answers them: over http.max_body_bytes is 413 naming the limit, not received within
// http.read_timeout is 408, any other failure is 400.
func TestReadBodyErrors(t *testing.T) {
	for _, c := range []struct {
		name string
		body func(w http.ResponseWriter) io.ReadCloser
		code int
		says string
	}{
		{"over the limit", func(w http.ResponseWriter) io.ReadCloser {
			return http.MaxBytesReader(w, io.NopCloser(strings.NewReader(`{"x":[1,2,3]}`)), 8)
		}, http.StatusRequestEntityTooLarge, "request body over 8 bytes (http.max_body_bytes)"},
		{"past the read deadline", func(http.ResponseWriter) io.ReadCloser {
			return io.NopCloser(errReader{os.ErrDeadlineExceeded})
		}, http.StatusRequestTimeout, "http.read_timeout"},
		{"cut short", func(http.ResponseWriter) io.ReadCloser {
			return io.NopCloser(errReader{io.ErrUnexpectedEOF})
		}, http.StatusBadRequest, "reading the request body: unexpected EOF"},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := httptest.NewRecorder()
			r := httptest.NewRequest("POST", "/v1/predict", nil)
			r.Body = c.body(w)
			body, err := readBody(r)
			if err == nil {
				t.Fatalf("readBody: %q, want an error", body)
			}
			writeBodyError(w, err)
			if w.Code != c.code || !strings.Contains(w.Body.String(), c.says) {
				t.Fatalf("readBody's error answered %d %s, want %d saying %q", w.Code, w.Body.String(), c.code, c.says)
			}
		})
	}
}

// TestSetRetryAfter holds Retry-After to whole seconds rounded up, at least 1.
func TestSetRetryAfter(t *testing.T) {
	for after, want := range map[string]string{"0s": "1", "1ms": "1", "1s": "1", "1.2s": "2", "10s": "10", "-3s": "1"} {
		d, err := time.ParseDuration(after)
		if err != nil {
			t.Fatal(err)
		}
		w := httptest.NewRecorder()
		setRetryAfter(w, d)
		if got := w.Header().Get("Retry-After"); got != want {
			t.Errorf("setRetryAfter(%v): %q, want %q", d, got, want)
		}
	}
}

// TestWriteErrorStripsPathsOfServerErrors: the message of a server error (5xx) is answered
// without server paths; a client error's is answered as it is.
func TestWriteErrorStripsPathsOfServerErrors(t *testing.T) {
	const msg = "ledger: /srv/state/cfguard.db: no space left"
	for code, want := range map[int]string{
		http.StatusInternalServerError: "ledger: cfguard.db: no space left",
		http.StatusServiceUnavailable:  "ledger: cfguard.db: no space left",
		http.StatusGatewayTimeout:      "ledger: cfguard.db: no space left",
		http.StatusBadRequest:          msg,
		http.StatusConflict:            msg,
	} {
		w := httptest.NewRecorder()
		writeError(w, code, msg)
		var e struct{ Error string }
		if w.Code != code || json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error != want {
			t.Errorf("writeError(%d): %d %s, want %q", code, w.Code, w.Body.String(), want)
		}
	}
}

// TestWritePending: a 202 for a request its owner has not applied names the CE's Location
// and says it is pending, with the fields given.
func TestWritePending(t *testing.T) {
	w := httptest.NewRecorder()
	writePending(w, "ce-1", cluster.ErrPending, map[string]any{"generation": 1})
	var body map[string]any
	if w.Code != http.StatusAccepted || w.Header().Get("Location") != "/v1/counterfactuals/ce-1" || json.Unmarshal(w.Body.Bytes(), &body) != nil ||
		body["id"] != "ce-1" || body["status"] != "pending" || body["detail"] != cluster.ErrPending.Error() || body["generation"] != float64(1) {
		t.Errorf("writePending: %d (Location %q) %s", w.Code, w.Header().Get("Location"), w.Body.String())
	}
}

// A field whose value is JSON the field does not take is refused by what the field takes, not
// as bad JSON: the body parsed.
func TestAValueAFieldDoesNotTakeIsNotBadJSON(t *testing.T) {
	for _, c := range []struct{ body, says string }{
		{`{"x":[1],"method":"dice"}`, `"dice"`},
		{`{"x":[1],"method":""}`, "method is empty"},
		{`{"x":[1],"method":1}`, "method must be a string"},
		{`{"x":[1],"id":""}`, "id is empty"},
		{`{"x":[1],"target":null}`, `"target" is null`},
		{`{"x":[1],"target":[1]}`, "target must be a class index"},
	} {
		err := decodeJSON([]byte(c.body), new(explainRequest))
		var be *bodyError
		if !errors.As(err, &be) || be.code != http.StatusBadRequest || !strings.Contains(be.msg, c.says) || strings.Contains(be.msg, "bad JSON") {
			t.Errorf("decodeJSON(%s): %v, want a 400 saying %q, not bad JSON", c.body, err, c.says)
		}
	}
}
