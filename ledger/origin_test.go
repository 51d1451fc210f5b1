package ledger

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/certify"
)

// Open refuses a ledger whose first posterior came from another origin than Options.Origin
// before it writes anything: a configuration refused for its model.* keys that also changes
// the certificate policy must not rebuild the indexes and re-judge the CEs under that policy.
// A ledger with no origin yet, or the same one, opens.
func TestOpenRefusesAnotherOriginWritingNothing(t *testing.T) {
	dir := t.TempDir()
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), Origin: "first"})
	if err != nil {
		t.Fatalf("a new ledger, which records no origin: %v", err)
	}
	if err := l.Checkpoint(&Checkpoint{Model: testModel(4), Origin: "first"}); err != nil {
		t.Fatal(err)
	}
	policy := func(l *Ledger) string {
		var fp string
		if err := l.view(func(tx *bolt.Tx) error {
			v, err := getSealed(tx.Bucket(bMeta), kPolicy, "meta policy")
			fp = string(v)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return fp
	}
	before := policy(l)
	l.Close()

	other := testPolicy()
	other.Mode = certify.Tight
	_, err = Open(dir, Options{Policy: other, Logger: quietLogger(), Origin: "second"})
	var refused *OriginError
	if !errors.As(err, &refused) || !errors.Is(err, ErrOrigin) || refused.Have != "first" || refused.Want != "second" {
		t.Fatalf("Open with another origin: %v, want an *OriginError naming first and second", err)
	}
	// Opened again as before the refusal: the indexes were built for this policy, so nothing is
	// rebuilt (a refused Open that had rebuilt them for its own would show as a policy change).
	var logs bytes.Buffer
	l, err = Open(dir, Options{Policy: testPolicy(), Logger: slog.New(slog.NewTextHandler(&logs, nil)), Origin: "first"})
	if err != nil {
		t.Fatalf("Open with the ledger's origin: %v", err)
	}
	defer l.Close()
	if after := policy(l); after != before || strings.Contains(logs.String(), "policy changed") {
		t.Fatalf("the refused Open rebuilt the indexes for its policy: now %q, was %q; log:\n%s", after, before, logs.String())
	}
}
