package ident

import (
	"strings"
	"testing"
)

func TestCheck(t *testing.T) {
	for _, id := range []string{"a", "ce-1", "r_2.v3:x", strings.Repeat("x", MaxLen), "...", ".a", "a.."} {
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
