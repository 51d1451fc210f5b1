package replica

import (
	"encoding/json"
	"maps"
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
)

// summaryStep is a Step that is its own Summary: what a host's Compute returned, as the
// updater sees it.
type summaryStep Summary

func (s summaryStep) Summary(uint64) Summary { return Summary(s) }

// TestEntryOfRecordsTheStep: the updater's entry for a step continues the head (next seq, the
// head's hash as parent, its term and writer), covers the head's coverage moved on by the
// increment's offsets (the head's own map untouched), and records the step: a step without
// records as skipped with the head's posterior, a promotion with a last layer that every
// follower's Apply turns back into exactly the posterior the updater computed.
func TestEntryOfRecordsTheStep(t *testing.T) {
	cfg := config.Default()
	r := &Replica{cfg: &cfg, writer: "r1/00ff"}
	prev := bnn.New(3, []int{4}, []string{"no", "yes"}, 1, rand.New(rand.NewPCG(1, 2)))
	prev.Version = 4
	prevSHA, err := postlog.PosteriorHash(prev)
	if err != nil {
		t.Fatal(err)
	}
	head := &postlog.Head{Seq: 3, Hash: "ab12", Offset: 9, Term: 2, Writer: r.writer, Version: 4, Covers: map[int]int64{0: 5, 1: 7},
		PosteriorSHA256: prevSHA}
	covers := maps.Clone(head.Covers)
	inc := &stream.Increment{NextOffsets: map[int]int64{0: 10}, DeadLettered: 2,
		Gaps: []stream.Gap{{Partition: 0, From: 5, To: 6}}}

	skipped, err := r.entryOf(head, summaryStep{Counters: map[string]int64{}}, inc, false)
	if err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(head.Covers, covers) {
		t.Fatalf("entryOf changed the head's coverage to %v", head.Covers)
	}
	if e := skipped; e.Kind != postlog.Increment || e.Seq != 4 || e.Parent != "ab12" || e.Term != 2 || e.Writer != r.writer ||
		e.Version != 4 || e.ParentVersion != 4 || e.Outcome != postlog.Skipped || e.PosteriorSHA256 != prevSHA ||
		e.InputTopic != cfg.Kafka.Topic || e.LastLayer != nil || e.EventsThrough != 3 || e.Events != nil {
		t.Errorf("skipped step's entry = %+v", e)
	}
	if want := map[int]int64{0: 10, 1: 7}; !maps.Equal(skipped.Covers, want) {
		t.Errorf("covers %v, want %v", skipped.Covers, want)
	}
	if c := skipped.Counts; c.DeadLettered != 2 || c.Lost != inc.Lost() || inc.Lost() == 0 || c.Applied != 0 {
		t.Errorf("counts %+v, want 2 dead-lettered, %d lost, none applied", c, inc.Lost())
	}
	if !skipped.Point {
		t.Error("the skipped step's entry does not mark the head's version a confirmation point")
	}
	if got, err := skipped.Apply(prev); err != nil || got != prev {
		t.Errorf("a follower applying the skipped entry: %v, %v; want the posterior kept", got, err)
	}

	next := prev.Clone()
	next.Version, next.Records = 5, 40
	for i := range next.Last().WeightMu {
		next.Last().WeightMu[i] += 0.25
	}
	quality := json.RawMessage(`{"n":3}`)
	promoted, err := r.entryOf(head, summaryStep{Outcome: certify.OutcomeClipped, KL: 0.01, Seed: 77, Next: next, Records: 3,
		Counters: map[string]int64{"failed": 0, "held": 0}, Quality: quality}, inc, false)
	if err != nil {
		t.Fatal(err)
	}
	wantSHA, err := postlog.PosteriorHash(next)
	if err != nil {
		t.Fatal(err)
	}
	// An increment of no good records closes short of kafka.max_records: a point. A full one
	// while the consumer holds more is not, within the stride.
	full := &stream.Increment{Records: make([]stream.Record, cfg.Kafka.MaxRecords), NextOffsets: map[int]int64{0: 10}}
	step := summaryStep{Outcome: certify.OutcomePromoted, Next: next, Records: cfg.Kafka.MaxRecords, Counters: map[string]int64{}}
	for _, pc := range []struct {
		inc      *stream.Increment
		caughtUp bool
		want     bool
	}{{inc, false, true}, {full, false, false}, {full, true, true}} {
		e, err := r.entryOf(head, step, pc.inc, pc.caughtUp)
		if err != nil {
			t.Fatal(err)
		}
		if e.Point != pc.want {
			t.Errorf("a promotion of %d records, caught up %t: point %t, want %t", len(pc.inc.Records), pc.caughtUp, e.Point, pc.want)
		}
	}
	if e := promoted; e.Version != 5 || e.ParentVersion != 4 || e.Outcome != string(certify.OutcomeClipped) || e.KL != 0.01 || e.Seed != 77 ||
		e.PosteriorSHA256 != wantSHA || e.Records != 40 || e.Counts.Applied != 3 || string(e.Quality) != string(quality) {
		t.Errorf("promoting step's entry = %+v", e)
	}
	got, err := promoted.Apply(prev)
	if err != nil {
		t.Fatalf("a follower applying the updater's entry: %v", err)
	}
	if sha, _ := postlog.PosteriorHash(got); sha != wantSHA || got.Version != 5 {
		t.Errorf("the follower's posterior: version %d sha256 %s, want 5, %s", got.Version, sha, wantSHA)
	}

	events := []postlog.Event{{Key: "kl_over_budget", Value: json.RawMessage(`{"type":"kl_over_budget"}`)},
		{Key: "increment_held", Value: json.RawMessage(`{"type":"increment_held"}`)}}
	held, err := r.entryOf(head, summaryStep{Outcome: certify.OutcomeRejected, KL: 0.3, Counters: map[string]int64{"held": 6}, Events: events}, inc, false)
	if err != nil {
		t.Fatal(err)
	}
	if held.Outcome != string(certify.OutcomeRejected) || held.Counts.Held != 6 || held.Version != 4 || held.PosteriorSHA256 != prevSHA {
		t.Errorf("rejected step's entry = %+v, counts %+v", held, held.Counts)
	}
	// The step's events ride in the entry, which vouches for the head's (the updater applied it).
	if len(held.Events) != 2 || held.Events[1].Key != "increment_held" || string(held.Events[1].Value) != `{"type":"increment_held"}` ||
		held.EventsThrough != head.Seq {
		t.Errorf("rejected step's entry carries events %v through %d; want the step's 2 through %d", held.Events, held.EventsThrough, head.Seq)
	}
}

