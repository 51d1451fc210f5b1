package postlog

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"maps"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/clusterkey"
)

// testKeys is the cluster key of these tests.
func testKeys() *clusterkey.Keyring {
	k, err := clusterkey.Parse([]byte("t1:"+strings.Repeat("5a", 32)), "test")
	if err != nil {
		panic(err)
	}
	return k
}

// signed is the record at offset with value, authenticated under testKeys.
func signed(offset int64, value []byte) Record {
	return Record{Offset: offset, Value: value, Auth: Sign(testKeys(), value)}
}

// acceptAll offers vals to c at offsets 0, 1, ..., failing the test unless each is accepted.
func acceptAll(t *testing.T, c *Chain, vals ...[]byte) {
	t.Helper()
	for i, v := range vals {
		if _, r, _ := c.Offer(signed(int64(i), v)); r != Accepted {
			t.Fatalf("setup record %d: %s", i, r)
		}
	}
}

// testLog builds a chain's records as a writer would, from a small real model.
type testLog struct {
	t      *testing.T
	models map[uint64]*bnn.Model
}

func newTestLog(t *testing.T) (*testLog, *Entry) {
	t.Helper()
	m := bnn.New(3, []int{4}, []string{"no", "yes"}, 1, rand.New(rand.NewPCG(1, 2)))
	body, err := NewBody(m)
	if err != nil {
		t.Fatal(err)
	}
	sha, err := PosteriorHash(m)
	if err != nil {
		t.Fatal(err)
	}
	l := &testLog{t: t, models: map[uint64]*bnn.Model{0: m}}
	return l, &Entry{Format: Format, Kind: Genesis, Writer: "a/1", Body: body, PosteriorSHA256: sha}
}

func (l *testLog) value(e *Entry) []byte {
	b, err := e.Encode()
	if err != nil {
		l.t.Fatal(err)
	}
	return b
}

// claim returns a claim of term on parent (value bytes pv, entry pe).
func (l *testLog) claim(pv []byte, pe *Entry, term uint64, writer string) *Entry {
	h := Hash(pv)
	return &Entry{Format: Format, Kind: Claim, Seq: pe.Seq + 1, Parent: hex.EncodeToString(h[:]), Term: term, Writer: writer,
		Version: pe.Version, ParentVersion: pe.Version, Covers: pe.Covers, PosteriorSHA256: pe.PosteriorSHA256}
}

// increment returns a promoted increment on parent that moves the last layer's first mean by d.
func (l *testLog) increment(pv []byte, pe *Entry, term uint64, writer string, to int64, d float64) *Entry {
	h := Hash(pv)
	next := l.models[pe.Version].Clone()
	next.Last().WeightMu[0] += d
	next.Version = pe.Version + 1
	l.models[next.Version] = next
	sha, err := PosteriorHash(next)
	if err != nil {
		l.t.Fatal(err)
	}
	return &Entry{Format: Format, Kind: Increment, Seq: pe.Seq + 1, Parent: hex.EncodeToString(h[:]), Term: term, Writer: writer,
		Version: pe.Version + 1, ParentVersion: pe.Version, Covers: map[int]int64{0: to}, Outcome: Promoted,
		LastLayer: LastLayerOf(next), PosteriorSHA256: sha}
}

// edited is e after edit.
func edited(e *Entry, edit func(*Entry)) *Entry {
	edit(e)
	return e
}

func TestFirstValidSuccessorWins(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c1v := l.value(c1)
	i1 := l.increment(c1v, c1, 1, "a/1", 10, 0.1)
	i1v := l.value(i1)
	rival := l.claim(c1v, c1, 2, "b/1") // b claims term 2 on the same head as a's increment
	rivalv := l.value(rival)
	late := l.increment(i1v, i1, 1, "a/1", 20, 0.2) // a appends on, as if it had won
	latev := l.value(late)
	c2 := l.claim(i1v, i1, 2, "b/1") // b claims again on the real head
	c2v := l.value(c2)
	fenced := l.increment(i1v, i1, 1, "a/1", 20, 0.3) // a's append after b's claim: stale term
	i2 := l.increment(c2v, c2, 2, "b/1", 20, 0.4)

	c := NewChain(testKeys())
	for i, tc := range []struct {
		name  string
		value []byte
		want  Reason
	}{
		{"genesis", gv, Accepted},
		{"a second genesis", gv, NotSuccessor},
		{"claim of term 1", c1v, Accepted},
		{"duplicate of the claim", c1v, NotSuccessor},
		{"a's increment", i1v, Accepted},
		{"b's claim on the old head", rivalv, NotSuccessor},
		{"b's claim on the head", c2v, Accepted},
		{"a's increment after b's claim", latev, NotSuccessor},
		{"a's increment named on b's claim's parent", l.value(fenced), NotSuccessor},
		{"b's increment", l.value(i2), Accepted},
		{"not an entry", []byte("{"), Malformed},
	} {
		_, r, err := c.Offer(signed(int64(i), tc.value))
		if err != nil || r != tc.want {
			t.Errorf("%s: Offer = %s, %v, want %s", tc.name, r, err, tc.want)
		}
	}
	if h := c.Head(); h.Seq != 4 || h.Term != 2 || h.Writer != "b/1" || h.Version != 2 || h.Covers[0] != 20 || h.Offset != 9 {
		t.Errorf("head %+v, want seq 4 term 2 writer b/1 version 2 covering 20 at offset 9", h)
	}
}

func TestGenesisOpensNoTerm(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c := NewChain(testKeys())
	if _, r, _ := c.Offer(signed(0, gv)); r != Accepted {
		t.Fatalf("genesis: %s", r)
	}
	if w := c.Head().Writer; w != "" {
		t.Errorf("the genesis head's claimant is %q, want none", w)
	}
	// The genesis's writer has no term to write in: it must claim one first.
	if _, r, _ := c.Offer(signed(1, l.value(l.increment(gv, g, 0, g.Writer, 5, 0.1)))); r != StaleTerm {
		t.Errorf("an increment of term 0 by the genesis's writer: %s, want %s", r, StaleTerm)
	}
}

func TestFencing(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c1v := l.value(c1)
	cases := []struct {
		name string
		e    *Entry
		want Reason
	}{
		{"the claimant's increment", l.increment(c1v, c1, 1, "a/1", 5, 0.1), Accepted},
		{"another writer in the term", l.increment(c1v, c1, 1, "b/1", 5, 0.1), StaleTerm},
		{"the same replica restarted (new nonce)", l.increment(c1v, c1, 1, "a/2", 5, 0.1), StaleTerm},
		{"an older term", l.increment(c1v, c1, 0, "a/1", 5, 0.1), StaleTerm},
		{"a newer term without a claim", l.increment(c1v, c1, 2, "a/1", 5, 0.1), StaleTerm},
		{"a claim that skips a term", l.claim(c1v, c1, 3, "b/1"), StaleTerm},
		{"a claim of the same term", l.claim(c1v, c1, 1, "b/1"), StaleTerm},
		{"a claim of the next term", l.claim(c1v, c1, 2, "b/1"), Accepted},
		// A claim changes the term only: the posterior and what it covers stay the head's.
		{"a claim that moves the coverage", edited(l.claim(c1v, c1, 2, "b/1"), func(e *Entry) { e.Covers = map[int]int64{0: 500} }), Invalid},
		{"a claim that moves the version", edited(l.claim(c1v, c1, 2, "b/1"), func(e *Entry) { e.Version++ }), Invalid},
		{"a claim that moves the parent version", edited(l.claim(c1v, c1, 2, "b/1"), func(e *Entry) { e.ParentVersion++ }), Invalid},
		{"a claim of another posterior", edited(l.claim(c1v, c1, 2, "b/1"), func(e *Entry) { e.PosteriorSHA256 = strings.Repeat("0", 64) }), Invalid},
	}
	for _, tc := range cases {
		c := NewChain(testKeys())
		acceptAll(t, c, gv, c1v)
		if _, r, err := c.Offer(signed(2, l.value(tc.e))); err != nil || r != tc.want {
			t.Errorf("%s: %s, %v, want %s", tc.name, r, err, tc.want)
		}
	}
}

