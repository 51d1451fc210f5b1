package ledger

import (
	"fmt"
	"reflect"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/certify"
)

// qualityLedger opens a ledger in a fresh directory and commits three updates, each with its
// prequential record (KL history sequence numbers 1, 2 and 3).
func qualityLedger(t *testing.T) (*Ledger, string) {
	t.Helper()
	dir := t.TempDir()
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	m := testModel(4)
	install(t, l, m)
	for i := 1; i <= 3; i++ {
		m = drift(m, 0.001)
		up := &UpdateRecord{Version: m.Version, KL: 1e-4, Outcome: certify.OutcomePromoted, Quality: fmt.Appendf(nil, `{"n":%d}`, i)}
		if _, _, err := l.Commit(bg, &Checkpoint{Model: m, Update: up}); err != nil {
			t.Fatal(err)
		}
	}
	return l, dir
}

func qualitySeqs(t *testing.T, l *Ledger) []uint64 {
	t.Helper()
	recs, err := l.Quality(0)
	if err != nil {
		t.Fatal(err)
	}
	var seqs []uint64
	for _, r := range recs {
		seqs = append(seqs, r.Seq)
	}
	return seqs
}

// The trim of the prequential records meets a key that is not a sequence number (damaged
// after Open) without failing: it deletes it, as Open would.
func TestQualityTrimMeetsAShortKey(t *testing.T) {
	l, _ := qualityLedger(t)
	defer l.Close()
	if err := l.update(func(tx *bolt.Tx) error { return tx.Bucket(bQuality).Put([]byte{0, 0, 0}, []byte("x")) }); err != nil {
		t.Fatal(err)
	}
	cur, _ := l.Current()
	m := drift(cur, 0.001)
	up := &UpdateRecord{Version: m.Version, KL: 1e-4, Outcome: certify.OutcomePromoted, Quality: []byte(`{"n":4}`)}
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m, Update: up}); err != nil {
		t.Fatal(err)
	}
	if got := qualitySeqs(t, l); !reflect.DeepEqual(got, []uint64{1, 2, 3, 4}) {
		t.Fatalf("prequential records %v, want 1 to 4", got)
	}
	checkInvariants(t, l)
}
