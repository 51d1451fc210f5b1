package daemon

import (
	"errors"
	"net/http"
	"strings"
	"testing"
)

// TestIdempotencyKey holds what an Idempotency-Key header may be: one header of 1 to 255
// printable ASCII bytes (0x20 to 0x7e), bare or quoted as a structured-field string, whose quotes
// are not part of the key. No header is no key; anything else is errBadRequest.
func TestIdempotencyKey(t *testing.T) {
	long := strings.Repeat("k", 255)
	for _, c := range []struct {
		name   string
		values []string // the header's values, in order; none: no header
		want   string   // the key, when ok
		ok     bool
	}{
		{"no header", nil, "", true},
		{"bare", []string{"8e03-a1"}, "8e03-a1", true},
		{"quoted", []string{`"8e03-a1"`}, "8e03-a1", true},
		{"a space inside", []string{"a b"}, "a b", true},
		{"a lone quote", []string{`"`}, `"`, true},
		{"an opening quote only", []string{`"abc`}, `"abc`, true},
		{"a closing quote only", []string{`abc"`}, `abc"`, true},
		{"255 bytes", []string{long}, long, true},
		{"255 bytes quoted", []string{`"` + long + `"`}, long, true},
		{"the printable ends", []string{" ~"}, " ~", true},
		{"two headers", []string{"a", "b"}, "", false},
		{"two equal headers", []string{"a", "a"}, "", false},
		{"empty", []string{""}, "", false},
		{"empty quoted", []string{`""`}, "", false},
		{"256 bytes", []string{long + "k"}, "", false},
		{"256 bytes quoted", []string{`"` + long + `k"`}, "", false},
		{"a tab", []string{"a\tb"}, "", false},
		{"a unit separator", []string{"a\x1fb"}, "", false},
		{"a DEL", []string{"a\x7fb"}, "", false},
		{"a byte over 0x7f", []string{"a\x80b"}, "", false},
		{"UTF-8", []string{"clé"}, "", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, err := http.NewRequest("POST", "/v1/counterfactuals", nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, v := range c.values {
				r.Header.Add(headerIdempotencyKey, v)
			}
			key, err := idempotencyKey(r)
			switch {
			case c.ok && (err != nil || key != c.want):
				t.Fatalf("idempotencyKey(%q) = %q, %v; want %q", c.values, key, err, c.want)
			case !c.ok && (!errors.Is(err, errBadRequest) || key != ""):
				t.Fatalf("idempotencyKey(%q) = %q, %v; want an errBadRequest", c.values, key, err)
			case !c.ok && !strings.Contains(err.Error(), headerIdempotencyKey):
				t.Fatalf("idempotencyKey(%q): %v does not name the header", c.values, err)
			}
		})
	}
}