func TestIncrementMustFollowItsParent(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c1v := l.value(c1)
	i1 := l.increment(c1v, c1, 1, "a/1", 10, 0.1)
	i1v := l.value(i1)
	for _, tc := range []struct {
		name string
		edit func(e *Entry)
	}{
		{"skips a version", func(e *Entry) { e.Version++ }},
		{"wrong parent version", func(e *Entry) { e.ParentVersion++ }},
		{"coverage goes back", func(e *Entry) { e.Covers = map[int]int64{0: 9} }},
		{"drops a partition", func(e *Entry) { e.Covers = map[int]int64{1: 30} }},
		{"promoted without a last layer", func(e *Entry) { e.LastLayer = nil }},
		{"rejected but moves the version", func(e *Entry) { e.Outcome = Rejected }},
		{"wrong parent hash", func(e *Entry) { e.Parent = e.Parent[:63] + "0" }},
		{"a sequence number past the next", func(e *Entry) { e.Seq++ }},
		{"the head's sequence number", func(e *Entry) { e.Seq-- }},
		{"rejected, moving the version", func(e *Entry) {
			e.Outcome, e.LastLayer, e.PosteriorSHA256 = Rejected, nil, i1.PosteriorSHA256
		}},
		{"rejected, carrying a last layer", func(e *Entry) {
			e.Outcome, e.Version, e.PosteriorSHA256 = Rejected, i1.Version, i1.PosteriorSHA256
		}},
		{"skipped, with another posterior", func(e *Entry) {
			e.Outcome, e.LastLayer, e.Version, e.PosteriorSHA256 = Skipped, nil, i1.Version, strings.Repeat("0", 64)
		}},
	} {
		c := NewChain(testKeys())
		acceptAll(t, c, gv, c1v, i1v)
		e := l.increment(i1v, i1, 1, "a/1", 20, 0.2)
		tc.edit(e)
		if _, r, _ := c.Offer(signed(3, l.value(e))); r == Accepted {
			t.Errorf("%s: accepted", tc.name)
		}
		// A well-formed successor is still accepted afterwards: a refused record does not move the head.
		if _, r, _ := c.Offer(signed(4, l.value(l.increment(i1v, i1, 1, "a/1", 20, 0.2)))); r != Accepted {
			t.Errorf("%s: the valid successor after it: %s", tc.name, r)
		}
	}
	// A clipped increment (a step scaled down to the KL budget) moves the version as a promoted
	// one does.
	c0 := NewChain(testKeys())
	acceptAll(t, c0, gv, c1v, i1v)
	clipped := l.increment(i1v, i1, 1, "a/1", 20, 0.2)
	clipped.Outcome = Clipped
	if _, r, _ := c0.Offer(signed(3, l.value(clipped))); r != Accepted || c0.Head().Version != 2 {
		t.Errorf("a clipped increment: %s, head at version %d, want accepted at version 2", r, c0.Head().Version)
	}
	// Kept (not moving the version) with the parent's hash is fine, whatever kept it: rejected,
	// failed, or skipped (only dead letters).
	for _, outcome := range []string{Rejected, Failed, Skipped} {
		c := NewChain(testKeys())
		for i, v := range [][]byte{gv, c1v, i1v} {
			c.Offer(signed(int64(i), v))
		}
		keep := &Entry{Format: Format, Kind: Increment, Seq: 3, Parent: c.Head().Hash, Term: 1, Writer: "a/1", Version: 1, ParentVersion: 1,
			Covers: map[int]int64{0: 15}, Outcome: outcome, PosteriorSHA256: i1.PosteriorSHA256, Counts: &Counts{Held: 5}}
		if _, r, _ := c.Offer(signed(3, l.value(keep))); r != Accepted {
			t.Errorf("a %s increment: %s", outcome, r)
		}
		if got := Covered(&Head{Covers: map[int]int64{0: 10}}, keep); got[0] != (Range{10, 15}) || len(got) != 1 {
			t.Errorf("Covered = %v, want partition 0 [10, 15)", got)
		}
	}
}

// TestCoverageMayStandStillInAPartition: an increment's coverage may not go back in any
// partition the head covers, but it may stay where it was in one (an increment that read no
// record of it) while another moves on; what it covers there is then nothing.
func TestCoverageMayStandStillInAPartition(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c1v := l.value(c1)
	i1 := l.increment(c1v, c1, 1, "a/1", 10, 0.1)
	i1.Covers = map[int]int64{0: 10, 1: 5}
	i1v := l.value(i1)
	c := NewChain(testKeys())
	acceptAll(t, c, gv, c1v, i1v)
	for _, tc := range []struct {
		name    string
		covers  map[int]int64
		want    Reason
		covered map[int]Range // Covered after the head, when accepted
	}{
		{"partition 1 stays", map[int]int64{0: 20, 1: 5}, Accepted, map[int]Range{0: {10, 20}}},
		{"both stay", map[int]int64{0: 10, 1: 5}, Accepted, map[int]Range{}},
		{"partition 1 goes back", map[int]int64{0: 20, 1: 4}, Invalid, nil},
		{"partition 1 dropped", map[int]int64{0: 20}, Invalid, nil},
	} {
		e := l.increment(i1v, i1, 1, "a/1", 0, 0.2)
		e.Covers = tc.covers
		if _, r, _ := c.Fork().Offer(signed(3, l.value(e))); r != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, r, tc.want)
		}
		if got := Covered(c.Head(), e); tc.want == Accepted && !maps.Equal(got, tc.covered) {
			t.Errorf("%s: Covered = %v, want %v", tc.name, got, tc.covered)
		}
	}
}

// TestDiverged: an entry the chain did not accept says the chain diverged from its writer's only
// when it comes after an entry the chain does not have (seq past head + 1), while the chain
// follows: losers, duplicates and late appends of a fenced writer (seq <= head + 1) do not.
func TestDiverged(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c1v := l.value(c1)
	i1 := l.increment(c1v, c1, 1, "a/1", 10, 0.1) // the head's successor, refused by this reader
	i2 := l.increment(l.value(i1), i1, 1, "a/1", 20, 0.2)
	at := func(seq uint64) *Entry { e := *i2; e.Seq = seq; return &e }
	for _, tc := range []struct {
		name    string
		e       *Entry
		stuck   bool
		diverge bool
	}{
		{"a stale claim on the genesis", l.claim(gv, g, 1, "b/1"), false, false},
		{"a rival successor of the head", l.claim(c1v, c1, 2, "b/1"), false, false},
		{"an entry built on the refused successor", i2, false, true},
		{"two entries past the head", at(4), false, true},
		{"built on the refused successor, chain stopped already", i2, true, false},
		{"a record that is not an entry", nil, false, false},
	} {
		c := NewChain(testKeys())
		if err := c.Diverged(signed(2, l.value(i2)), i2); err != nil {
			t.Errorf("%s: before the genesis: %v", tc.name, err)
		}
		acceptAll(t, c, gv, c1v)
		if tc.stuck {
			c.Halt()
		}
		switch err := c.Diverged(signed(2, l.value(tc.e)), tc.e); {
		case tc.diverge && !errors.Is(err, ErrDiverged):
			t.Errorf("%s: Diverged = %v, want ErrDiverged", tc.name, err)
		case tc.diverge && !strings.Contains(err.Error(), "entry "+strconv.FormatUint(tc.e.Seq, 10)+" (term 1, writer a/1)"):
			t.Errorf("%s: %v does not name the entry", tc.name, err)
		case !tc.diverge && err != nil:
			t.Errorf("%s: Diverged = %v, want nil", tc.name, err)
		case tc.diverge && (c.Stuck() == nil || c.Stuck().Offset != 2):
			t.Errorf("%s: the chain is stopped at %+v, want at the diverging record (offset 2)", tc.name, c.Stuck())
		}
	}
}

