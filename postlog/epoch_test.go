package postlog

import (
	"encoding/hex"
	"errors"
	"strings"
	"testing"
)

// A chain stops at an authenticated entry of an unknown format and accepts nothing after it but a
// new epoch that names it, on the head, with the head's posterior and coverage; the epoch
// resumes the chain (a claim of the next term follows it). On a chain that follows, an epoch
// must name the head itself.
func TestNewEpochMovesPastAnUnreadableEntry(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	c := NewChain(testKeys())
	if _, r, err := c.Offer(signed(0, gv)); r != Accepted || err != nil {
		t.Fatalf("genesis: %s %v", r, err)
	}
	cl := l.claim(gv, g, 1, "a/1")
	cv := l.value(cl)
	if _, r, _ := c.Offer(signed(1, cv)); r != Accepted {
		t.Fatalf("claim: %s", r)
	}
	head := *c.Head()
	// On a chain that follows, a new epoch must move past the head.
	epoch := func(past Past) []byte {
		e := &Entry{Format: Format, Kind: Genesis, Seq: head.Seq + 1, Parent: head.Hash, Term: head.Term, Writer: "new-epoch@x/1",
			Version: head.Version, ParentVersion: head.Version, PosteriorSHA256: head.PosteriorSHA256, Body: g.Body, Epoch: 1, Past: &past}
		return l.value(e)
	}
	if _, r, _ := c.Fork().Offer(signed(2, epoch(Past{Offset: head.Offset, SHA256: head.Hash}))); r != Accepted {
		t.Fatalf("a forced epoch past the head: %s", r)
	}
	newer := []byte(`{"format":2,"kind":"increment","seq":2,"writer":"b/1","posterior_sha256":"` + head.PosteriorSHA256 + `"}`)
	if _, _, err := c.Offer(signed(2, newer)); !errors.Is(err, ErrUnknownFormat) {
		t.Fatalf("an entry of format 2: %v", err)
	}
	h := Hash(newer)
	stuck := Past{Offset: 2, SHA256: hex.EncodeToString(h[:])}
	if c.Stuck() == nil || *c.Stuck() != stuck {
		t.Fatalf("stuck at %+v, want %+v", c.Stuck(), stuck)
	}
	// Stuck: another unknown record, a valid claim, an epoch past the head or naming another
	// record are all refused, and the chain stays where it stopped.
	if _, r, err := c.Offer(signed(3, newer)); r != UnknownFormat || err != nil {
		t.Fatalf("a second unknown record: %s %v", r, err)
	}
	if _, r, _ := c.Offer(signed(4, l.value(l.claim(cv, cl, 2, "b/1")))); r != NotSuccessor {
		t.Fatalf("a claim after the unreadable entry: %s", r)
	}
	for _, p := range []Past{{Offset: head.Offset, SHA256: head.Hash}, {Offset: 3, SHA256: stuck.SHA256}} {
		if _, r, _ := c.Offer(signed(5, epoch(p))); r != NotSuccessor {
			t.Fatalf("an epoch past %+v: %s", p, r)
		}
	}
	bad := &Entry{Format: Format, Kind: Genesis, Seq: head.Seq + 1, Parent: head.Hash, Term: head.Term, Writer: "new-epoch@x/1",
		Version: head.Version, ParentVersion: head.Version, PosteriorSHA256: head.PosteriorSHA256, Body: g.Body, Epoch: 1, Past: &stuck,
		Covers: map[int]int64{0: 10}}
	if _, r, _ := c.Offer(signed(6, l.value(bad))); r != Invalid {
		t.Fatalf("an epoch that changes the coverage: %s", r)
	}
	// The epoch is the next one, in the head's term, with the head's posterior: anything else is
	// refused, and the chain stays stuck.
	for _, tc := range []struct {
		name string
		edit func(e *Entry)
		want Reason
	}{
		{"skips an epoch", func(e *Entry) { e.Epoch = 2 }, NotSuccessor},
		{"names no record to move past", func(e *Entry) { e.Past = nil }, NotSuccessor},
		{"opens a term", func(e *Entry) { e.Term++ }, Invalid},
		{"moves the version", func(e *Entry) { e.Version++; e.ParentVersion++ }, Invalid},
		{"moves the version from the head's", func(e *Entry) { e.Version++ }, Invalid},
		{"names another parent version", func(e *Entry) { e.ParentVersion++ }, Invalid},
		{"carries another posterior", func(e *Entry) { e.PosteriorSHA256 = strings.Repeat("0", 64) }, Invalid},
	} {
		e, err := Decode(epoch(stuck))
		if err != nil {
			t.Fatal(err)
		}
		tc.edit(e)
		if _, r, _ := c.Offer(signed(6, l.value(e))); r != tc.want || c.Stuck() == nil {
			t.Fatalf("an epoch that %s: %s (stuck %v), want %s", tc.name, r, c.Stuck(), tc.want)
		}
	}
	ev := epoch(stuck)
	if _, r, _ := c.Offer(signed(7, ev)); r != Accepted {
		t.Fatalf("the epoch past the unreadable entry: %s", r)
	}
	eh := Hash(ev)
	if got := c.Head(); c.Stuck() != nil || got.Epoch != 1 || got.GenesisOffset != 7 || got.GenesisHash != hex.EncodeToString(eh[:]) || got.Writer != "" {
		t.Fatalf("head after the epoch %+v (stuck %v)", got, c.Stuck())
	}
	ee, err := Decode(ev)
	if err != nil {
		t.Fatal(err)
	}
	if _, r, _ := c.Offer(signed(8, l.value(l.claim(ev, ee, head.Term+1, "b/1")))); r != Accepted {
		t.Fatalf("a claim after the epoch: %s", r)
	}
	// A copy of an entry of the branch the epoch moved past (naming the first genesis), numbered
	// past the new head: another log's entry, which does not stop the chain.
	gh := Hash(gv)
	old := l.increment(cv, cl, 1, "a/1", 10, 0.1)
	old.Genesis, old.Seq = hex.EncodeToString(gh[:]), c.Head().Seq+2
	rec := signed(9, l.value(old))
	if _, r, _ := c.Offer(rec); r != OtherLog {
		t.Fatalf("a copy of the abandoned branch's entry past the head: %s, want %s", r, OtherLog)
	}
	if err := c.Diverged(rec, old); err != nil || c.Stuck() != nil {
		t.Fatalf("a copy of the abandoned branch's entry past the head: Diverged = %v, stuck %v", err, c.Stuck())
	}
}

