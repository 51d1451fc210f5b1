package ledger

import (
	"os"
	"reflect"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/certify"
)

// A ledger whose indexes have layout v1 (testdata/index1.db: lapses stored in the CEs' headers
// and in idx_fail, certified CEs in idx_cert) verifies as it is, and Open rebuilds its indexes
// without changing what it reads back: every CE's status, lapse, anchor and bound, the counts and
// the renewal backlog are what the code that wrote it read (testdata/index1.json). Afterwards the
// file has the current layout, passes the full check, and the lapsed certificates Confirm finds
// are exactly the CEs read back as renewal pending.
func TestOpenRebuildsIndexLayoutV1(t *testing.T) {
	var want struct {
		State State `json:"state"`
		CEs   []*CE `json:"ces"`
	}
	dir, path, data := copyTestdata(t, "index1", &want)
	info, err := Verify(path)
	if err != nil || !strings.HasPrefix(info.Policy, "index v1;") || !reflect.DeepEqual(info.Counts, want.State.Counts) {
		t.Fatalf("Verify of the layout-v1 file: %+v, %v; want its counts %v", info, err, want.State.Counts)
	}
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), EncodeChange: encodeChangeJSON})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	st, err := l.State()
	if err != nil {
		t.Fatal(err)
	}
	// The verdicts' posterior (version 2) is neither current nor an anchor: after a restart
	// they wait to be measured again, with the lapsed certificates.
	unconfirmed := want.State.Pending + want.State.Counts[certify.AtRisk] + want.State.Counts[certify.Invalidated]
	if !reflect.DeepEqual(st.Counts, want.State.Counts) || st.Pending != want.State.Pending || st.Unconfirmed != unconfirmed || st.Pending == 0 {
		t.Fatalf("after the rebuild: counts %v, pending %d, unconfirmed %d; the file read %v, %d, want %d unconfirmed", st.Counts, st.Pending,
			st.Unconfirmed, want.State.Counts, want.State.Pending, unconfirmed)
	}
	minBound, pending := 1.0, map[string]bool{}
	for _, w := range want.CEs {
		got, err := l.Get(w.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.Status != w.Status || got.RenewalPending != w.RenewalPending || got.AnchorVersion != w.AnchorVersion || got.Bound != w.Bound ||
			got.VarBound != w.VarBound || !reflect.DeepEqual(got.ConfirmedVersion, w.ConfirmedVersion) || len(got.History) != len(w.History) {
			t.Fatalf("counterfactual %s after the rebuild: %+v; the file read %+v", w.ID, got, w)
		}
		if w.Status == certify.Certified && w.Bound >= 0.5 {
			minBound = min(minBound, w.Bound)
		}
		if w.RenewalPending {
			pending[w.ID] = true
		}
	}
	if !st.HasBound || st.MinBound != minBound {
		t.Fatalf("min bound %v (has %v), want %v", st.MinBound, st.HasBound, minBound)
	}
	found := map[string]bool{}
	if err := l.view(func(tx *bolt.Tx) error {
		if n := tx.Bucket(bIdxCert).Stats().KeyN; n != 0 {
			t.Errorf("the rebuild left %d entries in the layout-v1 bucket idx_cert", n)
		}
		return eachLapsed(tx, l.opts.Policy, func(id []byte) error { found[string(id)] = true; return nil })
	}); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(found, pending) {
		t.Fatalf("lapsed certificates by the indexes %v, want %v", found, pending)
	}
	checkInvariants(t, l)
	if now, _ := os.ReadFile("testdata/index1.db"); !reflect.DeepEqual(now, data) {
		t.Fatal("testdata/index1.db changed")
	}
}