func TestUnknownFormatStops(t *testing.T) {
	c := NewChain(testKeys())
	if _, _, err := c.Offer(signed(0, []byte(`{"format":2,"kind":"genesis"}`))); !errors.Is(err, ErrUnknownFormat) {
		t.Fatalf("Offer of format 2 = %v, want ErrUnknownFormat", err)
	}
}

func TestApplyIsBitExactAndChecked(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	back, err := Decode(gv)
	if err != nil {
		t.Fatal(err)
	}
	m0, err := back.Body.Model(back.PosteriorSHA256)
	if err != nil {
		t.Fatal(err)
	}
	c1 := l.claim(gv, g, 1, "a/1")
	i1 := l.increment(l.value(c1), c1, 1, "a/1", 10, 1e-17) // below one ulp of most weights: must still round-trip
	e, err := Decode(l.value(i1))
	if err != nil {
		t.Fatal(err)
	}
	m1, err := e.Apply(m0)
	if err != nil {
		t.Fatal(err)
	}
	want := l.models[1].Last().WeightMu
	for i, v := range m1.Last().WeightMu {
		if v != want[i] {
			t.Fatalf("weight_mu[%d] = %v, want %v", i, v, want[i])
		}
	}
	if m0.Version != 0 || m1.Version != 1 {
		t.Errorf("versions %d, %d", m0.Version, m1.Version)
	}
	if _, err := e.Apply(m1); err == nil || !strings.Contains(err.Error(), "applies to version 0, the posterior is version 1") {
		t.Errorf("Apply on the wrong parent version: %v", err)
	}
	e.LastLayer.BiasLogSigma[0] += 1e-9
	if _, err := e.Apply(m0); !errors.Is(err, ErrMismatch) {
		t.Errorf("a changed parameter: Apply = %v, want ErrMismatch", err)
	}
	if _, err := back.Body.Model(strings.Repeat("0", 64)); !errors.Is(err, ErrMismatch) {
		t.Errorf("a genesis body under another posterior hash: %v, want ErrMismatch", err)
	}
}

// ApplyHashing with one hasher along a log gives what Apply gives, entry after entry (the
// hasher hashing the unchanged layers once), and refuses what Apply refuses: an entry whose last
// layer does not hash to its posterior_sha256, also one that follows entries it hashed from the
// kept prefix.
func TestApplyHashingAlongALogIsApply(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	m0, err := g.Body.Model(g.PosteriorSHA256)
	if err != nil {
		t.Fatal(err)
	}
	var h bnn.WeightsHasher
	c1 := l.claim(gv, g, 1, "a/1")
	pv, pe := l.value(c1), c1
	plain, hashed := m0, m0
	for i := range 12 {
		e := l.increment(pv, pe, 1, "a/1", int64(10+i), 1e-3*float64(i+1))
		want, err := e.Apply(plain)
		if err != nil {
			t.Fatal(err)
		}
		got, err := e.ApplyHashing(hashed, &h)
		if err != nil || got.Version != want.Version || !bnn.LayersEqual(got.Last(), want.Last()) {
			t.Fatalf("entry %d: ApplyHashing = version %v, %v; Apply gives version %d", e.Seq, got, err, want.Version)
		}
		plain, hashed, pv, pe = want, got, l.value(e), e
	}
	bad := l.increment(pv, pe, 1, "a/1", 30, 1e-3)
	bad.LastLayer.BiasMu[0] += 1e-9
	if _, err := bad.Apply(plain); !errors.Is(err, ErrMismatch) {
		t.Fatalf("Apply of a changed parameter: %v, want ErrMismatch", err)
	}
	if _, err := bad.ApplyHashing(hashed, &h); !errors.Is(err, ErrMismatch) {
		t.Errorf("ApplyHashing of a changed parameter: %v, want ErrMismatch", err)
	}
}

// Decode refuses what no kind of entry may hold, before the chain judges it.
func TestDecodeRefusesMalformedEntries(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	inc := l.increment(l.value(c1), c1, 1, "a/1", 10, 0.1)
	for _, tc := range []struct {
		name string
		e    *Entry
		edit func(e *Entry)
	}{
		{"format 0", inc, func(e *Entry) { e.Format = 0 }},
		{"an unknown kind", inc, func(e *Entry) { e.Kind = "foo" }},
		{"no writer", inc, func(e *Entry) { e.Writer = "" }},
		{"a short posterior hash", inc, func(e *Entry) { e.PosteriorSHA256 = e.PosteriorSHA256[:63] }},
		{"a long posterior hash", inc, func(e *Entry) { e.PosteriorSHA256 += "0" }},
		{"an upper-case posterior hash", inc, func(e *Entry) { e.PosteriorSHA256 = strings.ToUpper(e.PosteriorSHA256) }},
		{"a posterior hash of 64 non-hex characters", inc, func(e *Entry) { e.PosteriorSHA256 = strings.Repeat("g", 64) }},
		{"a posterior hash of 64 characters below '0'", inc, func(e *Entry) { e.PosteriorSHA256 = strings.Repeat("/", 64) }},
		{"an increment without an outcome", inc, func(e *Entry) { e.Outcome = "" }},
		{"an increment with an unknown outcome", inc, func(e *Entry) { e.Outcome = "held" }},
		{"a genesis without a body", g, func(e *Entry) { e.Body = nil }},
		{"a genesis without weights", g, func(e *Entry) { e.Body = &Body{Sidecar: g.Body.Sidecar} }},
		{"a claim with events", c1, func(e *Entry) { e.EventsThrough = 1 }},
		{"a genesis with events", g, func(e *Entry) { e.Events = []Event{{Key: "update_failed", Value: []byte(`{}`)}} }},
		{"a negative offset", inc, func(e *Entry) { e.Covers = map[int]int64{0: -1} }},
		{"a negative partition", inc, func(e *Entry) { e.Covers = map[int]int64{-1: 5} }},
		{"a genesis naming a genesis", g, func(e *Entry) { e.Genesis = e.PosteriorSHA256 }},
		{"a short genesis hash", inc, func(e *Entry) { e.Genesis = e.PosteriorSHA256[:63] }},
		{"an upper-case genesis hash", c1, func(e *Entry) { e.Genesis = strings.ToUpper(inc.PosteriorSHA256) }},
		{"a claim of an epoch naming no genesis", c1, func(e *Entry) { e.Epoch = 1 }},
		{"an increment of an epoch naming no genesis", inc, func(e *Entry) { e.Epoch = 1 }},
	} {
		e := *tc.e
		tc.edit(&e)
		if _, err := Decode(l.value(&e)); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: Decode = %v, want ErrMalformed", tc.name, err)
		}
	}
	// Values that are not an entry's JSON at all are malformed too, never another kind of error.
	for _, v := range []string{`{`, `[]`, `null x`, `{"format":"1"}`, `{"format":1,"covers":{"p":1}}`,
		`{"format":1,"last_layer":{"weight_mu":"AAAAAAAAAA=="}}`} {
		if e, err := Decode([]byte(v)); !errors.Is(err, ErrMalformed) || e != nil {
			t.Errorf("Decode(%s) = %v, %v; want nil, ErrMalformed", v, e, err)
		}
	}
	// A partition covered to offset 0 (one the writer found empty) is a coverage, not a malformed one.
	empty := *inc
	empty.Covers = map[int]int64{0: 10, 1: 0}
	for _, e := range []*Entry{g, c1, inc, &empty} {
		if _, err := Decode(l.value(e)); err != nil {
			t.Errorf("a well-formed %s (covers %v): %v", e.Kind, e.Covers, err)
		}
	}
}

