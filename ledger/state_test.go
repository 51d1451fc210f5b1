package ledger

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// encodeStateJSON is an Options.EncodeState for tests: key = CE id, value = the CE as JSON.
func encodeStateJSON(ce *CE) (OutboxEntry, error) {
	v, err := json.Marshal(ce)
	return OutboxEntry{Key: ce.ID, Value: v}, err
}

// latestStates folds l's outbox of StreamStates by CE id, the last entry of each winning, as a
// reader of a compacted topic sees it (a tombstone leaves none).
func latestStates(t *testing.T, l *Ledger) map[string]*CE {
	t.Helper()
	out, err := l.Outbox(0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	states := map[string]*CE{}
	for _, e := range out {
		if e.Stream != StreamStates {
			continue
		}
		if len(e.Value) == 0 {
			delete(states, e.Key)
			continue
		}
		var ce CE
		if err := json.Unmarshal(e.Value, &ce); err != nil {
			t.Fatal(err)
		}
		if ce.ID != e.Key {
			t.Fatalf("state entry keyed %q holds %q", e.Key, ce.ID)
		}
		states[ce.ID] = &ce
	}
	return states
}

// registrations are share operations registering ces, read at the given offsets' time at.
func registrations(ces []*CE, at time.Time) []ShareOp {
	ops := make([]ShareOp, len(ces))
	for i, ce := range ces {
		c := *ce
		c.CreatedAt = at
		ops[i] = ShareOp{RID: fmt.Sprintf("rid-%d", i), Offset: int64(i), ID: ce.ID, CE: &c}
	}
	return ops
}

// shareOwner is a ledger with opts on a model's posterior, holding n CEs ce-00, ce-01, ...
// (drawn with seed) registered through its share at the time it returns.
func shareOwner(t *testing.T, opts Options, n int, seed uint64) (*Ledger, *bnn.Model, []*CE, time.Time) {
	t.Helper()
	owner, _ := openTest(t, opts)
	m0 := testModel(4)
	install(t, owner, m0)
	rng := rand.New(rand.NewPCG(seed, seed))
	var ces []*CE
	for i := range n {
		ce := newCE(t, m0, rng)
		ce.ID = fmt.Sprintf("ce-%02d", i)
		ces = append(ces, ce)
	}
	at := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	if _, err := owner.ApplyShare(0, registrations(ces, at), int64(len(ces)), nil, nil); err != nil {
		t.Fatal(err)
	}
	return owner, m0, ces, at
}

// A CE that moves to a new owner keeps what its previous owner learnt: the owner's ledger puts
// each registered or changed CE's state in its outbox, and the new owner, replaying the same registrations
// with the latest state of each, stores every CE with its renewed certificate, its verdict and
// its history, judged to the same status, decided as far, as at its previous owner, and
// publishes no status change again.
func TestStatesFollowAMovedCE(t *testing.T) {
	owner, m0, ces, at := shareOwner(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON, EncodeState: encodeStateJSON}, 30, 5)
	// Each registration puts its CE's state in the outbox: the state topic holds every CE, so
	// that one whose registration was deleted from the CE topic can be restored.
	for id, s := range latestStates(t, owner) {
		got, err := owner.Get(id)
		if err != nil {
			t.Fatalf("state of %s, which the ledger does not hold: %v", id, err)
		}
		if s.Status != got.Status || s.AnchorVersion != got.AnchorVersion || !s.CreatedAt.Equal(got.CreatedAt) {
			t.Fatalf("%s: state at registration %+v, stored %+v", id, s, got)
		}
	}
	if s := latestStates(t, owner); len(s) != len(ces) {
		t.Fatalf("%d registrations put %d states in the outbox, want one each", len(ces), len(s))
	}
	// A drift that lapses Theorem 2 only (renewals), then one that fails every bound.
	m1 := drift(m0, -0.01)
	if _, _, err := owner.Commit(bg, &Checkpoint{Model: m1}); err != nil {
		t.Fatal(err)
	}
	confirmAll(t, owner, m1, auditSamples, 11)
	m2 := drift(m1, -1.5)
	if _, _, err := owner.Commit(bg, &Checkpoint{Model: m2}); err != nil {
		t.Fatal(err)
	}
	// Verdicts for some: the others stay at risk, waiting to be measured.
	if _, _, err := owner.Confirm(bg, NewModelPredictor(m2, auditSamples, 12), 12); err != nil {
		t.Fatal(err)
	}
	// A small step the verdicts carry over.
	m3 := drift(m2, 1e-4)
	if _, _, err := owner.Commit(bg, &Checkpoint{Model: m3}); err != nil {
		t.Fatal(err)
	}
	states := latestStates(t, owner)
	renewed, verdicts, carried := 0, 0, 0
	for _, ce := range ces {
		got, err := owner.Get(ce.ID)
		if err != nil {
			t.Fatal(err)
		}
		s := states[ce.ID]
		if s == nil {
			t.Fatalf("%s changed (history %d) and has no state in the outbox", ce.ID, len(got.History))
		}
		if s.Status != got.Status || s.AnchorVersion != got.AnchorVersion || !reflect.DeepEqual(s.History, got.History) {
			t.Fatalf("%s: latest state %+v, stored %+v", ce.ID, s, got)
		}
		if got.AnchorVersion != 0 {
			renewed++
		}
		if got.ConfirmedVersion != nil {
			verdicts++
			if *got.ConfirmedVersion < m3.Version && got.Decided {
				carried++
			}
		}
	}
	if carried == 0 {
		t.Fatal("no verdict carried to the last posterior: the test must show that restored verdicts carry")
	}
	if renewed == 0 || verdicts == 0 || verdicts == len(ces) {
		t.Fatalf("%d renewed, %d with verdicts: the drifts must give both, and leave some certified, for the test to mean anything", renewed, verdicts)
	}

	// The new owner follows the same posteriors; it replays the registrations with the states.
	next, _ := openTest(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON, EncodeState: encodeStateJSON})
	install(t, next, m3)
	ops := registrations(ces, at)
	for i := range ops {
		ops[i].State = states[ops[i].ID]
	}
	past := map[uint64]*bnn.Model{0: m0, 1: m1, 2: m2}
	outs, err := next.ApplyShare(0, ops, int64(len(ops)), nil, past)
	if err != nil {
		t.Fatal(err)
	}
	for i, o := range outs {
		if o.Result != OutcomeStored || o.State != StateRestored {
			t.Fatalf("%s: outcome %+v; want stored and restored", ops[i].ID, o)
		}
	}
	for _, ce := range ces {
		was, _ := owner.Get(ce.ID)
		got, err := next.Get(ce.ID)
		if err != nil {
			t.Fatal(err)
		}
		was.UpdatedAt, got.UpdatedAt = time.Time{}, time.Time{}
		if !reflect.DeepEqual(was, got) {
			t.Errorf("%s moved:\n was %+v\n got %+v", ce.ID, was, got)
		}
	}
	// No status changed, so the new owner publishes none (its previous owner published every
	// change its states record), and it writes each CE's state: the topic's last record of a CE
	// is then its current owner's.
	out, err := next.Outbox(0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	written := map[string]int{}
	for _, e := range out {
		if e.Stream != StreamStates {
			t.Errorf("the new owner put %s in its outbox: %s; want states only", e.Key, e.Value)
			continue
		}
		written[e.Key]++
	}
	mine := latestStates(t, next)
	for _, ce := range ces {
		got, _ := next.Get(ce.ID)
		s := mine[ce.ID]
		if written[ce.ID] != 1 || s == nil || s.Status != got.Status || s.AnchorVersion != got.AnchorVersion || !reflect.DeepEqual(s.History, got.History) {
			t.Errorf("%s: the new owner wrote %d states, the last %+v; want one, of the CE as it stored it", ce.ID, written[ce.ID], s)
		}
	}
	checkInvariants(t, next)

	// A deletion writes a tombstone; a release (the CE moves on) writes none.
	if _, err := next.ApplyShare(0, []ShareOp{{RID: "rid-del", Offset: int64(len(ops)), ID: ces[0].ID}}, int64(len(ops))+1, nil, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := next.ReleaseShare(bg, 0, func(id string) bool { return id != ces[1].ID }); err != nil {
		t.Fatal(err)
	}
	mine = latestStates(t, next)
	if mine[ces[0].ID] != nil {
		t.Errorf("%s deleted, and its state is still the topic's last record", ces[0].ID)
	}
	for _, ce := range ces[1:] {
		if mine[ce.ID] == nil {
			t.Errorf("%s released, and its state is gone: its next owner would rebuild it from its registration", ce.ID)
		}
	}
}

// A state the new owner cannot vouch for is not used: the registration is stored as read, and
// the outcome says why.
func TestStateNotUsed(t *testing.T) {
	m0 := testModel(4)
	m1 := drift(m0, -0.01)
	reg := newCE(t, m0, rand.New(rand.NewPCG(9, 9)))
	reg.ID, reg.CreatedAt = "ce", time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	p, v := measure(t, m1, reg.XCF, 1, 400, 3)
	good := *reg
	good.AnchorVersion, good.P1, good.Var1 = 1, p, v
	two := uint64(2)
	one := uint64(1)
	half, over := 0.4, 0.5
	for _, tc := range []struct {
		name, want string
		edit       func(s *CE)
	}{
		{"another counterfactual", "another counterfactual", func(s *CE) { s.XCF = []float64{0, 0, 0} }},
		{"another registration", "another counterfactual", func(s *CE) { s.CreatedAt = s.CreatedAt.Add(time.Second) }},
		{"uncertified", "holds no certificate", func(s *CE) { s.Status = certify.Uncertified }},
		{"another set", "is not the registration's", func(s *CE) { s.Delta = 0.2 }},
		{"anchor ahead", "is not between", func(s *CE) { s.AnchorVersion = 2 }},
		{"a certificate that fails at its anchor", "does not hold at its own anchor", func(s *CE) { s.P1 = 0.6 }},
		{"a verdict on a certificate", "with a verdict", func(s *CE) { s.ConfirmedVersion = &one }},
		{"a verdict ahead", "verdict version 2", func(s *CE) { s.Status, s.ConfirmedVersion = certify.AtRisk, &two }},
		{"a bound without a verdict", "without a verdict", func(s *CE) { s.Status, s.VerdictBound = certify.AtRisk, &half }},
		{"an at_risk bound under 1/2", "side of 1/2", func(s *CE) { s.Status, s.ConfirmedVersion, s.VerdictBound = certify.AtRisk, &one, &half }},
		{"an invalidated bound over 1/2", "side of 1/2", func(s *CE) { s.Status, s.ConfirmedVersion, s.VerdictBound = certify.Invalidated, &one, &over }},
		{"a long history", "history entries", func(s *CE) { s.History = make([]StatusChange, MaxHistory+1) }},
		{"a history entry ahead", "history entry 0", func(s *CE) {
			s.History = []StatusChange{{From: certify.Certified, To: certify.AtRisk, PosteriorVersion: 5}}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, _ := openTest(t, Options{Policy: testPolicy(), EncodeState: encodeStateJSON})
			install(t, l, m1)
			state := good
			state.Status = certify.Certified
			tc.edit(&state)
			// A state refused for a version ahead of the current one names it as its newest
			// (a replica waits for it before applying the state); the others do not.
			if ahead, want := state.NewestVersion() > 1, strings.HasSuffix(tc.name, " ahead"); ahead != want {
				t.Errorf("NewestVersion() = %d with the current version 1; want past it: %v", state.NewestVersion(), want)
			}
			ops := registrations([]*CE{reg}, reg.CreatedAt)
			ops[0].State = &state
			outs, err := l.ApplyShare(0, ops, 1, nil, map[uint64]*bnn.Model{0: m0})
			if err != nil {
				t.Fatal(err)
			}
			if outs[0].Result != OutcomeStored || !strings.HasPrefix(outs[0].State, "previous owner's state not used") ||
				!strings.Contains(outs[0].State, tc.want) {
				t.Fatalf("outcome %+v; want stored, the state not used because %q", outs[0], tc.want)
			}
			got, err := l.Get("ce")
			if err != nil {
				t.Fatal(err)
			}
			if got.AnchorVersion != 0 || got.P1 != reg.P1 || len(got.History) != 0 {
				t.Fatalf("stored %+v; want the registration as read", got)
			}
			// The state put in its place is the CE as stored, not the one refused.
			if s := latestStates(t, l)["ce"]; s == nil || s.AnchorVersion != 0 || s.P1 != reg.P1 || len(s.History) != 0 {
				t.Fatalf("state written %+v; want the CE as stored", s)
			}
		})
	}
	// A verdict measured under a posterior before the state's anchor (a confirmer's pool that
	// lagged) is a verdict all the same.
	t.Run("a verdict before its anchor", func(t *testing.T) {
		l, _ := openTest(t, Options{Policy: testPolicy()})
		install(t, l, m1)
		state := good
		zero, bound := uint64(0), 0.6
		state.Status, state.ConfirmedVersion, state.VerdictBound = certify.AtRisk, &zero, &bound
		ops := registrations([]*CE{reg}, reg.CreatedAt)
		ops[0].State = &state
		outs, err := l.ApplyShare(0, ops, 1, nil, map[uint64]*bnn.Model{0: m0})
		if err != nil || outs[0].State != StateRestored {
			t.Fatalf("outcome %+v, %v; want restored", outs, err)
		}
		if v := state.NewestVersion(); v != 1 {
			t.Errorf("NewestVersion() = %d; want its anchor's, 1", v)
		}
	})
	// The state's anchor must be at hand, as a registration's must.
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m2 := drift(m1, 0.01)
	install(t, l, m2)
	ops := registrations([]*CE{reg}, reg.CreatedAt)
	state := good
	state.Status = certify.Certified
	ops[0].State = &state
	var need *AnchorsNeededError
	if _, err := l.ApplyShare(0, ops, 1, nil, map[uint64]*bnn.Model{0: m0}); !errors.As(err, &need) || !reflect.DeepEqual(need.Versions, []uint64{1}) {
		t.Fatalf("ApplyShare with the state's anchor missing = %v; want the anchors needed to name version 1", err)
	}
	outs, err := l.ApplyShare(0, ops, 1, nil, map[uint64]*bnn.Model{0: m0, 1: m1})
	if err != nil || outs[0].State != StateRestored {
		t.Fatalf("with the anchor given: %+v, %v; want restored", outs, err)
	}
	if got, _ := l.Get("ce"); got.AnchorVersion != 1 || got.P1 != p {
		t.Fatalf("restored %+v; want anchored to version 1 with p1 %v", got, p)
	}
}

// Outbox entries carry their stream; an entry written before streams existed reads as an event.
func TestOutboxEntryStreams(t *testing.T) {
	k := u64bytes(7)
	for _, e := range []OutboxEntry{{Seq: 7, Key: "a", Value: []byte("{}")}, {Seq: 7, Stream: StreamStates, Key: "b", Value: []byte("[1]")}} {
		got, err := decodeOutboxEntry(k, e.encode())
		if err != nil || !reflect.DeepEqual(got, e) {
			t.Fatalf("round trip of %+v = %+v, %v", e, got, err)
		}
	}
	old := append(binary.AppendUvarint(nil, 1), "k{}"...)
	if got, err := decodeOutboxEntry(k, old); err != nil || got.Stream != StreamEvents || got.Key != "k" || string(got.Value) != "{}" {
		t.Fatalf("an entry without stream bits = %+v, %v", got, err)
	}
	bad := append(binary.AppendUvarint(nil, 1|2<<32), "k{}"...)
	if _, err := decodeOutboxEntry(k, bad); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("an entry of stream 2 = %v; want ErrCorrupt", err)
	}
}