// TestMarksPoint: the updater marks a version a confirmation point when an entry leaves it as it
// was or the consumer is caught up, and otherwise every confirmStride versions from the last
// point; never a version that is one already.
func TestMarksPoint(t *testing.T) {
	withPoint := &postlog.Head{Version: 4, Points: []uint64{2, 4}, PointsKept: true}
	pastPoint := &postlog.Head{Version: 5, Points: []uint64{2, 4}, PointsKept: true}
	old := &postlog.Head{Version: 3} // stored before heads kept points
	for _, tc := range []struct {
		name     string
		head     *postlog.Head
		version  uint64
		caughtUp bool
		want     bool
	}{
		{"the same version, a point already", withPoint, 4, true, false},
		{"the same version, not a point yet", pastPoint, 5, false, true},
		{"a new version, caught up", pastPoint, 6, true, true},
		{"a new version, behind, within the stride", pastPoint, 4 + confirmStride - 1, false, false},
		{"a new version, behind, a stride from the last point", pastPoint, 4 + confirmStride, false, true},
		{"a head without points, within the stride", old, confirmStride - 1, false, false},
		{"a head without points, a stride from its start", old, confirmStride, false, true},
	} {
		e := &postlog.Entry{Version: tc.version}
		if got := marksPoint(tc.head, e, tc.caughtUp); got != tc.want {
			t.Errorf("%s: marksPoint = %t, want %t", tc.name, got, tc.want)
		}
	}
}

// TestClaimOnMarksTheHeadsVersion: a claim marks the head's version a confirmation point when it
// is not one (the last updater may have stopped after a version it did not mark), and continues
// the head as a claim does.
func TestClaimOnMarksTheHeadsVersion(t *testing.T) {
	cfg := config.Default()
	r := &Replica{cfg: &cfg, writer: "r2/00ff"}
	for _, tc := range []struct {
		head *postlog.Head
		want bool
	}{
		{&postlog.Head{Seq: 7, Hash: "ab", Term: 2, Writer: "r1/1", Version: 9, Points: []uint64{8}, PointsKept: true}, true},
		{&postlog.Head{Seq: 7, Hash: "ab", Term: 2, Writer: "r1/1", Version: 9, Points: []uint64{8, 9}, PointsKept: true}, false},
	} {
		c := r.claimOn(tc.head, 5)
		if c.Kind != postlog.Claim || c.Seq != 8 || c.Parent != "ab" || c.Term != 3 || c.Writer != r.writer || c.Version != 9 ||
			c.ParentVersion != 9 || c.Generation != 5 || c.Point != tc.want {
			t.Errorf("claim on a head with points %v: %+v; want point %t", tc.head.Points, c, tc.want)
		}
	}
}