// The settings a genesis records are part of its value bytes: changing one breaks its
// authenticator, so a replica cannot be made to accept other settings by editing the record.
func TestSettingsAreAuthenticated(t *testing.T) {
	l, g := newTestLog(t)
	g.Settings = map[string]string{"certify.delta": "0.05", "certify.mode": "paper"}
	v := l.value(g)
	rec := signed(0, v)
	if err := Authenticate(testKeys(), rec); err != nil {
		t.Fatal(err)
	}
	forged := []byte(strings.Replace(string(v), `"certify.delta":"0.05"`, `"certify.delta":"0.2"`, 1))
	if string(forged) == string(v) {
		t.Fatal("the settings are not in the value bytes")
	}
	rec.Value = forged
	if _, r, _ := NewChain(testKeys()).Offer(rec); r != Unauthenticated {
		t.Fatalf("a genesis whose settings were changed after signing: %s", r)
	}
}

// A log that lost its start (its records deleted, or the topic recreated) can begin again with a
// later epoch written from a replica's head: a reader from nothing accepts it first, as a first
// genesis, and the chain goes on from its head, while a halted chain (one that found its log
// reset) accepts it as its head's successor. A later epoch without the record it moves past, or
// anything but a genesis, is no start.
func TestALogMayBeginWithALaterEpoch(t *testing.T) {
	l, g := newTestLog(t)
	gv := l.value(g)
	old := NewChain(testKeys())
	if _, r, _ := old.Offer(signed(0, gv)); r != Accepted {
		t.Fatalf("genesis: %s", r)
	}
	cl := l.claim(gv, g, 1, "a/1")
	cv := l.value(cl)
	if _, r, _ := old.Offer(signed(1, cv)); r != Accepted {
		t.Fatalf("claim: %s", r)
	}
	inc := l.increment(cv, cl, 1, "a/1", 10, 0.1)
	iv := l.value(inc)
	if _, r, _ := old.Offer(signed(2, iv)); r != Accepted {
		t.Fatalf("increment: %s", r)
	}
	head := *old.Head()
	body, err := NewBody(l.models[inc.Version])
	if err != nil {
		t.Fatal(err)
	}
	rebase := &Entry{Format: Format, Kind: Genesis, Seq: head.Seq + 1, Parent: head.Hash, Term: head.Term, Writer: "new-epoch@x/1",
		Version: head.Version, ParentVersion: head.Version, Covers: head.Covers, PosteriorSHA256: head.PosteriorSHA256, Body: body,
		Epoch: 1, Past: &Past{Offset: head.Offset, SHA256: head.Hash}}
	rv := l.value(rebase)

	// The recreated topic: a stray increment at offset 0 (no start), then the epoch.
	fresh := NewChain(testKeys())
	if _, r, _ := fresh.Offer(signed(0, iv)); r != NotSuccessor {
		t.Fatalf("an increment as a log's first record: %s", r)
	}
	for name, e := range map[string]Entry{
		"no past":           func() Entry { e := *rebase; e.Past = nil; return e }(),
		"no parent":         func() Entry { e := *rebase; e.Parent = ""; return e }(),
		"sequence number 0": func() Entry { e := *rebase; e.Seq = 0; return e }(),
		"epoch 0":           func() Entry { e := *rebase; e.Epoch = 0; return e }(),
	} {
		if _, r, _ := fresh.Fork().Offer(signed(1, l.value(&e))); r != NotSuccessor {
			t.Errorf("a later epoch with %s as a log's first record: %s", name, r)
		}
	}
	// A first genesis (epoch 0) starts from nothing: no sequence number, parent, past, term or
	// coverage, and no version change. Only a genesis starts a log: a claim or an increment shaped
	// like a first genesis does not.
	for name, e := range map[string]Entry{
		"an epoch":          func() Entry { e := *g; e.Epoch = 1; return e }(),
		"a claim's kind":    func() Entry { e := *g; e.Kind = Claim; return e }(),
		"an increment kind": func() Entry { e := *g; e.Kind, e.Body, e.Outcome = Increment, nil, Skipped; return e }(),
		"coverage":          func() Entry { e := *g; e.Covers = map[int]int64{0: 10}; return e }(),
		"a sequence number": func() Entry { e := *g; e.Seq = 1; return e }(),
		"a parent":          func() Entry { e := *g; e.Parent = head.Hash; return e }(),
		"a past":            func() Entry { e := *g; e.Past = &Past{Offset: head.Offset, SHA256: head.Hash}; return e }(),
		"a term":            func() Entry { e := *g; e.Term = 1; return e }(),
		"a version change":  func() Entry { e := *g; e.Version = 1; return e }(),
	} {
		if _, r, _ := fresh.Fork().Offer(signed(1, l.value(&e))); r != NotSuccessor {
			t.Errorf("a first genesis with %s: %s", name, r)
		}
	}
	if _, r, _ := fresh.Offer(signed(1, rv)); r != Accepted {
		t.Fatalf("the later epoch as a log's first genesis: %s", r)
	}
	if h := fresh.Head(); h.Seq != head.Seq+1 || h.Version != head.Version || h.Covers[0] != 10 || h.Epoch != 1 || h.GenesisOffset != 1 {
		t.Fatalf("head after the later epoch: %+v", h)
	}
	if _, r, _ := fresh.Offer(signed(2, l.value(l.claim(rv, rebase, head.Term+1, "b/1")))); r != Accepted {
		t.Fatalf("a claim after the later epoch: %s", r)
	}

	// The replica that followed the old log halts, then takes the same epoch as its successor.
	old.Halt()
	if _, r, _ := old.Fork().Offer(signed(0, l.value(l.claim(iv, inc, 2, "b/1")))); r != NotSuccessor {
		t.Fatalf("a claim on a halted chain: %s", r)
	}
	if _, r, _ := old.Offer(signed(1, rv)); r != Accepted || old.Stuck() != nil {
		t.Fatalf("the epoch on the halted chain: %s (stuck %v)", r, old.Stuck())
	}
}