// A record that does not authenticate is refused before it is even decoded, whatever it holds:
// a well-formed increment on the head naming the current updater (the forgery that would make
// every replica skip records), a claim of a writer outside the group, an entry of an unknown
// format. The head stays, and the real successor is accepted afterwards.
func TestUnauthenticatedRecordsAreRefused(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c1v := l.value(c1)
	i1 := l.increment(c1v, c1, 1, "a/1", 10, 0.1)
	i1v := l.value(i1)
	h1 := Hash(i1v)
	// The forged increment: on the last accepted entry, by its term's claimant, skipping 500 records.
	forged := &Entry{Format: Format, Kind: Increment, Seq: 3, Parent: hex.EncodeToString(h1[:]), Term: 1, Writer: "a/1",
		Version: 1, ParentVersion: 1, Covers: map[int]int64{0: 510}, Outcome: Skipped, PosteriorSHA256: i1.PosteriorSHA256}
	fv := l.value(forged)
	evil := l.value(l.claim(i1v, i1, 2, "evil/deadbeef"))
	otherKey, err := clusterkey.Parse([]byte("t1:"+strings.Repeat("a5", 32)), "another cluster's")
	if err != nil {
		t.Fatal(err)
	}
	valid := signed(0, l.value(l.increment(i1v, i1, 1, "a/1", 20, 0.2)))
	for _, tc := range []struct {
		name string
		rec  Record
	}{
		{"the forged increment without an authenticator", Record{Value: fv}},
		{"the forged increment under another key with the cluster's key id", Record{Value: fv, Auth: Sign(otherKey, fv)}},
		{"the forged increment with the valid entry's authenticator", Record{Value: fv, Auth: valid.Auth}},
		{"the forged increment with a key id nobody has", Record{Value: fv, Auth: append([]byte("t9"), valid.Auth[2:]...)}},
		{"a claim of a writer outside the group", Record{Value: evil}},
		{"a claim of a writer outside the group under another key", Record{Value: evil, Auth: Sign(otherKey, evil)}},
		{"an entry of an unknown format", Record{Value: []byte(`{"format":99,"kind":"genesis"}`)}},
	} {
		c := NewChain(testKeys())
		acceptAll(t, c, gv, c1v, i1v)
		before := *c.Head()
		tc.rec.Offset = 3
		if e, r, err := c.Offer(tc.rec); r != Unauthenticated || err != nil || e != nil {
			t.Errorf("%s: Offer = %v, %s, %v; want nil, %s, nil", tc.name, e, r, err, Unauthenticated)
		}
		if h := c.Head(); h.Seq != before.Seq || h.Hash != before.Hash || h.Covers[0] != 10 {
			t.Errorf("%s: the head moved to %+v", tc.name, h)
		}
		valid.Offset = 4
		if _, r, _ := c.Offer(valid); r != Accepted {
			t.Errorf("%s: the real successor after it: %s", tc.name, r)
		}
	}
	// A chain without keys accepts nothing.
	if _, r, _ := NewChain(nil).Offer(signed(0, gv)); r != Unauthenticated {
		t.Errorf("a chain without keys: %s, want %s", r, Unauthenticated)
	}
}

// Entries signed under the old key still verify after a new key is added and moved first.
func TestChainAcrossKeyRotation(t *testing.T) {
	old := "t1:" + strings.Repeat("5a", 32)
	next := "t2:" + strings.Repeat("c3", 32)
	rotated, err := clusterkey.Parse([]byte(next+"\n"+old+"\n"), "rotated")
	if err != nil {
		t.Fatal(err)
	}
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c1v := l.value(c1)
	i1v := l.value(l.increment(c1v, c1, 1, "a/1", 10, 0.1))
	c := NewChain(rotated)
	for i, rec := range []Record{signed(0, gv), signed(1, c1v), {Offset: 2, Value: i1v, Auth: Sign(rotated, i1v)}} {
		if _, r, _ := c.Offer(rec); r != Accepted {
			t.Fatalf("record %d: %s", i, r)
		}
	}
	if !strings.HasPrefix(string(Sign(rotated, i1v)), "t2:") {
		t.Errorf("the rotated key file signs with %q, want t2", Sign(rotated, i1v)[:2])
	}
}

func TestCheckCoverage(t *testing.T) {
	ends := map[int]int64{0: 100, 1: 0}
	for _, tc := range []struct {
		name   string
		covers map[int]int64
		want   string // "" for none
	}{
		{"nothing", nil, ""},
		{"to the end", map[int]int64{0: 100, 1: 0}, ""},
		{"below the end", map[int]int64{0: 50}, ""},
		{"past the end", map[int]int64{0: 600}, "partition 0 to offset 600, and the partition ends at 100"},
		{"past an empty partition", map[int]int64{0: 10, 1: 1}, "partition 1 to offset 1, and the partition ends at 0"},
		{"a partition the topic lacks", map[int]int64{2: 5}, "no partition 2"},
		{"a partition the topic lacks, from 0", map[int]int64{2: 0}, ""},
	} {
		err := CheckCoverage(tc.covers, ends)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.want != "" && (!errors.Is(err, ErrPastEnd) || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v, want ErrPastEnd saying %q", tc.name, err, tc.want)
		}
	}
}

// TestHeadOwesTheEventsNoLaterEntryVouchesFor plays writer a's term (increments with events,
// each saying the ones before are published), a claim by b, and b's increments: the head owes
// exactly the events of the entries after the last events_through, across the claim, and a
// restarted chain (Resume from the stored head) owes the same.
func TestHeadOwesTheEventsNoLaterEntryVouchesFor(t *testing.T) {
	l, g := newTestLog(t)
	ev := func(seq uint64) []Event {
		return []Event{{Key: "kl_over_budget", Value: []byte(`{"type":"kl_over_budget","log_entry":` + strconv.FormatUint(seq, 10) + `}`)}}
	}
	c := NewChain(testKeys())
	var off int64
	offer := func(e *Entry) {
		t.Helper()
		off++
		if _, r, err := c.Offer(signed(off, l.value(e))); err != nil || r != Accepted {
			t.Fatalf("entry %d: %s %v", e.Seq, r, err)
		}
	}
	owes := func(want ...uint64) {
		t.Helper()
		var got []uint64
		for _, u := range c.Head().Unpublished {
			got = append(got, u.Seq)
			if string(u.Events[0].Value) != string(ev(u.Seq)[0].Value) {
				t.Errorf("entry %d's events stored as %s", u.Seq, u.Events[0].Value)
			}
		}
		if len(got) != len(want) {
			t.Fatalf("head owes the events of %v, want %v", got, want)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("head owes the events of %v, want %v", got, want)
			}
		}
		b, err := MarshalHead(c.Head())
		if err != nil {
			t.Fatal(err)
		}
		h, err := UnmarshalHead(b)
		if err != nil || len(h.Unpublished) != len(want) {
			t.Fatalf("the stored head owes %d entries (%v), want %d", len(h.Unpublished), err, len(want))
		}
	}
	off = -1
	offer(g)
	prev, pv := g, l.value(g)
	next := func(e *Entry) {
		offer(e)
		prev, pv = e, l.value(e)
	}
	next(l.claim(pv, prev, 1, "a/1"))
	owes()
	// a's first increment has events; it vouches for nothing before it but its claim.
	e := l.increment(pv, prev, 1, "a/1", 10, 0.1)
	e.Events, e.EventsThrough = ev(e.Seq), prev.Seq
	next(e)
	owes(2)
	// A quiet increment vouches for the one before: nothing owed.
	e = l.increment(pv, prev, 1, "a/1", 20, 0.1)
	e.EventsThrough = prev.Seq
	next(e)
	owes()
	e = l.increment(pv, prev, 1, "a/1", 30, 0.1)
	e.Events, e.EventsThrough = ev(e.Seq), prev.Seq
	next(e)
	owes(4)
	// a stops here; b claims: entry 4's events are still owed, past the claim.
	next(l.claim(pv, prev, 2, "b/1"))
	owes(4)
	// b's increment without events_through (a writer that does not say) vouches for nothing.
	e = l.increment(pv, prev, 2, "b/1", 40, 0.1)
	e.Events = ev(e.Seq)
	next(e)
	owes(4, 6)
	c = Resume(c.Head(), testKeys())
	owes(4, 6)
	// Vouching through entry 5 (the claim: b published entry 4's at its claim) leaves 6 owed.
	e = l.increment(pv, prev, 2, "b/1", 50, 0.1)
	e.EventsThrough = 5
	next(e)
	owes(6)
}

