package ledger

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger/store"
)

// fixedClock is a deterministic clock: each call advances one second.
func fixedClock() func() time.Time {
	t := time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)
	return func() time.Time { t = t.Add(time.Second); return t }
}

// encodeChangeJSON is an Options.EncodeChange for tests: key = CE id, value = the change as JSON.
func encodeChangeJSON(ch StatusChange) OutboxEntry {
	v, _ := json.Marshal(ch)
	return OutboxEntry{Key: ch.ID, Value: v}
}

// richLedger builds, in dir, a ledger with a posterior, two live anchors, CEs in every status,
// offsets, counters, a KL history and outbox entries. It returns the last posterior.
func richLedger(t testing.TB, dir string) *bnn.Model {
	t.Helper()
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), Now: fixedClock(), EncodeChange: encodeChangeJSON})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	m0 := testModel(4)
	if err := l.Checkpoint(&Checkpoint{Model: m0, Origin: "test:testModel(4)"}); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(21, 21))
	var ces []*CE
	for i := 0; i < 30; i++ {
		c := newCE(t, m0, rng)
		c.ID = fmt.Sprintf("rich-a-%02d", i)
		if i%10 == 9 {
			c.P1 = 0.9 // uncertified
		}
		ces = append(ces, c)
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	m1 := drift(m0, -0.01) // past the variance ceiling of anchor 0: its CEs at_risk
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m1, Offsets: map[int]int64{0: 40, 3: 9}, Applied: 40,
		Counters: map[string]int64{"dead_lettered": 3}, Update: &UpdateRecord{Version: m1.Version, KL: 0.005, Outcome: certify.OutcomePromoted},
		Events: []OutboxEntry{{Key: "kl", Value: []byte(`{"type":"update"}`)}}}); err != nil {
		t.Fatal(err)
	}
	confirmAll(t, l, m1, 200, 1)
	ces = nil
	for i := 0; i < 20; i++ {
		c := newCE(t, m1, rng)
		c.ID = fmt.Sprintf("rich-b-%02d", i)
		ces = append(ces, c)
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	m2 := toBias(m1, -0.19) // many invalidated
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m2, Offsets: map[int]int64{0: 80}, Applied: 40,
		Update: &UpdateRecord{Version: m2.Version, KL: 0.3, Outcome: certify.OutcomeClipped}}); err != nil {
		t.Fatal(err)
	}
	confirmAll(t, l, m2, 200, 2)
	m3 := toBias(m2, 3.95) // back near anchor 1: its CEs certified again
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m3, Offsets: map[int]int64{0: 90}, Applied: 10,
		Update: &UpdateRecord{Version: m3.Version, KL: 0.3, Outcome: certify.OutcomePromoted}}); err != nil {
		t.Fatal(err)
	}
	confirmAll(t, l, m3, 200, 3)
	if err := l.Delete("rich-a-03"); err != nil {
		t.Fatal(err)
	}
	if err := l.Checkpoint(&Checkpoint{Offsets: map[int]int64{0: 95}, Counters: map[string]int64{"held": 5},
		Update: &UpdateRecord{Version: m3.Version + 1, KL: 0.9, Outcome: certify.OutcomeRejected}}); err != nil {
		t.Fatal(err)
	}
	if err := l.AckOutbox(2); err != nil {
		t.Fatal(err)
	}
	return m3
}