// BenchmarkConfirmStates measures what CE states cost the confirmer of a replica: Confirm of
// n CEs whose certificates a drift lapsed (every one renewed or judged, so every one changes),
// without states and with Options.EncodeState (the CE loaded and encoded as JSON in the write
// transaction, one outbox entry each). It reports the time per CE and the bytes of state per CE.
//
//	go test ./ledger -run '^$' -bench ConfirmStates -count 6 | benchstat -col /states -
func BenchmarkConfirmStates(b *testing.B) {
	const n = 2048
	for _, states := range []bool{false, true} {
		b.Run(fmt.Sprintf("states=%v", states), func(b *testing.B) {
			var bytes, entries int
			for range b.N {
				b.StopTimer()
				opts := Options{Policy: testPolicy(), Logger: quietLogger()}
				if states {
					opts.EncodeState = encodeStateJSON
				}
				l, err := Open(b.TempDir(), opts)
				if err != nil {
					b.Fatal(err)
				}
				m0 := testModel(4)
				if err := l.Checkpoint(&Checkpoint{Model: m0}); err != nil {
					b.Fatal(err)
				}
				if err := l.Put(bg, cheapCEs(m0, rand.New(rand.NewPCG(1, 1)), "ce", n)...); err != nil {
					b.Fatal(err)
				}
				m1 := drift(m0, -0.01)
				if _, _, err := l.Commit(bg, &Checkpoint{Model: m1}); err != nil {
					b.Fatal(err)
				}
				p := NewModelPredictor(m1, 100, 1)
				b.StartTimer()
				for {
					rep, _, err := l.Confirm(bg, p, 128)
					if err != nil {
						b.Fatal(err)
					}
					if !rep.More {
						break
					}
				}
				b.StopTimer()
				out, err := l.Outbox(0, 1<<20)
				if err != nil {
					b.Fatal(err)
				}
				for _, e := range out {
					if e.Stream == StreamStates {
						bytes += len(e.Key) + len(e.Value)
						entries++
					}
				}
				l.Close()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n)/1e3, "µs/CE")
			if entries > 0 {
				b.ReportMetric(float64(bytes)/float64(entries), "state-bytes")
			}
			b.ReportMetric(float64(entries)/float64(b.N*n), "states/CE")
		})
	}
}