// TestEventsOnlyOnIncrements: Decode refuses events on a claim and events_through that is not
// below the entry's own seq.
func TestEventsOnlyOnIncrements(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	claim := l.claim(gv, g, 1, "a/1")
	inc := l.increment(gv, g, 1, "a/1", 10, 0.1)
	ev := []Event{{Key: "update_failed", Value: []byte(`{"type":"update_failed"}`)}}
	for _, tc := range []struct {
		name   string
		e      Entry
		refuse string
	}{
		{"claim with events", func() Entry { e := *claim; e.Events = ev; return e }(), "a claim with events"},
		{"claim with events_through", func() Entry { e := *claim; e.EventsThrough = 0 + 1; e.Seq = 2; return e }(), "a claim with events"},
		{"increment through itself", func() Entry { e := *inc; e.EventsThrough = e.Seq; return e }(), "says its events are through entry 1"},
		{"increment through the past", func() Entry { e := *inc; e.Seq = 3; e.EventsThrough = 2; e.Events = ev; return e }(), ""},
		// events_through 0 says nothing: it is no claim about entry 0, whatever the entry's seq
		// (the chain, not Decode, refuses an increment at seq 0).
		{"increment at seq 0 saying nothing", func() Entry { e := *inc; e.Seq = 0; return e }(), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode(l.value(&tc.e))
			switch {
			case tc.refuse == "" && err != nil:
				t.Errorf("Decode: %v", err)
			case tc.refuse != "" && (!errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), tc.refuse)):
				t.Errorf("Decode = %v, want malformed: %q", err, tc.refuse)
			}
		})
	}
}

// TestFloatsRoundTripBitForBit: a parameter list is little-endian float64 in base64, exact for
// every value (signed zeros, subnormals, the extremes), and a value that is not a whole number
// of float64s is refused, not cut.
func TestFloatsRoundTripBitForBit(t *testing.T) {
	in := Floats{0, math.Copysign(0, -1), 1e-320, -math.MaxFloat64, math.SmallestNonzeroFloat64, 0.1}
	b, err := json.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	var out Floats
	if err := json.Unmarshal(b, &out); err != nil || len(out) != len(in) {
		t.Fatalf("Unmarshal(%s) = %v, %v", b, out, err)
	}
	for i := range in {
		if math.Float64bits(out[i]) != math.Float64bits(in[i]) {
			t.Errorf("value %d: %v, want %v bit for bit", i, out[i], in[i])
		}
	}
	for _, n := range []int{1, 7, 9, 15} {
		v, _ := json.Marshal(base64.StdEncoding.EncodeToString(make([]byte, n)))
		var f Floats
		if err := json.Unmarshal(v, &f); err == nil {
			t.Errorf("%d bytes: decoded as %v, want an error", n, f)
		}
	}
}

// TestApplyRefusesWhatDoesNotFollowItsParent: Apply checks an entry against the parent posterior
// before a follower serves it: an entry that keeps the version must record the parent's hash; one
// that moves it needs a last layer of exactly the parent's shapes (a parameter too many or too
// few is refused even when the rest hashes right) whose values make a valid model. All are
// ErrMismatch.
func TestApplyRefusesWhatDoesNotFollowItsParent(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	i1 := l.increment(l.value(c1), c1, 1, "a/1", 10, 0.1)
	m0 := l.models[0]
	for _, tc := range []struct {
		name string
		e    *Entry
		edit func(ll *LastLayer)
	}{
		{"a kept version recording another posterior", edited(l.claim(gv, g, 1, "a/1"), func(e *Entry) { e.PosteriorSHA256 = strings.Repeat("0", 64) }), nil},
		{"a new version without a last layer", edited(l.increment(l.value(c1), c1, 1, "a/1", 10, 0.1), func(e *Entry) { e.LastLayer = nil }), nil},
		{"a weight_mu too many", nil, func(ll *LastLayer) { ll.WeightMu = append(ll.WeightMu, 0) }},
		{"a weight_mu too few", nil, func(ll *LastLayer) { ll.WeightMu = ll.WeightMu[:len(ll.WeightMu)-1] }},
		{"a weight_log_sigma too many", nil, func(ll *LastLayer) { ll.WeightLogSigma = append(ll.WeightLogSigma, 0) }},
		{"a weight_log_sigma too few", nil, func(ll *LastLayer) { ll.WeightLogSigma = ll.WeightLogSigma[:len(ll.WeightLogSigma)-1] }},
		{"a bias_mu too many", nil, func(ll *LastLayer) { ll.BiasMu = append(ll.BiasMu, 0) }},
		{"a bias_mu too few", nil, func(ll *LastLayer) { ll.BiasMu = ll.BiasMu[:len(ll.BiasMu)-1] }},
		{"a bias_log_sigma too many", nil, func(ll *LastLayer) { ll.BiasLogSigma = append(ll.BiasLogSigma, 0) }},
		{"a bias_log_sigma too few", nil, func(ll *LastLayer) { ll.BiasLogSigma = ll.BiasLogSigma[:len(ll.BiasLogSigma)-1] }},
		{"a NaN mean", nil, func(ll *LastLayer) { ll.WeightMu[1] = math.NaN() }},
		{"a log sigma out of range", nil, func(ll *LastLayer) { ll.BiasLogSigma[0] = 1e6 }},
	} {
		e := tc.e
		if e == nil {
			c := *i1
			c.LastLayer = LastLayerOf(l.models[1])
			tc.edit(c.LastLayer)
			e = &c
		}
		if _, err := e.Apply(m0); !errors.Is(err, ErrMismatch) {
			t.Errorf("%s: Apply = %v, want ErrMismatch", tc.name, err)
		}
	}
	if _, err := i1.Apply(m0); err != nil {
		t.Errorf("the entry unedited: %v", err)
	}
	// A version that goes back from the parent's moves it too: it needs a last layer, even when
	// the entry records the parent's posterior.
	back := edited(l.claim(gv, g, 1, "a/1"), func(e *Entry) { e.ParentVersion, e.Version, e.PosteriorSHA256 = 1, 0, i1.PosteriorSHA256 })
	if _, err := back.Apply(l.models[1]); !errors.Is(err, ErrMismatch) {
		t.Errorf("an entry from version 1 back to 0, recording version 1's posterior: Apply = %v, want ErrMismatch", err)
	}
}

// TestApplyTakesTheRecordsTheEntryRecords: the records a posterior stands for are not in its
// hash, so Apply takes them from the entry, or keeps the parent's when the entry omits them (a
// log written before entries carried them).
func TestApplyTakesTheRecordsTheEntryRecords(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	i1 := l.increment(l.value(c1), c1, 1, "a/1", 10, 0.1)
	prev := l.models[0].Clone()
	prev.Records = 12
	for _, tc := range []struct{ entry, want float64 }{{0, 12}, {40, 40}} {
		e := *i1
		e.Records = tc.entry
		next, err := e.Apply(prev)
		if err != nil || next.Records != tc.want {
			t.Errorf("an entry recording %v records on a parent of 12: %v, %v; want %v", tc.entry, next, err, tc.want)
		}
	}
	if prev.Records != 12 {
		t.Errorf("Apply changed its parent's records to %v", prev.Records)
	}
}