// snapshot reads everything a ledger holds (and a re-certification against a nearby posterior)
// into one string; any error is returned.
func snapshot(l *Ledger) (string, error) {
	st, err := l.State()
	if err != nil {
		return "", err
	}
	cur, err := l.Current()
	if err != nil && !errors.Is(err, ErrNoPosterior) {
		return "", err
	}
	var blob []byte
	if cur != nil {
		if blob, err = encodeModel(cur); err != nil {
			return "", err
		}
	}
	var all []*CE
	for after := ""; ; {
		page, err := l.List(0, 7, after)
		if err != nil {
			return "", err
		}
		if len(page) == 0 {
			break
		}
		all = append(all, page...)
		after = page[len(page)-1].ID
	}
	an, err := l.Anchors()
	if err != nil {
		return "", err
	}
	hist, err := l.KLHistory(0)
	if err != nil {
		return "", err
	}
	out, err := l.Outbox(0, 0)
	if err != nil {
		return "", err
	}
	origin, err := l.Origin()
	if err != nil {
		return "", err
	}
	var rep Report
	var changes []StatusChange
	if cur != nil {
		if rep, changes, err = l.Recertify(bg, drift(cur, -0.002)); err != nil {
			return "", err
		}
		rep.Duration = 0
		for i := range changes {
			changes[i].At = time.Time{}
		}
	}
	b, err := json.Marshal([]any{st, fmt.Sprintf("%x", sha256.Sum256(blob)), all, an, hist, out, origin, rep, changes})
	return string(b), err
}

func fileHash(t *testing.T, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

// checkCorruptError checks what every refusal of a damaged file must say.
func checkCorruptError(t *testing.T, err error, path, what string) {
	t.Helper()
	msg := err.Error()
	var ce *CorruptError
	switch {
	case !errors.Is(err, ErrCorrupt) || !errors.As(err, &ce):
		t.Fatalf("%s: error %v does not wrap ErrCorrupt as a *CorruptError", what, err)
	case !strings.Contains(msg, path):
		t.Fatalf("%s: error does not name %s: %v", what, path, err)
	case !strings.Contains(msg, "cfguard restore") || !strings.Contains(msg, "move the file aside"):
		t.Fatalf("%s: error does not say how to recover: %v", what, err)
	case strings.Contains(msg, bnn.SidecarFile) || strings.Contains(msg, bnn.WeightsFile) || errors.Is(err, bnn.ErrModelFile):
		t.Fatalf("%s: a damaged ledger reported as a model file: %v", what, err)
	}
}

// faultOutcome is what a damaged file led to.
type faultOutcome string

const (
	refused     faultOutcome = "refused at Open"
	readErr     faultOutcome = "error on read"
	intact      faultOutcome = "intact"
	quarantined faultOutcome = "quarantined, rebuilt or deleted at Open"
)

// faultTrial installs data as a ledger in a fresh directory, opens it and reads everything.
// It must refuse or fail naming the file (and then the file must be unchanged), read exactly ref
// (never the previous transaction: see olderDamaged), or quarantine damaged CEs: then Damaged
// counts them, every invariant holds, and every other CE reads exactly as in ref.
func faultTrial(t *testing.T, what string, data []byte, ref string) (outcome faultOutcome) {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, FileName)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	before := fileHash(t, path)
	defer func() {
		if outcome != quarantined && fileHash(t, path) != before {
			t.Fatalf("%s: the damaged file was written to", what)
		}
	}()
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), Now: fixedClock()})
	if err != nil {
		checkCorruptError(t, err, path, what)
		return refused
	}
	defer l.Close()
	if l.Created() {
		t.Fatalf("%s: Open says it created an existing file", what)
	}
	if n := l.Damaged(); n > 0 {
		checkQuarantine(t, what, l, ref, n)
		return quarantined
	}
	snap, err := snapshot(l)
	switch {
	case err != nil:
		checkCorruptError(t, err, path, what)
		return readErr
	case snap == ref && l.repairs.IndexEntries == 0 && l.repairs.AnchorKLHistories+l.repairs.AnchorKLStrays == 0:
		return intact
	case l.repairs.AnchorKLHistories+l.repairs.AnchorKLStrays > 0 && l.repairs.IndexEntries == 0:
		// A deleted anchor KL history: the same data, less the lapse versions it gave.
		checkInvariants(t, l)
		since := regexp.MustCompile(`"renewal_pending_since":\d+,`)
		if since.ReplaceAllString(snap, "") == since.ReplaceAllString(ref, "") {
			return quarantined
		}
	case l.repairs.IndexEntries > 0:
		// Rebuilt indexes: the same data, one generation later.
		checkInvariants(t, l)
		gen := regexp.MustCompile(`"generation":\d+`)
		if gen.ReplaceAllString(snap, "") == gen.ReplaceAllString(ref, "") {
			return quarantined
		}
	}
	t.Fatalf("%s: read different data without an error:\n got %.600s\nwant %.600s", what, snap, ref)
	return ""
}

