package ledger

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/certify"
)

// schema1Snapshot is what the schema-1 code read back from testdata/schema1.db.
type schema1Snapshot struct {
	State          State     `json:"state"`
	CEs            []*CE     `json:"ces"`
	Anchors        []Anchor  `json:"anchors"`
	KLHistory      []KLEntry `json:"kl_history"`
	CurrentVersion uint64    `json:"current_version"`
	CurrentBias    []float64 `json:"current_bias"`
}

// A ledger written by the schema-1 code opens: it is migrated in one transaction (checksums,
// format-2 headers, indexes) and reads back what the schema-1 code read, field by field. Its
// at_risk CEs are unconfirmed (schema 1 did not record the version of their Monte-Carlo
// verdict), and the migrated file passes the full check.
func TestMigrateSchema1(t *testing.T) {
	var want schema1Snapshot
	dir, path, data := copyTestdata(t, "schema1", &want)
	if info, err := Verify(path); err != nil || info.Schema != 1 {
		t.Fatalf("Verify of the schema-1 file: %+v, %v", info, err)
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
	ws := want.State
	if st.PosteriorVersion != ws.PosteriorVersion || st.Applied != ws.Applied || !reflect.DeepEqual(st.Offsets, ws.Offsets) ||
		!reflect.DeepEqual(st.Counters, ws.Counters) || !equalCounts(st.Counts, ws.Counts) || st.Anchors != ws.Anchors || st.OutboxLen != 0 {
		t.Fatalf("state after migration %+v\nschema 1 read %+v", st, ws)
	}
	cur, err := l.Current()
	if err != nil || cur.Version != want.CurrentVersion || !reflect.DeepEqual(cur.Last().BiasMu, want.CurrentBias) {
		t.Fatalf("current posterior %v (%v), want version %d bias %v", cur, err, want.CurrentVersion, want.CurrentBias)
	}
	an, _ := l.Anchors()
	if !reflect.DeepEqual(an, want.Anchors) {
		t.Fatalf("anchors %+v\nwant %+v", an, want.Anchors)
	}
	hist, _ := l.KLHistory(0)
	if !reflect.DeepEqual(hist, want.KLHistory) {
		t.Fatalf("kl history %+v\nwant %+v", hist, want.KLHistory)
	}
	all, err := l.List(0, 1000, "")
	if err != nil || len(all) != len(want.CEs) {
		t.Fatalf("%d CEs (%v), schema 1 had %d", len(all), err, len(want.CEs))
	}
	for i, got := range all {
		w := want.CEs[i]
		if got.ConfirmedVersion != nil {
			t.Errorf("%s: confirmed at %d after migration; schema 1 recorded no version", got.ID, *got.ConfirmedVersion)
		}
		got.ConfirmedVersion = nil
		// Schema 1 recorded no verdicts: a certificate that holds is decided, an at_risk or
		// invalidated CE waits for its first verdict.
		w.Decided = w.Status == certify.Certified && !w.RenewalPending
		w.VerdictPending = w.Status == certify.AtRisk || w.Status == certify.Invalidated
		w.PosteriorVersion = cur.Version // the version a read judges at, which that build did not report
		if !reflect.DeepEqual(got, w) {
			g, _ := json.Marshal(got)
			e, _ := json.Marshal(w)
			t.Fatalf("CE %d after migration:\n%s\nschema 1 read:\n%s", i, g, e)
		}
	}
	checkInvariants(t, l)
	// It works: the at_risk CEs get verdicts, an update re-certifies through the indexes.
	confirmAll(t, l, cur, 100, 1)
	if after, _ := l.List(0, 1000, ""); len(after) == len(all) {
		for _, ce := range after {
			if (ce.Status == certify.AtRisk || ce.Status == certify.Invalidated) && (ce.ConfirmedVersion == nil || *ce.ConfirmedVersion != cur.Version) {
				t.Fatalf("%s is %v without a verdict at version %d after Confirm", ce.ID, ce.Status, cur.Version)
			}
		}
	}
	rep, _, err := l.Commit(bg, &Checkpoint{Model: drift(cur, -0.0001)})
	if err != nil || rep.Checked != len(all)-want.State.Counts[certify.Uncertified] {
		t.Fatalf("commit after migration: %+v, %v", rep, err)
	}
	checkInvariants(t, l)
	// The fixture itself was not touched.
	if now, _ := os.ReadFile("testdata/schema1.db"); !reflect.DeepEqual(now, data) {
		t.Fatal("testdata/schema1.db changed")
	}
}

// A ledger written by a newer schema is refused, saying which schema it has and which this
// build reads, and it is not written to (a migration or a rebuild would damage it).
func TestNewerSchemaRefused(t *testing.T) {
	for _, schema := range []uint64{schemaVersion + 1, 1 << 40} {
		t.Run(fmt.Sprint(schema), func(t *testing.T) {
			l, dir := openTest(t, Options{Policy: testPolicy()})
			install(t, l, testModel(0))
			if err := l.update(func(tx *bolt.Tx) error { return putU64(tx.Bucket(bMeta), kSchema, schema) }); err != nil {
				t.Fatal(err)
			}
			l.Close()
			path := filepath.Join(dir, FileName)
			before := fileHash(t, path)
			l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger()})
			if err == nil {
				l.Close()
				t.Fatalf("Open accepted a ledger of schema %d", schema)
			}
			msg := err.Error()
			for _, want := range []string{path, fmt.Sprintf("has schema %d", schema), fmt.Sprintf("reads schemas 1 and %d", schemaVersion), "newer cfguard"} {
				if !strings.Contains(msg, want) {
					t.Errorf("the refusal does not say %q: %v", want, err)
				}
			}
			if fileHash(t, path) != before {
				t.Fatal("the newer ledger was written to")
			}
			if !errors.Is(err, ErrNewerSchema) || errors.Is(err, ErrCorrupt) {
				t.Errorf("Open of a ledger of schema %d: %v; want ErrNewerSchema, not a damaged file", schema, err)
			}
			// As a backup, it is refused by Restore for the same reason, not as a damaged one:
			// another backup of the same daemon has the same schema, so the remedy is the
			// newer cfguard.
			_, err = Restore(path, filepath.Join(t.TempDir(), "state"))
			if !errors.Is(err, ErrNewerSchema) || errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "the cfguard that wrote it") ||
				strings.Contains(err.Error(), "another backup") {
				t.Errorf("Restore of a ledger of schema %d: %v; want ErrNewerSchema naming the newer cfguard, not a damaged backup", schema, err)
			}
		})
	}
}

// A ledger whose indexes have a newer layout than this build's is a ledger of a newer cfguard to
// Verify (and so to Restore), not a damaged one; a layout that is no layout is damage.
func TestNewerIndexLayoutRefused(t *testing.T) {
	for _, tc := range []struct {
		layout string
		newer  bool
	}{{"v9", true}, {"vx", false}} {
		t.Run(tc.layout, func(t *testing.T) {
			l, dir := openTest(t, Options{Policy: testPolicy()})
			install(t, l, testModel(0))
			fp := strings.Replace(policyFingerprint(testPolicy()), "index "+indexLayout, "index "+tc.layout, 1)
			if err := l.update(func(tx *bolt.Tx) error { return putSealed(tx.Bucket(bMeta), kPolicy, []byte(fp)) }); err != nil {
				t.Fatal(err)
			}
			l.Close()
			_, err := Verify(filepath.Join(dir, FileName))
			if errors.Is(err, ErrNewerSchema) != tc.newer || errors.Is(err, ErrCorrupt) == tc.newer {
				t.Errorf("Verify of index layout %s: %v; want a newer cfguard's ledger %v, damage %v", tc.layout, err, tc.newer, !tc.newer)
			}
		})
	}
}
