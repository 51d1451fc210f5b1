// Package ident holds the one rule for the ids cfguard stores and names things by: a CE's id
// (given to the API) and a record's id (given in a Kafka record), so that both are checked alike.
// An id appears in URL paths (/v1/counterfactuals/{id}), ledger keys, event keys and logs: it is
// 1 to MaxLen characters of [A-Za-z0-9._:-], and neither "." nor ".." (which a URL path resolves
// away, so such a CE could never be read or deleted).
package ident

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"unicode/utf8"
)

// MaxLen is the longest id, in bytes (every accepted character is one byte).
const MaxLen = 128

// Check reports why id is not a valid id, or nil.
func Check(id string) error {
	if len(id) == 0 || len(id) > MaxLen {
		return fmt.Errorf("id %q: want 1 to %d characters", Clip(id, MaxLen+16), MaxLen)
	}
	if id == "." || id == ".." {
		return fmt.Errorf("id %q: \".\" and \"..\" are not ids", id)
	}
	for _, c := range id { // invalid UTF-8 is reported as U+FFFD
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' || c == ':') {
			return fmt.Errorf("id %q: character %q not in [A-Za-z0-9._:-]", Clip(id, MaxLen+16), c)
		}
	}
	return nil
}

// Clip shortens a value from a request that an error quotes (an id, a name: it may be a megabyte
// long) to at most max bytes, on a character boundary, saying how many bytes it cut.
func Clip(s string, max int) string {
	if len(s) <= max {
		return s
	}
	n := max
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return fmt.Sprintf("%s... (%d more bytes)", s[:n], len(s)-n)
}

// ReissueStem is what the id of a CE reissued for CE id (explain.reissue) starts with, before
// ".r<posterior version>": id itself when the longest such id fits MaxLen; else id's first
// characters, ".", and the first 16 hex digits of id's SHA-256, so that long ids that share their
// first characters get stems of their own.
func ReissueStem(id string) string {
	const room = len(".r") + 20 // a posterior version (uint64) has at most 20 digits
	if len(id)+room <= MaxLen {
		return id
	}
	sum := sha256.Sum256([]byte(id))
	tag := "." + hex.EncodeToString(sum[:8])
	return id[:MaxLen-room-len(tag)] + tag
}

// Reissue is the id of the CE reissued for CE id at posterior version v: ReissueStem(id) and
// ".r<v>".
func Reissue(id string, v uint64) string {
	return ReissueStem(id) + ".r" + strconv.FormatUint(v, 10)
}
