// Package ident holds the one rule for the ids cfguard stores and names things by: a CE's id
// (given to the API) and a record's id (given in a Kafka record), so that both are checked alike.
// An id appears in URL paths (/v1/counterfactuals/{id}), ledger keys, event keys and logs: it is
// 1 to MaxLen characters of [A-Za-z0-9._:-], and neither "." nor ".." (which a URL path resolves
// away, so such a CE could never be read or deleted).
package ident

import "fmt"

// MaxLen is the longest id, in bytes (every accepted character is one byte).
const MaxLen = 128

// Check reports why id is not a valid id, or nil.
func Check(id string) error {
	if len(id) == 0 || len(id) > MaxLen {
		return fmt.Errorf("id %q: want 1 to %d characters", clip(id), MaxLen)
	}
	if id == "." || id == ".." {
		return fmt.Errorf("id %q: \".\" and \"..\" are not ids", id)
	}
	for _, c := range id { // invalid UTF-8 is reported as U+FFFD
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' || c == ':') {
			return fmt.Errorf("id %q: character %q not in [A-Za-z0-9._:-]", clip(id), c)
		}
	}
	return nil
}

// clip shortens an id quoted in an error (it may be a megabyte long).
func clip(s string) string {
	const max = MaxLen + 16
	if len(s) <= max {
		return s
	}
	return s[:max] + "..."
}