// TestHeadOwesAtMostMaxUnpublished: on a log whose writer never says what it published, the head
// keeps the events of the last MaxUnpublished increments only, the newest, in order.
func TestHeadOwesAtMostMaxUnpublished(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c := NewChain(testKeys())
	acceptAll(t, c, gv, l.value(c1))
	for seq := uint64(2); seq <= MaxUnpublished+2; seq++ {
		h := c.Head()
		e := &Entry{Format: Format, Kind: Increment, Seq: seq, Parent: h.Hash, Term: 1, Writer: "a/1", Version: h.Version,
			ParentVersion: h.Version, Covers: map[int]int64{0: int64(seq)}, Outcome: Skipped, PosteriorSHA256: h.PosteriorSHA256,
			Events: []Event{{Key: "update_failed", Value: []byte(`{"seq":` + strconv.FormatUint(seq, 10) + `}`)}}}
		if _, r, _ := c.Offer(signed(int64(seq), l.value(e))); r != Accepted {
			t.Fatalf("increment %d: %s", seq, r)
		}
		// Entries 2 .. seq are owed; the head keeps the newest MaxUnpublished of them.
		u := c.Head().Unpublished
		first := uint64(2)
		if seq > MaxUnpublished+1 {
			first = seq + 1 - MaxUnpublished
		}
		if len(u) != int(seq+1-first) || u[0].Seq != first || u[len(u)-1].Seq != seq {
			t.Fatalf("after increment %d the head owes %d entries, %d to %d; want %d to %d", seq, len(u), u[0].Seq, u[len(u)-1].Seq, first, seq)
		}
	}
}

// TestAuthenticatorIsDomainSeparated: an entry's authenticator is the HMAC-SHA256, under the
// cluster key, of the posterior log's domain, the key id and the value bytes (clusterkey), so
// that entries signed by any build verify; the authenticator of the same bytes as another kind
// of record (the CE topics' domains) does not verify as an entry's.
func TestAuthenticatorIsDomainSeparated(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	secret, _ := hex.DecodeString(strings.Repeat("5a", 32))
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte("cfguard posterior log entry v1\x00t1\x00"))
	mac.Write(gv)
	if got, want := string(Sign(testKeys(), gv)), "t1:"+hex.EncodeToString(mac.Sum(nil)); got != want {
		t.Errorf("Sign = %s, want %s", got, want)
	}
	for _, domain := range []string{"cfguard ce request v1", "cfguard ce state v1", "cfguard ce state tombstone v1",
		"cfguard ce state claim v1", "cfguard ce member v1", ""} {
		rec := Record{Value: gv, Auth: testKeys().Sign(domain, gv)}
		if err := Authenticate(testKeys(), rec); err == nil {
			t.Errorf("an authenticator in domain %q verifies as an entry's", domain)
		}
		if _, r, _ := NewChain(testKeys()).Offer(rec); r != Unauthenticated {
			t.Errorf("a genesis authenticated in domain %q: %s, want %s", domain, r, Unauthenticated)
		}
	}
}

// TestHaltBeforeTheGenesis: a chain without a head has nothing to stop after; it still takes
// the genesis.
func TestHaltBeforeTheGenesis(t *testing.T) {
	l, g := newTestLog(t)
	c := NewChain(testKeys())
	c.Halt()
	if c.Stuck() != nil {
		t.Fatalf("stuck at %+v before the genesis", c.Stuck())
	}
	if _, r, _ := c.Offer(signed(0, l.value(g))); r != Accepted {
		t.Fatalf("the genesis after Halt: %s", r)
	}
}

// TestHeadKeepsTheLatestMarkOfEachPartition: the head's marks are, per input partition, the
// mark of the last increment that read it, across claims (a claim's own marks count for
// nothing) and increments that read other partitions; the head also keeps the genesis it
// descends from. A head, once returned, is the chain's own: neither the next Offer nor the
// caller's edits of the entry Offer returned change it.
func TestHeadKeepsTheLatestMarkOfEachPartition(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c1v := l.value(c1)
	c := NewChain(testKeys())
	acceptAll(t, c, gv, c1v)
	genesis := *c.Head()
	m := func(off int64) Mark { return Mark{Offset: off, Timestamp: 1000 + off, Sum: uint64(off) * 7} }
	var off int64 = 1
	offer := func(e *Entry) *Entry {
		t.Helper()
		off++
		got, r, _ := c.Offer(signed(off, l.value(e)))
		if r != Accepted {
			t.Fatalf("entry %d: %s", e.Seq, r)
		}
		return got
	}
	marks := func(want map[int]Mark) {
		t.Helper()
		h := c.Head()
		if !maps.Equal(h.Marks, want) {
			t.Fatalf("head marks %v, want %v", h.Marks, want)
		}
		if h.GenesisOffset != genesis.GenesisOffset || h.GenesisHash != genesis.GenesisHash || h.GenesisHash == "" || h.Epoch != genesis.Epoch {
			t.Fatalf("head %+v does not keep its genesis (offset %d, hash %s)", h, genesis.GenesisOffset, genesis.GenesisHash)
		}
	}
	i1 := l.increment(c1v, c1, 1, "a/1", 10, 0.1)
	i1.Marks = map[int]Mark{0: m(9)}
	i1v := l.value(i1)
	got := offer(i1)
	marks(map[int]Mark{0: m(9)})
	h1 := c.Head()
	got.Covers[0], got.Marks[0] = 999, m(999) // the caller's entry, not the head
	if h1.Covers[0] != 10 || h1.Marks[0] != m(9) {
		t.Fatalf("editing the entry Offer returned changed the head to %+v", h1)
	}
	i2 := l.increment(i1v, i1, 1, "a/1", 20, 0.1)
	i2.Covers, i2.Marks = map[int]int64{0: 10, 1: 5}, map[int]Mark{1: m(4)}
	i2v := l.value(i2)
	offer(i2)
	marks(map[int]Mark{0: m(9), 1: m(4)})
	if !maps.Equal(h1.Marks, map[int]Mark{0: m(9)}) {
		t.Fatalf("the next Offer changed an earlier head's marks to %v", h1.Marks)
	}
	c2 := l.claim(i2v, i2, 2, "b/1")
	c2.Marks = map[int]Mark{0: m(1)}
	c2v := l.value(c2)
	offer(c2)
	marks(map[int]Mark{0: m(9), 1: m(4)})
	i3 := l.increment(c2v, c2, 2, "b/1", 30, 0.1)
	i3.Covers, i3.Marks = map[int]int64{0: 30, 1: 5}, map[int]Mark{0: m(29)}
	offer(i3)
	marks(map[int]Mark{0: m(29), 1: m(4)})
}

// TestCoveredFromNothing: after no head (a log's first entry) an entry covers each partition
// from offset 0, and a partition it covers to 0 is no range.
func TestCoveredFromNothing(t *testing.T) {
	e := &Entry{Covers: map[int]int64{0: 7, 1: 0, 2: 3}}
	if got, want := Covered(nil, e), map[int]Range{0: {0, 7}, 2: {0, 3}}; !maps.Equal(got, want) {
		t.Errorf("Covered(nil) = %v, want %v", got, want)
	}
}

