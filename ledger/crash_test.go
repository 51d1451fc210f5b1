package ledger

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"
	"time"

	"github.com/cfguard/cfguard/certify"
)

const crashDirEnv = "CFGUARD_LEDGER_CRASH_DIR"

// TestCrashWriter is the child of TestKilledMidCheckpoint: it commits posterior updates, each
// checkpoint recording offset = posterior version and an "update" event with the version, and
// confirms the CEs whose bound fails after each, until killed (or 30 s pass). Every status change
// goes to the outbox (EncodeChange).
func TestCrashWriter(t *testing.T) {
	dir := os.Getenv(crashDirEnv)
	if dir == "" {
		t.Skip("child process of TestKilledMidCheckpoint")
	}
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), EncodeChange: encodeChangeJSON})
	if err != nil {
		t.Fatal(err)
	}
	m, err := l.Current()
	if err != nil {
		m = testModel(4)
		install(t, l, m)
	}
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	deadline := time.Now().Add(30 * time.Second)
	for step := 0; time.Now().Before(deadline); step++ {
		if step%3 == 0 { // keep registering, so anchors and counts keep changing
			if err := l.Put(bg, newCE(t, m, rng), newCE(t, m, rng)); err != nil {
				t.Fatal(err)
			}
		}
		m = drift(m, -0.02*rng.Float64()+0.004) // some steps flip statuses, both ways
		_, _, err := l.Commit(context.Background(), &Checkpoint{Model: m, Offsets: map[int]int64{0: int64(m.Version)}, Applied: 1,
			Update: &UpdateRecord{Version: m.Version, KL: 1e-4, Outcome: certify.OutcomePromoted},
			Events: []OutboxEntry{{Key: "update", Value: []byte(fmt.Sprint(m.Version))}}})
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("committed %d\n", m.Version)
		confirmAll(t, l, m, 20, m.Version)
	}
}

// A writer killed with SIGKILL at arbitrary points leaves a ledger in which every checkpoint is
// all-or-nothing: posterior version, offsets and applied count agree, per-status counts match a
// scan, anchor references match the CEs holding certificates, and every CE reads back.
func TestKilledMidCheckpoint(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills child processes")
	}
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(42, 42))
	var lastSeen int64
	for round := 0; round < 8; round++ {
		ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestCrashWriter$", "-test.count=1")
		cmd.Env = append(os.Environ(), crashDirEnv+"="+dir)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Let it commit a few steps, then kill it at a random moment of a later one.
		sc := bufio.NewScanner(out)
		seen, want := 0, 3+rng.IntN(5)
		for seen < want && sc.Scan() {
			if strings.HasPrefix(sc.Text(), "committed ") {
				seen++
			}
		}
		time.Sleep(time.Duration(rng.IntN(4000)) * time.Microsecond)
		cmd.Process.Kill()
		cmd.Wait()
		cancel()
		if seen < want {
			t.Fatalf("round %d: child committed only %d steps before exiting", round, seen)
		}
		v := checkConsistent(t, dir)
		if v < lastSeen {
			t.Fatalf("round %d: posterior version went back from %d to %d", round, lastSeen, v)
		}
		t.Logf("round %d: killed after %d commits seen; reopened at posterior version %d", round, seen, v)
		lastSeen = v
	}
}

// checkConsistent opens the ledger in dir and checks its invariants; it returns the version.
func checkConsistent(t *testing.T, dir string) int64 {
	t.Helper()
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	st, err := l.State()
	if err != nil {
		t.Fatal(err)
	}
	if !st.HasPosterior || st.Offsets[0] != int64(st.PosteriorVersion) || st.Applied != int64(st.PosteriorVersion) {
		t.Fatalf("torn checkpoint: posterior %d, offset %d, applied %d", st.PosteriorVersion, st.Offsets[0], st.Applied)
	}
	if scan := countByScan(t, l); !equalCounts(scan, st.Counts) {
		t.Fatalf("stored counts %v, scan %v", st.Counts, scan)
	}
	refs := map[uint64]int{}
	all, err := l.List(0, 10000, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, ce := range all {
		if ce.Status != certify.Uncertified {
			refs[ce.AnchorVersion]++
		}
	}
	anchors, err := l.Anchors()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range anchors {
		if a.Refs != refs[a.Version] || (a.Refs == 0 && a.Version != st.PosteriorVersion) {
			t.Fatalf("anchor %d has %d refs, CEs hold %d", a.Version, a.Refs, refs[a.Version])
		}
		delete(refs, a.Version)
	}
	if len(refs) != 0 {
		t.Fatalf("CEs refer to anchors that are not stored: %v", refs)
	}
	hist, err := l.KLHistory(1)
	if err != nil || len(hist) != 1 || hist[0].PosteriorVersion != st.PosteriorVersion {
		t.Fatalf("last KL step %+v (%v), posterior %d", hist, err, st.PosteriorVersion)
	}
	checkInvariants(t, l)
	checkOutbox(t, l, all, st.PosteriorVersion)
	// The ledger keeps working after the crash.
	cur, err := l.Current()
	if err != nil || cur.Version != st.PosteriorVersion {
		t.Fatalf("current posterior: %v, %v; state says version %d", cur, err, st.PosteriorVersion)
	}
	if _, _, err := l.Recertify(context.Background(), drift(cur, -0.001)); err != nil {
		t.Fatal(err)
	}
	return int64(st.PosteriorVersion)
}

// checkInvariants runs the full record check Verify runs on the open ledger.
func checkInvariants(t testing.TB, l *Ledger) {
	t.Helper()
	var info Info
	if err := l.view(func(tx *bolt.Tx) error { return l.checkAll(tx, &info) }); err != nil {
		t.Fatal(err)
	}
}

// checkOutbox checks that the outbox holds every status change the CEs' histories record and one
// "update" event per committed posterior version 1..version, with contiguous sequence numbers.
func checkOutbox(t *testing.T, l *Ledger, all []*CE, version uint64) {
	t.Helper()
	out, err := l.Outbox(0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := l.OutboxLen(); n != len(out) {
		t.Fatalf("OutboxLen %d, Outbox returned %d", n, len(out))
	}
	changes := map[string]int{}
	updates := map[uint64]int{}
	for i, e := range out {
		if e.Seq != uint64(i+1) {
			t.Fatalf("outbox entry %d has seq %d: not contiguous", i, e.Seq)
		}
		if e.Key == "update" {
			var v uint64
			fmt.Sscan(string(e.Value), &v)
			updates[v]++
			continue
		}
		var ch StatusChange
		if err := json.Unmarshal(e.Value, &ch); err != nil || ch.ID != e.Key {
			t.Fatalf("outbox entry %d: %s (%v)", e.Seq, e.Value, err)
		}
		ch.P2 = nil
		b, _ := json.Marshal(ch)
		changes[string(b)]++
	}
	for v := uint64(1); v <= version; v++ {
		if updates[v] != 1 {
			t.Fatalf("the outbox holds %d update events for committed posterior version %d", updates[v], v)
		}
	}
	if len(updates) != int(version) {
		t.Fatalf("the outbox holds update events for %d versions, %d were committed", len(updates), version)
	}
	n := 0
	for _, ce := range all {
		for _, h := range ce.History {
			h.P2 = nil
			b, _ := json.Marshal(h)
			if changes[string(b)] == 0 {
				t.Fatalf("status change %s is in the CE's history but not in the outbox", b)
			}
			n++
		}
	}
	t.Logf("outbox: %d status changes (%d in histories), %d update events", len(out)-len(updates), n, len(updates))
}
