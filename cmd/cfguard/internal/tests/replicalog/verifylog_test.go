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
	"strings"
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
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
func newTestLog(t *testing.T) *testLog {
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
	l := &testLog{t: t, b: b, plog: plog, sha: sha, model: m, config: filepath.Join(dir, "config.yaml")}
	if err := os.WriteFile(l.config, []byte(fmt.Sprintf("kafka:\n  brokers: [%s]\nreplication:\n  enabled: true\n  key_file: %s\nlog:\n  level: error\n",
		strings.Join(b.Addrs(), ", "), keyFile)), 0o600); err != nil {
		t.Fatal(err)
	}
	l.accept(&postlog.Entry{Format: postlog.Format, Kind: postlog.Genesis, Writer: "r1/1", Body: body, PosteriorSHA256: sha})
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

// verify runs verify-log on the log and decodes its report.
func (l *testLog) verify() (int, command.VerifyReport, string) {
	l.t.Helper()
	code, out, errs := proc.RunCLI(l.t, "verify-log", "--config", l.config)
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
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(l.b.Addrs()...), Topic: "cfguard.records", RequiredAcks: kafka.RequireAll}
	defer w.Close()
	if err := w.WriteMessages(context.Background(), kafka.Message{Value: []byte(`{"id":"far","features":[1,2e9,3],"label":0}`)}); err != nil {
		t.Fatal(err)
	}
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
		w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(l.b.Addrs()...), Topic: "cfguard.records", RequiredAcks: kafka.RequireAll}
		defer w.Close()
		if err := w.WriteMessages(context.Background(), kafka.Message{Value: []byte(`{"id":"r0","features":[0.5,-1,2],"label":1}`)}); err != nil {
			t.Fatal(err)
		}
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