// checkQuarantine checks a ledger that quarantined n damaged CEs at Open: its invariants hold,
// n CEs of ref are missing, each quarantined one answers ErrQuarantined, and the others read as
// in ref.
func checkQuarantine(t *testing.T, what string, l *Ledger, ref string, n int) {
	t.Helper()
	checkInvariants(t, l)
	var parts []json.RawMessage
	var want []*CE
	if err := json.Unmarshal([]byte(ref), &parts); err != nil || json.Unmarshal(parts[2], &want) != nil {
		t.Fatalf("reference snapshot: %v", err)
	}
	got, err := l.List(0, 10000, "")
	if err != nil {
		t.Fatalf("%s: List after quarantine: %v", what, err)
	}
	byID := map[string]*CE{}
	for _, ce := range got {
		byID[ce.ID] = ce
	}
	missing := 0
	for _, w := range want {
		g, ok := byID[w.ID]
		if !ok {
			missing++
			if _, err := l.Get(w.ID); !errors.Is(err, ErrQuarantined) {
				t.Fatalf("%s: Get(%q) of a quarantined CE: %v, want ErrQuarantined", what, w.ID, err)
			}
			continue
		}
		gj, _ := json.Marshal(g)
		wj, _ := json.Marshal(w)
		if string(gj) != string(wj) {
			t.Fatalf("%s: %s after quarantine:\n got %s\nwant %s", what, w.ID, gj, wj)
		}
	}
	// Damaged counts quarantined records: one per damaged CE, or two when a flip hit a header's
	// key (the header under the changed key has no body, the body has no header), of which only
	// the original CE was in ref.
	if missing < 1 || missing > n || len(got)+missing != len(want) {
		t.Fatalf("%s: %d CEs listed and %d missing of %d; Damaged() = %d", what, len(got), missing, len(want), n)
	}
}

// faultFixture is a closed rich ledger's bytes, what it reads back, and what it read back before
// its last transaction.
type faultFixture struct {
	data      []byte
	ref, prev string
	pageSize  int
	lastSlot  int      // meta page of the last transaction
	inUse     []uint64 // pages the last transaction reads (store.Layout.InUse)
}

func buildFaultFixture(t *testing.T) faultFixture {
	t.Helper()
	dir := t.TempDir()
	richLedger(t, dir)
	read := func() string {
		l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), Now: fixedClock()})
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		s, err := snapshot(l)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	var fx faultFixture
	fx.prev = read()
	// The last transaction: one counter.
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), Now: fixedClock()})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Checkpoint(&Checkpoint{Counters: map[string]int64{"final": 1}}); err != nil {
		t.Fatal(err)
	}
	l.Close()
	fx.ref = read()
	if fx.ref == fx.prev {
		t.Fatal("the last transaction changed nothing visible")
	}
	var err2 error
	if fx.data, err2 = os.ReadFile(filepath.Join(dir, FileName)); err2 != nil {
		t.Fatal(err2)
	}
	f, _ := os.Open(filepath.Join(dir, FileName))
	lo, err := store.Inspect(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	fx.pageSize, fx.lastSlot, fx.inUse = lo.PageSize, lo.MetaPage, lo.InUse
	return fx
}