// TestStoredHead: a head round-trips through MarshalHead, every field of it, and no stored bytes
// (a replica's first start) is no head rather than an error; bytes that are not a head are an
// error.
func TestStoredHead(t *testing.T) {
	for _, b := range [][]byte{nil, {}} {
		if h, err := UnmarshalHead(b); h != nil || err != nil {
			t.Errorf("UnmarshalHead(%q) = %v, %v; want nil, nil", b, h, err)
		}
	}
	if _, err := UnmarshalHead([]byte("{")); err == nil {
		t.Error("UnmarshalHead of a cut value: no error")
	}
	in := &Head{Seq: 3, Hash: "ab", Offset: 7, Term: 2, Writer: "a/1", Version: 1, Covers: map[int]int64{0: 5, 2: 9},
		PosteriorSHA256: "cd", GenesisOffset: 4, GenesisHash: "ef", Epoch: 1,
		Unpublished: []Unpublished{{Seq: 3, Events: []Event{{Key: "k", Value: []byte(`{}`)}}}},
		Marks:       map[int]Mark{0: {Offset: 4, Timestamp: 1700000000000, Sum: 0xfeed}},
		Points:      []uint64{1}, PointsAfter: 1, PointsKept: true}
	if v := reflect.ValueOf(*in); slices.ContainsFunc(reflect.VisibleFields(v.Type()), func(f reflect.StructField) bool { return v.FieldByIndex(f.Index).IsZero() }) {
		t.Fatalf("the head %+v leaves a field at its zero value: the round trip would not show it kept", in)
	}
	b, err := MarshalHead(in)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := UnmarshalHead(b); err != nil || !reflect.DeepEqual(out, in) {
		t.Errorf("round trip: %+v, %v; want %+v", out, err, in)
	}
}

// TestResumeCopiesTheHead: a resumed chain owns its head: edits of the head it was resumed from
// (the caller's, as UnmarshalHead returned it) do not move it.
func TestResumeCopiesTheHead(t *testing.T) {
	h := &Head{Seq: 3, Hash: "ab", Term: 1, Writer: "a/1", Covers: map[int]int64{0: 5}, Marks: map[int]Mark{0: {Offset: 4}},
		Unpublished: []Unpublished{{Seq: 3}}, Points: []uint64{2}, PointsKept: true}
	c := Resume(h, testKeys())
	h.Covers[0], h.Marks[0], h.Unpublished[0].Seq, h.Points[0] = 99, Mark{Offset: 99}, 99, 99
	if got := c.Head(); got.Covers[0] != 5 || got.Marks[0].Offset != 4 || got.Unpublished[0].Seq != 3 || got.Points[0] != 2 {
		t.Errorf("the resumed head follows the caller's edits: %+v", got)
	}
}