// A CE waiting for its reissue (Options.Reissue) says so in its state, from the transaction of
// the change that made it wait to the one that settles it, and a new owner that restores the
// state makes it wait again, since the same version: it is reissued by whoever owns it, once.
// A state that waits since a version past the new owner's current one is not used.
func TestStatesCarryAReissueWait(t *testing.T) {
	enters := func(ch StatusChange) bool { return ch.To == certify.Invalidated }
	opts := Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON, EncodeState: encodeStateJSON, Reissue: enters}
	owner, m0, ces, at := shareOwner(t, opts, 40, 1)
	m1 := drift(m0, -8)
	commit(t, owner, m1, 3)
	waiting, err := owner.PendingReissues("", 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(waiting) < 3 {
		t.Fatalf("%d CEs wait for a reissue after the drift, want at least 3", len(waiting))
	}
	states := latestStates(t, owner)
	for _, p := range waiting {
		got, err := owner.Get(p.ID)
		if err != nil {
			t.Fatal(err)
		}
		if s := states[p.ID]; s == nil || s.ReissuePendingSince == nil || *s.ReissuePendingSince != p.Version ||
			got.ReissuePendingSince == nil || *got.ReissuePendingSince != p.Version {
			t.Fatalf("%s waits for a reissue since %d: its state %+v, Get %+v", p.ID, p.Version, s, got)
		}
	}
	for id, s := range states {
		if _, err := owner.Get(id); err == nil && s.ReissuePendingSince != nil && !slices.ContainsFunc(waiting, func(p PendingReissue) bool { return p.ID == id }) {
			t.Fatalf("%s's state waits for a reissue, the ledger does not: %+v", id, s)
		}
	}
	// The first one's outcome settles it: its state says so at once.
	settled := waiting[0]
	if err := owner.Checkpoint(&Checkpoint{Reissued: []PendingReissue{settled}}); err != nil {
		t.Fatal(err)
	}
	states = latestStates(t, owner)
	if s := states[settled.ID]; s == nil || s.ReissuePendingSince != nil {
		t.Fatalf("%s settled, and its latest state %+v still waits: its next owner would reissue it again", settled.ID, s)
	}
	// A CE whose record was damaged since Open does not stop the outcome of the others it
	// settles with: its state is left as it was.
	damaged, other := waiting[len(waiting)-1], waiting[len(waiting)-2]
	damageValue(t, owner, bBodies, damaged.ID)
	if err := owner.Checkpoint(&Checkpoint{Reissued: []PendingReissue{damaged, other}}); err != nil {
		t.Fatalf("settling %s with %s, whose record is damaged: %v", other.ID, damaged.ID, err)
	}
	if s := latestStates(t, owner)[other.ID]; s == nil || s.ReissuePendingSince != nil {
		t.Fatalf("%s settled beside a damaged CE, and its latest state %+v still waits", other.ID, s)
	}
	// What the new owner must hold as waiting: the others, and the damaged one, whose last state
	// still waits.
	waiting = append(waiting[:len(waiting)-2], damaged)
	states = latestStates(t, owner)

	next, _ := openTest(t, opts)
	install(t, next, m1)
	ops := registrations(ces, at)
	for i := range ops {
		ops[i].State = states[ops[i].ID]
	}
	outs, err := next.ApplyShare(0, ops, int64(len(ops)), nil, map[uint64]*bnn.Model{m0.Version: m0})
	if err != nil {
		t.Fatal(err)
	}
	for i, o := range outs {
		if o.Result != OutcomeStored || o.State != StateRestored && ops[i].State.Status != certify.Uncertified {
			t.Fatalf("%s: outcome %+v; want stored and restored", ops[i].ID, o)
		}
	}
	got, err := next.PendingReissues("", 100)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, waiting[1:]) {
		t.Fatalf("the new owner holds as waiting for a reissue\n%+v\nwant what the old one left waiting\n%+v", got, waiting[1:])
	}
	checkInvariants(t, next)

	// A state waiting since a version the new owner has not reached is a claim it cannot check.
	late := *states[waiting[1].ID]
	v := m1.Version + 1
	late.ReissuePendingSince = &v
	third, _ := openTest(t, opts)
	install(t, third, m1)
	op := registrations(ces, at)[slices.IndexFunc(ces, func(c *CE) bool { return c.ID == late.ID })]
	op.State = &late
	outs, err = third.ApplyShare(0, []ShareOp{op}, op.Offset+1, nil, map[uint64]*bnn.Model{m0.Version: m0})
	if err != nil {
		t.Fatal(err)
	}
	if o := outs[0]; o.Result != OutcomeStored || !strings.Contains(o.State, "waits for a reissue since version") {
		t.Fatalf("a state waiting since version %d under current %d: %+v; want stored from its registration, the state refused", v, m1.Version, o)
	}
}