// TestAChainStoppedBeforeItsGenesisTakesOnlyAnEpochPastTheStop: a log whose first record is an
// entry of an unknown format stops a reader with no head, as it stops one with a head: a genesis
// after it (another build's first genesis, which readers of the newer format ignore as not the
// first) is not a successor, nor is an epoch that moves past another record; an epoch that names
// the record it stopped at starts the chain.
func TestAChainStoppedBeforeItsGenesisTakesOnlyAnEpochPastTheStop(t *testing.T) {
	l, g := newTestLog(t)
	newer := []byte(`{"format":2,"kind":"genesis"}`)
	c := NewChain(testKeys())
	if _, _, err := c.Offer(signed(0, newer)); !errors.Is(err, ErrUnknownFormat) {
		t.Fatalf("a first record of format 2: %v, want ErrUnknownFormat", err)
	}
	stop := *c.Stuck()
	body, err := NewBody(l.models[0])
	if err != nil {
		t.Fatal(err)
	}
	epochEntry := func(past Past) *Entry {
		return &Entry{Format: Format, Kind: Genesis, Seq: 1, Parent: stop.SHA256, Writer: "new-epoch@x/1", Version: g.Version,
			ParentVersion: g.Version, PosteriorSHA256: g.PosteriorSHA256, Body: body, Epoch: 1, Past: &past}
	}
	epoch := func(past Past) []byte { return l.value(epochEntry(past)) }
	// An epoch past the stop is a later one (epoch above 0), numbered past the log's start and
	// naming a parent, as rule 2 asks of any later epoch that begins a chain: a genesis that names
	// the stop but lacks one of them is no successor either.
	for name, v := range map[string][]byte{
		"a first genesis":                         l.value(g),
		"an epoch past another record":            epoch(Past{Offset: 7, SHA256: stop.SHA256}),
		"an epoch past a record of other bytes":   epoch(Past{Offset: stop.Offset, SHA256: strings.Repeat("0", 64)}),
		"an epoch 0 past the stop":                l.value(edited(epochEntry(stop), func(e *Entry) { e.Epoch = 0 })),
		"an epoch past the stop numbered 0":       l.value(edited(epochEntry(stop), func(e *Entry) { e.Seq = 0 })),
		"an epoch past the stop naming no parent": l.value(edited(epochEntry(stop), func(e *Entry) { e.Parent = "" })),
	} {
		f := c.Fork()
		if _, r, err := f.Offer(signed(1, v)); r != NotSuccessor || err != nil {
			t.Errorf("%s after the stop: %s, %v; want %s", name, r, err, NotSuccessor)
		}
		if f.Head() != nil || f.Stuck() == nil || *f.Stuck() != stop {
			t.Errorf("%s after the stop: head %+v, stuck %+v; want no head, stuck at %+v", name, f.Head(), f.Stuck(), stop)
		}
	}
	if _, r, err := c.Offer(signed(1, epoch(stop))); r != Accepted || err != nil {
		t.Fatalf("the epoch past the stop: %s, %v", r, err)
	}
	if c.Stuck() != nil || c.Head() == nil || c.Head().Epoch != 1 {
		t.Errorf("after the epoch past the stop: head %+v, stuck %+v; want epoch 1 and not stuck", c.Head(), c.Stuck())
	}
}