// TestNewGenesis: NewGenesis is the genesis built from NewBody and PosteriorHash, byte for byte,
// with the writer and settings it is given; a chain accepts it as a log's first entry.
func TestNewGenesis(t *testing.T) {
	l, g := newTestLog(t)
	e, err := NewGenesis(l.models[0], g.Writer, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := l.value(e), l.value(g); !bytes.Equal(got, want) {
		t.Errorf("NewGenesis encodes as\n%s\nwant\n%s", got, want)
	}
	settings := map[string]string{"certify.delta": "0.05"}
	if e, err = NewGenesis(l.models[0], "b/1", settings); err != nil || e.Writer != "b/1" || !maps.Equal(e.Settings, settings) {
		t.Fatalf("NewGenesis with a writer and settings: %+v, %v", e, err)
	}
	if _, r, _ := NewChain(testKeys()).Offer(signed(0, l.value(e))); r != Accepted {
		t.Errorf("a chain offered NewGenesis's entry: %s", r)
	}
}

// An entry names the genesis it descends from (Head.Lineage), so that one signed with the same key
// for another log, copied in past the head, is counted as such (OtherLog) and does not stop the
// chain as a diverged entry does; and the head's successor must name the head's genesis and epoch.
// Entries that name no genesis (written by an earlier build) are judged as before.
func TestEntriesOfAnotherLog(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c1v := l.value(c1)
	gh := Hash(gv)
	ours := hex.EncodeToString(gh[:])
	other := edited(&Entry{}, func(e *Entry) { *e = *g; e.Writer = "staging/1" })
	oh := Hash(l.value(other))
	theirs := hex.EncodeToString(oh[:])
	// The head's successor, as the updater writes it.
	next := func() *Entry {
		e := l.increment(c1v, c1, 1, "a/1", 10, 0.1)
		e.Genesis = ours
		return e
	}
	past := func(edit func(e *Entry)) *Entry { // numbered two past the head's successor
		e := next()
		e.Seq += 2
		e.Parent = strings.Repeat("ab", 32)
		edit(e)
		return e
	}
	for _, tc := range []struct {
		name    string
		e       *Entry
		want    Reason
		diverge bool
	}{
		{"another log's entry past the head", past(func(e *Entry) { e.Genesis = theirs }), OtherLog, false},
		{"this log's entry past the head", past(func(*Entry) {}), NotSuccessor, true},
		{"an entry naming no genesis past the head (an earlier build's)", past(func(e *Entry) { e.Genesis = "" }), NotSuccessor, true},
		{"an entry of a later epoch past the head (a new epoch this reader missed)", past(func(e *Entry) { e.Genesis, e.Epoch = theirs, 1 }), NotSuccessor, true},
		{"another log's entry at the head's place", edited(next(), func(e *Entry) { e.Genesis = theirs; e.Parent = strings.Repeat("ab", 32) }), NotSuccessor, false},
		{"the head's successor naming another genesis", edited(next(), func(e *Entry) { e.Genesis = theirs }), Invalid, false},
		{"the head's successor naming another epoch", edited(next(), func(e *Entry) { e.Epoch = 1 }), Invalid, false},
		{"the head's successor naming no genesis", edited(next(), func(e *Entry) { e.Genesis = "" }), Accepted, false},
		{"the head's successor", next(), Accepted, false},
	} {
		c := NewChain(testKeys())
		acceptAll(t, c, gv, c1v)
		rec := signed(2, l.value(tc.e))
		_, r, err := c.Offer(rec)
		if r != tc.want || err != nil {
			t.Errorf("%s: Offer = %s, %v; want %s", tc.name, r, err, tc.want)
		}
		if err := c.Diverged(rec, tc.e); tc.diverge != errors.Is(err, ErrDiverged) || !tc.diverge && err != nil {
			t.Errorf("%s: Diverged = %v, want diverged %v", tc.name, err, tc.diverge)
		}
		if r == OtherLog {
			// The chain goes on: the head's successor is accepted after it.
			if _, r, _ := c.Offer(signed(3, l.value(next()))); r != Accepted {
				t.Errorf("%s: the head's successor after it: %s", tc.name, r)
			}
		}
	}
	// An entry appended on a head names the head's genesis and epoch, unless the head does not
	// know its genesis (stored before heads kept it).
	c := NewChain(testKeys())
	acceptAll(t, c, gv, c1v)
	e := &Entry{}
	c.Head().Lineage(e)
	if e.Genesis != ours || e.Epoch != 0 {
		t.Errorf("Lineage on the head: genesis %q epoch %d, want %q 0", e.Genesis, e.Epoch, ours)
	}
	h := *c.Head()
	h.Epoch = 3 // as after three new epochs
	e = &Entry{}
	h.Lineage(e)
	if e.Genesis != ours || e.Epoch != 3 {
		t.Errorf("Lineage on a head of epoch 3: genesis %q epoch %d, want %q 3", e.Genesis, e.Epoch, ours)
	}
	h.GenesisHash = ""
	e = &Entry{}
	h.Lineage(e)
	if e.Genesis != "" || e.Epoch != 0 {
		t.Errorf("Lineage on a head without its genesis: genesis %q epoch %d, want none", e.Genesis, e.Epoch)
	}
}

// TestAHeadWithoutItsGenesisJudgesEntriesWithoutIt: a head stored before heads kept their genesis
// (GenesisHash empty, as a replica upgraded from such a build resumes it) cannot tell which genesis
// or epoch an entry names, so it judges the successors that name one (written by a replica whose
// head knows it: Head.Lineage) without it, as it judges those that name none; the heads it moves
// to stay without a genesis.
func TestAHeadWithoutItsGenesisJudgesEntriesWithoutIt(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c1v := l.value(c1)
	c := NewChain(testKeys())
	acceptAll(t, c, gv, c1v)
	old := *c.Head()
	ours := old.GenesisHash
	old.GenesisOffset, old.GenesisHash = 0, ""
	for _, tc := range []struct {
		name    string
		genesis string
		epoch   uint64
	}{
		{"naming no genesis", "", 0},
		{"naming the log's genesis", ours, 0},
		{"naming the log's genesis and epoch 1", ours, 1},
	} {
		e := l.increment(c1v, c1, 1, "a/1", 10, 0.1)
		e.Genesis, e.Epoch = tc.genesis, tc.epoch
		f := Resume(&old, testKeys())
		if _, r, err := f.Offer(signed(2, l.value(e))); r != Accepted || err != nil {
			t.Errorf("the successor %s: %s, %v; want %s", tc.name, r, err, Accepted)
			continue
		}
		if h := f.Head(); h.GenesisHash != "" || h.Seq != 2 {
			t.Errorf("the successor %s: head %+v, want entry 2 without a genesis", tc.name, h)
		}
	}
}

// TestHeadKeepsTheConfirmationPoints: the head keeps the versions increments mark as points
// (Entry.Point), each once, the latest MaxPoints of them, and PointsIn tells which are known: every
// point after the first genesis, after the oldest kept point once older ones went, and after the
// version of a head stored before heads kept points.
func TestHeadKeepsTheConfirmationPoints(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c := NewChain(testKeys())
	acceptAll(t, c, gv, l.value(c1))
	if ps, known := c.Head().PointsIn(0, 10); !known || len(ps) != 0 {
		t.Fatalf("after the genesis: PointsIn(0, 10) = %v, %t; want none, known", ps, known)
	}
	prev, pv := c1, l.value(c1)
	offset := int64(2)
	offer := func(e *Entry) {
		t.Helper()
		v := l.value(e)
		if _, r, _ := c.Offer(signed(offset, v)); r != Accepted {
			t.Fatalf("entry %d: %s", e.Seq, r)
		}
		offset++
		prev, pv = e, v
	}
	// Versions 1..5: 2 and 4 marked by the increment that promotes them, 5 by two increments
	// that do not move it (kept once).
	for v := uint64(1); v <= 5; v++ {
		offer(edited(l.increment(pv, prev, 1, "a/1", int64(v), 0.01), func(e *Entry) { e.Point = v == 2 || v == 4 }))
	}
	mark := func() *Entry {
		h := c.Head()
		return &Entry{Format: Format, Kind: Increment, Seq: h.Seq + 1, Parent: h.Hash, Term: 1, Writer: "a/1", Version: h.Version,
			ParentVersion: h.Version, Covers: h.Covers, Outcome: Skipped, PosteriorSHA256: h.PosteriorSHA256, Point: true}
	}
	offer(mark())
	offer(mark())
	h := c.Head()
	if want := []uint64{2, 4, 5}; !slices.Equal(h.Points, want) {
		t.Fatalf("points %v; want %v", h.Points, want)
	}
	for _, tc := range []struct {
		after, through uint64
		want           []uint64
	}{{0, 5, []uint64{2, 4, 5}}, {2, 5, []uint64{4, 5}}, {2, 3, nil}, {4, 4, nil}, {5, 9, nil}} {
		if ps, known := h.PointsIn(tc.after, tc.through); !known || !slices.Equal(ps, tc.want) {
			t.Errorf("PointsIn(%d, %d) = %v, %t; want %v, known", tc.after, tc.through, ps, known, tc.want)
		}
	}
	for through, want := range map[uint64]uint64{3: 2, 4: 4, 9: 5} {
		if p, ok := h.LatestPoint(through); !ok || p != want {
			t.Errorf("LatestPoint(%d) = %d, %t; want %d", through, p, ok, want)
		}
	}
	if _, ok := h.LatestPoint(1); ok {
		t.Error("LatestPoint(1): a point before the first one")
	}
	// A head stored before heads kept points knows the points after its version only.
	old := *h
	old.Points, old.PointsAfter, old.PointsKept = nil, 0, false
	if _, known := old.PointsIn(9, 10); known || old.KnownAfter() != old.Version {
		t.Errorf("a head that keeps no points says it knows them, or after %d; want after its version %d", old.KnownAfter(), old.Version)
	}
	c = Resume(&old, testKeys())
	offer(edited(l.increment(pv, prev, 1, "a/1", 6, 0.01), func(e *Entry) { e.Point = true }))
	h = c.Head()
	if _, known := h.PointsIn(4, 6); known {
		t.Error("a resumed head without points knows the points before its version")
	}
	if ps, known := h.PointsIn(5, 6); !known || !slices.Equal(ps, []uint64{6}) {
		t.Errorf("PointsIn(5, 6) = %v, %t; want [6], known", ps, known)
	}
	// Past MaxPoints, the oldest go, and the points at or before the oldest gone are unknown.
	for range MaxPoints {
		offer(edited(l.increment(pv, prev, 1, "a/1", offset, 0.001), func(e *Entry) { e.Point = true }))
	}
	h = c.Head()
	// Points 6 .. 6+MaxPoints: the first went.
	if len(h.Points) != MaxPoints || h.Points[0] != 7 || h.PointsAfter != 6 {
		t.Fatalf("%d points from %d, after %d; want %d from 7, after 6", len(h.Points), h.Points[0], h.PointsAfter, MaxPoints)
	}
	if _, known := h.PointsIn(5, 8); known || h.KnownAfter() != 6 {
		t.Errorf("PointsIn(5, 8) known after point 6 went, or every point known after %d; want 6", h.KnownAfter())
	}
	if ps, known := h.PointsIn(6, 8); !known || !slices.Equal(ps, []uint64{7, 8}) {
		t.Errorf("PointsIn(6, 8) = %v, %t; want [7 8], known", ps, known)
	}
}

// TestAClaimMarksAPoint: a claim that marks the head's version a point (Entry.Point) adds it to
// the head's points; a genesis that says so does not.
func TestAClaimMarksAPoint(t *testing.T) {
	l, g := newTestLog(t)
	g.Point = true
	gv := l.value(g)
	c := NewChain(testKeys())
	acceptAll(t, c, gv)
	if ps := c.Head().Points; len(ps) != 0 {
		t.Fatalf("a genesis marked points %v", ps)
	}
	c1 := l.claim(gv, g, 1, "a/1")
	c1.Point = true
	if _, r, _ := c.Offer(signed(1, l.value(c1))); r != Accepted {
		t.Fatalf("the claim: %s", r)
	}
	if h := c.Head(); !h.IsPoint(h.Version) {
		t.Errorf("after a claim that marks version %d, the head's points are %v", h.Version, h.Points)
	}
}

// TestAPointAtTheVersionOfAHeadStoredWithoutPointsIsKnown: on a head stored before heads kept
// points, an entry that marks the head's own version (a claim, or an increment that leaves it)
// makes it a point the head knows, as an increment that promotes the next version does: a CE due
// at it is found there.
func TestAPointAtTheVersionOfAHeadStoredWithoutPointsIsKnown(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c1 := l.claim(gv, g, 1, "a/1")
	c1v := l.value(c1)
	i1 := l.increment(c1v, c1, 1, "a/1", 1, 0.01)
	c := NewChain(testKeys())
	acceptAll(t, c, gv, c1v, l.value(i1))
	old := *c.Head()
	old.Points, old.PointsAfter, old.PointsKept = nil, 0, false
	c = Resume(&old, testKeys())
	claim := l.claim(l.value(i1), i1, 2, "b/1")
	claim.Point = true
	if _, r, _ := c.Offer(signed(3, l.value(claim))); r != Accepted {
		t.Fatalf("the claim: %s", r)
	}
	h := c.Head()
	if ps, known := h.PointsIn(h.KnownAfter(), h.Version); !known || !slices.Equal(ps, []uint64{h.Version}) || !h.IsPoint(h.Version) {
		t.Errorf("points %v after %d: PointsIn(KnownAfter, %d) = %v, %t; want [%d], known", h.Points, h.PointsAfter, h.Version, ps, known, h.Version)
	}
}
