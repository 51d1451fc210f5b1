package ident

import (
	"crypto/sha256"
	"encoding/hex"
	"math"
	"strings"
	"testing"
)

func TestCheck(t *testing.T) {
	for _, id := range []string{"a", "ce-1", "r_2.v3:x", strings.Repeat("x", MaxLen), "...", ".a", "a..", "azAZ09", "z", "Z", "A"} {
		if err := Check(id); err != nil {
			t.Errorf("Check(%q) = %v, want nil", id, err)
		}
	}
	for id, want := range map[string]string{
		"":                              "want 1 to 128 characters",
		strings.Repeat("x", MaxLen+1):   "want 1 to 128 characters",
		".":                             `"." and ".." are not ids`,
		"..":                            `"." and ".." are not ids`,
		"../etc":                        `character '/'`,
		"a/b":                           `character '/'`,
		"a\x00b":                        `character '\x00'`,
		"a b":                           `character ' '`,
		"é":                             `character 'é'`,
		"\xff":                          `character '�'`,
		"a\nb":                          `character '\n'`,
		strings.Repeat("y", 1<<20) + "": "want 1 to 128 characters",
		// The characters either side of each range in ASCII: '/' and ';' around "0-9:", '@' and '['
		// around "A-Z", '`' and '{' around "a-z"; and '~', which URLs leave unescaped.
		"a;b": `character ';'`,
		"a@b": `character '@'`,
		"a[b": `character '['`,
		"a`b": "character '`'",
		"a{b": `character '{'`,
		"a~b": `character '~'`,
	} {
		err := Check(id)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Check(%.20q) = %v, want an error containing %q", id, err, want)
		}
		if err != nil && len(err.Error()) > 300 {
			t.Errorf("Check(%.20q): the error quotes %d bytes", id, len(err.Error()))
		}
	}
}

// Clip keeps a value of at most max bytes whole; a longer one it cuts to at most max bytes on a
// character boundary (never inside a UTF-8 sequence, so what it quotes stays valid UTF-8) and says
// how many bytes it cut, even when no character starts within the first max bytes.
func TestClip(t *testing.T) {
	for _, tc := range []struct {
		s    string
		max  int
		want string
	}{
		{"", 0, ""},
		{"abc", 3, "abc"},
		{"abcd", 3, "abc... (1 more bytes)"},
		{"aé", 2, "a... (2 more bytes)"}, // é is 2 bytes: the cut is before it
		{"ééé", 3, "é... (4 more bytes)"},
		{"ééé", 4, "éé... (2 more bytes)"},
		{"\x80\x80\x80", 1, "... (3 more bytes)"},
	} {
		if got := Clip(tc.s, tc.max); got != tc.want {
			t.Errorf("Clip(%q, %d) = %q, want %q", tc.s, tc.max, got, tc.want)
		}
	}
}

// A reissued CE's id is "<id>.r<version>"; an id too long for that at some version keeps its
// first characters and a digest of the whole, so that long ids sharing their first characters
// stay apart; every one is a valid id, and starts with its stem.
func TestReissue(t *testing.T) {
	long := func(first byte, n int) string { return string(first) + strings.Repeat("p", n-1) }
	for _, tc := range []struct {
		id   string
		v    uint64
		want string
	}{
		{"ce-1", 7, "ce-1.r7"},
		{long('a', MaxLen-22), 18446744073709551615, long('a', MaxLen-22) + ".r18446744073709551615"},
	} {
		if got := Reissue(tc.id, tc.v); got != tc.want {
			t.Errorf("Reissue(%q, %d) = %q, want %q", tc.id, tc.v, got, tc.want)
		}
	}
	// The stem of an id too long: its first characters, "." and the first 16 hex digits of its
	// SHA-256, as many first characters as let the reissue at the largest version be MaxLen long.
	q := strings.Repeat("q", MaxLen)
	sum := sha256.Sum256([]byte(q))
	stem := q[:MaxLen-len(".r18446744073709551615")-len(".")-16] + "." + hex.EncodeToString(sum[:])[:16]
	if got := ReissueStem(q); got != stem {
		t.Errorf("ReissueStem(%q) = %q, want %q", q, got, stem)
	}
	if got := Reissue(q, math.MaxUint64); len(got) != MaxLen {
		t.Errorf("Reissue(%q, MaxUint64) = %q: %d bytes, want %d", q, got, len(got), MaxLen)
	}
	seen := map[string]string{}
	for _, id := range []string{long('a', MaxLen-21), long('a', MaxLen), long('b', MaxLen), long('c', MaxLen-3), strings.Repeat("q", MaxLen)} {
		stem := ReissueStem(id)
		if stem == id || !strings.HasPrefix(id, stem[:8]) {
			t.Errorf("ReissueStem(%q) = %q: want the id's first characters and a digest", id, stem)
		}
		if other, ok := seen[stem]; ok {
			t.Errorf("ReissueStem gives %q for %q and for %q", stem, id, other)
		}
		seen[stem] = id
		for _, v := range []uint64{1, 18446744073709551615} {
			got := Reissue(id, v)
			if err := Check(got); err != nil || !strings.HasPrefix(got, stem+".r") {
				t.Errorf("Reissue(%q, %d) = %q (%v), want a valid id after %q", id, v, got, err, stem+".r")
			}
		}
	}
}