// A truncated ledger (bbolt panics on these: "assertion failed: Page expected to be") is refused
// at every size, without a panic and without a write; an empty one (0 bytes) too, never taken for
// a first start (store's TestOpenEmptyFileRefused says more).
func TestOpenTruncatedRefused(t *testing.T) {
	fx := buildFaultFixture(t)
	n := len(fx.data)
	sizes := []int{0, 1, 100, 1023, 4095, 4096, 4097, 8191, 8192, 100000, n - 1}
	for p := 3; p < n/fx.pageSize; p++ {
		sizes = append(sizes, p*fx.pageSize, p*fx.pageSize+fx.pageSize/2)
	}
	out := map[faultOutcome]int{}
	for _, size := range sizes {
		if size >= n {
			continue
		}
		o := faultTrial(t, fmt.Sprintf("truncated to %d of %d bytes", size, n), fx.data[:size], fx.ref)
		out[o]++
	}
	t.Logf("%d truncations of a %d-byte ledger: %v", len(sizes), n, out)
	// The tail beyond the last transaction's high-water mark may be free space bbolt grew into;
	// every cut below it must be refused at Open, before bbolt reads a byte.
	if out[intact] > 0 && out[refused] == 0 {
		t.Fatal("no truncation was refused")
	}
}

// Random byte flips in the pages of a real ledger's last transaction (its meta pages and the
// pages its tree reaches: a byte anywhere else is never read): each either leaves the data intact
// (slack in a page), is reported naming cfguard.db (at Open or on read), or quarantines the CEs
// it damaged; a flip in the newest meta page is refused at Open rather than falling back to the
// previous transaction as bbolt would. Never a panic, never silently different data, never a
// write to the damaged file.
func TestRandomByteFlips(t *testing.T) {
	fx := buildFaultFixture(t)
	seeds := 200
	if testing.Short() {
		seeds = 40
	}
	out := map[faultOutcome]int{}
	for seed := 0; seed < seeds; seed++ {
		rng := rand.New(rand.NewPCG(uint64(seed), 0xf11b))
		data := append([]byte(nil), fx.data...)
		page := int(fx.inUse[rng.IntN(len(fx.inUse))])
		off := page*fx.pageSize + rng.IntN(fx.pageSize)
		bit := byte(1) << rng.IntN(8)
		data[off] ^= bit
		o := faultTrial(t, fmt.Sprintf("seed %d: bit %#02x flipped at offset %d (page %d)", seed, bit, off, page),
			data, fx.ref)
		t.Logf("seed %d: offset %d (page %d): %s", seed, off, page, o)
		out[o]++
	}
	t.Logf("%d flips in the %d pages in use of a %d-byte ledger: %v", seeds, len(fx.inUse), len(fx.data), out)
	if out[intact] == seeds {
		t.Fatal("no flip was detected: the test is not reaching the data")
	}
}

// Every byte of every non-free page flipped in turn would take too long; flipping each page's
// header and a few bytes of each used page covers every kind of page.
func TestFlipEveryPage(t *testing.T) {
	if testing.Short() {
		t.Skip("many opens")
	}
	fx := buildFaultFixture(t)
	out := map[faultOutcome]int{}
	rng := rand.New(rand.NewPCG(5, 5))
	for p := 0; p < len(fx.data)/fx.pageSize; p++ {
		for _, o := range []int{0, 8, 10, 12, 16, 20, 24 + rng.IntN(fx.pageSize-24)} {
			off := p*fx.pageSize + o
			data := append([]byte(nil), fx.data...)
			data[off] ^= 0x10
			out[faultTrial(t, fmt.Sprintf("page %d byte %d", p, o), data, fx.ref)]++
		}
	}
	t.Logf("page flips: %v", out)
}

// A damaged posterior inside the ledger is reported as the ledger's record, not as a model file.
func TestDamagedPosteriorNamesTheRecord(t *testing.T) {
	l, dir := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	path := l.Path()
	l.Close()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// Change one digit of the sidecar's posterior_version in the stored blob: still valid JSON.
	i := bytes.Index(data, []byte(`"posterior_version": 0`))
	if i < 0 {
		t.Fatal("posterior blob not found in the file")
	}
	data[i+len(`"posterior_version": `)] = '7'
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = Open(dir, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err == nil {
		t.Fatal("Open accepted a changed posterior")
	}
	checkCorruptError(t, err, path, "posterior digit")
	if !strings.Contains(err.Error(), "posterior version 0") {
		t.Errorf("error does not name the record: %v", err)
	}
}
