package store

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// ShellQuote makes the recovery commands of an error paste into a POSIX shell as they are: a
// path of safe characters bare, any other quoted, a quote inside closed and escaped, and the
// empty string as ”.
func TestShellQuote(t *testing.T) {
	for in, want := range map[string]string{
		"/var/lib/cfguard/cfguard.db": "/var/lib/cfguard/cfguard.db",
		"/data/my state/cfguard.db":   "'/data/my state/cfguard.db'",
		"/data/it's/cfguard.db":       `'/data/it'\''s/cfguard.db'`,
		"":                            "''",
		"/srv/a+b:c@d%e,f=g_h-i.db":   "/srv/a+b:c@d%e,f=g_h-i.db",
	} {
		if got := ShellQuote(in); got != want {
			t.Errorf("ShellQuote(%q) = %s, want %s", in, got, want)
		}
	}
}

// InFile names the file once, however often an error passes through it, and leaves an error
// that is not about a damaged file as it is.
func TestInFileNamesTheFileOnce(t *testing.T) {
	const path = "/state/cfguard.db"
	err := InFile(path, InFile(path, Corruptf("page 3: checksum mismatch")))
	var ce *CorruptError
	if !errors.As(err, &ce) || strings.Count(err.Error(), "ledger corrupt: "+path+": page 3: checksum mismatch.") != 1 {
		t.Fatalf("InFile twice: %v, want one *CorruptError naming %s once", err, path)
	}
	if _, nested := ce.Detail.(*CorruptError); nested {
		t.Fatalf("InFile wrapped a *CorruptError in another: %#v", ce)
	}
	plain := errors.New("disk on fire")
	if got := InFile(path, plain); got != plain {
		t.Fatalf("InFile of an error that is not ErrCorrupt: %v (%T), want it unchanged", got, got)
	}
	if InFile(path, nil) != nil {
		t.Fatal("InFile(nil) is not nil")
	}
}

// Reason drops the "ledger corrupt: " prefix of an error made by Corruptf, and nothing else: an
// error that wraps one keeps its own context.
func TestReason(t *testing.T) {
	if got := Reason(Corruptf("anchor %d: %d bytes", 7, 3)); got != "anchor 7: 3 bytes" {
		t.Errorf("Reason of a Corruptf error: %q", got)
	}
	wrapped := fmt.Errorf("ledger: verify: %w", Corruptf("bbolt check: page 9 unreachable"))
	if got := Reason(wrapped); got != "ledger: verify: ledger corrupt: bbolt check: page 9 unreachable" {
		t.Errorf("Reason of a wrapped Corruptf error: %q, want it whole", got)
	}
}

// TestInRecord: InRecord of no error is no error (a decode that succeeded), and an error made by
// Corruptf stays one, prefixed with the record.
func TestInRecord(t *testing.T) {
	if err := InRecord(nil, "anchor %d", 7); err != nil {
		t.Fatalf("InRecord(nil) = %v, want nil", err)
	}
	err := InRecord(Corruptf("3 bytes"), "anchor %d", 7)
	if !errors.Is(err, ErrCorrupt) || Reason(err) != "anchor 7: 3 bytes" {
		t.Fatalf("InRecord of a Corruptf error: %v (reason %q), want ErrCorrupt with reason %q", err, Reason(err), "anchor 7: 3 bytes")
	}
}
