package ledger

import (
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"strings"
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

// Verify reads the prequential records as it reads every other record: a damaged one, or one
// that belongs to no KL history entry written, fails it with an error naming the record.
func TestVerifyChecksQualityRecords(t *testing.T) {
	for _, tc := range []struct {
		name, want string
		damage     func(t *testing.T, l *Ledger)
	}{
		{"damaged", "quality record 0000000000000002: checksum mismatch", func(t *testing.T, l *Ledger) {
			damageValue(t, l, bQuality, string(u64bytes(2)))
		}},
		{"ahead of the KL history", "quality record 9", func(t *testing.T, l *Ledger) {
			if err := l.update(func(tx *bolt.Tx) error { return putSealed(tx.Bucket(bQuality), u64bytes(9), []byte("{}")) }); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, _ := qualityLedger(t)
			if got := qualitySeqs(t, l); !reflect.DeepEqual(got, []uint64{1, 2, 3}) {
				t.Fatalf("prequential records %v, want 1, 2 and 3", got)
			}
			tc.damage(t, l)
			l.Close()
			_, err := Verify(l.Path())
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Verify of a ledger with a %s prequential record = %v; want a *CorruptError saying %q", tc.name, err, tc.want)
			}
		})
	}
}

// A damaged prequential record does not stop Open: it only feeds the daemon's prequential
// scores, so Open drops it, names it in an ERROR line, and the records kept read back; the
// ledger then passes Verify.
func TestOpenDropsDamagedQualityRecord(t *testing.T) {
	l, dir := qualityLedger(t)
	damageValue(t, l, bQuality, string(u64bytes(2)))
	l.Close()
	var log strings.Builder
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		t.Fatalf("Open with a damaged prequential record: %v", err)
	}
	defer l.Close()
	if got := qualitySeqs(t, l); !reflect.DeepEqual(got, []uint64{1, 3}) {
		t.Fatalf("prequential records after Open %v, want 1 and 3", got)
	}
	if !strings.Contains(log.String(), "level=ERROR") || !strings.Contains(log.String(), "seq=2") {
		t.Fatalf("the log does not name the dropped record at ERROR:\n%s", log.String())
	}
	if n := l.Damaged(); n != 0 {
		t.Fatalf("Damaged() = %d, want 0: it counts counterfactuals", n)
	}
	checkInvariants(t, l)
	l.Close()
	if _, err := Verify(l.Path()); err != nil {
		t.Fatalf("Verify after Open dropped the record: %v", err)
	}
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
