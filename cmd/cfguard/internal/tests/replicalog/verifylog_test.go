package replicalog

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/command"
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
)

// testLog is a posterior log on a broker of the test's own, written entry by entry as a holder
// of the cluster key (or a forger) would, and a replica's configuration file for it.
type testLog struct {
	t      *testing.T
	b      *broker.Broker
	plog   *postlog.Log
	prev   []byte // the last accepted entry's value
	seq    uint64
	sha    string
	model  *bnn.Model // the genesis's posterior
	config string
}

// newTestLog opens cfguard.posterior on a new broker with a genesis and a claim of term 1 by
// r1/1 accepted.
func newTestLog(t *testing.T) *testLog { return newTestLogWith(t, nil) }

// writeLogConfig writes dir/config.yaml for the log commands: replication on brokers with
// keyFile, errors only in the log. It returns the file's path.
func writeLogConfig(t *testing.T, dir string, brokers []string, keyFile string) string {
	t.Helper()
	path := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(path, []byte(fmt.Sprintf("kafka:\n  brokers: [%s]\nreplication:\n  enabled: true\n  key_file: %s\nlog:\n  level: error\n",
		strings.Join(brokers, ", "), keyFile)), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// newTestLogWith is newTestLog with the genesis edited by edit (nil: as newTestLog writes it)
// before it is appended.
func newTestLogWith(t *testing.T, edit func(g *postlog.Entry)) *testLog {
	b := proc.StartBroker(t)
	dir := t.TempDir()
	keyFile := proc.ClusterKey(t, dir)
	keys, err := clusterkey.Load(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	plog, err := postlog.Open(context.Background(), stream.ConnConfig{Brokers: b.Addrs()}, "cfguard.posterior", keys, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { plog.Close() })
	m := bnn.New(3, []int{4}, []string{"no", "yes"}, 1, rand.New(rand.NewPCG(1, 2)))
	body, err := postlog.NewBody(m)
	if err != nil {
		t.Fatal(err)
	}
	sha, err := postlog.PosteriorHash(m)
	if err != nil {
		t.Fatal(err)
	}
	l := &testLog{t: t, b: b, plog: plog, sha: sha, model: m, config: writeLogConfig(t, dir, b.Addrs(), keyFile)}
	g := &postlog.Entry{Format: postlog.Format, Kind: postlog.Genesis, Writer: "r1/1", Body: body, PosteriorSHA256: sha}
	if edit != nil {
		edit(g)
	}
	l.accept(g)
	l.accept(&postlog.Entry{Format: postlog.Format, Kind: postlog.Claim, Seq: l.seq + 1, Term: 1, Writer: "r1/1", PosteriorSHA256: sha})
	return l
}

// inc is a skipped increment of term 1 after the last accepted entry, covering partition 0 to to.
func (l *testLog) inc(to int64) *postlog.Entry {
	return &postlog.Entry{Format: postlog.Format, Kind: postlog.Increment, Seq: l.seq + 1, Term: 1, Writer: "r1/1", Covers: map[int]int64{0: to},
		Outcome: postlog.Skipped, Counts: &postlog.Counts{}, PosteriorSHA256: l.sha}
}

// append writes e, named the successor of the last accepted entry, with the cluster's
// authenticator when sign is set; it returns e's value.
func (l *testLog) append(e *postlog.Entry, sign bool) []byte {
	l.t.Helper()
	if l.prev != nil {
		h := postlog.Hash(l.prev)
		e.Parent = hex.EncodeToString(h[:])
	}
	v, err := e.Encode()
	if err != nil {
		l.t.Fatal(err)
	}
	ctx := context.Background()
	if sign {
		if err := l.plog.Append(ctx, fmt.Sprintf("e/%d", e.Seq), v); err != nil {
			l.t.Fatal(err)
		}
		return v
	}
	w := &kafka.Writer{Transport: kafkatest.Transport(l.t), Addr: kafka.TCP(l.b.Addrs()...), Topic: "cfguard.posterior", RequiredAcks: kafka.RequireAll}
	defer w.Close()
	if err := w.WriteMessages(ctx, kafka.Message{Value: v}); err != nil {
		l.t.Fatal(err)
	}
	return v
}

// accept appends e signed; the log's next entries follow it.
func (l *testLog) accept(e *postlog.Entry) {
	l.t.Helper()
	l.prev, l.seq = l.append(e, true), e.Seq
}

// verify runs verify-log on the log, with args after --config, and decodes its report.
func (l *testLog) verify(args ...string) (int, command.VerifyReport, string) {
	l.t.Helper()
	code, out, errs := proc.RunCLI(l.t, append([]string{"verify-log", "--config", l.config}, args...)...)
	var rep command.VerifyReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		l.t.Fatalf("verify-log: exit %d, %v\n%s\n%s", code, err, out, errs)
	}
	return code, rep, errs
}

// verify-log reports an increment that covers offsets past the input topic's end as a mismatch
// (exit 1), not as input past retention, and plays the log as the replicas do: the entry is not
// the head, the valid entry after it is. Records that do not authenticate are listed and ignored.
func TestVerifyLogCoveragePastTheEnd(t *testing.T) {
	l := newTestLog(t)
	l.append(l.inc(500), false) // unauthenticated, past the end: ignored before its coverage is looked at
	l.append(l.inc(500), true)  // authenticated, past the end: a mismatch
	l.accept(l.inc(0))          // the valid successor: covers nothing
	code, rep, errs := l.verify()
	if code != 1 || !strings.Contains(errs, "do not match") {
		t.Errorf("verify-log: exit %d, %s; want 1 and the mismatch said", code, errs)
	}
	if len(rep.Mismatches) != 1 || rep.Mismatches[0].Offset != 3 || !strings.Contains(rep.Mismatches[0].Why, "partition 0 to offset 500, and the partition ends at 0") {
		t.Errorf("mismatches %+v, want the entry at offset 3 covering past the end", rep.Mismatches)
	}
	if len(rep.Unverifiable) != 0 {
		t.Errorf("unverifiable %+v: coverage past the end is not input past retention", rep.Unverifiable)
	}
	if len(rep.Unauthenticated) != 1 || rep.Unauthenticated[0].Offset != 2 || rep.Ignored["unauthenticated"] != 1 || rep.Ignored["coverage_past_end"] != 1 {
		t.Errorf("unauthenticated %+v, ignored %v; want the record at offset 2, and one entry past the end", rep.Unauthenticated, rep.Ignored)
	}
	if rep.Head == nil || rep.Head.Offset != 4 || rep.Entries != 3 {
		t.Errorf("head %+v after %d entries; want the valid successor at offset 4, the third entry", rep.Head, rep.Entries)
	}
	if len(rep.Stopped) != 0 {
		t.Errorf("stopped %+v: the valid successor takes the refused entry's place", rep.Stopped)
	}
}

// An authenticated entry that follows an increment every replica refused (its coverage passes the
// input's end) stops the replicas there (TestReplicaOffAnEntryTheLogExtendsStops): verify-log
// lists it under stopped, and new-epoch finds it and writes the epoch that moves past it, after
// the head the replicas kept.
func TestNewEpochMovesPastAnEntryBuiltOnARefusedOne(t *testing.T) {
	l := newTestLog(t)
	head := l.seq
	l.accept(l.inc(500)) // authenticated, past the end: refused
	l.accept(l.inc(500)) // built on it: the replicas stop here (offset 3)
	code, rep, _ := l.verify()
	if code != 1 || len(rep.Stopped) != 1 || rep.Stopped[0].Offset != 3 || !strings.Contains(rep.Stopped[0].Why, "extends an entry this chain does not have") {
		t.Fatalf("verify-log: exit %d, stopped %+v; want 1 and the entry at offset 3", code, rep.Stopped)
	}
	if rep.Head == nil || rep.Head.Seq != head {
		t.Errorf("verify-log's head %+v; want entry %d, before the refused one", rep.Head, head)
	}
	code, out, errs := proc.RunCLI(t, "new-epoch", "--config", l.config)
	var ep command.EpochReport
	if err := json.Unmarshal([]byte(out), &ep); code != 0 || err != nil {
		t.Fatalf("new-epoch: exit %d, %v\n%s\n%s", code, err, out, errs)
	}
	if ep.MovedPast == nil || ep.MovedPast.Offset != 3 || ep.Seq != head+1 || !strings.Contains(ep.Stopped, "extends an entry") {
		t.Errorf("new-epoch wrote %+v; want entry %d moving past offset 3", ep, head+1)
	}
	if _, rep, _ := l.verify(); len(rep.Stopped) != 1 || rep.Head == nil || rep.Head.Seq != head+1 || rep.Head.Epoch != 1 {
		t.Errorf("after the epoch verify-log reports head %+v, stopped %+v; want the epoch as the head", rep.Head, rep.Stopped)
	}
}

// A record the updater dead-lettered as out_of_range (a feature 2e9 standard deviations from the
// model's mean) is one verify-log's schema refuses too: the entry's dead-letter count matches.
func TestVerifyLogMatchesAnOutOfRangeDeadLetter(t *testing.T) {
	l := newTestLog(t)
	l.produce(kafka.Message{Value: []byte(`{"id":"far","features":[1,2e9,3],"label":0}`)})
	e := l.inc(1)
	e.Counts = &postlog.Counts{DeadLettered: 1}
	l.accept(e)
	if code, rep, errs := l.verify(); code != 0 || len(rep.Mismatches) != 0 {
		t.Fatalf("verify-log: exit %d, mismatches %+v\n%s; want the entry's dead letter matched", code, rep.Mismatches, errs)
	}
}

// verify-log re-executes a promoted increment and compares what it records: a KL the step does
// not give is a mismatch, and so is, at the step's own KL, a posterior it does not give.
func TestVerifyLogComparesTheKLAndThePosterior(t *testing.T) {
	// run writes one good record and a promoted increment of it that records kl and a posterior
	// other than the step's (the genesis's with its first mean moved), on a log of its own, and
	// returns verify-log's mismatches.
	run := func(kl float64) []command.VerifyProblem {
		l := newTestLog(t)
		l.produce(kafka.Message{Value: []byte(`{"id":"r0","features":[0.5,-1,2],"label":1}`)})
		m := l.model.Clone()
		m.Last().WeightMu[0] += 0.5
		m.Version = 1
		sha, err := postlog.PosteriorHash(m)
		if err != nil {
			t.Fatal(err)
		}
		l.accept(&postlog.Entry{Format: postlog.Format, Kind: postlog.Increment, Seq: l.seq + 1, Term: 1, Writer: "r1/1", Version: 1,
			Covers: map[int]int64{0: 1}, Outcome: postlog.Promoted, Counts: &postlog.Counts{Applied: 1}, Seed: 7, KL: kl,
			LastLayer: postlog.LastLayerOf(m), PosteriorSHA256: sha})
		code, rep, errs := l.verify()
		if code != 1 || len(rep.Mismatches) != 1 || rep.Mismatches[0].Offset != 2 {
			t.Fatalf("verify-log: exit %d, mismatches %+v\n%s; want exit 1 and the increment at offset 2", code, rep.Mismatches, errs)
		}
		return rep.Mismatches
	}
	const made = 0.123456789
	mm := run(made)
	var kl float64
	if _, err := fmt.Sscanf(mm[0].Why, "KL %g, the entry records", &kl); err != nil || !(kl >= 0) || kl == made {
		t.Fatalf("a made-up KL: %q, want the step's KL against the entry's", mm[0].Why)
	}
	// At the step's own KL (verify-log prints it exactly: %v round-trips a float64), the
	// posterior is what differs.
	if mm = run(kl); !strings.HasPrefix(mm[0].Why, "posterior ") {
		t.Errorf("the step's KL and another posterior: %q, want the posterior named", mm[0].Why)
	}
}

// produce writes msgs to the input topic, cfguard.records, one at a time.
func (l *testLog) produce(msgs ...kafka.Message) {
	l.t.Helper()
	w := &kafka.Writer{Transport: kafkatest.Transport(l.t), Addr: kafka.TCP(l.b.Addrs()...), Topic: "cfguard.records", RequiredAcks: kafka.RequireAll}
	defer w.Close()
	for _, m := range msgs {
		if err := w.WriteMessages(context.Background(), m); err != nil {
			l.t.Fatal(err)
		}
	}
}

// verify-log's mismatch says what of the increment differs from its re-execution: the records
// that fail the schema against those it dead-lettered, the good records against those it
// counts, a version that moves over no records, the events of a step over no records, and the
// outcome of the step.
func TestVerifyLogNamesWhatDiffers(t *testing.T) {
	const (
		good = `{"id":"r0","features":[0.5,-1,2],"label":1}`
		far  = `{"id":"far","features":[1,2e9,3],"label":0}`
	)
	for _, tc := range []struct {
		name    string
		records []string
		edit    func(l *testLog, e *postlog.Entry)
		why     string
	}{
		{"a record it did not dead-letter", []string{far}, nil, "1 records fail the schema, the entry dead-lettered 0"},
		{"a good record it does not count", []string{good}, nil, "1 good records, the entry covers 0 (applied 0, held 0, failed 0)"},
		{"a version that moves over no records", nil, func(l *testLog, e *postlog.Entry) {
			m := l.model.Clone()
			m.Version = 1
			sha, err := postlog.PosteriorHash(m)
			if err != nil {
				t.Fatal(err)
			}
			e.Outcome, e.Version, e.LastLayer, e.PosteriorSHA256 = postlog.Promoted, 1, postlog.LastLayerOf(m), sha
		}, "no records, yet the version moves"},
		{"an event of a step over no records", nil, func(l *testLog, e *postlog.Entry) {
			e.Events = []postlog.Event{{Key: "kl_over_budget", Value: []byte(fmt.Sprintf(`{"type":"kl_over_budget","log_entry":%d}`, e.Seq))}}
			e.EventsThrough = e.Seq - 1
		}, "events [kl_over_budget], the step has []"},
		{"another outcome", []string{good}, func(l *testLog, e *postlog.Entry) { e.Counts = &postlog.Counts{Applied: 1} }, "the entry says skipped at KL 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newTestLog(t)
			for _, r := range tc.records {
				l.produce(kafka.Message{Value: []byte(r)})
			}
			e := l.inc(int64(len(tc.records)))
			if tc.edit != nil {
				tc.edit(l, e)
			}
			l.accept(e)
			code, rep, errs := l.verify()
			if code != 1 || len(rep.Mismatches) != 1 || rep.Mismatches[0].Offset != 2 || !strings.Contains(rep.Mismatches[0].Why, tc.why) {
				t.Fatalf("verify-log: exit %d, mismatches %+v\n%s; want exit 1 and the increment at offset 2: %q", code, rep.Mismatches, errs, tc.why)
			}
			if tc.name == "another outcome" && !strings.HasPrefix(rep.Mismatches[0].Why, "outcome ") {
				t.Errorf("mismatch %q, want the step's outcome named first", rep.Mismatches[0].Why)
			}
		})
	}
}

// --from and --to bound, both included, the entries verify-log re-executes; the others are
// applied as recorded.
func TestVerifyLogReexecutesFromTo(t *testing.T) {
	l := newTestLog(t)
	first := l.seq + 1
	for range 3 {
		l.accept(l.inc(0))
	}
	for _, tc := range []struct {
		args []string
		want int
	}{
		{nil, 3},
		{[]string{"--from", fmt.Sprint(first + 1), "--to", fmt.Sprint(first + 1)}, 1},
		{[]string{"--from", fmt.Sprint(first + 1)}, 2},
		{[]string{"--to", fmt.Sprint(first + 1)}, 2},
	} {
		code, rep, errs := l.verify(tc.args...)
		if code != 0 || rep.Increments != tc.want || rep.Matched != tc.want || rep.Entries != 5 {
			t.Errorf("verify-log %v: exit %d, %d re-executed, %d matched, %d entries\n%s; want %d re-executed and matched of 5 entries",
				tc.args, code, rep.Increments, rep.Matched, rep.Entries, errs, tc.want)
		}
	}
	// A --from past the head re-executes nothing: a failure, not a log that verified.
	past := fmt.Sprint(first + 3)
	want := "--from " + past + " is past the log's head, entry " + fmt.Sprint(first+2)
	if code, rep, errs := l.verify("--from", past); code != 1 || rep.Increments != 0 || !strings.Contains(errs, want) {
		t.Errorf("verify-log --from %s: exit %d, %d re-executed\n%s; want exit 1 saying %q", past, code, rep.Increments, errs, want)
	}
}

// An increment whose input records the topic no longer holds (deleted by retention) is listed
// as unverifiable, not as a mismatch, and verify-log goes on with the entries after it.
func TestVerifyLogInputPastRetention(t *testing.T) {
	l := newTestLog(t)
	l.produce(kafka.Message{Value: []byte(`{"id":"old","features":[0.5,-1,2],"label":1}`), Time: time.Now().Add(-30 * 24 * time.Hour)},
		kafka.Message{Value: []byte(`{"id":"new","features":[0.5,-1,2],"label":1}`)})
	l.b.ApplyRetention()
	if got := l.b.LogStartOffsets("cfguard.records"); len(got) != 1 || got[0] != 1 {
		t.Fatalf("cfguard.records starts at %v after retention, want [1]", got)
	}
	past := l.inc(2)
	past.Counts = &postlog.Counts{Held: 2}
	l.accept(past)
	l.accept(l.inc(2))
	code, rep, errs := l.verify()
	if code != 0 || len(rep.Mismatches) != 0 || rep.Increments != 2 || rep.Matched != 1 {
		t.Errorf("verify-log: exit %d, mismatches %+v, %d re-executed, %d matched\n%s; want exit 0, 2 re-executed, 1 matched", code, rep.Mismatches, rep.Increments, rep.Matched, errs)
	}
	if len(rep.Unverifiable) != 1 || rep.Unverifiable[0].Offset != 2 || !strings.Contains(rep.Unverifiable[0].Why, "input past the topic's retention") {
		t.Errorf("unverifiable %+v, want the increment at offset 2, its input past retention", rep.Unverifiable)
	}
}

// verify-log given a key file that is not the cluster's authenticates none of the log's records:
// it says so (exit 1), rather than report an empty log.
func TestVerifyLogRefusesAnotherKeyFile(t *testing.T) {
	l := newTestLog(t)
	l.accept(l.inc(0))
	dir := t.TempDir()
	other := writeLogConfig(t, dir, l.b.Addrs(), proc.ClusterKey(t, dir))
	code, out, errs := proc.RunCLI(t, "verify-log", "--config", other)
	if code != 1 || !strings.Contains(errs, "none of the 3 records of cfguard.posterior authenticates under the keys of replication.key_file") {
		t.Fatalf("verify-log with another key file: exit %d\n%s\n%s; want 1, naming the key file", code, out, errs)
	}
}

// A step over the KL budget is re-executed under the genesis's certify.on_breach: under reject
// the increment is held, its posterior the parent's, and the entry matches at the step's KL;
// under clip the step is clipped to the budget, and the KL it compares is the clipped one.
func TestVerifyLogReexecutesAStepOverTheBudget(t *testing.T) {
	const delta = "0.45"
	d, err := strconv.ParseFloat(delta, 64)
	if err != nil {
		t.Fatal(err)
	}
	budget := certify.KLBudget(d)
	// run writes one good record and an increment of it with outcome and kl, on a log whose
	// genesis records on_breach, and returns verify-log's exit and report.
	run := func(onBreach, outcome string, kl float64) (int, command.VerifyReport) {
		l := newTestLogWith(t, func(g *postlog.Entry) {
			g.Settings = map[string]string{"certify.delta": delta, "certify.on_breach": onBreach}
		})
		l.produce(kafka.Message{Value: []byte(`{"id":"r0","features":[0.5,-1,2],"label":1}`)})
		e := l.inc(1)
		e.Outcome, e.Counts, e.Seed, e.KL = outcome, &postlog.Counts{Held: 1}, 7, kl
		if outcome == postlog.Clipped { // a posterior that moves, of its own version
			m := l.model.Clone()
			m.Version = 1
			sha, err := postlog.PosteriorHash(m)
			if err != nil {
				t.Fatal(err)
			}
			e.Counts, e.Version, e.LastLayer, e.PosteriorSHA256 = &postlog.Counts{Applied: 1}, 1, postlog.LastLayerOf(m), sha
		}
		l.accept(e)
		code, rep, _ := l.verify()
		return code, rep
	}
	stepKL := func(rep command.VerifyReport) float64 {
		t.Helper()
		var kl float64
		if len(rep.Mismatches) != 1 {
			t.Fatalf("mismatches %+v, want the increment's", rep.Mismatches)
		}
		if _, err := fmt.Sscanf(rep.Mismatches[0].Why, "KL %g, the entry records", &kl); err != nil {
			t.Fatalf("mismatch %q, want the step's KL named: %v", rep.Mismatches[0].Why, err)
		}
		return kl
	}
	_, rep := run("reject", postlog.Rejected, -1)
	kl := stepKL(rep)
	if !(kl > budget) {
		t.Fatalf("the step's KL %v is within the budget %v: no breach to re-execute", kl, budget)
	}
	if code, rep := run("reject", postlog.Rejected, kl); code != 0 || rep.Matched != 1 || len(rep.Mismatches) != 0 {
		t.Errorf("a held increment at the step's KL %v: exit %d, %d matched, mismatches %+v; want it matched", kl, code, rep.Matched, rep.Mismatches)
	}
	_, rep = run("clip", postlog.Clipped, -1)
	if clipped := stepKL(rep); !(clipped <= budget) || clipped == kl {
		t.Errorf("a clipped step's KL %v (unclipped %v), want the clipped one, within the budget %v", clipped, kl, budget)
	}
}
