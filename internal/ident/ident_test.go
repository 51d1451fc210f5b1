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
